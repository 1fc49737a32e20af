"""SlideEngine: full-parameter training through a sliding GPU window of layers.

One ``train_step`` walks the visit plan of ``window.schedule`` (forward over the layers, the loss
head, backward over the layers in reverse), running every micro-batch through a layer while it is
in the window. That is "layer-major" accumulation: weights cross PCIe once per step however many
micro-batches there are, and a layer's gradients are summed on the GPU before they leave it.

Forward runs without autograd and keeps only each layer's input (and, for the planner's saved layers,
its linears' outputs: model/recompute.py); backward recomputes a layer from that input. As soon as a
unit's gradient is complete it goes to the host and the CPU optimizer updates that unit while the GPU
continues with the layers below. With clipping, the update needs
the global norm, known at the end of backward: layers with a spare state (``speculative_layers``)
are updated before it, out of place, and the update stands if the norm is within the limit
(engine/runtime.py); the others wait for it and then run in forward order, so the next step's
forward consumes them as they finish.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
import json
import math
import os
import threading
from dataclasses import dataclass, field, replace
from functools import partial, wraps
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import parallel
from ..checkpoint import CheckpointError, export, loader
from ..checkpoint import state as ckpt_state
from ..config import ConfigError, EngineConfig, float_dtype, learning_rate
from ..data.batches import KEYS, BatchError, as_tensor, check_step, misspelt
from ..host.store import HostStore
from ..model.adapter import ModelAdapter, bind_parameters
from ..optim import native
from ..optim.adamw import Rows
from ..model.chunked_mlp import MlpChunking
from ..model.moe import RouterLoss, forward_adds_router_loss
from ..model.decoder import install as install_decoder
from ..model.recompute import LayerRecompute, mid_projection
from ..model.fused_ops import apply_liger, liger_missing
from ..model.fused_ops import resolve as resolve_fused_ops
from ..machine import host_memory
from ..plan.memory import (LOSS_CHUNK_TOKENS, MIN_SIZE, DoesNotFit, ModelShape, Layout, back_visits, check_host_fits,
                           config_host_bytes, embedding_by_rows, fit, fmt_bytes, mid_layers, nvme_layer_count,
                           parse_bytes, saved_layers, speculative_spares)
from ..window.schedule import plan_step
from .activations import ActivationStore
from .embedding import step_rows
from .loss import chunked_head_loss, fused_head_loss, head_loss_value, logits_workspace, sliced_head_loss
from .runtime import Runtime
from .updates import UpdateJob


NORM_ROW = 1 << 16


def grad_norm(g: torch.Tensor) -> torch.Tensor:
    """A flat gradient's fp32 norm. On the CPU by rows of NORM_ROW elements, whose norms are combined in
    fp64: torch's CPU norm of one long fp32 vector drifts (1e-3 relative at 30M elements), where
    clip_grad_norm_'s per-parameter norms stay near fp32's noise; the GPU's tree reduction does not drift."""
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    m = g.numel() // NORM_ROW * NORM_ROW
    parts = [torch.linalg.vector_norm(g[:m].view(-1, NORM_ROW), dim=1, dtype=torch.float32).double()]
    if m < g.numel():
        parts.append(torch.linalg.vector_norm(g[m:], dtype=torch.float32).double().view(1))
    return torch.linalg.vector_norm(torch.cat(parts)).float()


@dataclass
class _Step:
    """What one train_step carries from visit to visit."""
    mbs: list
    denom: int  # non-ignored labels in the whole step: every micro-batch's loss sum is divided by it
    index: int  # the optimizer step this is (1-based)
    hidden: list = field(default_factory=list)  # [B, S, H] per micro-batch, flowing forward
    grad_hidden: list = field(default_factory=list)  # its gradient, flowing backward
    loss: float | torch.Tensor = 0.0
    norms: list = field(default_factory=list)  # per-unit gradient norms (fp32, on the device)
    finished: list = field(default_factory=list)  # (unit, SentGrads) awaiting the clip coefficient
    embed_grad_written: bool = False
    rows: torch.Tensor | None = None  # the embedding rows the step's tokens touch (sorted, on the host)
    rows_device: torch.Tensor | None = None  # (and on the device: a tied embedding's by rows, from the head on)
    kept: dict = field(default_factory=dict)  # saved layer -> its products per micro-batch, forward to backward
    visiting: bool = False  # the first streamed layer's update runs on the GPU this step (``VisitingUpdate``)
    visiting_slot: object = None  # (its slot, for an update that waits for clipping's coefficient)


class Evaluation(NamedTuple):
    loss: float  # mean over the target tokens (+ coef x the router's load-balancing loss, for MoE models asking it)
    tokens: int  # the target tokens
    router_loss: float = 0.0  # that load-balancing part (0 for dense models)


def _as_rows(v) -> torch.Tensor:
    """A batch value as rows: one sequence (1-D) is one row; anything else as it is."""
    t = torch.as_tensor(v)
    return t.unsqueeze(0) if t.dim() == 1 else t


def _loads_after(plan) -> dict[int, list]:
    """A plan's loads by the visit after whose compute each is issued (-1: at the step's start)."""
    out: dict[int, list] = {}
    for v in plan:
        if v.load:
            out.setdefault(v.issue_after, []).append(v)
    return out


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, S] on the device
    labels: torch.Tensor  # [B*S] shifted left by one, -100 = ignored
    targets: torch.Tensor  # [B*S] bool on the host, labels != -100: the loss head skips chunks without a sync
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # [1, S], or [B, S] restarting at 0 for each packed sample
    packed: bool = False  # position_ids restart: the mask functions must look at them (a device read)
    masks: dict | None = None  # per attention type, built after the embedding
    rope: dict | None = None  # attention type -> (cos, sin)
    # (unique token ids, each position's index into them, their rows in the embedding's gradient: the ids
    # themselves, or by rows their places among the step's rows; by rows, each token's place among them
    # as well, [B, S]): the embedding's forward and backward
    rows: tuple | None = None


class StepFailed(RuntimeError):
    """A step raised after it began (some units updated, others not; the window's loads and the offloaded
    inputs half used): the engine's state is then no training's. Its threads skip what the step left
    queued, and it refuses to step, evaluate, synchronize, save, load or hand out its weights; ``close``
    releases it."""


def _one_caller(what: str):
    """A public method that changes or reads the training state: refused on an engine that failed or was
    closed, and while another thread is inside the engine (two threads' steps would interleave their
    visits and updates). The same thread may call in again (save_checkpoint synchronizes)."""
    def wrap(method):
        @wraps(method)
        def call(self, *args, **kwargs):
            if not self._caller.acquire(blocking=False):
                raise RuntimeError(f"cannot {what}: another thread is using this engine; an engine serves one "
                                   "thread at a time")
            try:
                self._usable(what)
                return method(self, *args, **kwargs)
            finally:
                self._caller.release()
        return call
    return wrap


