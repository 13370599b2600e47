#!/usr/bin/env bash
# The whole CUDA test file on the GPU, no time cut (the second call of issue 23 was cut inside the compile test),
# then the CPU quick subset of the layers there. Run from the repository root with .whl/ carried.
set -u
. results/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/layers/test_head_sparse_cuda.py -rs --durations=8 \
    > "$OUT/cuda_tests.log" 2>&1; echo "cuda tests exit $?"; tail -16 "$OUT/cuda_tests.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/layers -m "not slow" -x > "$OUT/layers.log" 2>&1
echo "layers exit $?"; tail -3 "$OUT/layers.log"
