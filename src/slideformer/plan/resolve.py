"""One place decides every "auto": the trainer, `slideformer plan` and the benchmark all call
``resolve``. It is pure: the machine's facts (RAM, GPU memory, the disk free for the NVMe tier, the time
model's rates) come in as a ``Machine``.

The order is the dependency chain: spare states for clipping (what RAM holds with every layer
streamed; residency depends on them), then the window's slots and the units trained on the GPU (under
the GPU budget), then the placement (micro-batches, offloaded layer inputs), then the host settings
(bf16 copy, gradient buffers, spares), then the NVMe tier for what RAM still cannot hold, then the mid
layers (whose sums take RAM from gradient buffers), the loss head's chunk and the inputs displaced for
saved layers, then the host check, then the disk's where the machine says what is free."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..machine import Machine, MachineRates
from ..optim.formats import compact_master
from .memory import (EFFICIENT_TOKENS, LOSS_CHUNK_TOKENS, MIN_GRAD_BUFFERS, SMALL_HEAD_CHUNK_COST, DoesNotFit,
                     ModelShape, Layout,
                     auto_host, auto_residency, auto_tier, check_host_fits, choose_window_slots, config_host_bytes,
                     fit, fmt_bytes, gpu_budget, gpu_bytes, held, host_budget, least_layout, nvme_bytes,
                     mid_layers, nvme_layer_count, parse_bytes, spares_that_fit, step_time)


@dataclass(frozen=True)
class Auto:
    """Which of an EngineConfig's placement settings the caller leaves to the planner (they hold
    Placement's defaults until ``resolve`` decides them)."""
    host_weights: bool = True
    host_grad_buffers: bool = True
    speculative_layers: bool = True
    resident_layers: bool = True
    resident_edges: bool | None = None  # None: the planner's call; True or False: fixed
    window_slots: bool = True
    nvme_fraction: bool = True  # (with offload_dir: as few layers on the tier as the host budget allows)
    nvme_master: bool = True  # (fp32 state: the tier's master too, where the moments alone are not enough)
    mid_layers: bool = True

    @classmethod
    def of(cls, asked: dict) -> tuple["Auto", dict]:
        """From placement settings as a caller states them ("auto" or a value): which the planner decides,
        and the fixed ones (for ``Placement``)."""
        edges = asked.get("resident_edges", "auto")
        auto = cls(**{k: asked.get(k, "auto") == "auto"
                      for k in ("host_weights", "host_grad_buffers", "speculative_layers", "resident_layers",
                                "window_slots", "nvme_fraction", "nvme_master", "mid_layers")},
                   resident_edges=None if edges == "auto" else edges)
        return auto, {k: v for k, v in asked.items() if v != "auto"}


@dataclass(frozen=True)
class Plan:
    config: object  # the EngineConfig with every "auto" decided
    placement: Layout
    gpu: dict | None  # GPU bytes by category (None: not on a GPU)
    gpu_limit: int | None
    host: dict  # host bytes by category
    problem: str | None = None  # what does not fit, naming the resource and the settings that would help
    binds: str | None = None  # "gpu", "host" or "disk" where it does not fit
    shape: ModelShape | None = None  # the model as planned: with data parallel, its ranks (``predicted_step``)
    disk_short: str | None = None  # the NVMe tier's size against the disk's free space, where it does not fit

    @property
    def fits(self) -> bool:
        return self.problem is None


def resolve(cfg, auto: Auto, shape: ModelShape, batch: int, seq: int, machine: Machine,
            micro_batch: int | None = None, prefix: str = "") -> Plan:
    """``cfg`` with what ``auto`` names decided, for steps of ``batch`` x ``seq`` tokens on ``machine``.
    Without a GPU budget (gpu_memory_limit, or residency's) the step runs in micro-batches of
    ``micro_batch``. ``prefix`` is how the caller's config names the engine's settings ("offload.").

    Data parallel (``machine.ranks`` processes on each of ``machine.nodes`` machines): ``batch`` is one
    rank's, each rank keeps the host state of the units it owns (``ModelShape.ranks``), and the heaviest
    rank is planned within its share of the RAM, the disk and the cores. ``host_memory_limit`` is the
    machine's; the plan's config holds one process's share of it, which its engine and memory guard keep.

    Micro-batches past EFFICIENT_TOKENS (``micro_batch_tokens`` None: up to LARGE_TOKENS) keep fewer layer
    inputs on the GPU, and the offloaded ones take pinned RAM. Where that would not fit the host budget, or
    would take the embedding's bf16 host copy (staged, the first weights of a step cross as fp32 after the
    last update, and the GPU waits for them), the plan is the one with micro-batches of EFFICIENT_TOKENS.
    Where offloaded layer inputs still put the host over its budget, it plans again with more of them kept
    on the GPU, or with the embedding and head trained there where residency finds that faster."""
    plan, asked = _micro_batch_guard(cfg, auto, shape, batch, seq, machine, micro_batch, prefix)
    plan = _inputs_within_host(plan, asked, auto, batch, seq, machine, micro_batch, prefix)
    return _residents_within_host(plan, asked, auto, batch, seq, machine, micro_batch, prefix)


