"""Plain ``nn.Module`` models (no Lightning), a package per family: each puts ``MoHAttention`` into a standard
architecture (``vit``, ``transnext``, ``dit``, ``llama``), with its config, network, checkpoint layouts and, for the
timm families, the named models that ``registry`` registers from a table. ``hf_causal`` puts MoH into any
``transformers`` causal LM through transformers' attention interface, without a copy of its modelling code.

Importing this package registers the timm families' named models with timm, as importing timm does for its own."""
from moh_lightning.models import transnext, vit  # noqa: F401  (their @register_model functions register with timm)
