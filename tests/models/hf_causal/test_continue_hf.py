"""Continue-tuning any supported family with ``continue_hf_75.yaml`` and ``init_from`` (paper section 4.4): no shape
typed by hand, every setting the source's, a converted folder a valid start, exact resume, export, generate and
lm-eval; and each finding of the LLaMA path (issue 34) held by a test."""
from __future__ import annotations

import json
import time

import lightning as L
import pytest
import torch
import yaml
from conftest import run_checkpoints
from hf_families import FAMILIES, TEXT, save_family
from lightning.pytorch.trainer.states import TrainerFn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from moh_lightning.cli import main as moh
from moh_lightning.errors import BadValueError
from moh_lightning.layers import moh_layers
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.hf_causal import HFCausalLM
from moh_lightning.models.llama import LlamaConfig as SuiteLlamaConfig
from moh_lightning.tasks.checkpoints import load_language_model
from moh_lightning.tasks.language_model import LanguageModel

QUERY_NORM = SuiteLlamaConfig(moh=MoHConfig(router="query_norm"))


def _fitting(task: LanguageModel) -> LanguageModel:
    task.trainer = L.Trainer(logger=False)
    task.trainer.state.fn = TrainerFn.FITTING
    task.configure_model()
    return task


def test_the_architecture_and_budget_come_from_init_from(tmp_path):
    source = save_family("gemma2", tmp_path / "gemma2")
    task = _fitting(LanguageModel(QUERY_NORM, init_from=str(source)))
    original = AutoModelForCausalLM.from_pretrained(source)
    assert isinstance(task.model, HFCausalLM) and type(task.model.hf) is type(original)
    assert task.hparams.hf_config["rms_norm_eps"] == 1e-6 and task.hparams.hf_config["attn_logit_softcapping"] == 50
    assert [(layer.num_shared_heads, layer.router.top_k) for layer in moh_layers(task.model)] == [(4, 2), (4, 2)]
    torch.testing.assert_close(task.model.hf.model.layers[1].mlp.down_proj.weight,
                               original.model.layers[1].mlp.down_proj.weight)
    evaluated = LanguageModel(QUERY_NORM, init_from=str(source))
    evaluated.configure_model()  # outside a fit: the checkpoint's weights come next, not the source's
    assert not torch.equal(evaluated.model.hf.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_a_shape_or_setting_other_than_the_sources_is_refused_naming_it(tmp_path):
    source = save_family("qwen3", tmp_path / "qwen3")
    with pytest.raises(BadValueError, match=r"^model.init_args.arch.embed_dim=96: with init_from the architecture is "
                                            r".*'s \(hidden_size=64\); remove the override\.$"):
        LanguageModel(SuiteLlamaConfig(embed_dim=96, moh=MoHConfig(router="query_norm")), init_from=str(source))
    with pytest.raises(BadValueError, match=r"arch.norm_eps=0.0001: .*\(rms_norm_eps=1e-06\)"):
        LanguageModel(SuiteLlamaConfig(norm_eps=1e-4, embed_dim=64, num_heads=8, head_dim=16, num_kv_heads=2, depth=2,
                                       moh=MoHConfig(router="query_norm")), init_from=str(source))
    same = SuiteLlamaConfig(embed_dim=64, num_heads=8, head_dim=16, num_kv_heads=2, depth=2, norm_eps=1e-6,
                            moh=MoHConfig(router="query_norm"))
    LanguageModel(same, init_from=str(source))  # repeating the source's values is allowed
    with pytest.raises(ValueError, match=r"^moh.router='learned': continue-tuning a transformers model takes the "
                                         r"parameter-free router"):
        LanguageModel(SuiteLlamaConfig(), init_from=str(source))


def test_a_typed_shape_other_than_the_sources_is_named_before_the_budget_is_checked(run_dir):
    """`--model.init_args.arch.num_heads 4` on an 8-head source with its 4 shared + top-2 budget once stopped on the
    budget ("every head is shared (num_shared_heads=4), so set top_k: 0"), hiding that the shape is the source's."""
    source = save_family("qwen2", run_dir / "qwen2")
    (run_dir / "my.txt").write_text(TEXT * 20)
    with pytest.raises(SystemExit) as stop:
        moh(_fit_args(source, "--model.init_args.arch.num_heads", "4", "--trainer.fast_dev_run", "1"))
    message = str(stop.value)
    assert "\n" not in message and message.startswith("moh: model.init_args.arch.num_heads=4: with init_from the "
                                                      "architecture is ") and "(num_attention_heads=8)" in message
    assert not (run_dir / "runs").exists()


def test_a_converted_folder_is_a_valid_init_from(tmp_path):
    """`moh convert-llama`'s and `moh convert-hf`'s folders start a run (the first once ended in transformers'
    56-line 'contains custom code which must be executed' traceback), with the budget they were converted with."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    moh(["convert-llama", "--source", str(tmp_path / "llama"), "--out", str(tmp_path / "moh_llama"),
         "--num_shared_heads", "2", "--top_k", "3"])
    source = save_family("phi3", tmp_path / "phi3")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "moh_phi3"), "--num_shared_heads", "6",
         "--top_k", "1"])
    for folder, budget in (("moh_llama", (2, 3)), ("moh_phi3", (6, 1))):
        task = _fitting(LanguageModel(QUERY_NORM, init_from=str(tmp_path / folder)))
        assert {(layer.num_shared_heads, layer.router.top_k) for layer in moh_layers(task.model)} == {budget}
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    task = _fitting(LanguageModel(QUERY_NORM, init_from=str(tmp_path / "moh_llama")))
    torch.testing.assert_close(task.model.hf.model.layers[0].self_attn.q_proj.weight,
                               llama.model.layers[0].self_attn.q_proj.weight)


def test_convert_llama_keeps_the_sources_dtype_unless_asked(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "fp32")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        moh(["convert-llama", "--source", str(tmp_path / name), "--out", str(tmp_path / f"out_{name}")])
        assert AutoModelForCausalLM.from_pretrained(tmp_path / f"out_{name}", trust_remote_code=True).dtype == dtype


def test_the_8b_recipe_on_a_machine_without_a_gpu_fails_fast_saying_why(run_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    start = time.perf_counter()
    with pytest.raises(SystemExit, match=r"^moh: trainer.accelerator=gpu but this machine has no CUDA GPU; run the "
                                         r"same config on the CPU with --trainer.accelerator cpu"):
        moh(["fit", "--config", "llama3_8b_moh_75.yaml"])
    assert time.perf_counter() - start < 30
    assert not (run_dir / "runs").exists()


def _fit_args(source, *extra: str) -> list[str]:
    return ["fit", "--config", "continue_hf_75.yaml", "--model.init_args.init_from", str(source),
            "--data.init_args.tokenizer", str(source), "--data.init_args.sources", "[{path: my.txt}]",
            "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "4", "--data.init_args.val_samples", "2",
            "--model.init_args.max_tokens", str(6 * 4 * 32), "--model.init_args.warmup_steps", "2",
            "--model.init_args.lr", "3e-3", "--trainer.val_check_interval", "3", "--checkpoint.every_n_train_steps",
            "3", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *extra]


@pytest.mark.slow
def test_a_pretrained_model_reads_its_own_tokenizer_by_default(run_dir, capsys):
    source = save_family("llama", run_dir / "llama")
    (run_dir / "my.txt").write_text(TEXT * 20)
    args = _fit_args(source, "--trainer.fast_dev_run", "1")
    at = args.index("--data.init_args.tokenizer")
    del args[at:at + 2]
    moh(args)
    assert f"moh: data.init_args.tokenizer={source} (init_from's own" in capsys.readouterr().err


@pytest.mark.slow
def test_the_run_config_is_the_network_that_ran_and_a_partial_budget_keeps_the_sources_keys(run_dir, capsys):
    """A converted 2 shared + top-1 folder continue-tuned with `top_k 2` typed: 2 shared + top-2 (once 0 shared +
    top-2, exported as `moh_num_shared_heads: 0`), and the run's config.yaml records the source's shapes (once the
    defaults: depth 12, embed_dim 768) and evaluates its checkpoint, with no config given, with no line about
    another network."""
    save_family("phi3", run_dir / "source")
    moh(["convert-hf", "--source", "source", "--out", "converted", "--num_shared_heads", "2", "--top_k", "1"])
    (run_dir / "my.txt").write_text(TEXT * 20)
    moh(_fit_args("converted", "--model.init_args.arch.moh.top_k", "2", "--trainer.max_steps", "1"))
    run = run_checkpoints("continue_hf_50").parent  # named for the budget typed: 2 shared + top-2 of 8 heads
    arch = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["arch"]
    assert {key: arch[key] for key in ("depth", "embed_dim", "num_heads", "head_dim", "num_kv_heads",
                                       "intermediate_size", "norm_eps")} == {
        "depth": 2, "embed_dim": 64, "num_heads": 8, "head_dim": 8, "num_kv_heads": 2, "intermediate_size": 96,
        "norm_eps": 1e-6}
    assert (arch["moh"]["num_shared_heads"], arch["moh"]["top_k"]) == (2, 2)
    moh(["export-hf", "--checkpoint", str(run / "checkpoints" / "last.ckpt"), "--out", "exported"])
    written = json.loads((run_dir / "exported" / "config.json").read_text())
    assert (written["moh_num_shared_heads"], written["moh_top_k"]) == (2, 2)
    capsys.readouterr()
    moh(["validate", "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--trainer.enable_progress_bar", "false"])
    said = capsys.readouterr()
    assert "moh: evaluating" not in said.err and "not the config's" not in said.err
    assert f"moh validate: metrics and head load in {run / 'eval' / 'validate-last'}" in said.out


def _run_arch(name: str = "continue_hf_75") -> dict:
    """The arch of the last run ``name``'s config.yaml."""
    run = run_checkpoints(name).parent
    return yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]["arch"]