def _residents_within_host(plan: Plan, cfg, auto: "Auto", batch: int, seq: int, machine: Machine,
                           micro_batch: int | None, prefix: str) -> Plan:
    """Where the host state is over its budget with the resident layers residency chose (the most that
    keep micro-batches efficient, or fewer where the update hides anyway), the fastest plan with another
    count that fits both budgets: a resident layer keeps no host state, and fewer of them leave the GPU
    memory that keeps layer inputs out of pinned RAM; a slower step, in smaller micro-batches, beats a
    refusal; the embedding and head too, where residency decides them. Batches whose divisors allow no
    efficient micro-batch (a prime one) are where this is met."""
    c = plan.config
    if plan.binds != "host" or not auto.resident_layers or c.gpu_memory_limit is None:
        return plan
    tried = []
    for edges in (False, True) if auto.resident_edges is None else (auto.resident_edges,):
        fixed = replace(auto, resident_layers=False, resident_edges=edges)
        for k in range(plan.shape.layers - nvme_layer_count(c, plan.shape.layers) + 1):
            again = resolve(replace(cfg.placed(resident_layers=k, resident_edges=edges),
                                    gpu_memory_limit=c.gpu_memory_limit), fixed, plan.shape, batch, seq, machine,
                            micro_batch, prefix)
            if again.binds == "gpu":
                break  # (a resident layer more only takes more GPU memory)
            tried.append(again)
    fitting = [p for p in tried if p.fits]
    if not fitting:  # (the refusal names the least RAM any count asks)
        return min(tried + [plan], key=lambda p: sum(p.host.values()))
    rates = machine.rank_rates
    return min(fitting, key=lambda p: predicted_step(p, p.shape, batch, seq, rates)["step_s"])


def _micro_batch_guard(cfg, auto: "Auto", shape: ModelShape, batch: int, seq: int, machine: Machine,
                       micro_batch: int | None, prefix: str) -> tuple[Plan, object]:
    """The plan with micro-batches up to LARGE_TOKENS, or the one with EFFICIENT_TOKENS where the larger
    ones do not fit or stage the embedding (``resolve``); with the config it was resolved from."""
    plan = _resolve(cfg, auto, shape, batch, seq, machine, micro_batch, prefix)
    if cfg.placement.micro_batch_tokens is not None or plan.config.gpu_memory_limit is None \
            or min(plan.placement.micro_batch, batch) * seq <= EFFICIENT_TOKENS:
        return plan, cfg
    c = plan.config
    stages_edges = c.placement.host_weights == "staged" and not plan.placement.edges_resident(plan.shape)
    if not (plan.problem or stages_edges):
        return plan, cfg
    efficient = cfg.placed(micro_batch_tokens=EFFICIENT_TOKENS)
    small = _resolve(efficient, auto, shape, batch, seq, machine, micro_batch, prefix)
    if plan.problem or (small.problem is None and small.config.placement.host_weights != "staged"):
        return small, efficient  # (where neither fits, the one that asks less)
    return plan, cfg


