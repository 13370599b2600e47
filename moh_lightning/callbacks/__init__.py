"""Cross-cutting concerns of every task, as Lightning callbacks."""
from moh_lightning.callbacks.head_load import HeadLoadCallback

__all__ = ["HeadLoadCallback"]
