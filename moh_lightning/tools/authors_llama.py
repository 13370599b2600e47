"""``moh load-authors-llama``: the authors' MoH-LLaMA3-8B as a checkpoint or a ``transformers`` folder for
``moh lm-eval``.

What their release is and how it loads into the suite's MoH-LLaMA is ``moh_lightning.models.llama.authors``.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from moh_lightning.models.llama import AUTHORS_LLAMA_HUB, export_hf, load_authors_llama, model_folder
from moh_lightning.outputs import check_output_file, check_output_folder, created_folder
from moh_lightning.tasks.checkpoints import one_line_errors, write_checkpoint
from moh_lightning.tasks.language_model import LanguageModel


def load_authors_llama_tool(source: str = AUTHORS_LLAMA_HUB, out: str = "authors_llama3.ckpt",
                            dtype: str | None = None, router_dtype: str = "float32", overwrite: bool = False) -> Path:
    """Loads their MoH-LLaMA3 into the suite's MoH-LLaMA and writes it for ``moh lm-eval``.

    ``out`` ending in ``.ckpt`` is a LanguageModel checkpoint, evaluated by the suite's own model:
    ``moh lm-eval --checkpoint out.ckpt --add_bos_token true`` (LLaMA3 was trained with BOS). Any other ``out`` is a
    ``transformers`` folder written by the suite's exporter (the suite's remote code, model card with provenance):
    ``moh lm-eval --hf_folder out``.

    Args:
        source: Their model: a local folder or a hub repo id.
        out: The ``.ckpt`` or the folder to write; refused when the file exists or the folder holds anything,
            unless ``overwrite``.
        dtype: Weight dtype written (float32, bfloat16, float16); the checkpoint's when None.
        router_dtype: ``float32`` scores the heads exactly; ``activation`` scores them in the activations' dtype as
            their code does, to reproduce their bf16 numbers (with ``--dtype bfloat16``, or a bf16 evaluation).
        overwrite: Replace an ``out`` file that exists, or write into an ``out`` folder that holds files already.
    """
    path = Path(out)
    check = check_output_file if path.suffix == ".ckpt" else check_output_folder
    check(path, "--out", overwrite)
    with one_line_errors("load-authors-llama"):
        model = load_authors_llama(source, getattr(torch, dtype) if dtype else None, router_dtype)
        folder = model_folder(source)
    moh = model.config.moh
    provenance = (f"The authors' MoH-LLaMA3 weights `{source}` (SkyworkAI/MoH, continue-tuned from LLaMA3-8B), loaded "
                  f"by `moh load-authors-llama` with their query-norm budget: {moh.num_shared_heads} shared + top-"
                  f"{moh.top_k} of {model.config.num_heads - moh.num_shared_heads} routed heads per layer.")
    if path.suffix == ".ckpt":
        tokenizer = str(folder.resolve()) if Path(source).expanduser().is_dir() else source
        write_checkpoint(path, LanguageModel, {"arch": asdict(model.config), "init_from": None},
                         {f"model.{name}": value for name, value in model.state_dict().items()},
                         {"tokenizer": tokenizer, "provenance": provenance})
        print(f"wrote {path} ({model.config.activated_fraction:.0%} of heads active); evaluate with "
              f"`moh lm-eval --checkpoint {path} --add_bos_token true`")
    else:
        from transformers import AutoTokenizer

        with created_folder(path):
            export_hf(model, path, AutoTokenizer.from_pretrained(folder), source=provenance)
        print(f"wrote {path}; evaluate with `moh lm-eval --hf_folder {path}`")
    return path


__all__ = ["load_authors_llama_tool"]
