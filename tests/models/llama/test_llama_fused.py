"""The LM's fused kernels (``models.llama.fused``, liger-kernel) against the network's unfused torch path: each piece
and the whole decoder, forward and every gradient, per dtype; on the CPU through Triton's interpreter, on CUDA
compiled. Without liger-kernel (CI installs ``.[test]`` only) those skip, and the CPU tests check the option is off
there and changes no parameter."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moh_lightning.models.llama import LlamaConfig, MoHLlama, RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from moh_lightning.models.llama import fused as fused_ops
from moh_lightning.tasks.language_model import LanguageModel

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None
# Set before Triton's import, TRITON_INTERPRET makes every jit function an interpreted one, so the interpreted tests
# run in a process of their own (test_kernels_under_the_triton_interpreter).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(
    not HAS_LIGER or not (INTERPRETED or torch.cuda.is_available()),
    reason="needs liger-kernel (pip install 'moh-lightning[gpu]') and CUDA; on the CPU "
           "test_kernels_under_the_triton_interpreter runs these")
# Triton's interpreter holds bf16 values as their raw 16 bits and computes on those: liger's SwiGLU and RoPE, which
# multiply in bf16, can be checked in bf16 on CUDA only (RMSNorm and the cross-entropy compute in float32).
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BF16_ARITHMETIC = [pytest.param(d, marks=pytest.mark.skipif(INTERPRETED and d == torch.bfloat16,
                                                           reason="bf16 arithmetic under the interpreter"))
                   for d in DTYPES]
# Fused against unfused in the same dtype, relative to the largest value: each kernel rounds where torch rounds or
# once where torch rounds twice, and sums in another order.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    scale = ref.detach().float().abs().max().item()
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=TOLERANCE[dtype] * max(scale, 1e-6))


def _config(**overrides) -> LlamaConfig:
    args = dict(vocab_size=301, depth=2, embed_dim=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
                block_size=80, moh={"num_shared_heads": 1, "top_k": 2})
    return LlamaConfig(**{**args, **overrides})


if INTERPRETED and HAS_LIGER:
    # Two gaps of Triton 3.8's interpreter that liger's kernels reach and compiled kernels do not have: a float
    # argument reaches the kernel as a Python float (liger calls eps.to(tl.float32) on it), and libdevice's rsqrt,
    # imported by name, is not swapped for the interpreter's.
    import numpy as np
    import triton.language as tl
    from liger_kernel.ops import rms_norm as liger_rms_norm
    from triton.runtime import interpreter

    _implicit_cvt = interpreter._implicit_cvt

    def _float_as_fp32(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return _implicit_cvt(arg)

    interpreter._implicit_cvt = _float_as_fp32
    liger_rms_norm.rsqrt = lambda x: tl.rsqrt(x)  # tl's, as patched for the call


def _leaf(shape, dtype, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype).requires_grad_()


def _grads(out: torch.Tensor, tensors, generator) -> list[torch.Tensor]:
    grad = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
    return list(torch.autograd.grad(out, tensors, grad))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(64, generator=generator) * 0.1)
    x = _leaf((3, 7, 64), dtype, generator, 2.0)
    ref, ours = norm(x), norm(x, fused=True)
    _close(ours, ref, dtype)
    for a, b in zip(_grads(ours, (x, norm.weight), torch.Generator().manual_seed(1)),
                    _grads(ref, (x, norm.weight), torch.Generator().manual_seed(1)), strict=True):
        _close(a, b, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", BF16_ARITHMETIC)
def test_swiglu(dtype):
    generator = torch.Generator().manual_seed(0)
    mlp = SwiGLU(64, 96).to(DEVICE, dtype)
    x = _leaf((3, 7, 64), dtype, generator)
    ref, ours = mlp(x), mlp(x, fused=True)
    _close(ours, ref, dtype)
    params = (x, *mlp.parameters())
    for a, b in zip(_grads(ours, params, torch.Generator().manual_seed(1)),
                    _grads(ref, params, torch.Generator().manual_seed(1)), strict=True):
        _close(a, b, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", BF16_ARITHMETIC)
@pytest.mark.parametrize("batch, start, length", [(2, 0, 9), (1, 5, 3)], ids=["prefill", "continued"])
def test_rope(dtype, batch, start, length):
    generator = torch.Generator().manual_seed(0)
    cos, sin = RotaryEmbedding(16).to(DEVICE)(start, length)
    # q and k as the attention block hands them over: views of one (B, T, h + 2 h_kv, d) projection.
    qkv = _leaf((batch, length, 4 + 2 * 2, 16), dtype, generator)
    q, k, _ = qkv.transpose(1, 2).split([4, 2, 2], dim=1)
    before = q.detach().clone(), k.detach().clone()
    ours = fused_ops.rope(q, k, cos, sin)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])  # the kernel rotated copies
    ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    for a, b in zip(ours, ref, strict=True):
        _close(a, b, dtype)
    out_ours, out_ref = torch.cat([t.flatten() for t in ours]), torch.cat([t.flatten() for t in ref])
    _close(*_grads(out_ours, (qkv,), torch.Generator().manual_seed(1)),
           *_grads(out_ref, (qkv,), torch.Generator().manual_seed(1)), dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy(dtype):
    generator = torch.Generator().manual_seed(0)
    # 200 tokens of width 32 over 1000 classes: liger takes them in chunks of 8 (its logits stay tokens x width).
    hidden, weight = _leaf((200, 32), dtype, generator), _leaf((1000, 32), dtype, generator, 0.3)
    targets = torch.randint(0, 1000, (200,), generator=generator).to(DEVICE)
    ours = fused_ops.linear_cross_entropy(hidden, weight, targets)
    ref = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    _close(ours, ref, dtype)
    # Scaled: liger keeps the gradients of a loss of 1 and multiplies them by the incoming one.
    for a, b in zip(torch.autograd.grad(ours * 3.0, (hidden, weight)),
                    torch.autograd.grad(ref * 3.0, (hidden, weight)), strict=True):
        _close(a, b, dtype)
    with torch.no_grad():  # evaluation: no gradients computed in the forward
        _close(fused_ops.linear_cross_entropy(hidden, weight, targets), ref.detach(), dtype)


def _pair(dtype, **overrides) -> tuple[MoHLlama, MoHLlama]:
    torch.manual_seed(0)
    ref = MoHLlama(_config(fused_kernels=False, **overrides)).to(DEVICE, dtype)
    ours = MoHLlama(_config(fused_kernels=True, **overrides)).to(DEVICE, dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@needs_kernels
@pytest.mark.parametrize("dtype", BF16_ARITHMETIC)
@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "moh": {"num_shared_heads": 1, "top_k": 2,
                                                                            "router": "query_norm"}}],
                         ids=["learned", "tied-query-norm"])
def test_decoder_loss_and_gradients(dtype, overrides):
    ref, ours = _pair(dtype, **overrides)
    assert ours.uses_fused_kernels(torch.device(DEVICE)) and not ref.uses_fused_kernels(torch.device(DEVICE))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 301, (2, 18), generator=generator).to(DEVICE)
    losses = [model(tokens[:, :-1], targets=tokens[:, 1:]) for model in (ours, ref)]
    _close(*losses, dtype)
    for loss in losses:
        loss.backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert a.grad is not None, name
        _close(a.grad, b.grad, dtype)
    with torch.no_grad():
        _close(ours(tokens), ref(tokens), dtype)


@needs_kernels
def test_fused_loss_never_holds_the_logits():
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestLogits(TorchDispatchMode):
        """The most elements of any new tensor (not a view) whose last dimension is the vocabulary (301)."""
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in (*args, *(kwargs or {}).values())
                      if isinstance(t, torch.Tensor)}
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == 301
                        and tensor.untyped_storage().data_ptr() not in inputs):
                    self.largest = max(self.largest, tensor.numel())
            return out

    _, ours = _pair(torch.float32)
    tokens = torch.randint(0, 301, (2, 65), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with LargestLogits() as seen:
        ours(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    assert 0 < seen.largest <= 2 * 64 * 301 // 4  # chunks of at most a quarter of the tokens' logits


@needs_kernels
def test_decoder_generates_the_same_tokens():
    ref, ours = _pair(torch.float32)
    prompt = torch.randint(0, 301, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert torch.equal(ours.generate(prompt, 8, temperature=0), ref.generate(prompt, 8, temperature=0))


@pytest.mark.skipif(not HAS_LIGER or not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and liger-kernel")
def test_bf16_autocast_training_loss_and_gradients():
    """The paper recipe's precision (bf16-mixed): float32 weights, bf16 matmuls."""
    ref, ours = _pair(torch.float32)
    tokens = torch.randint(0, 301, (2, 18), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        losses = [model(tokens[:, :-1], targets=tokens[:, 1:]) for model in (ours, ref)]
    _close(*losses, torch.bfloat16)
    for loss in losses:
        loss.backward()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        _close(a.grad, b.grad, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (pip install 'moh-lightning[gpu]')")
def test_kernels_under_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this process is the interpreter's")
    # -n 0: in that one process (pyproject's addopts would start pytest-xdist workers of its own).
    result = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-n", "0",
                             "-m", "not slow"], env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


# The CPU path, with or without liger-kernel.


def test_auto_is_off_on_the_cpu_and_changes_nothing():
    torch.manual_seed(0)
    plain = MoHLlama(_config(fused_kernels=False))
    auto = MoHLlama(_config())
    assert _config().fused_kernels == "auto" and not auto.uses_fused_kernels(torch.device("cpu"))
    assert list(auto.state_dict()) == list(plain.state_dict())
    assert all(isinstance(m, torch.nn.RMSNorm) for m in (auto.norm, auto.blocks[0].attn_norm))
    auto.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 301, (2, 12))
    assert torch.equal(auto(tokens), plain(tokens))
    # The loss the model computes on the CPU is the task's loss as it was: float32 cross-entropy of the logits.
    assert torch.equal(auto(tokens[:, :-1], targets=tokens[:, 1:]),
                       F.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()))


def test_language_model_loss_is_the_models():
    task = LanguageModel(arch=_config())
    task.configure_model()
    tokens = torch.randint(0, 301, (2, 12))
    logits = task.model(tokens[:, :-1])
    assert torch.equal(task._loss({"tokens": tokens}),
                       F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))


def test_without_liger_auto_is_off_once_and_true_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fused_ops, "_liger", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fused_ops._say_auto_is_off.cache_clear()
    with pytest.warns(UserWarning, match="liger-kernel is not installed") as said:
        for _ in range(2):
            assert not MoHLlama(_config()).uses_fused_kernels(torch.device("cuda"))
    assert len([w for w in said if "liger-kernel" in str(w.message)]) == 1
    with pytest.raises(ImportError, match=r"pip install 'moh-lightning\[gpu\]'"):
        MoHLlama(_config(fused_kernels=True))
    assert not MoHLlama(_config(fused_kernels=False)).uses_fused_kernels(torch.device("cuda"))


def test_fused_kernels_takes_auto_true_or_false():
    with pytest.raises(ValueError, match="fused_kernels='yes'"):
        _config(fused_kernels="yes")
