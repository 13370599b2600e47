"""``moh convert-hf`` on tiny random models of every supported family (``hf_families``): every head kept computes the
source's logits exactly; 75% loads through ``AutoModelForCausalLM``, generates, decodes through its KV cache as its
full forward computes, and equals the suite's own model of it; every setting of the source is kept; what cannot work
stops in one line."""
from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from hf_families import FAMILIES, save_family
from transformers import AutoModelForCausalLM, AutoTokenizer

from moh_lightning.cli import main as moh
from moh_lightning.data.tokenizers import load_tokenizer
from moh_lightning.layers import QueryNormRouter, moh_layers
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.hf_causal import build_hf_causal, hf_moh, read_source_config


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family name, source folder, its 75% conversion by ``moh convert-hf``)."""
    root = tmp_path_factory.mktemp(request.param)
    source = save_family(request.param, root / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(root / "moh75")])
    return request.param, source, root / "moh75"


def _ids(length: int = 14, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 290, (batch, length), generator=torch.Generator().manual_seed(1))


def _logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def test_every_head_kept_computes_the_source_logits_exactly(family, tmp_path):
    name, source, _ = family
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "2",
         "--top_k", "6"])
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "all", trust_remote_code=True).eval()
    assert converted.config._attn_implementation.startswith("moh_")
    assert torch.equal(_logits(converted, _ids()), _logits(original, _ids()))


def test_75_percent_loads_generates_and_decodes_through_its_cache_as_its_full_forward(family):
    name, source, folder = family
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert (model.config.moh_num_shared_heads, model.config.moh_top_k) == (4, 2)   # 8 heads: 4 + top-2 of 4
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    assert not torch.allclose(_logits(model, _ids()), _logits(original, _ids()))   # some heads are off
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("def parse(line):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
        teacher = model(out).logits                                                  # one forward, no cache
    length = prompt["input_ids"].shape[1]
    assert out.shape[1] == length + 12
    assert torch.equal(teacher[0, length - 1:-1].argmax(-1), out[0, length:])


def test_the_suites_model_equals_the_exported_one(family):
    """The suite's routing (``InterfaceHeads``: the straight-through ``QueryNormRouter``, the execution dispatch) and
    the remote code's gates are the same function; with the gate formula broken in either, this fails."""
    name, source, folder = family
    suite = build_hf_causal(read_source_config(str(folder)), MoHConfig(router="query_norm"), weights=str(folder))
    suite.eval()
    layers = moh_layers(suite)
    assert len(layers) == 2 and all(isinstance(layer.router, QueryNormRouter) for layer in layers)
    exported = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(suite(_ids(40)), exported(_ids(40)).logits, atol=2e-5, rtol=1e-5)
    assert all(layer.last_gates.sum(-1).eq(6).all() for layer in layers)          # 4 shared + top-2 per token


def test_every_setting_of_the_source_is_kept(family):
    """Norm eps 1e-6, rotary theta, tied embeddings, biases, sliding windows and soft-capping: config.json is the
    source's, field for field, plus the head budget (a LLaMA-path conversion once wrote rms_norm_eps 1e-5)."""
    name, source, folder = family
    theirs = json.loads((source / "config.json").read_text())
    ours = json.loads((folder / "config.json").read_text())
    moh_keys = {"model_type", "auto_map", "moh_base_model_type", "moh_num_shared_heads", "moh_top_k", "moh_router",
                "moh_router_dtype"}
    assert set(ours) - set(theirs) <= moh_keys
    assert {k: v for k, v in ours.items() if k not in moh_keys} == {k: v for k, v in theirs.items()
                                                                      if k != "model_type"}
    assert ours["rms_norm_eps"] == 1e-6 and ours["moh_base_model_type"] == name
    assert (folder / "hf_moh.py").read_bytes() == open(hf_moh.__file__, "rb").read()


def test_without_trust_remote_code_it_stops_instead_of_running_every_head(family):
    _, _, folder = family
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)


