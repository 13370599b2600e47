"""Regional compilation (``compile: auto``) compiles one graph per distinct block shape in every task's CPU and GPU
default configs: nothing a block keeps of its own (its drop-path rate, its input's layout) makes it a graph of its own,
and no block runs eagerly past Dynamo's recompile limit.

Each config's network is built small (widths, images, vocabulary) with its depth, per-layer head budgets and
drop-path rate kept, its blocks compiled with ``backend="eager"`` and run forward and backward once in training.
Graphs, recompiles and frames falling back to eager are Dynamo's, decided before any backend sees a graph: the eager
backend counts them as Inductor would, without a backend's own tracing (AOT autograd's, seconds a graph; Inductor's
code generation, minutes here). Blocks through AOT autograd: the dry run's compiled training steps
(benchmarks/tests/test_gpu_call.py) and test_speed_switches.py.
"""
from __future__ import annotations

import pytest
import torch
from conftest import class_of
from torch._dynamo.utils import counters

from moh_lightning.configs import load_config
from moh_lightning.layers import MoHHeads, pop_load_balance_loss
from moh_lightning.layers.moh_attention import compile_blocks, model_blocks

# Each task's CPU default, then its GPU defaults (the pairs `benchmarks/steps.py` times), and the continue-tuning of a
# transformers model. MoH-TransNeXt once, at its GPU default (MoH-TransNeXt-S): the CPU default's blocks are the same
# kinds at other widths and depths, with the same kind of per-stage budgets.
CONFIGS = ["vit_tiny_mnist_75.yaml", "dit_mnist_75.yaml", "llm_stdlib_75.yaml", "vit_s_75.yaml", "dit_s2_75.yaml",
           "llm_s_75.yaml", "moh_transnext_small_75.yaml", "continue_hf_75.yaml"]
# Heads of 8 channels and small inputs; what makes a block differ from another (budgets, rates, stages) is kept.
SMALL = {"ImageClassifier": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "head_dim": 8, "mlp_ratio": 1.0,
                             "num_classes": 10},
         "ClassConditionalDiffusion": {"img_size": None, "input_size": 8, "embed_dim": 32, "head_dim": 8,
                                       "mlp_ratio": 1.0, "num_classes": 10},
         "LanguageModel": {"embed_dim": 32, "head_dim": 8, "intermediate_size": 32, "vocab_size": 64,
                           "block_size": 16},
         "TransNeXtClassifier": {"img_size": 32, "patch_size": 2, "mlp_ratio": 1.0, "num_classes": 10}}


def _small_task(name: str):
    """The task of a shipped config over its network made small."""
    config = load_config(name)["model"]
    task_class = class_of(config["class_path"])
    arch = config.get("init_args", {}).get("arch", {})
    if name == "continue_hf_75.yaml":  # the network and its shapes are init_from's: a tiny transformers LLaMA
        import transformers

        source = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        task = task_class(arch=arch, hf_config=source.to_dict())
    else:
        arch = {**arch, **SMALL[task_class.__name__]}
        if task_class.__name__ == "TransNeXtClassifier":
            heads = arch.get("num_heads", [3, 6, 12, 24])  # TransNeXtConfig's default, TransNeXt-S
            arch["embed_dim"] = [8 * h for h in heads]
        task = task_class(arch=arch)
    task.configure_model()  # the language model builds its network here
    return task


def _shape(block: torch.nn.Module) -> tuple:
    """What sets a block's graph: its class, its tensors' shapes and its MoH layers' budgets (top-k is a shape of the
    routing). Its drop-path rate is not: the graphs must not depend on it."""
    tensors = tuple((name, tuple(t.shape)) for name, t in [*block.named_parameters(), *block.named_buffers()])
    budgets = tuple((m.num_shared_heads, m.router.top_k if m.router is not None else None)
                    for m in block.modules() if isinstance(m, MoHHeads))
    return type(block), tensors, budgets


def _batch(task) -> tuple:
    """Two samples of the training shape: a batch of one leaves strides of a size-1 dimension to each op's choice,
    which Dynamo guards on."""
    inputs = task.example_input()
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, *x.shape[1:], generator=generator) if x.is_floating_point()
                 else x.repeat_interleave(2, 0) for x in (inputs if isinstance(inputs, tuple) else (inputs,)))


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_blocks_compile_into_one_graph_per_distinct_shape(name):
    task = _small_task(name)
    model = task.model.train()
    blocks = model_blocks(model, "the test")
    shapes = len({_shape(block) for block in blocks})
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(model, backend="eager") == len(blocks)
    out = task(*_batch(task))
    balance = pop_load_balance_loss(model)
    (out.float().square().mean() + (0.0 if balance is None else 0.01 * balance)).backward()
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= shapes, f"{len(blocks)} blocks of {shapes} shapes compiled into {graphs} graphs"
    assert counters["frames"]["total"] == counters["frames"]["ok"], "a block's frame fell back to eager"
    assert not [key for key in counters["unimplemented"] if "recompile limit" in key.lower()]
    assert all(p.grad is not None for p in blocks[-1].parameters() if p.requires_grad)
