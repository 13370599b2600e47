#!/usr/bin/env bash
# One call on a lent GPU for issues 29 and 31 (prepared without one): the fused router's and the LM's fused kernels' CUDA
# tests (liger-kernel from .whl/), the compile switches, then each task's
# MoH training step against its dense config, eager and compiled (moh bench --steps true), written row by row to
# $OUT/steps.json so a lease that ends mid-run keeps what it measured, then the image loader alone (loader.json / .md).
# Run from the repository root with .whl/ carried.
set -u
. results/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/layers/test_router_triton.py tests/layers/test_op_count.py \
    tests/models/llama/test_llama_fused.py tests/tasks/test_speed_switches.py \
    -rs > "$OUT/router_tests.log" 2>&1; echo "router tests exit $?"; tail -6 "$OUT/router_tests.log"
timeout 360 python3 -m moh_lightning.cli bench --device cuda --steps true --repeats 20 --warmup 5 \
    --output "$OUT/steps.json" 2>&1 | grep "moh bench" | tee "$OUT/steps.log"
cp "$OUT/steps.json" results/gpu/steps.json 2>/dev/null || true
# The ImageNet recipe's image loader alone on this machine's cores (moh bench --loader true, issue 31), in what is left
# of the call's 600 s: 4 timed batches per worker, the rows kept as each is measured.
left=$(( 590 - SECONDS )); [ "$left" -gt 90 ] && left=90
if [ "$left" -gt 30 ]; then
    timeout "$left" python3 -m moh_lightning.cli bench --loader true --loader_workers "[1,4,8,16]" --loader_batches 4 \
        --output "$OUT/loader.json" 2>&1 | grep "moh bench" | tee "$OUT/loader.log"
else
    echo "loader bench: skipped, ${left} s left of the call"
fi
cp "$OUT/loader.json" "$OUT/loader.md" results/gpu/ 2>/dev/null || true
