"""Speed switches: torch.compile (compiled outputs and gradients equal eager ones, the dense-and-mask path without
graph breaks) and activation checkpointing per block (equal gradients), as MoHTask options.

Compiled with ``backend="aot_eager"``: Dynamo's capture and AOT autograd's forward / backward graphs are what can
break or change a result; Inductor's C++ code generation takes ~40 s per layer on a loaded 2-core CPU, too slow here.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import class_of, printed_config
from lightning.pytorch import Trainer
from tiny_models import dit_t4_config, tiny_llama_config
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from moh_lightning.layers import MoHAttention, moh_layers, pop_load_balance_loss
from moh_lightning.layers.moh_attention import checkpoint_blocks
from moh_lightning.layers.moh_config import MoHConfig
from moh_lightning.models.dit import DiT
from moh_lightning.models.llama import MoHLlama
from moh_lightning.models.transnext import TransNeXt, TransNeXtConfig
from moh_lightning.models.vit import ViTConfig, create_vit
from moh_lightning.tasks.base import MoHTask
from moh_lightning.tasks.language_model import LanguageModel

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _tiny_vit(**overrides) -> torch.nn.Module:
    arch = {"img_size": 28, "patch_size": 7, "in_chans": 1, "num_classes": 10, "embed_dim": 32, "depth": 2,
            "num_heads": 4, "mlp_ratio": 2.0, "drop_path_rate": 0.1, "moh": MoHConfig(num_shared_heads=1, top_k=2)}
    return create_vit(ViTConfig(**{**arch, **overrides}))


TINY_TRANSNEXT = TransNeXtConfig(img_size=32, patch_size=2, in_chans=1, num_classes=10, embed_dim=[8, 16, 16, 16],
                                 depth=[1, 1, 2, 1], num_heads=[2, 4, 4, 4], mlp_ratio=2.0, sr_ratio=[4, 2, 2, 1],
                                 drop_path_rate=0.1, moh=MoHConfig(num_shared_heads=[2, 1, 0, 2], top_k=[0, 2, 2, 1]))


def _models():
    """(name, model, inputs, loss of the output) for each model family; drop path on where the model has it."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(3, 1, 28, 28, generator=generator)
    yield "vit", _tiny_vit(), (images,), lambda out: out.square().mean()
    dit_inputs = (torch.randn(2, 1, 32, 32, generator=generator), torch.randint(0, 1000, (2,), generator=generator),
                  torch.randint(0, 10, (2,), generator=generator))
    yield "dit", DiT(dit_t4_config("MoH-DiT-T/4-75")), dit_inputs, lambda out: out.square().mean()
    tokens = torch.randint(0, 259, (2, 33), generator=generator)
    yield "llama", MoHLlama(tiny_llama_config("tiny_50")), (tokens[:, :-1],), \
        lambda out: F.cross_entropy(out.flatten(0, 1), tokens[:, 1:].flatten())
    yield "transnext", TransNeXt(TINY_TRANSNEXT), (torch.randn(2, 1, 32, 32, generator=generator),), \
        lambda out: out.square().mean()


