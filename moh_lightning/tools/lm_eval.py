"""lm-evaluation-harness for MoH language models, through the harness's own model interface.

``MoHLM`` is registered with lm-eval as model type ``moh``: it reuses the harness's ``HFLM`` (request
batching, loglikelihood / rolling / generate_until logic, tokenisation) and only swaps the network for a
``moh fit`` checkpoint, so learned-router models trained from scratch are evaluated exactly like Hugging Face
ones. Folders written by ``moh convert-hf`` / ``moh export-hf`` / ``moh convert-llama`` go through lm-eval's stock
``hf`` model instead (``--hf_folder``). The paper's benchmarks (Tab. 4 / 5) are the default task list; offline,
local tasks (``--include_path``) are evaluated, such as the shipped example ``cli_configs/lm_eval_tasks/``
(``--include_path lm_eval_tasks``).
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from unittest import mock

import torch
from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from torch import nn
from transformers import PretrainedConfig

from moh_lightning.configs import config_dir
from moh_lightning.errors import BadValueError
from moh_lightning.hub import offline_unless_hub_answers as hub_offline
from moh_lightning.outputs import check_output_file
from moh_lightning.tasks.checkpoints import read_checkpoint
from moh_lightning.tasks.language_model import LanguageModel

PAPER_TASKS = ["sciq", "piqa", "winogrande", "openbookqa", "logiqa", "truthfulqa_mc2", "lambada_openai",
               "arc_easy", "boolq"]
EXAMPLE_TASKS = "lm_eval_tasks"  # cli_configs/lm_eval_tasks/: the example local task python_basics, no hub needed


class _HarnessView(nn.Module):
    """What ``HFLM`` reads from a pre-built model: ``config``, ``device``, ``tie_weights``; logits come from
    ``MoHLM._model_call``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net = model
        self.config = PretrainedConfig(max_position_embeddings=model.block_size)

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def tie_weights(self) -> None:  # MoHLlama ties its embeddings itself when configured to
        pass


@register_model("moh")
class MoHLM(HFLM):
    """A ``moh fit`` LanguageModel checkpoint as an lm-eval model (``--model moh``).

    Args:
        checkpoint: The ``.ckpt`` file.
        tokenizer: Tokenizer name or folder; the one recorded with the checkpoint's data module when None.
        batch_size: Requests per forward pass.
        max_length: Context length; the model's ``block_size`` when None.
        device: ``cpu`` or ``cuda``.
    """

    def __init__(self, checkpoint: str, tokenizer: str | None = None, batch_size: int | str = 1,
                 max_length: int | None = None, device: str = "cpu", **kwargs) -> None:
        from moh_lightning.data.tokenizers import exported_tokenizer, load_tokenizer
        from moh_lightning.tasks.checkpoints import load_language_model

        task, data_hparams = load_language_model(checkpoint, map_location=device, tool="lm-eval")
        name = tokenizer or data_hparams.get("tokenizer")
        if name is None:
            raise BadValueError(f"checkpoint {checkpoint} does not record its tokenizer: pass tokenizer=...")
        self.net = task.model.to(device).eval()
        # The tokenizer `moh export-hf` writes beside the weights, so that the checkpoint and its export score the same
        # under one policy (``lm_eval``'s ``add_bos_token``): a plain call encodes as training did, no BOS or EOS. A
        # tokenizer whose special tokens cannot be turned off (ByT5's) has them left out of each call instead.
        try:
            encoder = exported_tokenizer(name)
        except ValueError:
            encoder = load_tokenizer(name)
            kwargs.setdefault("add_bos_token", False)
        super().__init__(pretrained=_HarnessView(self.net), tokenizer=encoder, backend="causal",
                         batch_size=batch_size, max_length=max_length or self.net.block_size, **kwargs)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        # Requests are right-padded, so the causal logits of the real tokens do not see the padding.
        with torch.no_grad():
            return self.net(inps)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """Decodes each (left-padded) row alone through the KV cache; HFLM cuts the text at ``stop``."""
        temperature = float(generation_kwargs.get("temperature", 0.0) or 0.0)
        if not generation_kwargs.get("do_sample", False):
            temperature = 0.0
        pad = self.tokenizer.pad_token_id
        rows = []
        for row in context:
            start = 0
            while start < len(row) - 1 and row[start] == pad:
                start += 1
            out = self.net.generate(row[None, start:], max_length - context.shape[1], temperature=temperature,
                                    top_k_tokens=generation_kwargs.get("top_k"),
                                    top_p=generation_kwargs.get("top_p", 1.0),
                                    eos_id=self.tokenizer.eos_token_id, seed=0)
            rows.append(torch.cat([row[:start], out[0]]))
        width = max(len(r) for r in rows)
        return torch.stack([torch.cat([r, r.new_full((width - len(r),), pad)]) for r in rows])


