"""Writes results/hf_families.md: ``moh convert-hf`` on every causal-LM family of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), each a tiny random model of its default config (``tests/hf_families.py``:
``tiny_config``) saved without a tokenizer, converted with every head kept and compared with the source's logits.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python results/hf_families.py [family ...]

Each family ends in one of: ``exact`` (the converted folder's logits equal the source's bit for bit), ``refused``
(``convert-hf`` stops in one line, recorded), ``differs`` (converts, other logits: a bug), ``traceback`` (a bug), or
``not built`` (the tiny config of that family did not build here: a limit of this script, not of ``convert-hf``).
About a minute on one core.
"""
from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402
from hf_families import save_tiny, tiny_config  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from moh_lightning.cli import main  # noqa: E402
from moh_lightning.hf_configs import language_model_config  # noqa: E402
from moh_lightning.models.hf_causal import query_heads  # noqa: E402

MAX_PARAMETERS = 20_000_000  # a default config that stays larger than this once shrunk is left out ("not built")


def convert(model_type: str, root: Path) -> tuple[str, str]:
    """(outcome, detail) of converting a tiny ``model_type`` with every head kept."""
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return "not built", f"{size / 1e6:.0f}M parameters once shrunk"
        save_tiny(model_type, root / "source")
    except Exception as error:  # noqa: BLE001 - any failure to build is this script's, recorded as such
        # A config validator's cause is on the message's second line.
        reason = " ".join(line.strip() for line in str(error).strip().splitlines()[:2])
        return "not built", f"{type(error).__name__}: {reason[:200]}"
    try:  # every head kept: half of each layer's heads shared, every other one routed
        heads = list(query_heads(language_model_config(config)).values())
    except Exception:  # noqa: BLE001 - convert-hf meets the same and says it below, as a refusal or a traceback
        heads = [4]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main(["convert-hf", "--source", str(root / "source"), "--out", str(root / "moh"), "--num_shared_heads",
                  str([h // 2 for h in heads]), "--top_k", str([h - h // 2 for h in heads])])
    except SystemExit as stop:
        return "refused", str(stop).removeprefix("moh convert-hf: ")
    except Exception as error:  # noqa: BLE001 - a traceback is the outcome to record
        return "traceback", f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    ids = torch.randint(3, 290, (2, 14), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():
            theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "source").eval()(input_ids=ids).logits
    except Exception as error:  # noqa: BLE001 - the tiny source itself does not run: this script's limit
        return "not built", f"the source does not run: {type(error).__name__}: {str(error).strip()[:100]}"
    try:
        converted = transformers.AutoModelForCausalLM.from_pretrained(root / "moh", trust_remote_code=True).eval()
        with torch.no_grad():
            ours = converted(input_ids=ids).logits
    except Exception as error:  # noqa: BLE001 - a traceback is the outcome to record
        return "traceback", f"the converted folder: {type(error).__name__}: {str(error).strip().splitlines()[0][:140]}"
    if torch.equal(theirs, ours):
        return "exact", type(converted).__name__
    return "differs", f"{type(converted).__name__}: max |difference| {(theirs - ours).abs().max():.2e}"


def main_(families: list[str]) -> None:
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rows, start = [], time.time()
    for model_type in families:
        with tempfile.TemporaryDirectory() as folder:
            outcome, detail = convert(model_type, Path(folder))
        rows.append((model_type, outcome, detail))
        print(f"{model_type}: {outcome} {detail}", flush=True)
    if families != list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return  # a few families by hand: printed, the page is the whole list's
    counts = {outcome: sum(row[1] == outcome for row in rows)
              for outcome in ("exact", "refused", "differs", "traceback", "not built")}
    lines = ["# `moh convert-hf` over every causal-LM family of transformers", "",
             f"`results/hf_families.py` on transformers {transformers.__version__}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d')} ({time.time() - start:.0f} s on one core): each family of "
             f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` as a tiny random model of its default config (2 layers, width 64, "
             f"4 heads; `tests/hf_families.py`), saved without a tokenizer, converted with every head kept and its "
             f"logits compared with the source's. A composite (vision / audio + text) config converts its language "
             f"model, compared with the composite's logits on text.", "",
             f"Of {len(rows)} families: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) + ".", "",
             "'not built' is this script's limit (a default config the generic shrinking cannot make tiny and "
             "consistent), not a `convert-hf` outcome. `tests/models/hf_causal/test_convert_hf.py` converts a "
             "representative few (a composite, a no-interface family, per-layer head widths, an infinite config "
             "value, no tokenizer) on every run of the suite. 'differs' and 'traceback' rows are open bugs of "
             "`convert-hf`: the family converts without refusing, yet the folder computes other logits or fails to "
             "run.", "",
             "| family | outcome | detail |", "|---|---|---|",
             *(f"| `{name}` | {outcome} | {detail.replace('|', '/')} |" for name, outcome, detail in rows), ""]
    (ROOT / "results" / "hf_families.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main_(sys.argv[1:] or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
