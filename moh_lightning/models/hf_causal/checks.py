"""What ``moh convert-hf`` proves on a forward of four tokens before it writes a folder: the layers MoH gates are the
ones that call transformers' attention interface, and, layer by layer, the suite's head-sparse kernels compute the
family's own attention there. A layer where they do not keeps the family's attention (``InterfaceHeads.family_only``,
``moh_family_attention`` in ``config.json``): a family that reads sinks, biases or scales from the attention module
itself, not from the interface's arguments, which is all that ``InterfaceHeads`` sees before it picks the kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from moh_lightning.models.hf_causal.network import HFCausalLM, attention_layers, remote_code


def tolerance(dtype: torch.dtype) -> float:
    """The largest difference between the suite's kernels and the family's attention, over the family's largest
    output, that is rounding in another order: 8 units in the last place of ``dtype`` (an eager softmax against SDPA
    on tiny models: about 1e-7 in float32, 7e-4 in float16, 6e-3 in bfloat16), at least 1e-5."""
    return max(1e-5, 8 * torch.finfo(dtype).eps)


def check_layers(model: HFCausalLM) -> dict[int, float]:
    """Runs four tokens through ``model``. The layers MoH gates (``attention_layers``, read from the code) must be
    exactly the decoder layers' modules that call the attention interface, else it stops in one line, as the budget
    that ``config.json`` lists would not be the one that runs. Each gated layer's inputs to the interface go through
    both the family's attention and the suite's head-sparse kernels (every head on): where they differ beyond
    ``tolerance`` the layer keeps the family's attention from then on (``family_only``), recorded in the config as
    ``moh_family_attention`` (its ``layer_idx``s). Returns those layers' differences by ``layer_idx``."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hf = model.hf
    implementation = hf.config._attn_implementation
    attention = ALL_ATTENTION_FUNCTIONS[implementation]
    called: dict[int, nn.Module] = {}
    differences: dict[int, float | None] = {}

    def recording(module, *args, **kwargs):
        if remote_code().is_attention_layer(module):
            called[id(module)] = module
            heads = getattr(module, "moh_heads", None)
            if heads is not None:
                differences[module.layer_idx] = heads.suite_difference(
                    module, *args, base=implementation.removeprefix("moh_"), **kwargs)
        return attention(module, *args, **kwargs)

    AttentionInterface.register(implementation, recording)
    training = hf.training
    device = next(hf.parameters()).device
    try:
        with torch.no_grad():
            # Tokens of their own: four of one token would carry the same value at every position, where attention
            # weights of any kind average to the same output and no difference in them could show.
            hf.eval()(input_ids=torch.arange(1, 5, device=device)[None], use_cache=False)
    except Exception as error:  # noqa: BLE001 - whatever stops the family's forward, the layers stay unknown
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        raise ValueError(f"{type(hf).__name__}: a forward of four tokens, which tells the layers that go through "
                         f"transformers' attention interface, stops ({reason[:120]}); convert a model that runs on "
                         f"token ids alone.") from None
    finally:
        AttentionInterface.register(implementation, attention)
        hf.train(training)
    gated = {id(layer): layer for layer in attention_layers(hf)}
    if called.keys() != gated.keys():
        odd = [type(m).__name__ for key, m in {**called, **gated}.items() if (key in called) != (key in gated)]
        raise ValueError(f"{type(hf).__name__}: cannot tell which layers go through transformers' attention "
                         f"interface ({', '.join(sorted(set(odd)))} called it or not, unlike its code says); MoH "
                         f"would gate other layers than config.json lists: not supported.")
    largest = tolerance(next(hf.parameters()).dtype)
    differing = {index: difference for index, difference in differences.items()
                 if difference is not None and not difference <= largest}  # NaN differs too
    for layer in gated.values():
        layer.moh_heads.family_only = layer.layer_idx in differing
    hf.config.moh_family_attention = family_attention_layers(hf) or None
    return differing


def family_attention_layers(hf: nn.Module) -> list[int]:
    """The ``layer_idx`` of each gated layer of ``hf`` that keeps the family's attention (``family_only``)."""
    return [layer.layer_idx for layer in attention_layers(hf) if layer.moh_heads.family_only]


__all__ = ["check_layers", "family_attention_layers", "tolerance"]