class SlideEngine:
    def __init__(self, model, cfg: EngineConfig | None = None):
        """Train an in-memory Hugging Face causal LM. Its weights are copied to the engine's storage and
        ``model`` itself is left as it is: ``state_dict`` and ``save_pretrained`` give the trained weights."""
        model = loader.trainable_module(model)
        self._setup(copy.deepcopy(model.config), cfg)
        self._loading(lambda: loader.load_state_from_module(model, self.adapter, self.store))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, cfg: EngineConfig | None = None) -> "SlideEngine":
        from transformers import AutoConfig

        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: " + ("no such folder" if not folder.exists() else "not a folder" if
                                                  not folder.is_dir() else "no config.json (not a Hugging Face model "
                                                  "folder)") + "; slideformer loads local folders (fetch one with "
                                  "`hf download ORG/NAME --local-dir DIR`)")
        self = cls.__new__(cls)
        self._setup(AutoConfig.from_pretrained(path), cfg)
        self._loading(lambda: loader.load_safetensors(path, self.adapter, self.store))
        self._source = folder  # (its generation_config.json goes with save_pretrained's files)
        return self

    @classmethod
    def from_config(cls, config, cfg: EngineConfig | None = None) -> "SlideEngine":
        """Random initialisation from a Hugging Face config (benchmarks, tests)."""
        self = cls.__new__(cls)
        self._setup(copy.deepcopy(config), cfg)
        self._loading(lambda: loader.random_init(self.adapter, self.store, seed=self.cfg.seed, device=self.device))
        return self

    def _loading(self, load) -> None:
        """``load()`` the weights; where it fails (a file that does not match, a signal), the threads and the
        memory ``_setup`` took go back: the caller never gets this engine to close."""
        try:
            load()
        except BaseException:
            self.close(abort=True)
            raise

    def _setup(self, hf_config, cfg: EngineConfig | None) -> None:
        self._caller = threading.RLock()
        self._source: Path | None = None
        if cfg is not None and not isinstance(cfg, EngineConfig):
            raise ConfigError(f"cfg must be a slideformer.EngineConfig, got {type(cfg).__name__} (e.g. "
                              "EngineConfig(lr=1e-5, gpu_memory_limit='24GiB'))")
        # (a copy: the caller's object, changed later, would skip validate() and reach a running engine)
        self.cfg = copy.deepcopy(cfg or EngineConfig()).validate()
        p, t = self.cfg.placement, self.cfg.tuning
        self.device = torch.device(self.cfg.device)
        self.adapter = ModelAdapter(hf_config, self.cfg.compute_dtype, self.cfg.attn_implementation)
        self.fused_ops = resolve_fused_ops(t.fused_ops, str(self.cfg.device), self.adapter.model_type)
        self._liger_missing = liger_missing(t.fused_ops, str(self.device), self.adapter.model_type)
        if self.fused_ops == "liger":
            apply_liger(self.adapter.layers + [self.adapter.norm], getattr(hf_config, "hidden_act", ""))
        # (after Liger: the chunks run whatever MLP forward is bound)
        self.mlp_chunking = MlpChunking([layer.mlp for layer in self.adapter.layers], t.mlp_chunk_tokens)
        if self.cfg.fp8 and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (9, 0):
            raise ConfigError(f"fp8: {torch.cuda.get_device_name(self.device)} cannot multiply FP8 rows with a scale "
                              "each (torch._scaled_mm's rowwise scaling: compute capability 9.0 or newer, Hopper "
                              "on); leave fp8 off")
        self.recompute = LayerRecompute(self.adapter.layers, fp8=self.cfg.fp8)
        # Llama-style layers: the residual sum in the MLP norm's kernel, the recompute's output sum skipped
        install_decoder(self.adapter.layers, self.recompute, fused=self.fused_ops == "liger")
        # Mixture-of-Experts: experts as one grouped GEMM on CUDA (transformers' loop on the CPU), and the
        # router's load-balancing loss where the config asks for it (model/moe.py)
        if self.adapter.experts:
            for m in self.adapter.skeleton.modules():
                if hasattr(getattr(m, "config", None), "_experts_implementation"):
                    m.config._experts_implementation = "grouped_mm" if self.device.type == "cuda" else "eager"
        self.router_loss = RouterLoss(self.adapter) if self.adapter.experts and \
            getattr(hf_config, "output_router_logits", False) and forward_adds_router_loss(self.adapter) else None
        # Data parallel (parallel.py): each unit's host state, update and checkpoint belong to one rank; the
        # resident units are every rank's. host_memory_limit is then this process's (plan.resolve's share).
        self.ranks = parallel.current()
        self.shape = replace(ModelShape.from_adapter(self.adapter), ranks=self.ranks.world if self.ranks else 1)
        self._limit = None if self.cfg.gpu_memory_limit is None else parse_bytes(self.cfg.gpu_memory_limit)
        self._failed: str | None = None  # a step that raised midway (StepFailed)
        self._closed = False
        if self._limit is not None:  # refuse before allocating anything if not even one sequence fits
            try:
                fit(self.shape, 1, 1, self._limit, Layout.of(self.cfg))
            except DoesNotFit as e:
                x = self.cfg.gpu_memory_limit
                if isinstance(x, (int, float)) and x < MIN_SIZE:  # (24 meant as GiB)
                    raise DoesNotFit(f"{e} (gpu_memory_limit={x!r}: a number is bytes; for GiB write '{x}GiB')") \
                        from None
                raise
        # and if the host state (no layer inputs yet: they depend on the batch; on the CPU with the window's slots,
        # "compute", allocated now) is over the RAM
        local = parallel.local_world(self.ranks)
        check_host_fits(config_host_bytes(self.cfg, self.shape, 0, 1, Layout.of(self.cfg)), host_memory() // local,
                        self.cfg, "this model's host state" + ("" if self.device.type == "cuda" else
                                                               " and its window's slots (compute)"), ranks=local)
        self._placements: dict[tuple[int, int], Layout] = {}
        self._loss_chunk = t.loss_chunk_tokens or LOSS_CHUNK_TOKENS[-1]  # (under a budget: the planner's)
        self._head_slice = None  # the lm_head gradient by vocabulary slices: the planner's, under a budget
        # (under a budget: the planner's)
        self._saved = self._last_layers(saved_layers(self.shape, Layout.of(self.cfg)))
        ring = None if self.cfg.max_grad_norm is not None else p.host_grad_buffers  # clipping holds all
        n = self.adapter.num_layers
        # Resident layers are the first ones (config.py says why), the NVMe tier's the last ones.
        layers = [self.adapter.layer_unit(i).index for i in range(n)]
        k = min(p.resident_layers, n)
        nvme = set(layers[n - nvme_layer_count(self.cfg, n):])
        # The first streamed layer, updated on the GPU where the placement says so (engine/resident.py
        # ``VisitingUpdate``): fp32 state in RAM, one process. Its loads copy the GPU's master, so a bf16
        # host copy would only cost RAM and a copy back each step.
        first = layers[k] if k < n else None
        self._gpu_first = first if p.gpu_first_update and first is not None and first not in nvme \
            and self.cfg.optimizer_state == "fp32" and self.ranks is None else None
        hw = p.host_weights  # units without a compute copy on the host: cast at copy time
        staged = {u.index for u in self.adapter.units} if hw == "staged" else \
            set() if hw == "persistent" else set(layers[n - min(hw, n):])
        staged |= {self._gpu_first} - {None}
        # Resident units: `resident_layers` decoder layers, and embedding and head with `resident_edges` or
        # when every layer is resident (the whole model then trains on the GPU, as plain training would).
        # Their state is the runtime's, on the GPU; the host store keeps none of it.
        resident = set(layers[:k])
        if k == n or p.resident_edges:
            resident |= {self.adapter.embed_unit.index, self.adapter.head_unit.index}
        if resident & nvme:
            raise ConfigError("resident_layers and the NVMe tier (nvme_fraction) overlap: a layer on the GPU keeps "
                              "its moments there; lower one of them")
        self.resident = frozenset(resident)
        units = self.adapter.units
        self._owner = parallel.assign_units([u.numel for u in units], self.ranks.world) if self.ranks else \
            [0] * len(units)
        foreign = {u.index for u in units if self._owner[u.index] != self.ranks.rank} - self.resident \
            if self.ranks else set()
        nvme -= foreign  # (each rank's tier holds its own layers, in a folder of its own under offload_dir)
        self.store = HostStore(self.adapter.units, self.cfg.compute_dtype, pin=self.device.type == "cuda",
                               staged_units=staged, host_grad_buffers=ring,
                               nvme_dir=self.cfg.offload_dir, nvme_units=nvme, nvme_buffers=p.nvme_buffers,
                               state=self.cfg.optimizer_state, nvme_master=p.nvme_master,
                               spare_states=speculative_spares(self.cfg, n), resident_units=self.resident,
                               foreign_units=foreign,
                               gpu_updated_units=set() if self._gpu_first is None else {self._gpu_first})
        # Untied: the head's weights take the embedding's slot after its forward (window/schedule.py).
        self.plan = plan_step(n, p.window_slots, p.lookahead, self.resident,
                              share_edge=not self.adapter.tied)
        self.runtime = Runtime(self.adapter, self.store, self.cfg, self.plan, self._owner if self.ranks else None,
                               gpu_updated=self._gpu_first)
        self._visits_now = self._gpu_first is not None  # (per step under a budget: the placement's, ``_place``)
        if self._gpu_first is not None:  # its state crosses behind its input, restored by the visit before
            bwd = next(t for t, v in enumerate(self.plan) if v.unit == self._gpu_first and v.phase == "bwd")
            head = next(t for t, v in enumerate(self.plan) if v.phase == "head")
            self._fetch_after = max(bwd - 1, head)
        offload = set(range(max(0, n - p.gpu_activation_layers))) if p.offload_activations else set()
        self.activations = ActivationStore(self.runtime, n, offload,
                                           nvme_dir=self.cfg.offload_dir if p.activations_to_nvme else None)
        self._mids = self._first_mids(Layout.of(self.cfg))
        self._embed_slot = next((v.group, v.slot) for v in self.plan if v.unit == self.adapter.embed_unit.index)
        self._loads_after = _loads_after(self.plan)
        # Evaluation: the step's forward visits and the loss head, in the same slots (``evaluate``)
        self._eval_plan = plan_step(n, p.window_slots, p.lookahead, self.resident, share_edge=not self.adapter.tied,
                                    forward_only=True)
        self._eval_loads_after = _loads_after(self._eval_plan)
        # The order updates run in: as gradients complete, or (clipping) forward order after backward.
        done = [v.unit for v in self.plan if v.last and v.unit not in self.resident and self.store.owns(v.unit)]
        self._update_order = sorted(done) if self.cfg.max_grad_norm is not None else done
        self.rotary = self.adapter.rotary(self.device)
        # The embedding's update in two parts by rows (engine/embedding.py), where the planner's rule allows
        # (streamed, one rank; tied, without clipping) and the native kernel is there
        emb = self.adapter.embed_unit
        self._by_rows = embedding_by_rows(self.shape, Layout.of(self.cfg), self.cfg.optimizer_state,
                                          self.cfg.max_grad_norm is not None) and \
            self.runtime.updates.backend == "native" and len(emb.params) == 1 and emb.params[0].offset == 0 \
            and not self.store.on_tier(emb.index)
        self._row_length = emb.params[0].shape[-1]
        self.lr = self.cfg.lr
        self._grad_norm = None
        # With clipping the update waits for the global norm anyway: a step whose norm or loss is not finite
        # is then dropped (no state changes). Without clipping the updates run as gradients land, so such a
        # step has been applied when its norm is known (the caller must not save that state).
        self.last_step_dropped = False
        self.last_step_targets = 0  # the target tokens of the last step's loss (over every rank's part)

    # -- public API -----------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        """Learning rate for the next ``train_step`` on."""
        self.lr = learning_rate(lr, "set_lr: the learning rate")

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the last step (before clipping)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @_one_caller("train")
    def train_step(self, batch, *, blocking: bool = True) -> float | torch.Tensor:
        """One optimizer step over ``batch`` (a dict, or a list of micro-batch dicts accumulated).

        Returns the loss as a float, which waits for the GPU. With ``blocking=False`` it returns a 0-dim
        device tensor instead, so the next step's host work overlaps this one's GPU work (a loop that
        reads the loss only now and then loses no time at step boundaries). Clipping still waits, for
        the global norm; with it, a step whose norm or loss is not finite is dropped before it is applied
        (``last_step_dropped``)."""
        if self._limit is not None:
            batch = self._place(batch)
        mbs, denom, rows = self._prepare(batch)  # (a refused batch leaves the engine as it was)
        self.last_step_targets = denom  # (the loss is the mean over these, every rank's)
        st = _Step(mbs=mbs, denom=denom, index=self.store.step + 1, rows=rows, visiting=self._visits_now)
        rt = self.runtime
        if st.visiting:  # (the visits of the state's copy back, for the step's shape as fit() sizes it)
            seqs, longest = sum(m.input_ids.shape[0] for m in mbs), max(m.input_ids.shape[1] for m in mbs)
            rt.visiting.back_visits = back_visits(self.shape, Layout.of(self.cfg), seqs * longest)
        try:
            if self.router_loss is not None:
                self.router_loss.begin_step(self.device)
            self.activations.begin_step(sum(mb.input_ids.numel() for mb in mbs), self.adapter.config.hidden_size,
                                        self.cfg.compute_dtype, mid_layers=len(self._mids))
            rt.begin_step(self._update_order)
            # (by rows, the embedding's load is the step's rows: engine/embedding.py)
            rows = {self.adapter.embed_unit.index: st.rows} if self._by_rows else {}
            for v in self._loads_after.get(-1, ()):
                rt.load(v.unit, rt.slots[v.group][v.slot], rows.get(v.unit))
            for t, v in enumerate(self.plan):
                slot = rt.slots[v.group][v.slot]
                unit = self.adapter.units[v.unit]
                rt.begin_compute(slot)
                self.recompute.new_visit()
                getattr(self, f"_{v.phase}")(st, unit, slot)
                rt.end_compute(slot, v.unit)
                if v.phase == "embed_fwd" and self._by_rows and self.adapter.tied:
                    rt.load(v.unit, slot)  # the whole matrix over the rows, for the head (engine/embedding.py)
                if v.last:
                    self._gradient_done(st, v.unit, slot)
                for nxt in self._loads_after.get(t, ()):
                    rt.load(nxt.unit, rt.slots[nxt.group][nxt.slot], rows.get(nxt.unit))
                if st.visiting and t == self._fetch_after:
                    rt.visiting.fetch()
            loss = self._end_step(st)
            if rt.visiting is not None:
                rt.visiting.end_step()
        except BaseException as e:
            st.kept.clear()  # (saved layers' products: GPU memory a held traceback would otherwise keep)
            self._failed = f"step {st.index} raised {type(e).__name__}"
            # (what the step left queued or waiting, for clipping's coefficient or a tied embedding's
            # touched rows, would change no state worth keeping: the threads skip it and let go)
            self.runtime.abort(StepFailed(f"{self._failed} midway"))
            raise
        return float(loss) if blocking else loss.detach()

    def _end_step(self, st: "_Step"):
        """After the step's last visit: the global norm and, with clipping, the coefficient that the
        updates waiting for it take (or the step dropped); the step's loss."""
        rt = self.runtime
        total = torch.linalg.vector_norm(torch.stack(st.norms)) if st.norms else torch.zeros((), device=self.device)
        loss = st.loss if torch.is_tensor(st.loss) else torch.tensor(st.loss)
        if self.ranks is not None:  # each unit's norm was counted by its owner; the loss is each rank's part
            total, loss = parallel.sum_all(torch.stack([total.float() ** 2, loss.to(self.device, torch.float32)]))
            total = total.sqrt()
        self._grad_norm = total
        self.last_step_dropped = False
        if self.cfg.max_grad_norm is not None:
            norm, value = torch.stack([total, loss.to(total)]).tolist()  # (one wait for both)
            finite = math.isfinite(norm) and math.isfinite(value)
            # A non-finite norm or loss drops the step: no unit's state changes, the step count stays.
            coef = min(1.0, self.cfg.max_grad_norm / (norm + 1e-6)) if finite else None
            rt.updates.resolve(coef)  # the updates already run stand if coef is 1, else run again
            # (in forward order: the next step needs unit 0 first)
            for unit, sent in sorted(st.finished, key=lambda f: f[0]):
                if sent is not None and sent.rows is not None and finite:  # the embedding's untouched rows first
                    rt.updates.submit(UpdateJob(unit, None, st.index, self.lr, coef, rest=self._untouched(st)))
                if st.visiting and unit == self._gpu_first:
                    if finite:
                        rt.visiting.update(st.visiting_slot, st.index, self.lr, coef)
                elif unit not in self.resident:
                    rt.updates.submit(UpdateJob(unit, sent, st.index, self.lr, coef))
                elif finite:
                    rt.resident.update(unit, st.index, self.lr, coef)
            self.last_step_dropped = not finite
        if not self.last_step_dropped:
            self.store.step = st.index
        return loss

    def _usable(self, what: str) -> None:
        if self._failed is not None:  # (first: the failure is what the caller has to know of)
            raise StepFailed(f"cannot {what}: {self._failed} midway, after some units had been updated and before "
                             "others were, and the window, the loads and the offloaded inputs of that step are "
                             "left as they were; build a new engine (and load_checkpoint the last checkpoint)")
        if self._closed:
            raise RuntimeError(f"cannot {what}: the engine is closed (its threads and memory are released); build "
                               "a new one")

    @torch.no_grad()
    @_one_caller("evaluate")
    def evaluate(self, batch) -> "Evaluation":
        """The loss of ``batch`` (a dict, or a list of micro-batch dicts) without training it: forward only,
        the weights streamed through the window, no gradient, no update, no layer input kept. Returns the
        mean loss over its target tokens (plain PyTorch's ``model(**batch).loss`` on it, with a MoE model's
        load-balancing loss where its config asks for it), their number, and that load-balancing part."""
        if self._limit is not None:
            batch = self._place(batch)
        mbs, denom, _ = self._prepare(batch)
        st = _Step(mbs=mbs, denom=denom, index=self.store.step)
        rt = self.runtime
        if self.router_loss is not None:
            self.router_loss.begin_step(self.device)
        for v in self._eval_loads_after.get(-1, ()):
            rt.load(v.unit, rt.slots[v.group][v.slot])
        for t, v in enumerate(self._eval_plan):
            slot = rt.slots[v.group][v.slot]
            unit = self.adapter.units[v.unit]
            rt.begin_compute(slot)
            self.recompute.new_visit()
            if v.phase == "embed_fwd":
                self._embed_fwd(st, unit, slot, training=False)
            elif v.phase == "fwd":
                self._fwd(st, unit, slot, training=False)
            else:
                self._head_value(st, unit, slot)
            rt.end_compute(slot, v.unit)
            for nxt in self._eval_loads_after.get(t, ()):
                rt.load(nxt.unit, rt.slots[nxt.group][nxt.slot])
        router = 0.0 if self.router_loss is None else float(self.router_loss.loss())
        loss = st.loss if torch.is_tensor(st.loss) else torch.tensor(st.loss)
        if self.ranks is not None:
            loss = parallel.sum_all(loss.to(self.device, torch.float32))
        return Evaluation(float(loss), denom, router)

    # -- the phases of a step, one per visit kind (see window/schedule.py) --------------------------
    def _embed_fwd(self, st: "_Step", unit, slot, training: bool = True) -> None:
        w = slot.views(unit)[0]["weight"]
        by_rows = training and self._by_rows  # the slot holds the step's rows, packed (engine/embedding.py)
        if by_rows:
            w = slot.params[: st.rows.numel() * self._row_length].view(-1, self._row_length)
            # the rows the step does not touch (with clipping: after the verdict; tied: from the head's gradient)
            if self.cfg.max_grad_norm is None and not self.adapter.tied:
                self.runtime.updates.submit(UpdateJob(unit.index, None, st.index, self.lr, 1.0,
                                                      rest=self._untouched(st)))
        with torch.no_grad():
            for mb in st.mbs:
                # (by rows: each token's place among the step's rows, which know no padding id; the padding
                # row's gradient is zeroed by id in the backward either way)
                h = self.adapter.embed_scaled(F.embedding(mb.rows[3], w) if by_rows else
                                              F.embedding(mb.input_ids, w, self.adapter.padding_idx))  # [B, S, H]
                # (unpacked rows: no position ids, or transformers reads them on the device to look for packing)
                mb.masks = self.adapter.attention_masks(h, mb.attention_mask, mb.position_ids if mb.packed else None)
                mb.rope = self.adapter.positions(self.rotary, h, mb.position_ids)
                st.hidden.append(h)

    def _fwd(self, st: "_Step", unit, slot, training: bool = True) -> None:
        layer = self.adapter.layers[unit.layer]
        bind_parameters(layer, slot.views(unit)[0])
        saved = training and unit.layer in self._saved  # its products stay on the GPU until its backward
        out, kept, mids = [], [], []
        with torch.no_grad(), (self.recompute.keeping_mids(mids) if training and unit.layer in self._mids
                               else contextlib.nullcontext()):
            for h, mb in zip(st.hidden, st.mbs):
                with (self.recompute.recording() if saved else contextlib.nullcontext()) as products, \
                        (self.router_loss.counting(self._token_mask(mb)) if self.router_loss is not None
                         else contextlib.nullcontext()):  # (the routing counted for the load-balancing loss)
                    out.append(self._run_layer(layer, unit.layer, h, mb))
                kept.append(products)
        if saved:
            st.kept[unit.layer] = kept
        if training:
            # (after the layer is enqueued: the copy overlaps the next; a mid layer's sums after attention beside)
            self.activations.save(unit.layer, st.hidden + mids)
        st.hidden = out

    def _head(self, st: "_Step", unit, slot) -> None:
        rt, ad = self.runtime, self.adapter
        if self.router_loss is not None:  # (every layer's routing counted by now)
            st.loss += self._router_part()
        params, grads = slot.views(unit)
        bind_parameters(ad.skeleton.model, {"norm.weight": params["norm.weight"]})
        rt.begin_grads(slot)
        if ad.tied:  # the matrix lives in the embedding's slot; its gradient starts there
            eslot = rt.slots[self._embed_slot[0]][self._embed_slot[1]]
            if self._by_rows:  # (the whole matrix, loaded over the rows the forward took)
                rt.wait_loaded(eslot)
            rt.begin_grads(eslot)
            (eparams, egrads) = eslot.views(ad.embed_unit)
            w, gw = eparams["weight"], egrads[0]
            st.embed_grad_written = True
        else:
            w, gw = params["lm_head.weight"], grads[1]
            slot.grads[: unit.numel].zero_()  # the slot is shared with the embedding: clear the alignment gaps
        gnorm = grads[0]
        acc_n, acc_w = gnorm, gw
        sliced = self._head_slice is not None and self.cfg.tuning.loss_kernel == "fused"
        if gw.dtype != torch.float32:  # sum chunk gradients in fp32, cast once at the end
            acc_n = torch.empty_like(gnorm, dtype=torch.float32)
            # (sliced: an fp32 sum of one vocabulary slice at a time, inside sliced_head_loss)
            acc_w = gw if sliced else torch.empty_like(gw, dtype=torch.float32)
        if sliced:
            loss, ghs = sliced_head_loss([h.flatten(0, 1) for h in st.hidden], [mb.labels for mb in st.mbs],
                                         [mb.targets for mb in st.mbs], ad.head_norm, w, st.denom, self._loss_chunk,
                                         self._head_slice, acc_n, gw, softcap=ad.logit_softcap)
            st.loss += loss
            st.grad_hidden = [gh.view_as(h) for gh, h in zip(ghs, st.hidden)]
        else:
            # (the fused kernel takes the logits' scale on its input; the autograd head after the product, as HF)
            if self.cfg.tuning.loss_kernel == "fused":  # (one block for every chunk's logits, beside the sum above)
                block = logits_workspace(max(mb.input_ids.numel() for mb in st.mbs), w, self._loss_chunk)
                head_loss = partial(fused_head_loss, norm=ad.head_norm, softcap=ad.logit_softcap, workspace=block)
            else:
                head_loss = partial(chunked_head_loss, norm=ad.norm, logit_scale=ad.logit_scale,
                                    logit_divisor=ad.logit_divisor, softcap=ad.logit_softcap)
            for i, (h, mb) in enumerate(zip(st.hidden, st.mbs)):
                part, gh = head_loss(h.flatten(0, 1), mb.labels, weight=w, denom=st.denom, chunk=self._loss_chunk,
                                     grad_norm_weight=acc_n, grad_weight=acc_w, accumulate=i > 0, targets=mb.targets)
                st.loss += part
                st.grad_hidden.append(gh.view_as(h))
        if acc_n is not gnorm:
            gnorm.copy_(acc_n)
        if acc_w is not gw:
            gw.copy_(acc_w)
        if ad.tied and self._by_rows:
            self._send_head_gradient(st, eslot, gw)
        st.hidden = []
        self.activations.prefetch(ad.num_layers - 1)

    def _send_head_gradient(self, st: "_Step", slot, grad: torch.Tensor) -> None:
        """A tied embedding by rows (engine/embedding.py): the rows the step's tokens do not touch have the
        head's gradient as their whole gradient, complete now. It goes to the host at once, and their update
        runs while backward does; their part of the global norm is counted here, the touched rows' with
        their packed gradient after the embedding's backward."""
        unit = self.adapter.embed_unit.index
        st.rows_device = st.rows.to(self.device, non_blocking=True)
        per_row = torch.linalg.vector_norm(grad, dim=1, dtype=torch.float32)
        st.norms.append(torch.linalg.vector_norm(per_row.index_fill_(0, st.rows_device, 0)))
        sent = self.runtime.send_grads(unit, slot)
        self.runtime.updates.submit(UpdateJob(unit, sent, st.index, self.lr, 1.0, rest=self._untouched(st)))

    def _head_value(self, st: "_Step", unit, slot) -> None:
        """The loss head's forward alone (evaluation): the loss, no gradient."""
        ad, rt = self.adapter, self.runtime
        params = slot.views(unit)[0]
        bind_parameters(ad.skeleton.model, {"norm.weight": params["norm.weight"]})
        eslot = rt.slots[self._embed_slot[0]][self._embed_slot[1]]
        if ad.tied:  # the matrix lives in the embedding's slot
            w = eslot.views(ad.embed_unit)[0]["weight"]
        else:
            w = params["lm_head.weight"]
        if self.router_loss is not None:  # (every layer's routing counted by now)
            st.loss += self._router_part()
        for h, mb in zip(st.hidden, st.mbs):
            st.loss += head_loss_value(h.flatten(0, 1), mb.labels, ad.norm, w, st.denom, self._loss_chunk,
                                       targets=mb.targets, logit_scale=ad.logit_scale,
                                       logit_divisor=ad.logit_divisor, softcap=ad.logit_softcap)
        if ad.tied:  # (no embedding visit follows in evaluation: the slot's next load waits for this read)
            rt.end_read(eslot)
        st.hidden = []

    def _bwd(self, st: "_Step", unit, slot) -> None:
        layer = self.adapter.layers[unit.layer]
        params, grads = slot.views(unit)
        bind_parameters(layer, params)
        inputs = self.activations.take(unit.layer)
        self.activations.prefetch(unit.layer - 1)  # one layer ahead: it lands while this layer computes
        n = len(st.mbs)
        inputs, mids = inputs[:n], inputs[n:] or [None] * n
        self.runtime.begin_grads(slot)
        plist = list(params.values())
        # Each parameter's gradient is added into the slot as soon as it is computed (the .grad of a slot's
        # parameters is its gradient view: autograd adds there, and the recompute's linears add their
        # weight's within the GEMM), so a layer's gradient never exists twice on the GPU; micro-batches sum
        # there too.
        torch._foreach_zero_(grads)
        for p, g in zip(plist, grads):
            p.grad = g
        kept = st.kept.pop(unit.layer, [None] * len(st.mbs))
        for i, (x, mb) in enumerate(zip(inputs, st.mbs)):
            x = x.detach().requires_grad_(True)
            # (not with token-chunked MLPs: their checkpoints recompute the projection in backward)
            with torch.enable_grad(), self.recompute.active(self.mlp_chunking.tokens is None, kept[i], mids[i]), \
                    (self.router_loss.recording(self._token_mask(mb)) if self.router_loss is not None
                     else contextlib.nullcontext(lambda: None)) as router_term:
                y = self._run_layer(layer, unit.layer, x, mb)
                term = router_term()
            kept[i] = mids[i] = None  # (what the recompute took is the graph's now, freed with it)
            outs, grads = ([y], [st.grad_hidden[i]]) if term is None else ([y, term], [st.grad_hidden[i], None])
            torch.autograd.backward(outs, grads, inputs=[x] + plist)
            st.grad_hidden[i] = x.grad

    def _embed_bwd(self, st: "_Step", unit, slot) -> None:
        # Only the batch's rows have a gradient: each is summed in fp32 over its occurrences (sorted,
        # deterministic) into a [unique ids, H] block, then added into the slot. No [vocab, H] temporary,
        # and no weights needed (with an untied head the slot holds the head's by now).
        # By rows (engine/embedding.py) the sum is a packed block of the step's rows instead; tied, it starts
        # from their head gradient, and takes the slot once the head's whole gradient has left it.
        grad = slot.views(unit)[1][0]
        packed = slot.grads[: st.rows.numel() * self._row_length].view(-1, self._row_length)
        if self._by_rows and self.adapter.tied:
            rows = grad.index_select(0, st.rows_device)
            self._add_embedding_gradient(st, rows)
            self.runtime.begin_grads(slot)
            packed.copy_(rows)
            return
        self.runtime.begin_grads(slot)
        if self._by_rows:
            grad = packed
            grad.zero_()
        elif not st.embed_grad_written:  # (tied: the head's part of this matrix's gradient is already there)
            slot.grads[: unit.numel].zero_()  # the alignment padding too: the head's gradient was here
        self._add_embedding_gradient(st, grad)

    def _add_embedding_gradient(self, st: "_Step", grad: torch.Tensor) -> None:
        """Each micro-batch's rows' gradient into ``grad``: the embedding's [vocab, H], or by rows the step's
        rows packed."""
        pad = self.adapter.padding_idx
        for mb, gh in zip(st.mbs, st.grad_hidden):
            rows, where, index, _ = mb.rows
            gh = self.adapter.embed_scaled(gh)  # (the scale's backward)
            g = torch.ops.aten.embedding_dense_backward(gh.flatten(0, 1), where, rows.numel(), -1, False)
            if pad is not None:
                g.masked_fill_((rows == pad)[:, None], 0)
            grad.index_add_(0, index, g)
        st.grad_hidden = []

    def _gradient_done(self, st: "_Step", unit: int, slot) -> None:
        """The unit's gradient is complete on the GPU: send it to the host, queue its update."""
        rows = Rows(st.rows, self._row_length, True) \
            if self._by_rows and unit == self.adapter.embed_unit.index else None
        n = self.adapter.units[unit].numel if rows is None else rows.ids.numel() * rows.length
        owned = True
        if self.ranks is not None:  # the sum over the ranks: on every rank for a GPU unit, else on its owner
            owner = self._owner[unit]
            if unit in self.resident:
                parallel.sum_all(slot.grads[:n])
            else:
                parallel.reduce_to(slot.grads[:n], owner)
            owned = owner == self.ranks.rank
        if owned:  # (each unit's norm counted once over the ranks)
            st.norms.append(grad_norm(slot.grads[:n]))
        if unit in self.resident:  # updated on the GPU, in stream order (on every rank alike)
            if self.cfg.max_grad_norm is None:
                self.runtime.resident.update(unit, st.index, self.lr, 1.0)
            else:
                st.finished.append((unit, None))
            return
        if not owned:  # another rank's unit: its owner sends the gradient and updates it
            return
        if unit == self._gpu_first:
            if st.visiting:  # its state is on the GPU by now (``fetch``)
                if self.cfg.max_grad_norm is None:
                    self.runtime.visiting.update(slot, st.index, self.lr, 1.0)
                else:
                    st.finished.append((unit, None))
                    st.visiting_slot = slot
                return
            self.runtime.visiting.synchronize()  # (a CPU update reads the host state a visit wrote back)
        sent = self.runtime.send_grads(unit, slot, rows)
        if self.cfg.max_grad_norm is None:
            self.runtime.updates.submit(UpdateJob(unit, sent, st.index, self.lr, 1.0))
        elif (spare := self.runtime.updates.reserve_spare(unit)) is not None:  # before the norm: speculative
            self.runtime.updates.submit(UpdateJob(unit, sent, st.index, self.lr, 1.0, spare=spare))
        else:
            st.finished.append((unit, sent))

    def _untouched(self, st: "_Step") -> Rows:
        return Rows(st.rows, self._row_length, False)

    def _place(self, batch) -> list[dict]:
        """Split the step into the planner's micro-batches and set which layer inputs are offloaded."""
        items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
        if not all(isinstance(it, Mapping) and "input_ids" in it and not any(misspelt(k, it) for k in it)
                   for it in items):
            return items  # malformed: _prepare says what is wrong, every rank together
        try:
            ids = [as_tensor(it["input_ids"], "", "") for it in items]
        except BatchError:
            return items  # (refused there too)
        if any(t.dim() not in (1, 2) or not t.numel() for t in ids):
            return items
        shapes = [(1, t.shape[0]) if t.dim() == 1 else tuple(t.shape) for t in ids]
        key = (sum(s[0] for s in shapes), max(s[1] for s in shapes))
        if key not in self._placements:
            self._placements[key] = fit(self.shape, *key, self._limit, Layout.of(self.cfg))
        p = self._placements[key]
        n = self.adapter.num_layers
        self._visits_now = self._gpu_first is not None and p.gpu_first_update
        if self._gpu_first is not None and not self._visits_now:  # (this plan has no room for a held state)
            self.runtime.visiting.release()
        self.activations.offload_layers = set(range(max(0, n - p.gpu_activation_layers)))
        self.mlp_chunking.tokens = p.mlp_chunk_tokens
        self._saved = self._last_layers(saved_layers(self.shape, p))
        self._mids = self._first_mids(p)
        self._loss_chunk = p.loss_chunk_tokens or LOSS_CHUNK_TOKENS[-1]
        self._head_slice = p.head_slice
        out = []
        for it, (rows, _) in zip(items, shapes):
            try:
                given = {k: _as_rows(it[k]) for k in KEYS if it.get(k) is not None}  # (what _prepare reads, no more)
            except (ValueError, TypeError, RuntimeError):
                return items  # (refused there)
            if any(v.dim() == 0 for v in given.values()):
                return items  # (no rows: refused there too)
            full = tuple(given["input_ids"].shape)
            if any(tuple(v.shape) != full and not (k == "position_ids" and tuple(v.shape) == (1, *full[1:]))
                   for k, v in given.items()):
                return items  # (shapes that do not match: refused there as given, not sliced to fit)
            pos = given.get("position_ids")
            if pos is not None and pos.dim() == 2 and pos.shape[0] == 1:  # one row for all: for each row
                given["position_ids"] = pos.expand(rows, -1)
            for start in range(0, rows, p.micro_batch):
                # (split as given, never reshaped: a tensor of another shape reaches _prepare's check as one)
                out.append({k: v[start: start + p.micro_batch] for k, v in given.items()})
        return out

    def _first_mids(self, p: Layout) -> frozenset[int]:
        """The layers that offload their residual sum after attention beside their input: as many of the
        first offloaded ones as placement ``p`` counts (plan/memory.py ``mid_layers``: none with token-chunked
        MLPs, whose recompute would not take them, nor for inputs on the disk), but for saved layers and
        those whose forward cannot take it back (model/recompute.py ``mid_projection``)."""
        return frozenset(i for i in sorted(self.activations.offload_layers)[:mid_layers(self.shape, p)]
                         if i not in self._saved and mid_projection(self.adapter.layers[i]) is not None)

    def _last_layers(self, k: int) -> frozenset[int]:
        n = self.adapter.num_layers
        return frozenset(range(n - min(k, n), n))

    @staticmethod
    def _token_mask(mb: MicroBatch) -> torch.Tensor:
        """Which of the micro-batch's tokens count in the load-balancing loss, flat (transformers: those its
        attention_mask keeps; all of them without one)."""
        if mb.attention_mask is None:
            return torch.ones(mb.input_ids.numel(), device=mb.input_ids.device)
        return mb.attention_mask.reshape(-1)

    def _router_part(self) -> torch.Tensor:
        """The load-balancing loss over the global batch (every rank's routing counts summed), as this rank's
        share of the step's loss: the loss is summed over the ranks."""
        if self.ranks is None:
            return self.router_loss.loss()
        self.router_loss.combine(parallel.sum_all)
        return self.router_loss.loss() / self.ranks.world

    def _run_layer(self, layer, index: int, h: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        kind = self.adapter.layer_attention_type(index)
        out = layer(h, attention_mask=mb.masks[kind], position_ids=mb.position_ids,
                    position_embeddings=mb.rope[kind])
        return out[0] if isinstance(out, tuple) else out

    def _prepare(self, batch) -> tuple[list[MicroBatch], int, torch.Tensor]:
        """The step's micro-batches, checked on the host (data/batches.py), then on their way to the device;
        the step's target tokens (the loss's denominator), over every rank's part of it; and the embedding
        rows its tokens touch."""
        cfgm = self.adapter.config
        check = partial(check_step, batch, cfgm.vocab_size, getattr(cfgm, "max_position_embeddings", None),
                        flash=self.adapter.attn_implementation.startswith("flash"))
        if self.ranks is None:
            host, denom = check()
        else:  # every rank learns whether any rank's part was refused, and the global batch's target count
            err, host, denom = None, [], 0
            try:
                host, denom = check(some_targets=False)
            except BatchError as e:
                err = e
            total, refused = parallel.sum_all(torch.tensor([float(denom), float(err is not None)],
                                                           dtype=torch.float64, device=self.device)).tolist()
            if refused:
                raise err or BatchError("another rank's part of this step was refused: its own message says why")
            if total == 0:
                raise BatchError("every label in the step is ignored (-100): there is nothing to train on")
            denom = int(total)
        dev, mbs = self.device, []
        touched, per = step_rows([h.input_ids for h in host])  # (on the host: no GPU sync)
        for h, (rows, where, place) in zip(host, per):
            S = h.input_ids.shape[1]
            rows = rows.to(dev, non_blocking=True)
            by_rows = (place.to(dev, non_blocking=True), place[where].view_as(h.input_ids).to(dev, non_blocking=True)) \
                if self._by_rows else (rows, None)
            mbs.append(MicroBatch(
                rows=(rows, where.to(dev, non_blocking=True), *by_rows),
                input_ids=h.input_ids.to(dev, torch.long, non_blocking=True),
                labels=h.labels.reshape(-1).to(dev, torch.long, non_blocking=True),
                targets=(h.labels != -100).reshape(-1).cpu(),
                attention_mask=None if h.attention_mask is None else h.attention_mask.to(dev, non_blocking=True),
                position_ids=torch.arange(S, device=dev).unsqueeze(0) if h.position_ids is None
                else h.position_ids.to(dev, non_blocking=True),
                packed=h.position_ids is not None,
            ))
        return mbs, denom, touched

    @_one_caller("synchronize")
    def synchronize(self) -> None:
        """Wait for every pending update."""
        self.runtime.synchronize()

    @_one_caller("read the weights")
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face-named fp32 master weights (views of RAM; copies for compact state and for units
        trained on the GPU), after pending updates. Under several ranks: the units this rank owns.
        The views are of this step's buffers: a later speculative update may hand the unit other ones
        (host/store.py ``adopt``), so copy what is kept."""
        self.synchronize()
        return {k: v for u in self.adapter.units if self.store.owns(u.index)
                for k, v in self.store.unit_params(u.index).items()}

    def nonfinite_weight(self) -> str | None:
        """The first parameter of this rank's units whose master holds NaN or infinity (a unit at a time),
        after pending updates, or None: why a step before any update was not finite (a model file holding
        them)."""
        self.synchronize()
        for u in self.adapter.units:
            if self.store.owns(u.index):
                bad = next((k for k, v in self.store.unit_params(u.index).items() if not bool(torch.isfinite(v).all())),
                           None)
                if bad is not None:
                    return bad
        return None

    @_one_caller("save")
    def save_pretrained(self, out: str | os.PathLike, dtype: torch.dtype | None = None):
        """Write a Hugging Face checkpoint (config + safetensors, and the source folder's generation_config.json
        for an engine made by ``from_pretrained``) that from_pretrained loads. Under several ranks every rank
        calls it, and each writes the files of the units it owns."""
        dtype = self.cfg.compute_dtype if dtype is None else float_dtype(dtype, "save_pretrained's dtype")
        if ckpt_state.is_checkpoint_dir(Path(out)):
            raise CheckpointError(f"{out} is a slideformer checkpoint: Hugging Face files written into it would no "
                                  "longer match its checksums; choose another folder")
        self.synchronize()
        if self.ranks is None:
            return export.save_pretrained(out, self.adapter, self.store, dtype, source=self._source)
        err, staged, rank = None, [], self.ranks.rank
        try:
            staged = export.stage_pretrained(out, self.adapter, self.store, dtype, self._owner, rank)
        except BaseException as e:
            err = e
        try:  # (a rank that failed to write stops every rank, with its error, before any file is replaced)
            parallel.together(err)
        except BaseException:
            export.drop_staged(staged)
            raise
        # (one rank's rename failing puts back every rank's: the folder keeps one export whole)
        return export.place_pretrained(out, self.adapter, dtype, staged, self._owner, rank, self._source,
                                       agree=parallel.together)

    def profile(self, reset: bool = True, timeline: bool = False) -> dict:
        """Seconds per category since the last call (needs ``tuning=Tuning(profile=True)``); with
        ``timeline``, also each record (engine/profile.py) under the key "timeline"."""
        prof = self.runtime.profiler
        if not prof.enabled:
            raise RuntimeError("profiling is off: construct the engine with EngineConfig(tuning=Tuning(profile=True))")
        self.synchronize()
        self.runtime.copier.synchronize()
        out = prof.summary()
        if timeline:
            out["timeline"] = prof.timeline()
        if reset:
            prof.reset()
        return out

    @_one_caller("save")
    def save_checkpoint(self, path: str | os.PathLike, trainer_state: dict | None = None,
                        dtype: torch.dtype | None = None, extra=None):
        """Hugging Face weights plus the full training state, written atomically (checkpoint/state.py);
        ``extra(folder)`` adds files (a tokenizer) before the checkpoint is sealed. Under several ranks every
        rank calls it (with the same arguments): one checkpoint, each rank writing its units."""
        dtype = self.cfg.compute_dtype if dtype is None else float_dtype(dtype, "save_checkpoint's dtype")
        if trainer_state is not None and not isinstance(trainer_state, dict):
            raise ConfigError(f"save_checkpoint: trainer_state must be a dict, got {type(trainer_state).__name__}")
        state = {"lr": self.lr, **(trainer_state or {})}
        learning_rate(state["lr"], "save_checkpoint: trainer_state's lr (the rate load_checkpoint sets)")
        try:  # (it goes into trainer.json: refused before anything is written)
            json.dumps(state, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"save_checkpoint: trainer_state must be JSON (numbers, text, lists, dicts; finite): "
                              f"{e}") from None
        self.synchronize()
        return ckpt_state.save_checkpoint(path, self.adapter, self.store, dtype, state,
                                          extra, ranks=self.ranks, owner=self._owner if self.ranks else None)

    @_one_caller("load a checkpoint")
    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore a checkpoint written by save_checkpoint (by any number of ranks); returns the trainer state
        saved with it. Under several ranks every rank calls it and reads the units it keeps."""
        self.synchronize()
        state = ckpt_state.load_checkpoint(path, self.adapter, self.store, self.ranks,
                                           check=lambda st: learning_rate(st.get("lr", self.lr), f"{path}: its lr"))
        if self.runtime.visiting is not None:
            self.runtime.visiting.release()
        self.lr = float(state.get("lr", self.lr))  # (checked above)
        return state

    def describe(self) -> str:
        """One line on where the model trains: what a user should see once at start."""
        ad, n = self.adapter, self.adapter.num_layers
        layers = sum(1 for u in self.resident if ad.units[u].kind == "layer")
        edges = ad.embed_unit.index in self.resident and layers < n
        p = ad.num_params
        size = f"{p / 1e9:.2f} B" if p >= 1e9 else f"{p / 1e6:.1f} M" if p >= 1e6 else f"{p / 1e3:.1f} K"
        kept = "all layers" if layers == n else f"the first {layers} of {n} layers" if layers else f"0 of {n} layers"
        threads = self.cfg.tuning.optimizer_threads or native.default_threads()
        parts = [f"{size} params, {str(self.cfg.compute_dtype).replace('torch.', '')} on {self.device}",
                 f"trained on the device: {kept}{' + embedding and head' if edges else ''}",
                 f"streamed: {n - layers} layers through {self.cfg.placement.window_slots} slots"
                 + (" (the first one's update on the device)" if self._gpu_first is not None else ""),
                 f"fused ops {self.fused_ops}" + (" (Liger-Kernel is not installed: unfused RMSNorm, RoPE and SwiGLU "
                                                  "make the layers about a third slower; pip install liger-kernel)"
                                                  if self._liger_missing else ""),
                 f"CPU AdamW {self.runtime.updates.backend} on {threads} thread{'s' * (threads != 1)}, "
                 f"{self.cfg.optimizer_state} state"]
        staged = len(self.store.staged - {self._gpu_first})
        if staged:  # RAM-bound choices, which cost time: said where they were made
            every = staged == len(ad.units) - len(self.resident)
            parts.append("no bf16 host copy: the fp32 master crosses PCIe" if every else
                         f"no bf16 host copy for the last {staged} layer{'s' * (staged != 1)}: their fp32 master "
                         "crosses PCIe")
        ring = self.store.host_grad_buffers
        if ring < n - layers:
            parts.append(f"{ring} gradient buffer{'s' * (ring != 1)} for {n - layers} streamed layers")
        if self.cfg.max_grad_norm is not None and layers < n:  # clipping: how much of the update waits for the norm
            spec = len(self.store.spares)
            parts.append(f"clipping: {spec} of {n - layers} streamed layers updated before the global norm"
                         if spec else "clipping: the CPU update waits for the global norm")
        if self.store.tier is not None:
            tier = self.store.tier.numels
            read = sum(self.store.weights_on_tier(u) for u in tier)
            parts.append(f"NVMe tier: the last {len(tier)} layers' moments"
                         + (" and master" if self.store.nvme_master else "")
                         + (f", {'their' if read == len(tier) else f'{read} of them their'} weights read from disk"
                            if read else ""))
        if self._limit:
            parts.append(f"GPU budget {fmt_bytes(self._limit)}")
        return "; ".join(parts)

    def memory_report(self) -> dict[str, int]:
        rep = {f"host_{k}": v for k, v in self.store.bytes_by_category().items()}
        rep["host_activations"] = self.activations.host_bytes
        rep["nvme_disk"] = 0 if self.store.tier is None else self.store.tier.disk_bytes
        rep["nvme_activations"] = self.activations.disk_bytes
        rep["gpu_window"] = self.runtime.gpu_bytes()
        return rep

    def close(self, abort: bool = False) -> None:
        """Release threads, pinned memory and tier files; ``abort`` after a failure (see Runtime.close). Once
        closed, the engine refuses work; closing again does nothing."""
        if self._closed:
            return
        if not self._caller.acquire(blocking=False):
            raise RuntimeError("cannot close: another thread is using this engine; close it from that thread, or "
                               "once its call returns")
        self._closed = True
        self._caller.release()  # (closed: every later call is refused)
        try:
            self.runtime.close(abort)
        finally:  # files and pinned memory go back even if the runtime's last wait failed
            try:
                self.activations.close()
            finally:
                self.store.close()

    def __enter__(self) -> "SlideEngine":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(abort=exc_type is not None)