def test_the_dtype_is_the_sources_unless_asked(tmp_path):
    source = save_family("qwen3", tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "fp32")])
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", trust_remote_code=True).dtype == torch.float32
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", trust_remote_code=True).dtype == torch.bfloat16
    with pytest.raises(SystemExit, match="--dtype float64: choose one of float32, bfloat16, float16"):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "x"), "--dtype", "float64"])


def test_an_attention_implementation_that_cannot_take_gates_is_one_line(tmp_path):
    source = save_family("mistral", tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"^attn_implementation='flash_attention_2': MoH gates the heads of 'sdpa' "
                                         r"or 'eager' attention; load with one of those \(or none\)\.$"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True,
                                             attn_implementation="flash_attention_2")
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True, attn_implementation="eager")
    assert eager.config._attn_implementation == "moh_eager"


def test_a_model_whose_attention_bypasses_the_interface_is_one_line(tmp_path, monkeypatch):
    from transformers import MambaConfig, MambaForCausalLM, Qwen2ForCausalLM

    source = save_family("qwen2", tmp_path / "qwen2")
    # transformers' own test of whether a family's attention goes through the interface, answering no.
    monkeypatch.setattr(Qwen2ForCausalLM, "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.raises(SystemExit, match=r"^moh convert-hf: Qwen2ForCausalLM: its attention does not go through "
                                         r"transformers' attention interface, where MoH gates the heads; .*\.$"):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "out")])
    MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)).save_pretrained(
        tmp_path / "mamba")
    with pytest.raises(SystemExit, match=r"^moh convert-hf: model_type='mamba': this family has no attention heads"):
        moh(["convert-hf", "--source", str(tmp_path / "mamba"), "--out", str(tmp_path / "out")])
    (tmp_path / "nothing").mkdir()
    with pytest.raises(SystemExit, match=r"^moh convert-hf: init_from='.*nothing': no config.json in the folder"):
        moh(["convert-hf", "--source", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")])


@pytest.mark.slow
def test_head_sparse_execution_computes_the_masked_logits():
    """The suite's dispatch (``execution``) skips unselected heads in these models too, where its kernels compute the
    family's attention (Mistral's sliding window through the mask); Gemma 2's soft-capping refuses ``sparse``."""
    import tempfile
    from pathlib import Path

    for name in ("mistral", "gemma2"):
        source = save_family(name, Path(tempfile.mkdtemp()) / name)
        config = read_source_config(str(source))
        masked = build_hf_causal(config, MoHConfig(router="query_norm", execution="masked"), weights=str(source))
        sparse = build_hf_causal(config, MoHConfig(router="query_norm"), weights=str(source))
        for layer in moh_layers(sparse):  # the query-norm router trains masked, so a config cannot ask for sparse
            layer.execution = "sparse"
        idx = _ids(40)
        with torch.no_grad():
            if name == "gemma2":
                with pytest.raises(ValueError, match="moh.execution=sparse: .*its softcap"):
                    sparse.eval()(idx)
                continue
            torch.testing.assert_close(sparse.eval()(idx), masked.eval()(idx), atol=1e-5, rtol=1e-5)
            assert torch.equal(sparse.generate(idx[:, :5], 10, temperature=0),
                               masked.generate(idx[:, :5], 10, temperature=0))


#: Families of the installed transformers that once ended ``convert-hf`` in a traceback, each standing for a kind
#: (``results/hf_families.py`` converts every family): a composite's language model under ``text_config`` (Gemma 3),
#: per-layer head widths (Gemma 4), an infinite config value (Falcon-H1), a folder without a tokenizer whose family's
#: tokenizer class fails on it (CTRL), attention residuals that call the attention interface over the depth's block
#: outputs, not over tokens with heads (Inkling 2: the gates once asked them for a ``layer_idx``), an attention class
#: not named ``...Attention``, two a decoder layer (Longcat's ``LongcatFlashMLA``: once refused as having none).
CONVERTED_EXACTLY = ("gemma3", "gemma4_text", "falcon_h1", "ctrl", "inkling2_text", "longcat_flash")


@pytest.mark.parametrize("model_type", CONVERTED_EXACTLY)
@pytest.mark.slow
def test_a_family_of_each_kind_converts_with_the_source_logits(model_type, tmp_path):
    from hf_families import save_tiny

    source = save_tiny(model_type, tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "2",
         "--top_k", "2"])
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "all", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(converted(input_ids=_ids()).logits, original(input_ids=_ids()).logits)


@pytest.mark.parametrize("model_type", ["laguna", "dots3_note_text"])
@pytest.mark.slow
def test_layers_with_heads_of_their_own_number_take_a_budget_each(model_type, tmp_path):
    """The tiny Laguna's layers have 4 and 8 query heads (``num_attention_heads_per_layer``; Inkling's sliding layers
    have their own too), dots3's too (a heterogeneous config: ``per_layer_config``, whose per-layer fields the whole
    model's config refuses to read): the budget is each layer's, and every head kept computes the source's logits. The
    gates once took ``num_attention_heads`` for every layer and kept 4 of Laguna's second layer's 8 heads, and dots3
    stopped in a traceback."""
    from hf_families import save_tiny

    source = save_tiny(model_type, tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "[2, 4]",
         "--top_k", "[2, 4]"])
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "all", trust_remote_code=True).eval()
    assert torch.equal(_logits(converted, _ids()), _logits(original, _ids()))
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "75")])
    config = json.loads((tmp_path / "75" / "config.json").read_text())
    assert (config["moh_num_shared_heads"], config["moh_top_k"]) == ([2, 4], [1, 2])
    suite = build_hf_causal(read_source_config(str(tmp_path / "75")), MoHConfig(router="query_norm"),
                            weights=str(tmp_path / "75")).eval()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "75", trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(suite(_ids()), exported(_ids()).logits, atol=2e-5, rtol=1e-5)
    assert [layer.last_gates.sum(-1).unique().tolist() for layer in moh_layers(suite)] == [[3.0], [6.0]]
    with pytest.raises(SystemExit, match=r"^moh convert-hf: --top_k has 3 entries for 2 attention layers: give one "
                                         r"per layer or a single int\.$"):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "x"), "--top_k", "[1, 1, 1]"])


