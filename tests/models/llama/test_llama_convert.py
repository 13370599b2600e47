"""transformers LLaMA -> MoH-LLaMA (query-norm router) -> transformers folder, on tiny random LLaMAs."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from moh_lightning.cli import main as moh
from moh_lightning.layers import QueryNormRouter, activated_head_fraction, pop_load_balance_loss
from moh_lightning.models.llama import MoHLlama, export_hf, from_hf, llm_config_from_hf
from moh_lightning.tasks.language_model import LanguageModel


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama_folder(request, tmp_path_factory):
    """A tiny random LlamaForCausalLM with grouped-query attention, saved like a hub checkpoint."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                         tie_word_embeddings=request.param)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    ByT5Tokenizer(extra_ids=0).save_pretrained(folder)
    return folder


def _logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out


def test_all_heads_active_reproduces_llama_logits(llama_folder):
    original = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    converted = from_hf(str(llama_folder), num_shared_heads=4, top_k=4)
    assert isinstance(converted.blocks[0].attn.router, QueryNormRouter)
    assert activated_head_fraction(converted) == 1.0
    idx = torch.randint(3, 259, (2, 24))
    torch.testing.assert_close(_logits(converted, idx), _logits(original, idx), atol=1e-5, rtol=1e-5)


def test_default_split_is_half_shared_at_75_percent(llama_folder):
    config = llm_config_from_hf(LlamaForCausalLM.from_pretrained(llama_folder).config)
    assert (config.moh.num_shared_heads, config.moh.top_k, config.activated_fraction) == (4, 2, 0.75)
    assert config.moh.router == "query_norm" and config.num_kv_heads == 2 and config.rope_base == 5000.0


