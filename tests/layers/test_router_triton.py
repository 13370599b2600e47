"""The router's Triton pass (``router_triton``) against its PyTorch pass (``router_op``): every layout, with and without
statistics and padding, token counts that are no multiple of the block, fp32 and bf16; on the CPU through Triton's
interpreter, on CUDA compiled; the whole ``moh::route`` op with the kernels against it with the PyTorch passes in fp32,
bf16 and fp16, and on CUDA against the CPU's."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from moh_lightning.layers import router_op, router_triton  # noqa: E402

# Set before Triton's import, TRITON_INTERPRET builds every jit function for the interpreter, triton.language's own
# (tl.sum, tl.argmax) included: a process that imported Triton without it cannot run interpreted kernels, so the
# CPU tests run in a process of their own (test_passes_under_the_triton_interpreter), or with
# TRITON_INTERPRET=1 pytest tests/layers/test_router_triton.py.
INTERPRETED = isinstance(router_triton._route_kernel, InterpretedFunction)

# (shared_heads, routed_heads, top_k, shared_rows, type_rows): MoHRouter's layouts, one shared head without a router.
LAYOUTS = [(3, 5, 2, 3, 2), (2, 4, 1, 2, 0), (1, 4, 2, 0, 2), (1, 5, 3, 0, 0), (0, 6, 3, 0, 0), (3, 3, 3, 3, 2),
           (6, 0, 0, 6, 0)]
# The kernels compute in float32 and round once to bf16, against the PyTorch pass in float32 on the same values.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-6}}
# The whole op against the PyTorch passes in float32: (outputs, gradients) tolerances, relative and, times each one's
# largest entry, absolute. The outputs round once to the dtype, as above (the interpreter truncates to bf16: up to one
# unit in the last place); the gradients add the op's products in the dtype, sums over the tokens.
OP_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -6, 2 ** -5), torch.float16: (2 ** -9, 2 ** -8)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_passes_under_the_triton_interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs a CUDA device")
needs_kernels = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                   reason="needs a CUDA device or test_passes_under_the_triton_interpreter")
TRITON_PASSES = (router_triton.route_rows, router_triton.route_rows_backward)
PYTORCH_PASSES = (router_op.route_rows, router_op.route_rows_backward)


def _logits(layout, num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """(R, T) random logits whose routed rows have no tie in bf16 either (consecutive ones at least 0.25 apart):
    ties are where ``torch.topk`` and the kernel may pick different heads."""
    shared_heads, routed_heads, top_k, shared_rows, type_rows = layout
    routed = (torch.rand(routed_heads, num_tokens, generator=generator).argsort(0) * 0.5
              + torch.rand(routed_heads, num_tokens, generator=generator) * 0.25)
    return torch.cat([torch.randn(shared_rows, num_tokens, generator=generator), routed - 1.0,
                      torch.randn(type_rows, num_tokens, generator=generator)])


def _check_passes(module, layout, padded: bool, dtype: torch.dtype, device: str) -> None:
    """``module``'s passes on ``device`` equal the PyTorch passes in float32 on the CPU, rounded to ``dtype``, have the
    PyTorch passes' dtypes and shapes in ``dtype``, and take PyTorch's saved scores."""
    shared_heads, routed_heads, top_k, shared_rows, type_rows = layout
    generator = torch.Generator().manual_seed(0)
    num_tokens = 130 if padded else 37                                                # past one block, within one
    rows = _logits(layout, num_tokens, generator).to(dtype)
    valid = torch.rand(num_tokens, generator=generator) > 0.3 if padded else None
    # Transposed strides where padded: grad_gates reach the op as autograd hands them.
    grad_gates = (torch.randn(shared_heads + routed_heads, num_tokens, generator=generator).mT if padded
                  else torch.randn(num_tokens, shared_heads + routed_heads, generator=generator)).to(dtype)

    def on(tensor):
        return None if tensor is None else tensor.to(device)

    tolerance = TOLERANCE[dtype]
    for stats in (False, True) if top_k < routed_heads else (False,):
        ours = module.route_rows(on(rows), on(valid), *layout, stats)
        same_dtype = router_op.route_rows(rows, valid, *layout, stats)
        reference = router_op.route_rows(rows.float(), valid, *layout, stats)
        for out, like, ref in zip(ours, same_dtype, reference, strict=True):
            assert (out.shape, out.dtype, out.device.type) == (like.shape, like.dtype, device)
            torch.testing.assert_close(out.cpu(), ref.to(like.dtype), **tolerance)
        prob_grads = (None, torch.randn(routed_heads, generator=generator).to(dtype)) if stats else (None,)
        for grad_prob_sum in prob_grads:
            saved = same_dtype[1]
            grad_rows = module.route_rows_backward(on(grad_gates), on(grad_prob_sum), on(saved), on(valid), *layout)
            ref = router_op.route_rows_backward(grad_gates.float(), None if grad_prob_sum is None
                                                else grad_prob_sum.float(), saved.float(), valid, *layout)
            assert (grad_rows.shape, grad_rows.dtype) == (ref.shape, dtype)
            torch.testing.assert_close(grad_rows.cpu(), ref.to(dtype), **tolerance)


@pytest.mark.slow
def test_passes_under_the_triton_interpreter():
    if INTERPRETED:
        pytest.skip("this process is the interpreter's")
    # -n 0: in that one process (pyproject's addopts would start pytest-xdist workers of its own).
    result = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-n", "0"],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


# Interpreted, a case takes seconds: bf16 on the fullest layout only (shared, routed and type rows). The dtype changes
# how the kernels load and store, not which rows and tokens they visit: every layout runs in float32, both ways.
INTERPRETED_CASES = [(layout, dtype) for layout in LAYOUTS for dtype in (torch.float32, torch.bfloat16)
                     if dtype == torch.float32 or layout == LAYOUTS[0]]


@needs_interpreter
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("layout", "dtype"), INTERPRETED_CASES)
def test_triton_passes_equal_pytorch_passes(layout, padded, dtype):
    _check_passes(router_triton, layout, padded, dtype, "cpu")


@needs_interpreter
def test_interpreted_kernels_are_available_and_the_cpu_op_keeps_pytorch_passes():
    assert router_triton.available()
    assert router_op._passes(torch.device("cpu")) == (router_op.route_rows, router_op.route_rows_backward)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_passes_on_cuda_equal_pytorch_passes(layout, dtype):
    for padded in (False, True):
        _check_passes(router_triton, layout, padded, dtype, "cuda")


@needs_cuda
def test_route_op_on_cuda_equals_the_cpu_op():
    """The whole op, products and Triton pass, forward and every gradient, against the CPU's (float32: bf16 products
    round differently on the two devices, which can flip a top-k between near-equal logits)."""
    assert router_op._passes(torch.device("cuda")) == (router_triton.route_rows, router_triton.route_rows_backward)
    generator = torch.Generator().manual_seed(0)
    num_tokens, dim = 3 * 197, 64
    inputs = [torch.randn(num_tokens, dim, generator=generator)] + [
        torch.randn(rows, dim, generator=generator) * dim ** -0.5 for rows in (2, 4, 2)]
    valid = torch.rand(num_tokens, generator=generator) > 0.2
    grad_gates, grad_prob_sum = torch.randn(num_tokens, 6, generator=generator), torch.randn(4, generator=generator)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.to(device).requires_grad_() for t in inputs]
        outputs = router_op.route(*leaves, valid.to(device), 2, 4, 2, True)
        gates, _, prob_sum, _, _, loss = outputs
        total = (gates * grad_gates.to(device)).sum() + (prob_sum * grad_prob_sum.to(device)).sum() + 0.37 * loss
        results.append([t.cpu() for t in (*outputs, *torch.autograd.grad(total, leaves))])
    for out, ref in zip(*results, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _route_inputs(dtype: torch.dtype):
    """``moh::route``'s tensors for 2 shared heads, 4 routed with k = 2 and a type router, on the kernels' device: the
    tokens and three weights, the valid tokens, and the gradients of the gates, the summed scores and the loss.

    The weights are the identity's rows, so the logits are the tokens' first 8 columns, ``_logits``' tie-free ones,
    exactly in every dtype: products of random weights round differently in float32 and bf16, which could flip a top-k.
    """
    device = "cpu" if INTERPRETED else "cuda"
    generator = torch.Generator().manual_seed(0)
    num_tokens, dim = 130, 12
    logits = _logits((2, 4, 2, 2, 2), num_tokens, generator)
    tokens = torch.cat([logits.mT, torch.randn(num_tokens, dim - len(logits), generator=generator)], 1)
    tensors = [tokens, *torch.eye(len(logits), dim).split([2, 4, 2])]
    valid = torch.rand(num_tokens, generator=generator) > 0.3
    grads = [torch.randn(num_tokens, 6, generator=generator), torch.randn(4, generator=generator), torch.tensor(0.37)]
    return ([t.to(device, dtype) for t in tensors], valid.to(device), [g.to(device, dtype) for g in grads])


def _route_with(passes, monkeypatch, tensors, valid, grads):
    """``moh::route`` with ``passes`` each way: its six outputs, then the gradients of the tokens and each weight."""
    monkeypatch.setattr(router_op, "_passes", lambda device: passes)
    leaves = [t.detach().requires_grad_() for t in tensors]
    outputs = router_op.route(*leaves, valid, 2, 4, 2, True)
    gates, _, prob_sum, _, _, loss = outputs
    return [*outputs, *torch.autograd.grad((gates, prob_sum, loss), leaves, grads)]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_op_with_triton_passes_equals_pytorch_passes(dtype, monkeypatch):
    """The registered op, products and kernels, forward and backward: the gates, saved scores, load-balance statistics
    and every gradient in the PyTorch passes' dtypes and shapes, and their float32 values on the same inputs. In float32
    the kernels' summed scores once came out a view of the counts' buffer: two outputs sharing storage, which a
    custom op refuses (what failed a 32-true run on CUDA)."""
    tensors, valid, grads = _route_inputs(dtype)
    ours = _route_with(TRITON_PASSES, monkeypatch, tensors, valid, grads)
    same_dtype = _route_with(PYTORCH_PASSES, monkeypatch, tensors, valid, grads)
    reference = _route_with(PYTORCH_PASSES, monkeypatch, [t.float() for t in tensors], valid,
                            [g.float() for g in grads])
    forward, backward = OP_TOLERANCE[dtype]
    for index, (out, like, ref) in enumerate(zip(ours, same_dtype, reference, strict=True)):
        assert (out.shape, out.dtype) == (like.shape, like.dtype), index
        tolerance = forward if index < 6 else backward
        torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance * ref.abs().max().item(),
                                   msg=lambda message, index=index: f"output {index}: {message}")


@needs_kernels
@pytest.mark.parametrize("stats", [False, True])
# Interpreted, float32 alone (the dtype whose outputs once aliased; the longest interpreted cases are opcheck's):
# the other dtypes' outputs are test_route_op_with_triton_passes_equals_pytorch_passes's, and opcheck's on CUDA.
@pytest.mark.parametrize("dtype", [torch.float32] if INTERPRETED else DTYPES)
def test_route_op_with_triton_passes_passes_opcheck(dtype, stats, monkeypatch):
    """torch.library's checks of the op with the kernels: its schema (no output aliasing another or an input), the
    autograd registration, the fake's outputs against the real ones (storage offsets included) and an AOT-compiled
    forward and backward against eager."""
    tensors, valid, _ = _route_inputs(dtype)
    monkeypatch.setattr(router_op, "_passes", lambda device: TRITON_PASSES)
    torch.library.opcheck(router_op.route, (*[t.requires_grad_() for t in tensors], valid, 2, 4, 2, stats))