def _layer_budgets(task: LanguageModel) -> list[tuple[int, int, int]]:
    return [(layer.num_heads, layer.num_shared_heads, layer.router.top_k) for layer in moh_layers(task.model)]


@pytest.mark.slow
def test_layers_with_heads_of_their_own_number_continue_tune_with_a_budget_each(run_dir):
    """A tiny Laguna's layers have 4 and 8 query heads: with no budget typed each keeps 75% of its own (2 + top-1,
    4 + top-2), and the run's config.yaml records those heads and that budget and builds that network back; a typed
    `top_k 1` keeps the source's shared heads. One budget from num_attention_heads (2 + top-1) was once filled in for
    every layer, keeping 3 of the second's 8."""
    from hf_families import save_tiny, train_tokenizer

    source = save_tiny("laguna", run_dir / "source")
    train_tokenizer(source)
    (run_dir / "my.txt").write_text(TEXT * 20)
    moh(_fit_args(source, "--trainer.max_steps", "1"))
    arch = _run_arch()
    assert (arch["layer_heads"], arch["moh"]["num_shared_heads"], arch["moh"]["top_k"]) == ([4, 8], [2, 4], [1, 2])
    trained, _ = load_language_model(str(run_checkpoints("continue_hf_75") / "last.ckpt"))
    rebuilt = _fitting(LanguageModel(arch, init_from=str(source)))
    assert _layer_budgets(trained) == _layer_budgets(rebuilt) == [(4, 2, 1), (8, 4, 2)]
    moh(_fit_args(source, "--model.init_args.arch.moh.top_k", "1", "--trainer.max_steps", "1",
                  "--trainer.logger.init_args.name", "top1"))
    arch = yaml.safe_load(next((run_dir / "runs" / "top1").glob("*/config.yaml")).read_text())
    assert _layer_budgets(_fitting(LanguageModel(arch["model"]["init_args"]["arch"], init_from=str(source)))) == [
        (4, 2, 1), (8, 4, 1)]