@pytest.mark.slow
def test_75_percent_routes_trains_and_balances(llama_folder):
    model = from_hf(str(llama_folder)).train()
    idx = torch.randint(3, 259, (2, 16))
    original = _logits(LlamaForCausalLM.from_pretrained(llama_folder).eval(), idx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        logits = model(idx[:, :-1])
        gates = model.blocks[0].attn.last_gates
        assert torch.equal((gates > 0).sum(-1), torch.full((2, 15), 6))  # 4 shared + top-2 of 4 routed
        assert set(gates.unique().tolist()) <= {0.0, 1.0}  # quantised gates (Eq. 9)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        balance = pop_load_balance_loss(model)
        assert balance is not None and balance > 0
        (loss + 0.01 * balance).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.allclose(_logits(model.eval(), idx), original)


def test_query_norm_router_passes_the_scores_gradient_straight_through():
    """Eq. 10: backward through the {0, 1} gates is the gradient of the softmax scores they were picked from."""
    router = QueryNormRouter(num_heads=6, num_shared_heads=2, top_k=2)
    torch.manual_seed(0)
    q = torch.randn(1, 6, 5, 8, requires_grad=True)
    weights = torch.randn(1, 5, 6)
    (router(None, q=q).gates * weights).sum().backward()
    # The routed heads' scores, re-computed here, differentiated as if the gates were the scores themselves.
    q_again = q.detach().clone().requires_grad_(True)
    norms = q_again[:, 2:].norm(dim=-1).permute(0, 2, 1).reshape(5, 4)
    scores = (norms / norms.std(-1, keepdim=True)).softmax(-1)
    (scores.reshape(1, 5, 4) * weights[..., 2:]).sum().backward()
    assert q.grad.abs().sum() > 0
    torch.testing.assert_close(q.grad, q_again.grad)


def test_export_round_trip_through_transformers(llama_folder, tmp_path):
    model = from_hf(str(llama_folder))
    export_hf(model, tmp_path / "moh", ByT5Tokenizer(extra_ids=0))
    config = json.loads((tmp_path / "moh" / "config.json").read_text())
    assert config["model_type"] == "moh_llama" and "AutoModelForCausalLM" in config["auto_map"]
    assert (tmp_path / "moh" / "hf_moh_llama.py").is_file() and (tmp_path / "moh" / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moh", trust_remote_code=True).eval()
    idx = torch.randint(3, 259, (2, 20))
    torch.testing.assert_close(_logits(loaded, idx), _logits(model, idx), atol=1e-5, rtol=1e-5)
    prompt = idx[:1, :6]
    hf_greedy = loaded.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(hf_greedy, model.generate(prompt, 8, temperature=0))  # HF cache vs our KV cache


def test_dense_export_is_plain_llama(llama_folder, tmp_path):
    model = from_hf(str(llama_folder), num_shared_heads=4, top_k=4, dense=True)
    export_hf(model, tmp_path / "dense")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "dense").eval()
    original = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    idx = torch.randint(3, 259, (1, 10))
    torch.testing.assert_close(_logits(loaded, idx), _logits(original, idx), atol=1e-5, rtol=1e-5)


def test_convert_tool_and_continue_tuning_init(llama_folder, tmp_path):
    moh(["convert-llama", "--source", str(llama_folder), "--out", str(tmp_path / "out"), "--dtype", "float32"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert loaded.config.moh_num_shared_heads == 4 and loaded.config.moh_top_k == 2
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()

    # Continue-tuning runs transformers' own LLaMA with the source's shapes (tests/models/hf_causal/ for every family);
    # an arch that repeats them, as llm_config_from_hf gives, is accepted.
    hf = LlamaForCausalLM.from_pretrained(llama_folder)
    task = LanguageModel(llm_config_from_hf(hf.config), init_from=str(llama_folder))
    task.configure_model()  # outside a fit: fresh weights
    assert not torch.equal(task.model.hf.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    task = LanguageModel(llm_config_from_hf(hf.config), init_from=str(tmp_path / "out"))
    task.trainer = L.Trainer(logger=False)
    task.trainer.state.fn = TrainerFn.FITTING
    task.configure_model()  # a fresh fit of the continue-tuning config loads the pretrained weights here
    torch.testing.assert_close(task.model.hf.model.layers[1].mlp.down_proj.weight,
                               hf.model.layers[1].mlp.down_proj.weight)


def test_conversion_errors_are_clear(tmp_path):
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type"):
        llm_config_from_hf(config)
    with pytest.raises(OSError, match="LLaMA checkpoint"):
        from_hf(str(tmp_path / "nothing"))
    # A router the exported modelling code does not have ('learned' and 'query_norm' both export since 9cc0130).
    unknown = MoHLlama(llm_config_from_hf(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=4)))
    unknown.config.moh.router = "no_such_router"
    with pytest.raises(ValueError, match="router='no_such_router'.*'learned' and 'query_norm'"):
        export_hf(unknown, tmp_path / "x")


def test_from_hf_takes_the_asked_budget_dense_choice_and_dtype(llama_folder):
    model = from_hf(str(llama_folder), num_shared_heads=2, top_k=3, dtype=torch.bfloat16)
    assert (model.config.moh.num_shared_heads, model.config.moh.top_k) == (2, 3)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    dense = from_hf(str(llama_folder), dense=True)
    assert dense.config.moh is None and activated_head_fraction(dense) == 1.0
    assert {p.dtype for p in dense.parameters()} == {torch.float32}


@pytest.mark.parametrize("moh", [True, False], ids=["moh", "dense"])
def test_exported_folder_keeps_every_size_and_says_how_to_load_it(tmp_path, moh):
    """A head width other than width / heads and the context length reach config.json; the model card's hub header
    marks remote code for MoH (its snippets pass trust_remote_code=True) and not for a plain LLaMA."""
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, head_dim=12, max_position_embeddings=48,
                         tie_word_embeddings=False)
    model = MoHLlama(llm_config_from_hf(config, num_shared_heads=2, top_k=1, dense=not moh))
    folder = export_hf(model, tmp_path / "out")
    written = json.loads((folder / "config.json").read_text())
    assert (written["head_dim"], written["max_position_embeddings"]) == (12, 48)
    card = (folder / "README.md").read_text().splitlines()
    header = card[:card.index("---", 1) + 1]
    assert header[:5] == ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- moh"]
    assert ("- custom_code" in header) == moh
    assert any("trust_remote_code=True" in line for line in card) == moh
