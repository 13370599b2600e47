#!/usr/bin/env bash
# The one call on a lent GPU: measures first, then tests in what is left, within 540 s on an H100.
#   setup   the wheels carried in .whl/ installed into /tmp/site (benchmarks/wheels.py install); the GPU named
#   check   every module the call imports and every carried package import, the GPU and liger-kernel's ops are
#           there, the CUDA tests' ids collect (a failure ends the call before anything is measured); versions
#           outside the suite's ranges are said
#   steps   benchmarks/steps.py: each task's MoH training step against its dense config, eager, then compiled
#           (rows into $OUT/steps.json and steps.md as each is measured)
#   loader  benchmarks/loader.py: the ImageNet recipe's image loader on this machine's cores ($OUT/loader.json, .md)
#   tests   the CUDA tests, the never-yet-run ones first, in the seconds left
# Each phase prints its exit status and the seconds left; the whole log is $OUT/run.log. A phase cut at its limit
# (exit 124) keeps the rows it wrote.
#
# On a lent GPU, from the repository root, the wheels made here first (python benchmarks/wheels.py): the device
# tool's run with command `bash benchmarks/run.sh`, carry [".whl"], timeout_s 600. Then copy $OUT/steps.json and
# steps.md to results/gpu/.
# --dry-run: the same phases on the CPU with tiny shapes, compiled rows through aot_eager, the wheels' names checked
# but not installed (MOH_GPU_WHEELS names their folder) and the CUDA tests collected and skipped: CI's
# benchmarks/tests/test_gpu_call.py, so that a broken import, a missing wheel, a bad path or a bench crash shows there.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
DRY=""
[ "${1:-}" = "--dry-run" ] && DRY=--dry-run
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
WHEELS=${MOH_GPU_WHEELS:-.whl}
SITE=/tmp/site
LIMIT=${MOH_GPU_SECONDS:-540}  # the device tool's 600 s per command, less the start and the copy back
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "$DRY" ]; then
    DEVICE=cpu
    # One pair, one timed step: the other tasks' rows, eager and compiled, are benchmarks/tests/test_steps.py's.
    STEPS=(--quick true --configs "[vit_tiny_mnist_75]" --compile_backend aot_eager --repeats 1 --warmup 0)
    LOADER=(--quick true --workers "[0]")
    # One process: on the CPU every CUDA test skips, and two pytest-xdist workers would each import them again.
    TESTS=(-n 0)
else
    DEVICE=cuda
    STEPS=(--repeats 20 --warmup 5)
    LOADER=(--workers "[1,4,8,16]" --batches 4)
    TESTS=()
fi
# The CUDA tests, most telling first: the fused router and liger-kernel's kernels (never run on a GPU yet), the
# blocks compiled without graph breaks, no host read in a step, the router's compiled passes (96 Triton compiles),
# then the head-sparse kernels (passed on an H200 before: cuda_tests_h200.log).
CUDA_TESTS=(
    tests/layers/test_router_triton.py::test_route_op_on_cuda_equals_the_cpu_op
    tests/layers/test_router_triton.py::test_route_op_with_triton_passes_equals_pytorch_passes
    tests/layers/test_router_triton.py::test_route_op_with_triton_passes_passes_opcheck
    tests/models/llama/test_llama_fused.py::test_rms_norm
    tests/models/llama/test_llama_fused.py::test_swiglu
    tests/models/llama/test_llama_fused.py::test_rope
    tests/models/llama/test_llama_fused.py::test_linear_cross_entropy
    tests/models/llama/test_llama_fused.py::test_decoder_loss_and_gradients
    tests/models/llama/test_llama_fused.py::test_fused_loss_never_holds_the_logits
    tests/models/llama/test_llama_fused.py::test_decoder_generates_the_same_tokens
    tests/models/llama/test_llama_fused.py::test_bf16_autocast_training_loss_and_gradients
    tests/tasks/test_speed_switches.py::test_every_tasks_block_compiles_on_cuda_without_a_graph_break
    tests/tasks/test_host_reads.py::test_no_step_waits_for_the_gpu_outside_the_logging_steps
    tests/layers/test_router_triton.py::test_compiled_passes_on_cuda_equal_pytorch_passes
    tests/layers/test_head_sparse_cuda.py::test_cuda_sparse_equals_dense_forward_backward
    tests/layers/test_head_sparse_cuda.py::test_cuda_sparse_decoding_equals_dense
    tests/layers/test_head_sparse_cuda.py::test_cuda_sparse_compiles
)

SUMMARY=()
FAILED=0
phase() {  # name, most seconds, command...: the command under the lesser of its seconds and those left
    local name=$1 most=$2 left=$(( LIMIT - SECONDS - 5 )) start=$SECONDS rc
    shift 2
    local limit=$(( most < left ? most : left ))
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, $left s left"
        SUMMARY+=("$name: skipped ($left s left)")
        FAILED=1
        return 1
    fi
    echo "== $name (at most $limit s): $*"
    timeout -k 10 "$limit" "$@"
    rc=$?
    local cut=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && cut=" (cut at its $limit s)"
    echo "== $name: exit $rc$cut after $(( SECONDS - start )) s; $(( LIMIT - SECONDS )) s left of $LIMIT"
    SUMMARY+=("$name: exit $rc$cut after $(( SECONDS - start )) s")
    [ "$rc" -eq 0 ] || FAILED=1
    return "$rc"
}

finish() {
    echo "== summary ($DEVICE${DRY:+, dry run}, $SECONDS s of $LIMIT):"
    printf '   %s\n' "${SUMMARY[@]}"
    ls -l "$OUT"
    exit "$FAILED"
}

call() {
    echo "== benchmarks/run.sh ${DRY:-} on $(uname -n) at $(date -u +%FT%TZ), writing into $OUT"
    if [ -z "$DRY" ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    fi
    phase setup 60 "$PYTHON" benchmarks/wheels.py --wheels "$WHEELS" --site "$SITE" install $DRY || finish
    phase check 120 "$PYTHON" benchmarks/wheels.py --wheels "$WHEELS" --site "$SITE" check $DRY "$DEVICE" \
        "${CUDA_TESTS[@]}" || finish
    phase steps 330 "$PYTHON" benchmarks/steps.py --device "$DEVICE" "${STEPS[@]}" --output "$OUT/steps.json"
    # The loader's page sets its rate against the compiled dense ViT-S step it reads from results/gpu/steps.json:
    # on the GPU machine's copy of the tree, the rows just measured.
    if [ -z "$DRY" ] && [ -f "$OUT/steps.json" ]; then
        cp "$OUT/steps.json" results/gpu/steps.json
    fi
    phase loader 60 "$PYTHON" benchmarks/loader.py "${LOADER[@]}" --output "$OUT/loader.json"
    phase tests 600 "$PYTHON" -m pytest -v -p no:cacheprovider -rfEs --durations=15 "${TESTS[@]}" "${CUDA_TESTS[@]}"
    finish
}

call 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
