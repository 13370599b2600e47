"""Where a head-sparse MoH layer's time goes on a GPU: torch.profiler over a few forward + backward steps of the
bench's layer (N = 4096, 16 heads of 64, 4 shared + top-4 of 12 routed, bf16), eager, dense-and-mask and head-sparse.

Usage: python results/gpu/profile_sparse.py > profile.txt
"""
import torch
from torch.profiler import ProfilerActivity, profile

from moh_lightning.tools.bench.cuda import _layer, _layer_step

for causal in (False, True):
    for execution in ("masked", "sparse"):
        layer = _layer(causal, 4, execution, torch.device("cuda"), torch.bfloat16)
        x = torch.randn(4, 4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        step = _layer_step(layer, x)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 5
        print(f"## {'causal' if causal else 'bidirectional'} {execution}: {kernels:.0f} GPU kernels per step")
        print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