@pytest.mark.slow
def test_a_converted_hybrid_continue_tunes_with_a_budget_per_attention_layer(run_dir):
    """A converted bailing_hybrid's linear-attention layer stays dense: the run's arch lists the heads of its one
    attention layer, a per-layer budget has one entry for it (once refused: 'moh.top_k has 1 entries but depth=2'),
    the run's config.yaml builds that network back, and a list of another length stops in one line naming it."""
    from hf_families import save_tiny, train_tokenizer

    save_tiny("bailing_hybrid", run_dir / "source")
    moh(["convert-hf", "--source", "source", "--out", "converted"])
    train_tokenizer(run_dir / "converted")
    (run_dir / "my.txt").write_text(TEXT * 20)
    moh(_fit_args("converted", "--model.init_args.arch.moh.top_k", "[2]", "--trainer.max_steps", "1"))
    arch = _run_arch("continue_hf_100")  # named for the budget typed: 2 shared + top-2 of 4, every head
    assert (arch["depth"], arch["layer_heads"], arch["moh"]["num_shared_heads"], arch["moh"]["top_k"]) == (
        2, [4], 2, [2])
    assert _layer_budgets(_fitting(LanguageModel(arch, init_from="converted"))) == [(4, 2, 2)]
    with pytest.raises(SystemExit) as stop:
        moh(_fit_args("converted", "--model.init_args.arch.moh.top_k", "[2, 1]", "--trainer.max_steps", "1"))
    assert "\n" not in str(stop.value) and "moh.top_k has 2 entries but len(layer_heads)=1" in str(stop.value)



