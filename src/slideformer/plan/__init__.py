"""What fits where: pure functions of the model's shape, the batch and the budgets."""
from .memory import (auto_host, auto_residency, spares_that_fit, check_host_fits, config_host_bytes, DoesNotFit, MachineRates, ModelShape, Placement, fit, gpu_budget, gpu_bytes, host_bytes, host_memory,
                     nvme_layer_count,
                     choose_resident_layers, nvme_bytes, parse_bytes, step_time)

__all__ = ["auto_host", "auto_residency", "check_host_fits", "config_host_bytes", "DoesNotFit", "MachineRates", "ModelShape", "Placement", "fit", "gpu_budget", "gpu_bytes", "host_bytes", "host_memory",
           "nvme_layer_count",
           "choose_resident_layers", "nvme_bytes", "parse_bytes", "spares_that_fit", "step_time"]
