"""A test-only FSDP strategy for CPU processes (gloo), imported by the `moh` subprocesses of test_fsdp.py.

Lightning refuses ``FSDPStrategy`` without a GPU, and its ``_setup_model`` passes ``device_id=root_device.index``,
which is ``None`` on CPU, so torch refuses too ("FSDP needs a non-CPU accelerator device"). This subclass only
wraps the root with ``device_id=cpu``; everything else (auto-wrap policy, sharding, precision, state dicts,
optimizer setup, checkpointing) is Lightning's.
"""
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel


class CPUFSDPStrategy(FSDPStrategy):
    def _setup_model(self, model: nn.Module) -> nn.Module:
        if not any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
            model = FullyShardedDataParallel(model, cpu_offload=self.cpu_offload,
                                             mixed_precision=self.mixed_precision_config,
                                             sharding_strategy=self.sharding_strategy,
                                             device_id=torch.device("cpu"), **self.kwargs)
            # Applied above; Lightning would otherwise ignore it on an already wrapped model, with a warning.
            self.kwargs.pop("auto_wrap_policy", None)
        return super()._setup_model(model)