def _inputs_within_host(plan: Plan, cfg, auto: "Auto", batch: int, seq: int, machine: Machine,
                        micro_batch: int | None, prefix: str) -> Plan:
    """Where the offloaded layer inputs put the host over its budget, the plan made again with a floor on
    the inputs kept on the GPU (``min_gpu_inputs``), if it fits both budgets: a step the host holds rather
    than a refusal. The placements that meet the floor cost GPU work (the sliced head, smaller
    micro-batches), so residency, which weighs them, may take the embedding and head onto the GPU instead
    (their host state then goes); the floor stays in the config only where the placement meets it (where
    it does not, fit() places as it would without one, so the engine's placement is the same)."""
    if plan.binds != "host" or plan.config.gpu_memory_limit is None or cfg.placement.min_gpu_inputs:
        return plan
    over = sum(plan.host.values()) - host_budget(plan.config, machine.rank_ram)[1]
    per_input = batch * seq * plan.shape.hidden * plan.config.compute_dtype.itemsize
    if over <= 0 or not per_input or over > plan.host.get("activations", 0):
        return plan
    keep = plan.placement.gpu_activation_layers + math.ceil(over / per_input)
    again = _resolve(cfg.placed(min_gpu_inputs=keep), auto, plan.shape, batch, seq, machine, micro_batch, prefix)
    if again.problem is not None:
        return plan
    if again.placement.gpu_activation_layers < keep:
        again = replace(again, config=again.config.placed(min_gpu_inputs=0),
                        placement=replace(again.placement, min_gpu_inputs=0))
    return again


