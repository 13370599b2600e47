#!/usr/bin/env bash
# Second GPU call: the CUDA tests, moh bench --device cuda (with its compiled-layer table) and a profile.
set -u
. results/gpu/setup.sh
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/layers/test_head_sparse_cuda.py -rs 2>&1 | tee "$OUT/cuda_tests.log" \
    | tail -6
timeout 215 python3 -c "from moh_lightning.tools.bench.cuda import bench_cuda; \
bench_cuda(output='$OUT/bench_attention_cuda.md', min_run_time=0.1)" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "^\| (core|layer|decode|vit|dit)" "$OUT/bench_attention_cuda.md"
timeout 50 python3 results/gpu/profile_sparse.py > "$OUT/profile.txt" 2>&1; echo "profile exit $?"
grep "^## " "$OUT/profile.txt"; sed -n '/^## Whole MoH layer under/,$p' "$OUT/bench_attention_cuda.md"