@pytest.mark.slow
def test_the_run_folder_records_the_families_own_config_and_its_vocabulary(run_dir):
    """A continue-tuned tiny Granite (a 320-row embedding, a tokenizer of fewer tokens): the run's config.yaml holds
    Granite's own config (its multipliers), from which alone the task builds the checkpoint's network, and the logged
    hyper-parameters (hparams.yaml) and the checkpoint's say the embedding's vocabulary. Once `hf_config: null`, with
    arch.vocab_size the tokenizer's size."""
    from hf_families import save_tiny, train_tokenizer

    source = save_tiny("granite", run_dir / "source", embedding_multiplier=3.0, residual_multiplier=0.5)
    tokens = len(train_tokenizer(source))
    (run_dir / "my.txt").write_text(TEXT * 20)
    moh(_fit_args(source, "--trainer.max_steps", "1"))
    run = run_checkpoints("continue_hf_75").parent
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
    assert saved["hf_config"]["model_type"] == "granite" and saved["hf_config"]["vocab_size"] == 320 > tokens
    assert (saved["hf_config"]["embedding_multiplier"], saved["hf_config"]["residual_multiplier"]) == (3.0, 0.5)
    rebuilt = LanguageModel(**{**saved, "init_from": None})  # the config alone: no source, no checkpoint
    rebuilt.configure_model()
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {
        k: v.shape for k, v in checkpoint["state_dict"].items()}
    assert rebuilt.model.hf.config.embedding_multiplier == 3.0
    logged = yaml.safe_load((run / "hparams.yaml").read_text())
    assert logged["arch"]["vocab_size"] == checkpoint["hyper_parameters"]["arch"]["vocab_size"] == 320
    assert logged["hf_config"] == checkpoint["hyper_parameters"]["hf_config"] == saved["hf_config"]


