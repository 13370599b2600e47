"""The LM's fused kernels: liger-kernel's RMSNorm, SwiGLU, RoPE and linear cross-entropy, each computing what the
network's unfused torch path computes (``tests/models/llama/test_llama_fused.py`` holds them to it, forward and
gradients).

``LlamaConfig.fused_kernels`` turns them on: ``auto`` for CUDA tensors when liger-kernel is installed
(``pip install 'moh-lightning[gpu]'``, an optional extra, imported only here and only when asked for), ``true``
wherever the model runs (CUDA, or CPU tensors under Triton's interpreter), ``false`` never. The CPU path is the plain
torch one.

The three elementwise kernels replace torch ops only where the block runs eagerly: under ``torch.compile`` inductor
fuses the same ops itself, and a liger call in the graph would only split it. The cross-entropy takes the final
hidden states and the head's weight and never forms the (B T, V) logits: chunks of tokens go through the head and the
loss one after another, their gradients computed in the forward.
"""
from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import torch

from moh_lightning.errors import MissingExtraError, install_line

INSTALL = install_line("gpu")


@functools.cache
def _liger() -> SimpleNamespace | None:
    """liger-kernel's autograd functions, or None when it is not installed.

    Its op-level functions, not its ``transformers`` wrappers: those go through a dispatcher that
    ``torch.compiler.disable`` fences off, and the decoder calls them with its own tensors' layout.
    """
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return SimpleNamespace(rms_norm=LigerRMSNormFunction, silu_mul=LigerSiLUMulFunction, rope=LigerRopeFunction,
                           linear_cross_entropy=LigerFusedLinearCrossEntropyFunction)


@functools.cache
def _say_auto_is_off() -> None:
    warnings.warn(f"fused_kernels=auto: liger-kernel is not installed, so the LM runs without its fused kernels on "
                  f"CUDA too ({INSTALL}).", stacklevel=4)


def fused_kernels_ready(setting: bool | str) -> bool:
    """Whether ``setting`` (``LlamaConfig.fused_kernels``) has liger-kernel's kernels at hand.

    ``false``: no. ``true`` without liger-kernel raises. ``auto`` without it is off, said once where CUDA is available
    (on a CPU-only machine it would be off anyway).
    """
    if setting is False:
        return False
    if _liger() is not None:
        return True
    if setting is True:
        raise MissingExtraError(f"fused_kernels=true needs liger-kernel, which is not installed: {INSTALL}")
    if torch.cuda.is_available():
        _say_auto_is_off()
    return False


def eager(fused: bool) -> bool:
    """``fused`` outside ``torch.compile``, whose inductor fuses the elementwise torch ops itself."""
    return fused and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight)`` over the last dimension in one kernel."""
    # "gemma" casting is torch's arithmetic: normalised and scaled in float32, rounded to x's dtype once at the end
    # ("llama" rounds before the scale, as transformers' LlamaRMSNorm). Offset 0: the gain is the weight itself.
    # Not in place: dX would overwrite the gradient autograd hands over.
    return _liger().rms_norm.apply(x, weight, eps, 0.0, "gemma", False)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one kernel (SwiGLU's elementwise part)."""
    return _liger().silu_mul.apply(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``network.apply_rope`` of queries (B, h, T, d) and keys (B, h_kv, T, d) in one kernel, for T > 1.

    The kernel takes the row stride of its (B, T, h, d) layout from the token dimension, whose stride is any number
    for one token: a batch of one-token rows would be read from the wrong places. It rotates in place where q and k
    are laid out (B, T, h, d) already, and copies them otherwise: the attention block's q and k, views of its qkv
    projection, are copied.
    """
    # The tables in the activations' dtype, as apply_rope rotates.
    return _liger().rope.apply(q, k, cos.to(q.dtype), sin.to(q.dtype))


@torch.compiler.disable
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean ``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` over hidden states (N, C) and targets (N,),
    without the (N, V) logits."""
    # Outside the graph under whole-model compilation: the loss ends the forward, so the break costs one boundary.
    # Arguments after the targets: no bias or class weights, ignore_index -100, no z-loss or label smoothing, mean,
    # no softcap, no z-loss returned, and the weight's gradient summed over the chunks in float32 (in the weight's
    # bf16 each chunk's sum would round, where the unfused backward rounds once).
    return _liger().linear_cross_entropy.apply(hidden, weight, targets, None, None, -100, 0.0, 0.0, "mean", None,
                                               False, torch.float32)[0]


__all__ = ["INSTALL", "eager", "fused_kernels_ready", "linear_cross_entropy", "rms_norm", "rope", "silu_mul"]
