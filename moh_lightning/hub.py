"""Whether the Hugging Face hub can be asked: offline mode where it does not answer.

Unreachable, ``huggingface_hub`` retries each request with back-off, about a minute before a name that is in no
cache fails; in offline mode it reads its cache or fails at once. Imports nothing of the suite.
"""
from __future__ import annotations


def offline_unless_hub_answers(timeout: float = 3.0) -> bool:
    """Whether ``huggingface_hub`` is offline: ``HF_HUB_OFFLINE``, or turned on here when the hub does not answer
    within ``timeout``. Its flag is read by every later request, transformers' included."""
    from huggingface_hub import constants, get_session

    if not constants.HF_HUB_OFFLINE:
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout)
        except Exception:  # no answer at all (the HTTP client's connect, timeout and proxy errors); any status is one
            constants.HF_HUB_OFFLINE = True
    return constants.HF_HUB_OFFLINE


__all__ = ["offline_unless_hub_answers"]