@pytest.mark.slow
def test_continue_tuning_resumes_exactly_and_exports(run_dir):
    """From a `moh convert-hf` folder, with no shape on the command line: 6 steps straight, and 4 steps then resumed
    from `last`, end in the same weights; the export loads in transformers with the task's logits and the source's
    settings; `moh generate` continues a prompt with the checkpoint. (The loop and its resume are one for every
    family; each family's own conversion, step and export: the next test.)"""
    family = "qwen3"
    save_family(family, run_dir / "source")
    moh(["convert-hf", "--source", "source", "--out", "converted"])
    (run_dir / "my.txt").write_text(TEXT * 40)
    moh(_fit_args("converted", "--trainer.logger.init_args.name", "straight"))
    moh(_fit_args("converted", "--trainer.logger.init_args.name", "resumed", "--trainer.max_steps", "4"))
    moh(_fit_args("converted", "--trainer.logger.init_args.name", "resumed", "--ckpt_path", "last"))
    straight = torch.load(run_checkpoints("straight") / "last.ckpt", weights_only=False)
    resumed = torch.load(run_checkpoints("resumed") / "last.ckpt", weights_only=False)
    assert straight["global_step"] == resumed["global_step"] == 6
    for key, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key

    checkpoint = str(run_checkpoints("straight") / "last.ckpt")
    moh(["export-hf", "--checkpoint", checkpoint, "--out", "exported"])
    task, _ = load_language_model(checkpoint)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "exported", trust_remote_code=True).eval()
    idx = torch.randint(3, 290, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, task.model(idx), atol=2e-5, rtol=1e-5)
    written = json.loads((run_dir / "exported" / "config.json").read_text())
    source = json.loads((run_dir / "source" / "config.json").read_text())
    assert written["rms_norm_eps"] == source["rms_norm_eps"] == 1e-6
    assert written["moh_base_model_type"] == family and written["model_type"] == "moh"
    texts = moh_generate(checkpoint=checkpoint)
    assert len(texts) == 1 and texts[0]
    assert moh_generate(hf_folder="exported") == texts  # the export continues a prompt as the checkpoint does


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_continue_tunes_from_its_converted_folder_and_exports_what_it_trained(family, run_dir):
    save_family(family, run_dir / "source")
    moh(["convert-hf", "--source", "source", "--out", "converted"])
    (run_dir / "my.txt").write_text(TEXT * 40)
    moh(_fit_args("converted", "--trainer.logger.init_args.name", "tuned", "--trainer.max_steps", "1"))
    checkpoint = str(run_checkpoints("tuned") / "last.ckpt")
    moh(["export-hf", "--checkpoint", checkpoint, "--out", "exported"])
    task, _ = load_language_model(checkpoint)
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 1
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "exported", trust_remote_code=True).eval()
    idx = torch.randint(3, 290, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, task.model(idx), atol=2e-5, rtol=1e-5)
    written = json.loads((run_dir / "exported" / "config.json").read_text())
    assert written["moh_base_model_type"] == family and written["model_type"] == "moh"


def moh_generate(**model) -> list[str]:
    from moh_lightning.tools.generate import generate

    return generate(**model, prompt="def parse(", max_new_tokens=8, temperature=0)


@pytest.mark.slow
def test_one_model_one_score_checkpoint_export_and_lm_evals_own_hf_model(run_dir):
    """`moh lm-eval --checkpoint`, `--hf_folder` on its export (also in float32) and lm-eval's own `hf` model give
    one score with no BOS flag (they once gave 0.5 and 0.625 on the same task)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moh_lightning.tools.lm_eval import task_folder

    save_family("qwen2", run_dir / "source")
    (run_dir / "my.txt").write_text(TEXT * 40)
    moh(_fit_args("source", "--trainer.logger.init_args.name", "tuned"))
    checkpoint = str(run_checkpoints("tuned") / "last.ckpt")
    moh(["export-hf", "--checkpoint", checkpoint, "--out", "exported"])
    scores = []
    for args in (["--checkpoint", checkpoint], ["--hf_folder", "exported"],
                 ["--hf_folder", "exported", "--dtype", "float32"]):
        moh(["lm-eval", *args, "--include_path", "lm_eval_tasks", "--include_defaults", "false", "--tasks",
             "[python_basics]", "--output", "out.json", "--overwrite", "true"])
        scores.append(json.loads((run_dir / "out.json").read_text())["results"]["python_basics"])
    manager = TaskManager(include_path=task_folder("lm_eval_tasks"), include_defaults=False)
    theirs = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": "exported", "trust_remote_code": True},
                                     tasks=["python_basics"], task_manager=manager, device="cpu")
    theirs = theirs["results"]["python_basics"]
    for score in [*scores[1:], theirs]:
        assert (score["acc,none"], score["acc_norm,none"]) == (scores[0]["acc,none"], scores[0]["acc_norm,none"])
