"""Facts about this machine that the planner is given: RAM, the GPU's memory and the rates its time model
assumes. The one place that reads /proc and asks torch about the GPU; ``plan/`` takes a ``Machine`` and
reads nothing itself, so that `slideformer plan` can describe another machine and the tests can describe
any."""
from __future__ import annotations

from dataclasses import dataclass, replace


def cores() -> int:
    """The cores this process may run on: its affinity (a cgroup's or a job scheduler's limit), not the host's."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this platform)
        return os.cpu_count() or 1


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
class MachineRates:
    """Rates of the H200 machine the defaults were measured on; pass others for other machines (`slideformer plan`'s
    flags)."""
    # bf16 FLOP/s of a step's GPU work (step_time's count over gpu_compute_s) with Liger's kernels; one rate
    # for every model, though larger GEMMs (Llama-8B's) run a little faster than Qwen3-4B's
    gpu_flops: float = 565e12
    # the engine's CPU update: one-pass AdamW on all cores but one, beside the copies
    optimizer_params_per_s: float = 5.0e9
    # compact state's update over that: it moves 18 bytes a parameter, not 28, but its rounding's hashing
    # bounds it (it scales with threads), so it gains far less than 28/18
    compact_speedup: float = 1.1
    # 8-bit state's: it moves 14.1 bytes a parameter, but each moment's block maximum, divisions and table
    # lookups bound it (2.1 G params/s in the engine at Qwen2.5-14B b8, 2.3 alone on 15 threads)
    eightbit_speedup: float = 0.42
    # the resident units' AdamW on the GPU, fp32 state (compact: 2.3x, one Triton pass; 8-bit: 1.35 G
    # params/s, PyTorch in pieces, measured at Qwen3-4B b8 with 19 resident layers and the edges)
    gpu_adamw_params_per_s: float = 77e9

    @property
    def state_speedup(self) -> dict[str, float]:
        """The CPU update's rate by optimizer state format, over fp32's."""
        return {"fp32": 1.0, "compact": self.compact_speedup, "8bit": self.eightbit_speedup}

    @property
    def gpu_state_speedup(self) -> dict[str, float]:
        return {"fp32": 1.0, "compact": 2.3, "8bit": 1.35e9 / self.gpu_adamw_params_per_s}
    pcie_bytes_per_s: float = 55e9
    # between the GPUs of a data-parallel job: NCCL's broadcast and reduce over NVLink (H200's is 450 GB/s
    # each way; NCCL reaches about half of it at a layer's size); not measured on this machine
    peer_bytes_per_s: float = 250e9
    # the NVMe tier's disk with O_DIRECT: each direction while the other runs, and both together, one
    # device's bandwidth shared (that machine: 53.7 GB each way in a 55.9 s step; 59.2 GB read and 35.7 GB
    # written in 47.7 s: 1.92-1.99 GB/s together, however they split)
    disk_read_bytes_per_s: float = 1.6e9
    disk_write_bytes_per_s: float = 0.96e9
    # both directions together; None: that machine's 1.92 GB/s with its rates above, else the faster
    # direction's alone (one device's bandwidth, shared)
    disk_bytes_per_s: float | None = None

    @property
    def disk_shared_bytes_per_s(self) -> float:
        if self.disk_bytes_per_s:
            return self.disk_bytes_per_s
        if (self.disk_read_bytes_per_s, self.disk_write_bytes_per_s) == \
                (type(self).disk_read_bytes_per_s, type(self).disk_write_bytes_per_s):
            return 1.92e9
        return max(self.disk_read_bytes_per_s, self.disk_write_bytes_per_s)

    def disk_s(self, nbytes: float, read_only: float = 0) -> float:
        """Seconds to read ``nbytes`` from the tier and write them back, and to read ``read_only`` more: a
        step's traffic, reads and writes at once (engine/disk.py's threads, and the window's loader)."""
        read = nbytes + read_only
        return max(read / self.disk_read_bytes_per_s, nbytes / self.disk_write_bytes_per_s,
                   (read + nbytes) / self.disk_shared_bytes_per_s)


@dataclass(frozen=True)
class Machine:
    ram: int  # bytes of RAM
    gpu: int | None = None  # bytes of one GPU's memory; None: no GPU (nothing on it is checked)
    rates: MachineRates = MachineRates()  # what the time model assumes (not measured here)
    disk: int | None = None  # bytes free for the NVMe tier under offload_dir; None: not checked
    # data parallel: the processes training on this machine, one a GPU (they share its RAM, cores and
    # disk), and the machines of the job, each alike
    ranks: int = 1
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.ranks * self.nodes

    @property
    def rank_ram(self) -> int:
        """One process's share of the RAM."""
        return self.ram // self.ranks

    @property
    def rank_disk(self) -> int | None:
        return None if self.disk is None else self.disk // self.ranks

    @property
    def rank_rates(self) -> MachineRates:
        """One process's share of the rates its machine's processes share: the CPU update's cores and the
        disk (each GPU keeps its own PCIe link)."""
        r, n = self.rates, self.ranks
        if n == 1:
            return r
        return replace(r, optimizer_params_per_s=r.optimizer_params_per_s / n,
                       disk_read_bytes_per_s=r.disk_read_bytes_per_s / n,
                       disk_write_bytes_per_s=r.disk_write_bytes_per_s / n,
                       disk_bytes_per_s=r.disk_shared_bytes_per_s / n)

    @classmethod
    def detect(cls, device: str = "cuda") -> "Machine":
        """This machine; under torchrun, with its data-parallel processes (LOCAL_WORLD_SIZE, WORLD_SIZE)."""
        import os

        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(ram=host_memory(), gpu=gpu_memory(device), ranks=local, nodes=max(1, world // local))


def disk_free(path) -> int:
    """Bytes free to this user on the file system that holds ``path`` (or its nearest existing parent)."""
    import os
    import shutil
    from pathlib import Path

    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def describe() -> dict:
    """This machine in a benchmark record's words: the CPU's model, its cores, RAM and the GPU's memory."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    gpu = gpu_memory()
    return {"cpu": cpu, "cores": cores(), "ram_gib": round(host_memory() / 2**30, 1),
            "gpu_gib": None if gpu is None else round(gpu / 2**30, 1)}
