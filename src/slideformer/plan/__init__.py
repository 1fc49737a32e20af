"""What fits where: pure functions of the model's shape, the batch and the budgets."""
from .memory import DoesNotFit, ModelShape, Placement, fit, gpu_bytes, host_bytes, nvme_bytes, parse_bytes

__all__ = ["DoesNotFit", "ModelShape", "Placement", "fit", "gpu_bytes", "host_bytes", "nvme_bytes", "parse_bytes"]