def _resolve(cfg, auto: Auto, shape: ModelShape, batch: int, seq: int, machine: Machine,
             micro_batch: int | None, prefix: str) -> Plan:
    on_gpu = str(cfg.device).startswith("cuda")
    if machine.world > 1:
        shape = replace(shape, ranks=machine.world)
    if machine.ranks > 1 and cfg.host_memory_limit:
        cfg = replace(cfg, host_memory_limit=parse_bytes(cfg.host_memory_limit) // machine.ranks)
    ram, rates, free = machine.rank_ram, machine.rank_rates, machine.rank_disk
    if auto.nvme_fraction and cfg.offload_dir:
        cfg = cfg.placed(nvme_fraction=0.0)  # (RAM first; the tier is decided after the host settings)
    if auto.speculative_layers:
        cfg = cfg.placed(speculative_layers=spares_that_fit(cfg, shape, batch, seq, ram))
    depth_allows_two = (cfg.placement.prefetch_depth or 1) < 2  # (two slots prefetch one visit ahead)
    if auto.window_slots and on_gpu and (cfg.gpu_memory_limit or machine.gpu) and depth_allows_two:
        cfg = cfg.placed(window_slots=choose_window_slots(shape, batch, seq, gpu_budget(cfg, machine.gpu),
                                                          Layout.of(cfg)))
    if auto.resident_layers and on_gpu:
        budget = gpu_budget(cfg, machine.gpu)
        cfg = replace(cfg.placed(**auto_residency(cfg, shape, batch, seq, auto.resident_edges, machine.gpu,
                                                                 rates, ram)),
                      gpu_memory_limit=budget)
    if on_gpu and cfg.optimizer_state == "fp32" and shape.ranks == 1:  # (fit keeps it where it fits)
        cfg = cfg.placed(gpu_first_update=True)
    gpu, limit, problem, binds = None, None, None, None
    placement = Layout.of(cfg, micro_batch=micro_batch or batch)
    if on_gpu:
        limit = parse_bytes(cfg.gpu_memory_limit) if cfg.gpu_memory_limit else machine.gpu
        try:
            if cfg.gpu_memory_limit:
                placement = fit(shape, batch, seq, limit, Layout.of(cfg))
            elif placement.gpu_first_update and limit is not None and \
                    gpu_bytes(shape, batch, seq, placement, cfg.compute_dtype.itemsize)["peak"] > limit:
                placement = replace(placement, gpu_first_update=False)  # (as fit: only where it fits)
            gpu = gpu_bytes(shape, batch, seq, placement, cfg.compute_dtype.itemsize)
            if limit is not None and gpu["peak"] > limit:
                problem = (f"a step of {batch} x {seq} tokens in micro-batches of {min(placement.micro_batch, batch)} "
                           f"needs about {fmt_bytes(gpu['peak'])} of GPU memory, over the {fmt_bytes(limit)} "
                           f"available; set {prefix}gpu_memory_limit to let slideformer split the batch and offload, "
                           "or use smaller micro-batches (see `slideformer plan`)")
        except DoesNotFit as e:  # (the bytes of the least it could do: a sequence at a time, every input offloaded)
            placement, problem = least_layout(shape, batch, seq, Layout.of(cfg)), str(e)
            gpu = gpu_bytes(shape, batch, seq, placement, cfg.compute_dtype.itemsize)
        binds = "gpu" if problem else None
    cfg = auto_host(cfg, shape, batch, seq, placement, ram, weights=auto.host_weights,
                    buffers=auto.host_grad_buffers, spares=auto.speculative_layers)
    if auto.nvme_fraction and cfg.offload_dir:
        cfg = auto_tier(cfg, shape, batch, seq, placement, ram, buffers=auto.host_grad_buffers,
                        spares=auto.speculative_layers, weights=auto.host_weights, master=auto.nvme_master)
    if problem is None and on_gpu and cfg.gpu_memory_limit and auto.mid_layers:
        cfg, placement = mid_layers_that_pay(cfg, auto, shape, batch, seq, limit, placement, ram, rates)
    if problem is None and on_gpu and cfg.gpu_memory_limit:
        cfg, placement = head_chunk_and_inputs(cfg, auto, shape, batch, seq, limit, placement, ram, rates)
        gpu = gpu_bytes(shape, batch, seq, placement, cfg.compute_dtype.itemsize)
    if on_gpu:  # (the engine sets up the GPU update only where the planner's placement kept it)
        cfg = cfg.placed(gpu_first_update=placement.gpu_first_update)
    host = config_host_bytes(cfg, shape, batch, seq, placement)
    if problem is None:
        try:
            check_host_fits(host, ram, cfg, prefix=prefix, ranks=machine.ranks)
        except DoesNotFit as e:
            problem, binds = str(e), "host"
    disk, short = tier_bytes(cfg, shape, batch, seq, placement), None
    if free is not None and disk > free:
        each = f" ({machine.ranks} processes' tiers)" if machine.ranks > 1 else ""
        short = f"the NVMe tier needs about {fmt_bytes(disk * machine.ranks)} under {prefix}offload_dir " \
                f"{cfg.offload_dir}{each}, {fmt_bytes(machine.disk)} free there"
        if problem is None:
            levers = [] if cfg.optimizer_state == "8bit" else \
                [f"denser optimizer state ({prefix}optimizer_state: 8bit)"]
            if cfg.placement.activations_to_nvme:
                levers.append(f"the layer inputs in RAM ({prefix}activations_to_nvme: false)")
            if auto.nvme_fraction:
                levers.append(f"more RAM ({prefix}host_memory_limit)")
            elif cfg.placement.nvme_fraction > 0:
                levers.append(f"a smaller {prefix}nvme_fraction")
            problem, binds = f"{short}; free space, point it at a larger disk" + (
                f", or use {' or '.join(levers)}" if levers else ""), "disk"
        elif binds == "host":  # (both short: the fix for RAM alone would meet the disk's next)
            problem = f"{problem}; and {short}"
    return Plan(cfg, placement, gpu, limit, host, problem, binds, shape, short)


def _seconds(cfg, shape: ModelShape, batch: int, seq: int, p: Layout, rates: MachineRates, **kw) -> float:
    return step_time(shape, batch, seq, p, rates, state=cfg.optimizer_state, staged_params=staged_params(cfg, shape, p),
                     clipping=cfg.max_grad_norm is not None, **kw)["step_s"]


def staged_params(cfg, shape: ModelShape, p: Layout) -> int:
    """The parameters ``cfg``'s host weights stage (they cross PCIe as their fp32 master: step_time)."""
    hw, streamed = cfg.placement.host_weights, shape.layers - min(p.resident_layers, shape.layers)
    return 0 if compact_master(cfg.optimizer_state) else shape.params if hw == "staged" else \
        0 if hw == "persistent" else min(hw, streamed) * shape.layer_params


def mid_layers_that_pay(cfg, auto: "Auto", shape: ModelShape, batch: int, seq: int, limit: int, placement: Layout,
                        ram: int, rates: MachineRates) -> tuple[object, Layout]:
    """``mid_layers`` decided: as many of the offloaded layers as the host's budget holds offload their
    residual sum after attention too (a layer input's bytes each), whose recompute then skips the
    attention's output projection (model/recompute.py), where the time model says the step is faster for
    it. The sums take RAM before gradient buffers past MIN_GRAD_BUFFERS do, so only where the CPU update
    takes at most half the GPU's work (a short ring then never holds backward up: the time model does not
    weigh the ring), and without clipping (which holds a buffer per layer); the host weights stay as
    decided. Their GPU share (a layer's sums in backward, and the next one's fetched) is fit()'s; where it
    would change the micro-batches, the sliced head or token chunking, no sums."""
    if not shape.mid_params or cfg.max_grad_norm is not None:
        return cfg, placement
    try:
        q = fit(shape, batch, seq, limit, Layout.of(cfg.placed(mid_layers=shape.layers)))
    except DoesNotFit:
        return cfg, placement
    if (q.micro_batch, q.head_slice, q.mlp_chunk_tokens) != \
            (placement.micro_batch, placement.head_slice, placement.mlp_chunk_tokens):
        return cfg, placement  # (the time model does not weigh the micro-batches' size: not traded for sums)
    offloaded = mid_layers(shape, q)  # (as many as may keep sums: none on the disk or with token-chunked MLPs)
    if not offloaded:
        return cfg, placement
    ring = cfg.placed(host_grad_buffers=MIN_GRAD_BUFFERS) if auto.host_grad_buffers else cfg
    none = replace(q, mid_layers=0)
    room = host_budget(ring, ram)[0] - sum(config_host_bytes(ring, shape, batch, seq, none).values())
    k = min(offloaded, max(0, room) // (batch * seq * shape.hidden * cfg.compute_dtype.itemsize))
    if not k:
        return cfg, placement
    mid = replace(q, mid_layers=k)
    c1 = auto_host(ring.placed(mid_layers=k), shape, batch, seq, mid, ram, weights=False,
                   buffers=auto.host_grad_buffers, spares=False)
    t = step_time(shape, batch, seq, mid, rates, state=cfg.optimizer_state)

    def seconds(c, p: Layout) -> float:
        return _seconds(c, shape, batch, seq, p, rates, small_head_chunk_cost=SMALL_HEAD_CHUNK_COST)

    if t["optimizer_s"] > 0.5 * t["gpu_compute_s"] or seconds(c1, mid) >= CHUNK_MARGIN * seconds(cfg, placement):
        return cfg, placement
    return c1, mid


CHUNK_MARGIN = 0.995  # a larger chunk's predicted gain must pass the time model's noise: half a percent


def head_chunk_and_inputs(cfg, auto: "Auto", shape: ModelShape, batch: int, seq: int, limit: int,
                          placement: Layout, ram: int, rates: MachineRates) -> tuple[object, Layout]:
    """The loss head's chunk and the host's room for layer inputs (``displace_inputs``), decided together:
    fit() takes the largest chunk that fits beside the most kept inputs, but the head's products run faster
    in larger chunks (SMALL_HEAD_CHUNK_COST, counted here only), and the inputs a larger chunk sends to the
    host cost nothing where the GPU's work bounds the step (only there is it weighed). So each larger
    chunk's placement is timed beside fit()'s, with the same micro-batches (the time model does not weigh
    their size) and within the host's budget, and the smallest of the fastest is taken where it gains at
    least CHUNK_MARGIN; its chunk then goes into the config, so the engine's fit() places the same. Where
    the planner decides the host settings (and without offload_dir, whose tier they were placed beside),
    they are decided again for a larger chunk's inputs: more staged layers, never the embedding's and head's
    weights, and the steps are timed with what staging costs."""
    def seconds(c, p: Layout) -> float:
        return _seconds(c, shape, batch, seq, p, rates, small_head_chunk_cost=SMALL_HEAD_CHUNK_COST)

    best = displace_inputs(cfg, shape, batch, seq, limit, placement, ram, rates)
    if cfg.tuning.loss_chunk_tokens is not None or cfg.placement.activations_to_nvme:
        return best
    t = step_time(shape, batch, seq, best[1], rates, state=cfg.optimizer_state,
                  staged_params=staged_params(best[0], shape, best[1]))
    if t["optimizer_s"] >= t["gpu_compute_s"]:  # (the CPU update bounds the step: fit()'s chunk)
        return best
    best_s = seconds(*best)
    for chunk in sorted(c for c in LOSS_CHUNK_TOKENS if c > (placement.loss_chunk_tokens or 0)):  # (ties: the least)
        wider = replace(cfg, tuning=replace(cfg.tuning, loss_chunk_tokens=chunk))
        try:
            q = fit(shape, batch, seq, limit, Layout.of(wider))
        except DoesNotFit:
            continue
        if (q.micro_batch, q.head_slice, q.mlp_chunk_tokens) != \
                (placement.micro_batch, placement.head_slice, placement.mlp_chunk_tokens):
            continue
        if auto.host_weights and not cfg.offload_dir:
            wider = auto_host(wider, shape, batch, seq, q, ram, buffers=auto.host_grad_buffers,
                              spares=auto.speculative_layers)  # (in auto_host's order: the weights first)
            if wider.placement.host_weights == "staged" != cfg.placement.host_weights:
                continue  # (the embedding's and head's weights too: the GPU would wait for them at each step)
        c, p = displace_inputs(wider, shape, batch, seq, limit, q, ram, rates)
        if sum(config_host_bytes(c, shape, batch, seq, p).values()) > host_budget(c, ram)[0]:
            continue
        if (s := seconds(c, p)) < CHUNK_MARGIN * best_s:
            best, best_s = (c, p), s
    return best


def displace_inputs(cfg, shape: ModelShape, batch: int, seq: int, limit: int, placement: Layout, ram: int,
                    rates: MachineRates) -> tuple[object, Layout]:
    """The config and placement with ``host_input_bytes`` decided, last of the host's claims: the RAM that
    ``host_budget`` aims at and the state leaves, where fit() turns it into more saved layers and the time
    model says the step is faster for it (the inputs' copies share the copy engines with the weights)."""
    room = host_budget(cfg, ram)[0] - sum(config_host_bytes(cfg, shape, batch, seq, placement).values())
    if room <= 0 or cfg.placement.activations_to_nvme:  # (offloaded inputs would go on to the disk)
        return cfg, placement
    q = fit(shape, batch, seq, limit, Layout.of(cfg.placed(host_input_bytes=room)))

    def seconds(p: Layout) -> float:
        return _seconds(cfg, shape, batch, seq, p, rates)

    if q.saved_layers <= placement.saved_layers or seconds(q) >= seconds(placement):
        return cfg, placement
    used = (shape.layers - q.gpu_activation_layers) * batch * seq * shape.hidden * cfg.compute_dtype.itemsize
    if not used:  # (its saved layers came from the allowance's exact peak check, not from inputs it moved:
        return cfg, placement  # fit() without an allowance, as the engine fits, would not place them)
    # (fit under an allowance of just these bytes places the same: the most saved layers, the fewest inputs)
    return cfg.placed(host_input_bytes=used), replace(q, host_input_bytes=used)


def tier_bytes(cfg, shape: ModelShape, batch: int, seq: int, placement: Layout) -> int:
    """Disk under offload_dir of the process that needs the most: the NVMe tier's state of its layers
    (the last ones), and the layer inputs it offloads there."""
    if not cfg.offload_dir:
        return 0
    inputs = shape.layers - min(shape.layers, placement.gpu_activation_layers) \
        if cfg.placement.activations_to_nvme else 0
    first = shape.layers - min(nvme_layer_count(cfg, shape.layers), shape.layers)
    layers = max(sum(i >= first for i in mine) for mine, _ in held(shape, replace(placement, resident_layers=0)))
    return nvme_bytes(shape, layers, cfg.optimizer_state, cfg.placement.nvme_master) \
        + inputs * batch * seq * shape.hidden * cfg.compute_dtype.itemsize


def predicted_step(plan: Plan, shape: ModelShape, batch: int, seq: int, rates: MachineRates = MachineRates()) -> dict:
    """``step_time`` of a resolved plan on a machine of ``rates`` (the tier's layers are the last, never
    resident ones)."""
    c = plan.config
    resident = min(plan.placement.resident_layers, shape.layers)
    return step_time(shape, batch, seq, plan.placement, rates, state=c.optimizer_state,
                     staged_params=staged_params(c, shape, plan.placement),
                     nvme_layers=min(nvme_layer_count(c, shape.layers), shape.layers - resident),
                     nvme_master=c.placement.nvme_master, activations_to_nvme=c.placement.activations_to_nvme,
                     clipping=c.max_grad_norm is not None, speculative_layers=c.placement.speculative_layers)