@pytest.mark.parametrize("model_type", ["bailing_hybrid", "kimi_linear"])
@pytest.mark.slow
def test_a_hybrid_gates_exactly_the_layers_that_call_the_interface_and_its_folder_says_so(model_type, tmp_path,
                                                                                           monkeypatch):
    """A hybrid's linear-attention layer (``BailingHybridDeltaAttention``, ``KimiLinearDeltaAttention``) is named an
    attention and has a ``layer_idx`` but never calls the attention interface: it stays dense, and config.json and the
    model card say so. They once listed a budget for it (``moh_num_shared_heads: 1``, "Activated heads: 4 of 8")
    that no gate applied. Here each call of the interface is recorded with the gates it applied."""
    from hf_families import save_tiny
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    source = save_tiny(model_type, tmp_path / "source")              # layer 0 linear attention, layer 1 full
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "50"), "--num_shared_heads", "1",
         "--top_k", "1"])
    config = json.loads((tmp_path / "50" / "config.json").read_text())
    assert (config["moh_num_shared_heads"], config["moh_top_k"]) == ([None, 1], [None, 1])
    card = (tmp_path / "50" / "README.md").read_text()
    assert "Activated heads: 2 of 4 (50.0%) in the 1 layers whose attention goes through" in card
    assert "| 0 | - | dense | - |\n| 1 | 4 | 1 | 1 |" in card
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "50", trust_remote_code=True).eval()
    attention = ALL_ATTENTION_FUNCTIONS["moh_sdpa"]
    gates_of = attention.__globals__["query_norm_gates"]
    calls = []  # [layer_idx, mean fraction of heads the gates kept]

    def recording_attention(module, *args, **kwargs):
        calls.append([module.layer_idx, 1.0])
        return attention(module, *args, **kwargs)

    def recording_gates(*args):
        gates = gates_of(*args)
        calls[-1][1] = gates.mean().item()
        return gates

    monkeypatch.setitem(attention.__globals__, "query_norm_gates", recording_gates)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "moh_sdpa", recording_attention)
    _logits(model, _ids())
    assert calls == [[1, 0.5]]                                          # the gates the folder lists, where it lists
    suite = build_hf_causal(read_source_config(str(tmp_path / "50")), MoHConfig(router="query_norm"),
                            weights=str(tmp_path / "50")).eval()
    monkeypatch.undo()
    assert [(layer.num_shared_heads, layer.router.top_k) for layer in moh_layers(suite)] == [(1, 1)]
    with torch.no_grad():
        torch.testing.assert_close(suite(_ids()), _logits(model, _ids()), atol=2e-5, rtol=1e-5)


