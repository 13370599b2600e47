"""The dense-and-mask oracle of the CPU and CUDA head-sparse attention tests."""
import torch


def dense_and_mask(q, k, v, gates, causal=False, offset=0, key_padding_mask=None):
    """The dense-and-mask formulation: SDPA over every head with an explicit mask, times the gates; (B, N, h, d).
    The oracle of the CPU and the CUDA head-sparse tests."""
    length, num_keys = q.shape[2], k.shape[2]
    allowed = torch.ones(q.shape[0], 1, length, num_keys, dtype=torch.bool)
    if causal:
        allowed &= torch.arange(num_keys) <= torch.arange(length)[:, None] + offset
    if key_padding_mask is not None:
        allowed &= key_padding_mask[:, None, None, :num_keys]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    return out.transpose(1, 2) * gates[..., None]
