"""What fits where: pure functions of the model's shape, the batch and the budgets."""
from .memory import (auto_residency, DoesNotFit, MachineRates, ModelShape, Placement, fit, gpu_budget, gpu_bytes, host_bytes, host_memory,
                     choose_resident_layers, nvme_bytes, parse_bytes, step_time)

__all__ = ["auto_residency", "DoesNotFit", "MachineRates", "ModelShape", "Placement", "fit", "gpu_budget", "gpu_bytes", "host_bytes", "host_memory",
           "choose_resident_layers", "nvme_bytes", "parse_bytes", "step_time"]
