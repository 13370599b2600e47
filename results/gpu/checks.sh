#!/usr/bin/env bash
# One GPU lease, first call: the CUDA tests, then `moh bench --device cuda`. Logs and the page go to $OUT.
# Run from the repository root with .whl/ carried: bash results/gpu/checks.sh
set -u
. results/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/device.txt"
python3 -c "import torch, timm, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'timm', timm.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/device.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/layers/test_head_sparse_cuda.py -rs 2>&1 | tee "$OUT/cuda_tests.log" \
    | tail -25
timeout 330 python3 -c "from moh_lightning.tools.bench.cuda import bench_cuda; \
bench_cuda(output='$OUT/bench_attention_cuda.md', min_run_time=0.15)" 2>&1 | tail -20 | tee "$OUT/bench.log"
cat "$OUT/bench_attention_cuda.md" | head -60
