"""The authors' released MoH-ViT models (SkyworkAI/MoH README) as the suite's MoH-TransNeXt, ready to evaluate.

Apart from ``weights`` (which converts any layout) and ``registry`` (which names the networks) because this is the
meeting of the two: a released checkpoint and the named model that is the same network. The paper's MoH-ViTs are
TransNeXt networks; their checkpoints (hub repos ``Chat-UniVi/MoH-ViT-S-80``, ``-S-75``, ``-B-75``, ``-B-50``, and
TransNeXt's own dense ``DaiShiResearch/transnext-{small,base}-224-1k``) load into the named models with every tensor
used:

* their per-stage modules ``patch_embed{i}`` / ``block{i}.{j}`` / ``norm{i}`` are ``patch_embed`` (stage 1) or
  ``stages.{i-1}.downsample``, ``stages.{i-1}.blocks.{j}`` and ``stages.{i-1}.norm``;
* aggregated attention's ``q`` and ``kv`` projections are joined into ``qkv`` (rows q, k, v, head by head, as ``kv``
  already is), ``cpb_fc1`` / ``cpb_fc2`` are ``cpb.fc1`` / ``cpb.fc2``, the pooled tokens' ``norm`` is ``pool_norm``
  and the GLU's ``mlp.dwconv.dwconv`` is ``mlp.dwconv``;
* the routers ``wg`` (routed heads), ``wg_0`` (shared / routed balance) and ``wg_1`` (shared heads) are
  ``router.routed_router``, ``router.type_router`` and ``router.shared_router``. Their gates are ``MoHRouter``'s term by
  term: routed ``softmax(wg x)`` kept on the top-k (their ``routed_head`` is k), renormalised (sum clamped at eps) and
  times k; shared ``softmax(wg_1 x)`` times the number of shared heads (1 for a single shared head); both groups
  weighted by ``2 * softmax(wg_0 x)``. Stages with every head shared have only ``wg_1``, as ``MoHRouter`` with no
  routed heads has only ``shared_router``.

Evaluate a released model on ImageNet's validation folder with the shipped config of the same network::

    moh validate --config moh_transnext_small_75.yaml --model.init_args.init_from Chat-UniVi/MoH-ViT-S-75 \\
        --data.init_args.data_dir /data/imagenet

or in Python, ``authors_vit("Chat-UniVi/MoH-ViT-S-75")``. ``tests/models/transnext/test_transnext_authors.py`` loads
state dicts built with their names and shapes and checks the outputs against a re-computation from their formulas;
``results/authors_models.md`` compares the loaded models with their own code.
"""
from __future__ import annotations

from pathlib import Path

from moh_lightning.models.transnext.network import TransNeXt, create_transnext
from moh_lightning.models.transnext.registry import AUTHORS_HUB_IDS, NAMED_MODELS, transnext_config
from moh_lightning.models.transnext.weights import load_pretrained

#: The authors' hub repos -> the named model (and shipped experiment config) that is the same network.
AUTHORS_VIT = {hub_id: name for name, hub_id in AUTHORS_HUB_IDS.items()}
#: The shipped experiment config of each named model with released weights.
EXPERIMENT_CONFIGS = {
    "moh_transnext_small_80": "moh_transnext_small_80.yaml", "moh_transnext_small_75": "moh_transnext_small_75.yaml",
    "moh_transnext_base_75": "moh_transnext_base_75.yaml", "moh_transnext_base_50": "moh_transnext_base_50.yaml",
    "transnext_small": "transnext_small_100.yaml", "transnext_base": "transnext_base_100.yaml",
}


def authors_vit(source: str | Path, model: str | None = None, **overrides) -> TransNeXt:
    """A released MoH-ViT / TransNeXt as the suite's model, in eval mode.

    Args:
        source: A checkpoint file (their ``{"model": ...}`` training checkpoint or a bare state dict), a hub repo id
            (``Chat-UniVi/MoH-ViT-S-75``) or a repo id and the file in it (``owner/name/file.pth``).
        model: The named model it is (``moh_transnext_small_75`` ...); found from a known hub id when None.
        overrides: ``TransNeXtConfig`` fields on top of the named model's (``img_size``, ``pool_size`` ...).
    """
    repo_id = "/".join(str(source).split("/")[:2])
    name = model or AUTHORS_VIT.get(repo_id)
    if name is None:
        raise ValueError(f"{source}: not one of the released models ({', '.join(AUTHORS_VIT)}); name the model it "
                         f"is with model=<one of {', '.join(NAMED_MODELS)}>.")
    network = create_transnext(transnext_config(name, **overrides))
    load_pretrained(network, source)
    return network.eval()


__all__ = ["AUTHORS_VIT", "EXPERIMENT_CONFIGS", "authors_vit"]
