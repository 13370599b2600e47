"""The MoH-LLaMA's configuration: the decoder's sizes and the head budget, as one saved record.

Apart from the network because a config is data: the language-model task, its checkpoints and the Hugging Face
conversion read and write it without building anything.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from moh_lightning.layers.moh_config import MoHConfig, activated_fraction, as_moh_config, attention_layers
from moh_lightning.serialization import checkpoint_type
from moh_lightning.value_checks import check_numbers


@checkpoint_type(also_as="moh_lightning.models.llama.LlamaConfig")
@dataclass
class LlamaConfig:
    """Architecture of a (MoH) LLaMA decoder.

    ``moh`` holds the head budget and routing: ``moh.num_shared_heads`` heads are always on and ``moh.top_k`` of the
    remaining routed heads are picked per token; ``moh: null`` is plain multi-head attention (the baseline) and
    ``moh.router: query_norm`` the parameter-free router for continue-tuning a pretrained model (section 4.4).
    ``head_dim`` is ``embed_dim // num_heads`` and ``num_kv_heads`` is ``num_heads`` when None.
    ``layer_heads``: the query heads of each attention layer MoH gates, where that is not ``num_heads`` in each of
    ``depth`` layers: a pretrained source's (``init_from`` fills it) whose layers have heads of their own number
    (Laguna) or that keeps layers dense (a hybrid's linear attention). A per-layer ``moh`` list has one entry per such
    layer. None: ``num_heads`` in every layer, the only network the suite's own LLaMA builds.
    ``fused_kernels``: liger-kernel's RMSNorm, SwiGLU, RoPE and linear cross-entropy in place of torch's ops (same
    parameters and results): ``auto`` on CUDA when liger-kernel is installed (``pip install 'moh-lightning[gpu]'``),
    ``true`` always (an error without liger-kernel), ``false`` never (see ``models.llama.fused``).
    """

    vocab_size: int = 65536
    depth: int = 12
    embed_dim: int = 768
    num_heads: int = 12
    head_dim: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int = 2048
    block_size: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moh: MoHConfig | None = field(default_factory=lambda: MoHConfig(num_shared_heads=6, top_k=3))
    layer_heads: list[int] | None = None
    fused_kernels: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        check_numbers({"arch": self}, "model.init_args")  # before a size of 0 reaches any arithmetic
        self.moh = as_moh_config(self.moh)
        if not isinstance(self.fused_kernels, bool) and self.fused_kernels != "auto":
            raise ValueError(f"fused_kernels={self.fused_kernels!r}: choose auto, true or false.")
        if self.head_dim is None:
            if self.embed_dim % self.num_heads:
                raise ValueError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}: set "
                                 f"head_dim.")
            self.head_dim = self.embed_dim // self.num_heads
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.layer_heads is not None and not (
                isinstance(self.layer_heads, list) and self.layer_heads
                and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in self.layer_heads)):
            raise ValueError(f"layer_heads={self.layer_heads!r}: give one positive int per attention layer, or null "
                             f"for num_heads in each of depth layers.")
        attention_layers(self.moh, self.gated_heads, len(self.gated_heads),
                         "depth" if self.layer_heads is None else "len(layer_heads)")

    @property
    def gated_heads(self) -> list[int]:
        """The query heads of each attention layer, which the budget is checked against (``layer_heads``)."""
        return self.layer_heads or [self.num_heads] * self.depth

    @property
    def activated_fraction(self) -> float:
        return activated_fraction(self.moh, self.gated_heads, len(self.gated_heads))

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["LlamaConfig"]
