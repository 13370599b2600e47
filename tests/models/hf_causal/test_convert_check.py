"""``moh convert-hf`` proves each layer on its four-token forward: where the suite's head-sparse kernels compute
another attention than the family's (a family that reads a bias from the attention module itself, which the
interface's arguments do not show), that layer keeps the family's attention, through save / load and continue-tuning;
and a sparse-attention family's indexer (HY-V4's top-k keys) is applied under the MoH attention as under eager."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from hf_families import save_tiny
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto import CONFIG_MAPPING
from transformers.models.llama import modeling_llama

from moh_lightning.cli import main as moh
from moh_lightning.layers import moh_attention, moh_layers
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.hf_causal import build_hf_causal, checks, export_hf_causal, hf_moh, read_source_config
from moh_lightning.models.llama import LlamaConfig as SuiteLlamaConfig
from moh_lightning.tasks.language_model import LanguageModel


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """LLaMA's eager attention plus a learnt bias per head, read from the module: what the suite's kernels never see
    (as HY-V4's eager reads ``module.sinks``)."""
    out, weights = modeling_llama.eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                                          **kwargs)
    return out + module.head_bias[:, None].to(out.dtype), weights                      # (B, T, h, d)


class HeadBiasConfig(LlamaConfig):
    model_type = "moh_test_head_bias"


class HeadBiasAttention(modeling_llama.LlamaAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.head_bias = nn.Parameter(torch.zeros(config.num_attention_heads))

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (proj(hidden_states).view(shape).transpose(1, 2)
                             for proj in (self.q_proj, self.k_proj, self.v_proj))
        query, key = modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class HeadBiasForCausalLM(LlamaForCausalLM):
    config_class = HeadBiasConfig
    _supports_sdpa = False  # its bias is in its eager attention alone, as gpt-oss's sinks

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = HeadBiasAttention(config, layer.self_attn.layer_idx)


if HeadBiasConfig.model_type not in CONFIG_MAPPING:
    AutoConfig.register(HeadBiasConfig.model_type, HeadBiasConfig)
    AutoModelForCausalLM.register(HeadBiasConfig, HeadBiasForCausalLM)


def _save_head_bias(folder):
    torch.manual_seed(0)
    model = HeadBiasForCausalLM(HeadBiasConfig(vocab_size=320, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                               max_position_embeddings=128))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.head_bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _ids(length: int = 14) -> torch.Tensor:
    return torch.randint(3, 290, (2, length), generator=torch.Generator().manual_seed(1))


def _exported(folder) -> torch.nn.Module:
    """The folder as transformers loads it with its remote code, called by hand: ``AutoModelForCausalLM`` prefers a
    family registered in-process, as this test's is, to a folder's remote code."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = hf_moh.MoHForCausalLM.from_pretrained(folder, config=config).eval()
    assert model.config._attn_implementation == "moh_eager"
    return model


def _suite(folder, **moh) -> torch.nn.Module:
    return build_hf_causal(read_source_config(str(folder)), MoHConfig(router="query_norm", **moh),
                           weights=str(folder)).eval()


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """The suite's head-sparse kernels wherever ``execution: auto`` may pick them (on a GPU, or 512 queries at 75% on
    a CPU), here with every head on and a few tokens."""
    monkeypatch.setattr(moh_attention, "runs_head_sparse", lambda *args: True)


def test_a_layer_whose_attention_reads_the_module_keeps_the_familys_and_says_so(tmp_path, capsys, kernels_everywhere):
    source = _save_head_bias(tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "4",
         "--top_k", "4"])
    said = [line for line in capsys.readouterr().err.splitlines() if "own attention" in line]
    assert len(said) == 1 and said[0].startswith("moh convert-hf: layers 0, 1 keep HeadBiasForCausalLM's own "
                                                 "attention: on four tokens the suite's head-sparse kernels differ")
    assert json.loads((tmp_path / "all" / "config.json").read_text())["moh_family_attention"] == [0, 1]
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(source).eval()(input_ids=_ids()).logits
        assert torch.equal(_exported(tmp_path / "all")(input_ids=_ids()).logits, original)
        torch.testing.assert_close(_suite(tmp_path / "all")(_ids()), original, atol=1e-5, rtol=0)
    sparse = _suite(tmp_path / "all")
    for layer in moh_layers(sparse):
        layer.execution = "sparse"
    with pytest.raises(ValueError, match=r"moh.execution=sparse: .*moh_family_attention in config.json"):
        with torch.no_grad():
            sparse(_ids())


def test_without_the_check_the_kernels_compute_other_logits(tmp_path, monkeypatch, kernels_everywhere):
    """What the check prevents: the test family's bias is one the kernels miss."""
    source = _save_head_bias(tmp_path / "source")
    monkeypatch.setattr(checks, "tolerance", lambda dtype: float("inf"))
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "4",
         "--top_k", "4"])
    assert "moh_family_attention" not in json.loads((tmp_path / "all" / "config.json").read_text())
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(source).eval()(input_ids=_ids()).logits
        assert (_suite(tmp_path / "all")(_ids()) - original).abs().max() > 1e-3


def test_the_fallback_survives_continue_tuning_its_checkpoint_and_export(tmp_path, kernels_everywhere):
    source = _save_head_bias(tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "75")])
    task = LanguageModel(SuiteLlamaConfig(moh=MoHConfig(router="query_norm")), init_from=str(tmp_path / "75"))
    task.trainer = L.Trainer(logger=False)
    task.trainer.state.fn = TrainerFn.FITTING
    task.configure_model()
    assert [layer.family_only for layer in moh_layers(task.model)] == [True, True]
    restored = LanguageModel(SuiteLlamaConfig(moh=MoHConfig(router="query_norm")),
                             hf_config=task.hparams.hf_config)  # a checkpoint's hyperparameters
    restored.configure_model()
    assert [layer.family_only for layer in moh_layers(restored.model)] == [True, True]
    export_hf_causal(task.model, tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["moh_family_attention"] == [0, 1]
    with torch.no_grad():  # 75%: the suite's gates over the family's attention are the exported folder's
        torch.testing.assert_close(task.model.eval()(_ids()), _exported(tmp_path / "exported")(input_ids=_ids()).logits,
                                   atol=1e-5, rtol=0)


def test_a_family_the_kernels_compute_keeps_them(tmp_path):
    from hf_families import save_family

    source = save_family("llama", tmp_path / "source")
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "75")])
    assert "moh_family_attention" not in json.loads((tmp_path / "75" / "config.json").read_text())
    assert [layer.family_only for layer in moh_layers(_suite(tmp_path / "75"))] == [False, False]


@pytest.mark.slow
def test_a_sparse_attention_indexers_keys_are_the_ones_attended(tmp_path):
    """HY-V4 masks the keys its indexer left out itself under ``eager`` and ``sdpa`` only, and hands the indices
    (``indices``) to any other implementation: the MoH one once attended over every key (6.6e-3 from the source's
    logits wherever a sequence is longer than ``index_topk``)."""
    source = save_tiny("hy_v4", tmp_path / "source", index_topk=4)
    moh(["convert-hf", "--source", str(source), "--out", str(tmp_path / "all"), "--num_shared_heads", "2",
         "--top_k", "2"])
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(source).eval()(input_ids=_ids()).logits
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / "all", trust_remote_code=True).eval()
        assert torch.equal(converted(input_ids=_ids()).logits, original)
        assert torch.equal(_suite(tmp_path / "all")(_ids()), original)