def lm_eval(
        checkpoint: str | None = None,
        hf_folder: str | None = None,
        tasks: list[str] | None = None,
        num_fewshot: NonNegativeInt | None = None,
        batch_size: PositiveInt = 8,
        limit: PositiveFloat | None = None,
        device: str = "cpu",
        include_path: str | None = None,
        include_defaults: bool = True,
        add_bos_token: bool | None = None,
        output: str | None = None,
        log_samples: bool = False,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        dtype: str | None = None,
        overwrite: bool = False,
) -> dict:
    """Evaluates a MoH language model with lm-evaluation-harness and prints the harness's table.

    Args:
        checkpoint: A ``moh fit`` LanguageModel ``.ckpt`` (evaluated as lm-eval model type ``moh``).
        hf_folder: Or a folder from ``moh convert-hf``, ``moh export-hf`` or ``moh convert-llama`` (lm-eval's ``hf``
            model).
        tasks: lm-eval task names; the paper's benchmarks when None.
        num_fewshot: Few-shot examples per task; each task's default when None.
        batch_size: Requests per forward pass.
        limit: Documents per task (a count, or a fraction when below 1); all when None.
        device: ``cpu`` or ``cuda``.
        include_path: Folder of extra task YAMLs (local tasks, e.g. over a JSON dataset), or the name of a shipped
            one: ``lm_eval_tasks``, the example task ``python_basics`` (16 multiple-choice completions of Python and
            English), read from any working folder.
        include_defaults: Also index lm-eval's built-in tasks (False: only ``include_path``, much faster).
        add_bos_token: Whether encodings get the tokenizer's special tokens (BOS for LLaMA). None: the tokenizer's
            own default, for both kinds of model: a ``--checkpoint`` is scored with the tokenizer ``moh export-hf``
            writes (no BOS or EOS, as training encoded), so it scores as its export does, and an ``--hf_folder`` with
            the folder's tokenizer, as lm-eval's own ``hf`` model does.
        dtype: Weight dtype of an ``--hf_folder`` (float32, bfloat16, float16); the folder's when None.
        output: JSON file for the results; refused when it exists, unless ``overwrite``.
        log_samples: Also keep lm-eval's own per-sample log (its ``--log_samples``): each task's
            ``samples_<task>_<time>.jsonl`` and lm-eval's full results ``<output's name>_<time>.json``, written
            beside ``output``, which it needs.
        tokenizer: Tokenizer name or folder to score with, instead of the one the ``--checkpoint`` records (or the
            ``--hf_folder``'s own).
        trust_remote_code: Run the Python modelling code of an ``--hf_folder`` that is not the one ``moh export-hf``
            writes (read it first: loading runs it). The suite's own file is trusted without this.
        overwrite: Replace an ``output`` file that exists.
    """
    if output:
        check_output_file(output, "--output", overwrite)
    elif log_samples:
        raise SystemExit("moh lm-eval: --log_samples true writes the per-sample log beside the results: give "
                         "--output <file>.json too.")
    import lm_eval as harness
    from lm_eval import evaluator
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    if (checkpoint is None) == (hf_folder is None):
        raise SystemExit("moh lm-eval: give exactly one of --checkpoint (a .ckpt) or --hf_folder (an exported "
                         "folder).")
    if hf_folder is not None and not Path(hf_folder, "config.json").is_file():
        raise SystemExit(f"moh lm-eval: --hf_folder {hf_folder}: no config.json; export one with `moh export-hf`.")
    include_path = task_folder(include_path) if include_path else None
    offline_unless_hub_answers()
    if checkpoint is not None:  # a damaged or foreign checkpoint stops the tool before any task touches a cache
        read_checkpoint(checkpoint, LanguageModel, "lm-eval", mmap=True)  # its kind, without reading the weights
    # Tasks (and their data) load before the model, so a task that cannot stops the tool before a model is built.
    task_manager = TaskManager(include_path=include_path, include_defaults=include_defaults or not include_path)
    loaded = [obj for name in tasks or PAPER_TASKS for obj in load_task(task_manager, name)]
    if checkpoint is not None:
        model, model_args = "moh", {"checkpoint": checkpoint}
    else:
        model, model_args = "hf", {"pretrained": hf_folder,
                                   "trust_remote_code": remote_code_trusted(Path(hf_folder), trust_remote_code)}
    if add_bos_token is not None:
        model_args["add_bos_token"] = add_bos_token
    if tokenizer is not None:
        model_args["tokenizer"] = tokenizer
    if dtype is not None:
        if checkpoint is not None or dtype not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"moh lm-eval: --dtype {dtype}: give float32, bfloat16 or float16 with --hf_folder (a "
                             f"--checkpoint is evaluated in float32).")
        model_args["dtype"] = dtype
    # lm-eval records the working folder's git commit by running `git describe`, whose stderr reaches the terminal
    # outside a repository ("fatal: not a git repository"); its lookup runs with that stderr discarded.
    # lm-eval's own writer of its per-sample log, named after a .json file so that it writes beside it.
    tracker = EvaluationTracker(output_path=str(Path(output).with_suffix(".json"))) if log_samples else None
    with mock.patch.object(evaluator, "get_git_commit_hash", _without_stderr(evaluator.get_git_commit_hash)):
        results = harness.simple_evaluate(model=model, model_args=model_args, tasks=loaded, num_fewshot=num_fewshot,
                                          batch_size=batch_size, limit=limit, device=device,
                                          task_manager=task_manager, log_samples=log_samples,
                                          evaluation_tracker=tracker)
    print(make_table(results))
    if tracker is not None:
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for name in results["configs"]:
            tracker.save_results_samples(task_name=name, samples=samples[name])
        print(f"moh lm-eval: per-sample log in {Path(output).parent / f'samples_*_{tracker.date_id}.jsonl'}")
    summary = {"results": results["results"], "config": {"model": model, "device": device, **model_args}}
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(summary, indent=1, default=str))
        print(f"moh lm-eval: results in {output}")
    return summary


