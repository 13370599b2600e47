"""moh-lightning: Mixture-of-Head attention (Jin et al., ICML 2025) for PyTorch Lightning."""
from moh_lightning.layers import MoHAttention, activated_head_fraction, moh_layers, pop_load_balance_loss

__version__ = "0.1.0"
__all__ = ["MoHAttention", "activated_head_fraction", "moh_layers", "pop_load_balance_loss"]
