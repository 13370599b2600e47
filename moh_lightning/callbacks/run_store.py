"""The run's store (torch.distributed's ``TCPStore`` on rank 0): where the ranks of a failed collective report it, and
where one rank tells the others that the run ended (``shutdown``'s docstring says when)."""
from __future__ import annotations

import os
import time
from contextlib import suppress
from datetime import timedelta

import torch.distributed as dist

# The ranks of one failed collective report within seconds of each other: a closed connection fails them at once, a
# hung rank at the same timeout from about the same start.
_REPORT_WINDOW_S = 5.0
_STORE_TIMEOUT = timedelta(seconds=10)


def collective_failed(exception: BaseException) -> bool:
    """Whether a collective failed: torch.distributed's errors, and gloo's (plain RuntimeErrors naming its source)."""
    return isinstance(exception, dist.DistError) or "/gloo/" in str(exception)


def store_client() -> dist.Store:
    """A client of the run's store (rank 0's ``TCPStore``, at the address every rank connected to), under a prefix."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=_STORE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore("moh_lightning/shutdown/", store)


def missing_ranks(store: dist.Store, rank: int, world_size: int) -> list[int]:
    """The ranks that did not report the failure of the same collective within ``_REPORT_WINDOW_S``."""
    try:
        store.set(f"failed/{rank}", "1")
        reported, deadline = store.add("failed", 1), time.monotonic() + _REPORT_WINDOW_S
        while reported < world_size and time.monotonic() < deadline:
            time.sleep(0.2)
            reported = store.add("failed", 0)
        return [other for other in range(world_size) if not store.check([f"failed/{other}"])]
    except RuntimeError:  # the store lives in rank 0's process
        return [0]


class NoAnswerYet(Exception):
    """The run's store did not answer within ``_STORE_TIMEOUT``: slow (rank 0's machine fully loaded), not gone."""


def ended_elsewhere(store: dist.Store, leaving: bool) -> str | None:
    """Why the run ended on another rank, if it did: its message in the store, or a store whose connection is gone
    while this rank is not ``leaving`` itself (past its last step boundary, or failed: rank 0 may end first).

    A request that timed out raises ``NoAnswerYet``: a lost rank 0 closes its connections at once (its process or
    node is gone, the kernel resets them), and one that hangs is found by the collective timeout instead.
    """
    try:
        return store.get("stop").decode() if store.check(["stop"]) else None
    except RuntimeError as error:
        if leaving:
            return None
        if "timeout" in str(error).lower() or "timed out" in str(error).lower():
            raise NoAnswerYet from error
        return "rank 0, which holds the run's store, is gone"


def tell_the_run(store: dist.Store, why: str) -> None:
    with suppress(RuntimeError):
        store.set("stop", why)