def task_folder(include_path: str) -> str:
    """``--include_path`` as given when it exists, else the shipped folder of that name in ``cli_configs/``."""
    if Path(include_path).exists():
        return include_path
    shipped = config_dir() / include_path
    if shipped.is_dir():
        return str(shipped)
    raise SystemExit(f"moh lm-eval: --include_path {include_path}: no such folder here nor in the shipped configs; "
                     f"give a folder of task YAMLs, or {EXAMPLE_TASKS} for the shipped example.")


def load_task(task_manager, name: str) -> list:
    """The task, group or tag ``name`` as lm-eval builds it (data set loaded), as the objects to evaluate.

    A name lm-eval does not know, and a task whose data set is on an unreachable hub, stop in one line naming it.
    """
    known = task_manager.all_tasks
    if name not in known and not Path(name).is_file():
        # A folder's own tasks are few enough to list; lm-eval's thousands are not.
        shown = f"the tasks here: {', '.join(known)}" if len(known) <= 10 else (
            f"nearest: {', '.join(difflib.get_close_matches(name, known, n=3)) or 'none'}")
        raise SystemExit(f"moh lm-eval: unknown task {name!r} ({shown}); name an lm-eval task, or one of the task "
                         f"YAMLs of a folder given to --include_path ({EXAMPLE_TASKS} is the shipped example).")
    try:
        built = task_manager.load(name)
    except ConnectionError as error:  # datasets' error for a hub it cannot reach, offline mode included
        raise SystemExit(f"moh lm-eval: task {name!r} reads its data set from the Hugging Face hub, which cannot be "
                         f"reached ({error}); evaluate a local task instead, e.g. --include_path {EXAMPLE_TASKS} "
                         f"--include_defaults false --tasks '[python_basics]'.") from None
    # A group's tasks and subgroups are inside it; each is passed once, at the top.
    children = {child for kids in built.get("group_map", {}).values() for child in kids}
    return [obj for key, obj in {**built.get("groups", {}), **built["tasks"]}.items() if key not in children]


def offline_unless_hub_answers(timeout: float = 3.0) -> None:
    """Turns on ``huggingface_hub``'s and ``datasets``' offline mode when the hub does not answer within ``timeout``
    (``hub.offline_unless_hub_answers``): unreachable, ``datasets`` too retries each hub request for about half a
    minute. It reads ``HF_HUB_OFFLINE`` when imported, which lm-eval has done by now, so its own flag is set."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE or hub_offline(timeout):
        datasets.config.HF_HUB_OFFLINE = True


def _without_stderr(function):
    """``function`` run with this process's stderr file descriptor, which its subprocesses inherit, on /dev/null."""
    def run(*args, **kwargs):
        with open(os.devnull, "w") as null:
            saved = os.dup(2)
            os.dup2(null.fileno(), 2)
            try:
                return function(*args, **kwargs)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
    return run


def remote_code_trusted(folder: Path, trust_remote_code: bool = False) -> bool:
    """Whether ``transformers`` may run ``folder``'s Python files: yes when every one is a modelling file that
    ``moh export-hf`` / ``convert-hf`` writes, byte for byte, or when the user said so; none there needs no trust.

    Other code stops in one line naming the file, since loading the folder would run it.
    """
    from moh_lightning.layers import query_norm
    from moh_lightning.models.hf_causal import hf_moh
    from moh_lightning.models.llama import hf_moh_llama

    ours = {Path(module.__file__).read_bytes() for module in (hf_moh_llama, hf_moh, query_norm)}
    foreign = sorted(p.name for p in folder.glob("*.py") if p.read_bytes() not in ours)
    if foreign and not trust_remote_code:
        raise SystemExit(f"moh lm-eval: --hf_folder {folder}: its modelling code {', '.join(foreign)} is not the file "
                         f"`moh export-hf` writes, and loading the folder would run it; read it, then pass "
                         f"--trust_remote_code true.")
    return trust_remote_code or any(folder.glob("*.py"))


__all__ = ["EXAMPLE_TASKS", "MoHLM", "PAPER_TASKS", "lm_eval", "load_task", "offline_unless_hub_answers",
           "remote_code_trusted", "task_folder"]