def _step(model, inputs, loss_fn, seed: int = 3):
    """Output, routers' load-balance loss and every parameter's gradient of one training step."""
    model.train()
    for param in model.parameters():
        param.grad = None
    torch.manual_seed(seed)  # drop path / label dropout draw the same in both runs
    out = model(*inputs)
    balance = pop_load_balance_loss(model)
    loss = loss_fn(out) + (0.0 if balance is None else 0.01 * balance)
    loss.backward()
    return out.detach(), balance.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_same_step(first, second):
    (out_a, balance_a, grads_a), (out_b, balance_b, grads_b) = first, second
    torch.testing.assert_close(out_b, out_a, **TOL)
    torch.testing.assert_close(balance_b, balance_a, **TOL)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        assert grad is not None, name
        torch.testing.assert_close(grads_b[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ["vit", "dit", "llama", "transnext"])
@pytest.mark.slow
def test_activation_checkpointing_gives_equal_gradients(name):
    model, inputs, loss_fn = next((m, i, f) for n, m, i, f in _models() if n == name)
    reference = _step(model, inputs, loss_fn)
    checkpointed = copy.deepcopy(model)
    state = copy.deepcopy(checkpointed.state_dict())
    blocks = checkpoint_blocks(checkpointed)
    assert blocks == checkpoint_blocks(checkpointed) and blocks >= 2      # once; TransNeXt's blocks of every stage
    assert list(checkpointed.state_dict()) == list(state)                  # names untouched
    _assert_same_step(reference, _step(checkpointed, inputs, loss_fn))
    # The recomputation in backward does not bring a popped loss back, and the gates are the forward's.
    assert all(layer.load_balance_loss is None for layer in moh_layers(checkpointed))
    for layer, ref_layer in zip(moh_layers(checkpointed), moh_layers(model), strict=True):
        torch.testing.assert_close(layer.last_gates, ref_layer.last_gates)


def test_checkpointed_blocks_run_plainly_without_autograd_and_survive_deepcopy():
    model = _tiny_vit().eval()
    checkpoint_blocks(model)
    images = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        expected = model(images)
    copied = copy.deepcopy(model)
    assert copied.blocks[0].forward.module is copied.blocks[0]           # the copy checkpoints itself
    with torch.no_grad():
        torch.testing.assert_close(copied(images), expected)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_dense_and_mask_layer_compiles_in_one_graph_with_equal_outputs_and_gradients(causal):
    torch.manual_seed(0)
    layer = MoHAttention(32, 8, num_shared_heads=2, top_k=3, causal=causal, execution="masked").train()
    compiled = copy.deepcopy(layer)
    compiled.compile(backend="aot_eager", fullgraph=True)        # fullgraph: any graph break is an error
    x = torch.randn(2, 12, 32)
    results = []
    for module in (layer, compiled):
        inputs = x.clone().requires_grad_()
        out = module(inputs)
        (out.square().sum() + module.load_balance_loss).backward()
        results.append((out, module.last_gates, inputs.grad, [p.grad for p in module.parameters()]))
    (out, gates, dx, grads), (c_out, c_gates, c_dx, c_grads) = results
    torch.testing.assert_close(c_out, out, **TOL)
    torch.testing.assert_close(c_gates, gates, **TOL)
    torch.testing.assert_close(c_dx, dx, **TOL)
    for grad, c_grad in zip(grads, c_grads, strict=True):
        torch.testing.assert_close(c_grad, grad, **TOL)


@pytest.mark.parametrize("name", ["vit", "dit", "llama"])
@pytest.mark.slow
def test_cpu_default_models_trace_without_graph_breaks(name):
    """The embedded defaults run the dense-and-mask path (``auto`` at their lengths): one graph per model."""
    torch._dynamo.reset()
    model, inputs, _ = next((m, i, f) for n, m, i, f in _models() if n == name)
    explanation = torch._dynamo.explain(model.train())(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    pop_load_balance_loss(model)


@pytest.mark.slow
def test_sparse_path_compiles_with_only_its_data_dependent_breaks():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = MoHAttention(32, 8, num_shared_heads=2, top_k=3, causal=True, execution="sparse").train()
    x = torch.randn(2, 40, 32)
    compiled = copy.deepcopy(layer)
    compiled.compile(backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x), **TOL)
    reasons = list(counters["graph_break"])  # Dynamo's reason for each break of the compile above
    assert reasons and all("Data dependent" in reason or "item()" in reason for reason in reasons), reasons


class _TinyTask(MoHTask):
    def __init__(self, compile: bool = False, activation_checkpointing: bool = False, **vit) -> None:
        super().__init__(compile=compile, activation_checkpointing=activation_checkpointing,
                         compile_kwargs={"backend": "aot_eager"})
        self.model = _tiny_vit(**{"drop_path_rate": 0.0, **vit})

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return self.with_load_balance(F.cross_entropy(self.model(images), labels))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
def test_task_switches_compile_in_place_and_checkpoint_blocks_under_a_trainer(tmp_path):
    torch.manual_seed(0)
    task = _TinyTask(compile=True, activation_checkpointing=True)
    eager = copy.deepcopy(task.model)
    keys = list(task.state_dict())
    task.configure_model()                                    # no Trainer yet: checkpointing only
    assert getattr(task.model, "_compiled_call_impl", None) is None
    assert all(type(block.__dict__.get("forward")).__name__ == "_CheckpointedForward" for block in task.model.blocks)
    data = TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(task, DataLoader(data, batch_size=4))
    assert getattr(task.model, "_compiled_call_impl", None) is not None
    assert list(task.state_dict()) == keys                    # in place: no `_orig_mod` in the names
    eager.load_state_dict(task.model.state_dict())
    images, labels = data.tensors
    _assert_same_step(_step(eager, (images,), lambda out: F.cross_entropy(out, labels)),
                      _step(task.model, (images,), lambda out: F.cross_entropy(out, labels)))


def test_language_model_applies_the_switches_after_building_its_model():
    task = LanguageModel(tiny_llama_config("tiny_75"))
    task.activation_checkpointing = True
    task.configure_model()
    model = task.model
    task.configure_model()                                    # built once, wrapped once
    assert task.model is model
    assert all(type(block.__dict__.get("forward")).__name__ == "_CheckpointedForward" for block in model.blocks)


@pytest.mark.parametrize("config", ["vit_tiny_mnist_75.yaml", "dit_mnist_75.yaml", "llm_stdlib_75.yaml"])
def test_every_task_takes_the_speed_switches_and_compiles_only_on_cuda_by_default(config):
    printed = printed_config(["--config", config, "--model.init_args.compile", "false",
                              "--model.init_args.activation_checkpointing", "true",
                              "--model.init_args.compile_kwargs", "{mode: reduce-overhead}"])
    assert printed["model"]["init_args"]["compile"] is False
    assert printed["model"]["init_args"]["activation_checkpointing"] is True
    assert printed["model"]["init_args"]["compile_kwargs"] == {"mode": "reduce-overhead"}
    task_class = class_of(printed["model"]["class_path"])
    assert inspect.signature(task_class).parameters["compile"].default == "auto"
    assert inspect.signature(task_class).parameters["compile_kwargs"].default is None


def test_compile_kwargs_are_checked_against_torch_compile():
    assert MoHTask(compile_kwargs={"mode": "reduce-overhead", "recompile_limit": 16}).compile_kwargs["mode"]
    with pytest.raises(ValueError, match="compile_kwargs: modes is not an option of torch.compile"):
        MoHTask(compile_kwargs={"modes": "reduce-overhead"})


def test_compile_auto_compiles_each_block_on_cuda_and_nothing_on_the_cpu(monkeypatch):
    task = _TinyTask(compile="auto")
    task._trainer = type("T", (), {"strategy": type("S", (), {"root_device": torch.device("cpu")})()})()
    task.configure_model()
    assert not task._model_compiled and getattr(task.model, "_compiled_call_impl", None) is None
    task._trainer.strategy.root_device = torch.device("cuda")  # the device the Trainer runs on, not a tensor's
    task.configure_model()
    assert task._model_compiled and all(block._compiled_call_impl is not None for block in task.model.blocks)
    assert getattr(task.model, "_compiled_call_impl", None) is None  # regional: the blocks, not the whole model
    with pytest.raises(ValueError, match="compile='always'"):
        _TinyTask(compile="always")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
@pytest.mark.parametrize("config", ["vit_tiny_mnist_75", "dit_mnist_75", "llm_stdlib_75"])
def test_every_tasks_block_compiles_on_cuda_without_a_graph_break(config):
    """What compile auto compiles on CUDA, one block in its default execution, traces whole (the CPU models' trace is
    test_cpu_default_models_trace_without_graph_breaks)."""
    from moh_lightning.tools.bench.model_step import model_step_parts

    model, inputs, _ = model_step_parts(config, 2, torch.device("cuda"), 32)
    block, captured = model.blocks[0], {}
    hook = block.register_forward_pre_hook(lambda m, args, kwargs: captured.setdefault("in", (args, kwargs)),
                                           with_kwargs=True)
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    torch._dynamo.reset()
    args, kwargs = captured["in"]
    explanation = torch._dynamo.explain(block)(*args, **kwargs)
    assert explanation.graph_break_count == 0, [str(reason.reason) for reason in explanation.break_reasons]


def _on_cuda(task: MoHTask) -> MoHTask:
    """``task`` as a Trainer on CUDA would configure it: compile auto compiles its blocks (here to run on the CPU)."""
    task._trainer = type("T", (), {"strategy": type("S", (), {"root_device": torch.device("cuda")})()})()
    task.configure_model()
    return task


@pytest.mark.slow
@pytest.mark.parametrize(("top_k", "limit", "graphs"), [(2, None, 1), ([1, 2], 1, 1)])
def test_the_first_compiled_step_says_into_how_many_graphs_and_warns_at_the_recompile_limit(top_k, limit, graphs,
                                                                                            caplog):
    """Two blocks with drop path (rates 0 and 0.1) share one graph; with two budgets and a recompile limit of one,
    the second block's graph is not compiled, and the line says so."""
    torch._dynamo.reset()
    task = _TinyTask(compile="auto", drop_path_rate=0.1, moh=MoHConfig(num_shared_heads=1, top_k=top_k))
    task.compile_kwargs["backend"] = "eager"  # graphs and the recompile limit are Dynamo's, whatever the backend
    if limit is not None:
        task.compile_kwargs["recompile_limit"] = limit
    _on_cuda(task).on_train_batch_start(None, 0)
    _step(task.model, (torch.randn(2, 1, 28, 28),), lambda out: out.square().mean())
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        task.on_train_batch_end(None, None, 0)
    assert f"compilation included: 2 blocks compiled into {graphs} graph." in caplog.text
    limit_warnings = [str(w.message) for w in warned if "recompile limit" in str(w.message)]
    assert limit_warnings == ([] if limit is None else [
        "moh: torch.compile hit Dynamo's recompile limit (1): blocks it would have compiled next run eagerly "
        "(TORCH_LOGS=recompiles says why; --model.init_args.compile_kwargs '{recompile_limit: 2}' raises it)."])
