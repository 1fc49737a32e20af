"""Host storage: the training state that lives in CPU RAM."""
from .store import HostStore

__all__ = ["HostStore"]
