"""What fits where: pure functions of the model's shape, the batch, the budgets and the machine's facts.
``resolve`` is the one entry point that decides every "auto"."""
from .memory import (auto_host, auto_residency, spares_that_fit, check_host_fits, config_host_bytes, DoesNotFit,
                     MachineRates, ModelShape, Layout, fit, gpu_budget, gpu_bytes, host_bytes, nvme_layer_count,
                     choose_resident_layers, nvme_bytes, parse_bytes, step_time)
from .resolve import Auto, Plan, predicted_step, resolve

__all__ = ["Auto", "Plan", "auto_host", "auto_residency", "check_host_fits", "config_host_bytes", "DoesNotFit",
           "MachineRates", "ModelShape", "Layout", "fit", "gpu_budget", "gpu_bytes", "host_bytes",
           "nvme_layer_count", "choose_resident_layers", "nvme_bytes", "parse_bytes", "predicted_step", "resolve",
           "spares_that_fit", "step_time"]
