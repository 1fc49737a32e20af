"""Facts about this machine that the planner is given: RAM and the GPU's memory. The one place that
reads /proc and asks torch about the GPU; ``plan/`` takes a ``Machine`` and reads nothing itself, so
that `slideformer plan` can describe another machine and the tests can describe any."""
from __future__ import annotations

from dataclasses import dataclass


def host_memory() -> int:
    """This machine's RAM (MemTotal), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 40  # unknown: do not refuse on the host side


def gpu_memory(device: str = "cuda") -> int | None:
    """The GPU's total memory in bytes, or None where there is none (or ``device`` is the CPU)."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


@dataclass(frozen=True)
class Machine:
    ram: int  # bytes of RAM
    gpu: int | None = None  # bytes of the GPU's memory; None: no GPU (nothing on it is checked)

    @classmethod
    def detect(cls, device: str = "cuda") -> "Machine":
        return cls(ram=host_memory(), gpu=gpu_memory(device))


def describe() -> dict:
    """This machine in a benchmark record's words: the CPU's model, its cores, RAM and the GPU's memory."""
    import os

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    gpu = gpu_memory()
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(host_memory() / 2**30, 1),
            "gpu_gib": None if gpu is None else round(gpu / 2**30, 1)}