def test_layers_the_code_says_are_gated_but_a_forward_does_not_call_are_one_line(tmp_path, monkeypatch):
    """Had the gated layers been told by their class's name, as they once were, the linear attention would be listed
    with a budget no gate applies: a forward of four tokens tells, and convert-hf stops instead of writing it."""
    from hf_families import save_tiny

    from moh_lightning.models.hf_causal import network

    source = save_tiny("bailing_hybrid", tmp_path / "source")
    monkeypatch.setattr(network, "calls_interface", lambda module: type(module).__name__.endswith("Attention"))
    with pytest.raises(SystemExit, match=r"^moh convert-hf: BailingHybridForCausalLM: cannot tell which layers go "
                                         r"through transformers' attention interface \(BailingHybridDeltaAttention "
                                         r"called it or not, unlike its code says\); .*: not supported\.$"):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "out")])


def test_a_family_that_picks_its_attention_class_by_name_is_one_line(tmp_path):
    """GIT looks its attention class up by implementation name (``KeyError: 'moh_eager'`` once)."""
    from hf_families import save_tiny

    source = save_tiny("git", tmp_path / "source")
    with pytest.raises(SystemExit, match=r"^moh convert-hf: GitForCausalLM: none of its 2 layers calls "
                                         r"transformers' attention interface, [^\n]*\.$"):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "out")])


def test_the_suites_loads_of_a_converted_folder_warn_of_no_other_model_type(tmp_path):
    """`load_tokenizer` and `moh generate --hf_folder` of a `convert-hf` folder (model_type `moh`): transformers once
    warned "You are using a model of type `moh` to instantiate a model of type ``... can yield errors", AutoTokenizer
    having read its config.json without the remote code that defines `moh`."""
    save_family("llama", tmp_path / "source")
    folder = str(tmp_path / "converted")
    moh(["convert-hf", "--source", str(tmp_path / "source"), "--out", folder])
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_log = logging.getLogger("transformers")  # every transformers module logs below it
    transformers_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_tokenizer(folder)
            moh(["generate", "--hf_folder", folder, "--prompt", "def", "--max_new_tokens", "2"])
    finally:
        transformers_log.removeHandler(handler)
    said = [record.getMessage() for record in records] + [str(warning.message) for warning in caught]
    assert [line for line in said if "to instantiate a model of type" in line] == []


def test_keep_all_heads_shares_every_head_and_computes_the_source_logits(tmp_path, capsys):
    """The README said "with every head kept" without saying how; `--num_shared_heads 8` did it by arithmetic."""
    source = save_family("llama", tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--keep_all_heads", "true"])
    assert "every head shared, 8 per layer (100% active)" in capsys.readouterr().out
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "all", trust_remote_code=True).eval()
    assert (converted.config.moh_num_shared_heads, converted.config.moh_top_k) == (8, 0)
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    assert torch.equal(_logits(converted, _ids()), _logits(original, _ids()))
    with pytest.raises(SystemExit, match="--keep_all_heads true shares every head of every layer; leave out "):
        moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "x"), "--keep_all_heads", "true",
             "--top_k", "2"])
    assert not (tmp_path / "x").exists()
