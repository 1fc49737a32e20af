"""The GPU window: pre-allocated slots that units stream through, and the pure plan of which goes where."""
from .schedule import Visit, plan_step
from .slots import Slot

__all__ = ["Slot", "Visit", "plan_step"]
