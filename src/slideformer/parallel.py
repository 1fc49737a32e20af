"""Data parallel over torch.distributed: which rank owns which unit, and the collectives a step needs.

Every rank runs the same window over its own part of the global batch. Each unit (the embedding, a
decoder layer, the head) is *owned* by one rank, and only its owner keeps its host state (master,
moments, compute copy), sends its gradient to the host and runs its CPU update. So on one host with N
ranks the host state does not grow with N, each GPU's PCIe link carries about 1/N of the weights and
gradients, and the CPU cores are split among the ranks' optimizers. Per visit:

- a unit's weights: its owner loads them into its slot as a single process would; then they are
  broadcast from the owner into every other rank's slot (``share``);
- a unit's finished gradient: summed into its owner's slot (``reduce``); only the owner goes on with it;
- units trained on the GPU (resident) are replicated: their gradient is summed on every rank
  (``all_reduce``) and every rank applies the same update;
- the loss's denominator (target tokens), the loss and the squared gradient norm are summed over ranks,
  so the step is the one a single process takes over the global batch.

Whole units, not slices of each, are what a rank owns: the host store, the NVMe tier, the update queue
and checkpoints all work unit by unit, so ownership changes none of them, and a checkpoint written by N
ranks resumes under M by assigning its units again. The collectives are issued by each rank's main thread
in the visit plan's order, identical on every rank; the worker threads never take part in one.
"""
from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist


class RankLost(RuntimeError):
    """A collective failed: another rank died, was killed or stopped answering. The job cannot go on."""


def _collective(fn):
    """A failed collective as RankLost: one line on every surviving rank, naming what to read next."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RankLost:
            raise
        except (RuntimeError, dist.DistError) as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise RankLost(f"rank {dist.get_rank()} of {dist.get_world_size()} lost the others in {fn.__name__} "
                           f"({first}): another rank failed or was killed, and its own output says why; resume "
                           "from the last checkpoint once it is fixed") from e
    return run


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of a data-parallel job."""
    rank: int
    world: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def current() -> Ranks | None:
    """The job's ranks when torch.distributed is initialised with more than one process, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return Ranks(dist.get_rank(), dist.get_world_size())


def local_world(ranks: Ranks | None) -> int:
    """How many of the job's ranks share this machine (its RAM, cores and disk): torchrun's
    LOCAL_WORLD_SIZE, else all of them."""
    if ranks is None:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world))


def init_from_env(device_type: str) -> Ranks | None:
    """Join the process group that torchrun's environment describes (RANK, WORLD_SIZE, MASTER_ADDR...):
    NCCL for CUDA, gloo for the CPU. None outside torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    if missing := [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]:
        from .config import ConfigError

        raise ConfigError(f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set: start the ranks with torchrun (or set "
                          "nproc_per_node), or unset WORLD_SIZE to train in one process")
    if not dist.is_initialized():
        if device_type == "cuda":  # (train/loop.py has set LOCAL_RANK's device)
            from datetime import timedelta

            from .watchdog import SAVE_LIMIT_S

            # NCCL's default timeout is 10 minutes (gloo's 30): rank 0 alone checksums a whole checkpoint
            # (resume's latest_intact, a save's seal) while the others wait in a collective; a real hang is
            # the watchdog's (watchdog.py) and a dead rank torchrun's to end
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()),
                                    timeout=timedelta(seconds=SAVE_LIMIT_S))
        else:
            dist.init_process_group("gloo")
    return current()


def assign_units(numels: list[int], world: int) -> list[int]:
    """Each unit's owner: the largest units first, each to the rank that owns the fewest elements so far
    (ties to the lower rank). Deterministic, so every rank computes the same assignment."""
    load = [0] * world
    owner = [0] * len(numels)
    for u in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[u] = r
        load[r] += numels[u]
    return owner


@_collective
def share(t: torch.Tensor, owner: int) -> None:
    """``t`` on every rank becomes the owner's (a unit's weights, after the owner's load)."""
    dist.broadcast(t, src=owner)


@_collective
def reduce_to(t: torch.Tensor, owner: int) -> None:
    """The owner's ``t`` becomes the sum of every rank's (a finished gradient); the others' is left
    undefined. (gloo reduces CPU tensors only: a CUDA one is summed on every rank, as the GPU tests run
    several ranks on one GPU, which NCCL refuses.)"""
    if t.is_cuda and dist.get_backend() == "gloo":
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    else:
        dist.reduce(t, dst=owner, op=dist.ReduceOp.SUM)


@_collective
def sum_all(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, on every rank (in place, and returned)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


@_collective
def failures(err: BaseException | None) -> list[tuple[int, BaseException]]:
    """Every rank's failure in a step that all ranks take together (a checkpoint's save or load), as
    (rank, error), the same list on every rank: each then stops, or none does."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, None if err is None else _portable(err))
    return [(r, e) for r, e in enumerate(every) if e is not None]


def _portable(err: BaseException) -> BaseException:
    """``err`` as another process can raise it: a copy without its chain, or (one that does not pickle) its
    type and words."""
    try:
        out = pickle.loads(pickle.dumps(err))
    except Exception:
        out = RuntimeError(f"{type(err).__name__}: {err}")
    out.__cause__ = out.__context__ = None
    return out


def together(err: BaseException | None) -> None:
    """Raise on every rank if any rank failed: its own error, else the first failing rank's."""
    failed = failures(err)
    if err is not None:
        raise err
    if failed:
        raise failed[0][1]


def from_leader(work):
    """``work()`` run on rank 0 alone (a folder taken, a checkpoint found), its result given to every rank;
    if it raised, every rank raises that error."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", work())
        except BaseException as e:
            box[0] = ("error", e)
    mine = box[0]
    if mine is not None and mine[0] == "error":
        box[0] = ("error", _portable(mine[1]))
    _collective(dist.broadcast_object_list)(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise mine[1] if mine is not None else value  # (rank 0: its own error, traceback and all)
    return value


@_collective
def largest(values: list[float], device: torch.device) -> list[float]:
    """Each value's largest over the ranks (why to stop: a signal's number, the memory guard), the same on
    every rank, so that every rank stops at the same step, for the same reason."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def local_rows(mb: dict, ranks: Ranks) -> dict:
    """This rank's rows of a global micro-batch (rank, rank + world, ...)."""
    return {k: None if v is None else v[ranks.rank::ranks.world] for k, v in mb.items()}


def leave() -> None:
    """Leave the process group ``init_from_env`` joined (torchrun's), at the end of a run."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and dist.is_initialized():
        dist.destroy_process_group()
