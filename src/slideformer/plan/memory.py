"""GPU and host bytes of a training step, and the placement that fits a GPU budget.

The GPU peak is modelled as

    window slots + saved layer inputs kept on the GPU + saved layers' products
    + the hidden state and its gradient + max(loss head, one layer's backward)

where the loss head holds an fp32 accumulator for the [vocab, hidden] gradient and one chunk of logits
(the fused kernel: 4 bytes per logit, the chunk becoming its own gradient and the lm_head gradient's
addmm copying it, plus the final norm's buffers;
the autograd head: 16 bytes per logit and a bf16 chunk gradient of [vocab, hidden]), and a layer's
backward holds about 10 x ffn + 6 x hidden bf16 values per token of the micro-batch (HF's MLP keeps
gate, up, act and product and their gradients; the norms upcast to fp32) plus one weight's gradient.
The window counts one slot for an untied model's embedding and head (they share it). The constants
are fitted to the H200's max_memory_allocated of Qwen3-4B at batch 8 and 32 and Llama-3.1-8B at batch 8,
both loss heads, 2 and 3 slots: the model is at most 10% above each measurement, never below
(tests/test_plan.py), and so it stays at the tight caps of bench/cases.yaml ``footprint``, measured since
a layer's gradient accumulates per parameter in its slot (engine.py ``_bwd``: one weight's gradient in
flight, not a second copy of the layer's). Where the fp32 lm_head accumulator leaves no plan, or only
micro-batches under EFFICIENT_TOKENS, the fused head sums that gradient by vocabulary slices
(``head_slice``, ``loss_head_bytes``).

Micro-batches are free in this engine (weights cross PCIe once per step however many there are), so
the planner bounds a layer's backward by splitting the batch, and keeps as many layer inputs on the
GPU as the budget allows, offloading the rest: it prefers micro-batches of at least EFFICIENT_TOKENS
tokens (matmuls at full speed), then of up to LARGE_TOKENS (``prefer_tokens``: each micro-batch still
costs GPU time beyond its FLOPs), then the most layer inputs on the GPU (less pinned host memory and PCIe
traffic), then the largest micro-batch; what the GPU still has left keeps saved layers' products (no
matmul in their recompute), and where the resolver allows pinned RAM for it (``host_input_bytes``), the
first layers' inputs go there to keep more of them. Where even one sequence does not fit, the MLPs run in token
chunks (model/chunked_mlp.py; one more MLP forward per layer).
"""
from __future__ import annotations

import math
import re
import dataclasses
from dataclasses import dataclass

from ..machine import MachineRates
from ..optim.formats import BLOCK8, compact_master, moment_bytes, state_bytes

LAYER_TOKEN_FFN = 10  # bf16 values per token per ffn unit at the peak of a layer's backward
LAYER_TOKEN_HIDDEN = 6
LAYER_FORWARD_FFN = 3  # a layer's forward, per token: gate, up and their product per ffn unit,
LAYER_FORWARD_HIDDEN = 8  # and the attention's q, k, v, output and the norms' per hidden unit
LOGIT_BYTES = {"torch": 16,  # bf16 logits, fp32 copy, fp32 log-softmax, fp32 gradient (x1 each), bf16 gradient
               "fused": 4}  # one bf16 block for every chunk, which becomes its own gradient in place
# (engine/loss.py logits_workspace), counted twice: room for the allocator beside the head's largest blocks
# the fused head runs the final norm on the whole micro-batch: its normed output, fp32 saved input and
# the gradients around it (the autograd head's share of these was fitted into LOGIT_BYTES)
HEAD_TOKEN_HIDDEN = {"torch": 0, "fused": 8}
HEAD_GRAD_BYTES = {"torch": 6,  # per lm_head element: the fp32 accumulator and autograd's bf16 chunk gradient
                   "fused": 4}  # the fp32 accumulator only (cuBLAS adds into it)
SAFETY = 1.05  # allocator rounding and what the model leaves out
# the first layer's GPU-updated state on its way back in the forward (d2h), beside the CPU's update of the
# embedding's untouched rows and the loads: measured about 23 GB/s at Llama-3.1-8B b32 under 11.5 GiB
BACK_BYTES_PER_S = 20e9
EFFICIENT_TOKENS = 8192
# Past EFFICIENT_TOKENS a micro-batch still saves GPU time: each one costs about 8e-12 s per layer parameter
# beyond its FLOPs (the kernels a layer launches per micro-batch, its weights read again), so fit() takes
# micro-batches up to this many tokens before it keeps more layer inputs or saved layers on the GPU
LARGE_TOKENS = 16384
# the FP8 products' speed over bf16's (forward, input and weight gradients), their casts included: fitted to the
# measured step of Llama-3.1-8B b32 on the whole card (tests/test_plan.py); the FP8 GEMMs alone run about 1.8x
FP8_SPEEDUP = 1.26
# the loss head's products in chunks of half as many tokens, under 4096, over those in twice as large ones:
# each chunk's lm_head gradient reads and writes the whole fp32 accumulator, and a chunk of fewer rows runs its
# GEMMs slower. Measured at Qwen3-4B b64 under 15.5 GiB, 2048- against 4096-token chunks (1.12); Llama-3.1-8B
# b32 under 11.5 GiB, 1024 against 2048, about 1.08
SMALL_HEAD_CHUNK_COST = 1.12
MLP_CHUNK_TOKENS = (4096, 1024, 256)  # tried in turn where one sequence's layer backward does not fit
LOSS_CHUNK_TOKENS = (8192, 4096, 2048, 1024)  # the loss head's chunk: the largest that fits is taken
HEAD_SLICE_ROWS = 8192  # vocabulary rows per fp32 sum of the lm_head gradient, where the whole one does not fit


class DoesNotFit(ValueError):
    """No placement fits the budget; the message gives the largest batch that would."""


MIN_SIZE = 2**20  # a size without its unit under this was not meant as bytes; a person's budget is never under it


def parse_bytes(x) -> int:
    """'24GiB', '24 GB', '512MiB', '1000000B' or a number of bytes, > 0. A number without a unit is bytes only
    from MIN_SIZE up as text (a YAML ``gpu_memory_limit: 24`` meant GB or GiB); an int is the library's bytes."""
    if isinstance(x, bool):
        raise ValueError(f"cannot read a memory size from {x!r}; write e.g. '24GiB' or '80GB'")
    if isinstance(x, (int, float)):
        if not math.isfinite(x):
            raise ValueError(f"a memory size must be finite, got {x!r}")
        n = int(x)
    else:
        m = re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*([KMGT]?)(i?)(B?)\s*", str(x), re.IGNORECASE)
        if not m:
            raise ValueError(f"cannot read a memory size from {x!r}; write e.g. '24GiB' or '80GB'")
        num, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
        n = int(num * (1024 if binary else 1000) ** " KMGT".index(unit or " "))
        if not unit and not m.group(4) and 0 < n < MIN_SIZE:
            raise ValueError(f"{x!r} has no unit; write e.g. '{m.group(1)}GiB' (or '{m.group(1)}B' for bytes)")
    if n <= 0:
        raise ValueError(f"a memory size must be > 0, got {x!r}")
    return n


def user_bytes(x) -> int:
    """A budget a person wrote (the trainer's config, the CLI's flags): ``parse_bytes``, at least MIN_SIZE."""
    n = parse_bytes(x)
    if n < MIN_SIZE:
        raise ValueError(f"{x!r} is under 1 MiB, too little for any model: a budget is a few GiB")
    return n


def fmt_bytes(n: float) -> str:
    """Bytes for a person: GiB from 1 GiB up, else MiB (a small model's figures are not all "0.0 GiB")."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    ffn: int
    vocab: int
    tied: bool
    layer_params: int  # padded numel of one decoder layer's flat buffer
    embed_params: int
    head_params: int  # final norm (+ lm_head when untied)
    kept_per_token: int = 0  # values a token of a saved layer keeps for backward (model/recompute.py)
    # the attention output projection's parameters, whose product a mid layer's recompute skips (model/recompute.py
    # mid_projection; 0 where the layers cannot keep their residual sum after attention)
    mid_params: int = 0
    # Mixture-of-Experts (model/moe.py): the experts a layer has (0: dense), the parameters a token passes
    # through (attention, router and its top-k experts; ``ffn`` is then those experts' intermediate size
    # summed), and the largest parameter (the 3-D experts tensor, whose gradient autograd makes whole)
    experts: int = 0
    active_params: int = 0
    largest_param: int = 0
    top_k: int = 0  # experts a token visits; each visit keeps its gathered input and its output ([tokens x k, H])
    # heads whose [seq x seq] scores eager attention keeps for backward (soft-capped attention: Gemma 2); 0: SDPA
    eager_heads: int = 0
    # data-parallel ranks the units are owned by (parallel.py): each keeps the host state of its own units
    # only, and updates them on its share of the CPU (host_bytes, step_time); the GPU's bytes do not change
    ranks: int = 1

    @property
    def params(self) -> int:
        return self.embed_params + self.layers * self.layer_params + self.head_params

    @property
    def flop_params(self) -> int:
        """The parameters of a layer one token multiplies by: all of them, or a MoE layer's active ones."""
        return self.active_params if self.experts else self.layer_params

    @property
    def down_params(self) -> int:
        """The output-free down projection's parameters (model/recompute.py): none in a MoE layer, whose
        experts are not an nn.Linear."""
        return 0 if self.experts else self.hidden * self.ffn

    @property
    def kept_params(self) -> int:
        """The parameters of the linears whose products a saved layer keeps: all but the down projection,
        or a MoE layer's attention (its experts are recomputed)."""
        return self.flop_params - (3 * self.hidden * self.ffn if self.experts else self.hidden * self.ffn)

    @classmethod
    def from_adapter(cls, adapter) -> "ModelShape":
        from ..model.moe import expert_params
        from ..model.recompute import kept_values_per_token, mid_projection

        c = adapter.config
        down = getattr(adapter.layers[0].mlp, "down_proj", None)  # (a config may name it otherwise, or not at all)
        dense_ffn = getattr(c, "intermediate_size", None) or getattr(down, "in_features", None) or c.hidden_size
        moe = {}
        if adapter.experts:  # (a model may mix in dense layers: the first with experts stands for them)
            layer = next(m for m in adapter.layers if expert_params(m, adapter.experts))
            per_expert = expert_params(layer, adapter.experts) // adapter.experts
            numel = sum(p.numel() for p in layer.parameters())
            ffn = adapter.top_k * (getattr(c, "moe_intermediate_size", None) or dense_ffn)
            moe = dict(experts=adapter.experts, ffn=ffn, top_k=adapter.top_k,
                       active_params=numel - (adapter.experts - adapter.top_k) * per_expert,
                       largest_param=max(p.numel() for m in adapter.layers for p in m.parameters()))
        if adapter.attn_implementation == "eager":
            moe["eager_heads"] = c.num_attention_heads
        return cls(**{**dict(layers=adapter.num_layers, hidden=c.hidden_size, ffn=dense_ffn,
                             vocab=c.vocab_size, tied=adapter.tied,
                             layer_params=max(u.numel for u in adapter.units if u.kind == "layer"),
                             embed_params=adapter.embed_unit.numel, head_params=adapter.head_unit.numel,
                             kept_per_token=max(kept_values_per_token(layer) for layer in adapter.layers),
                             mid_params=min(o.weight.numel() if o is not None else 0
                                            for o in map(mid_projection, adapter.layers))), **moe})


def replace(obj, **changes):
    """``dataclasses.replace``; a Layout's copy without its __init__ (fit() makes hundreds of thousands of them
    when `slideformer plan` counts batches), its fields checked by name."""
    if type(obj) is not Layout:
        return dataclasses.replace(obj, **changes)
    if not changes.keys() <= _LAYOUT_FIELDS:
        raise TypeError(f"Layout has no field {sorted(changes.keys() - _LAYOUT_FIELDS)[0]!r}")
    new = object.__new__(Layout)
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class Layout:
    window_slots: int = 3
    micro_batch: int = 1 << 30  # sequences per micro-batch (capped at the batch)
    gpu_activation_layers: int = 1 << 30  # layer inputs kept on the GPU (the last ones); the rest offloaded
    loss_chunk_tokens: int | None = None  # None: fit() chooses (LOSS_CHUNK_TOKENS); counted as the smallest
    resident_layers: int = 0  # decoder layers trained on the GPU (all of them: embedding and head too)
    loss_kernel: str = "fused"
    resident_edges: bool = False  # embedding and head trained on the GPU, whatever the layers do
    mlp_chunk_tokens: int | None = None  # a layer's MLP in token chunks (model/chunked_mlp.py)
    # the fused head's lm_head gradient summed in fp32 by slices of this many vocabulary rows (engine/loss.py
    # sliced_head_loss): no [vocab, hidden] fp32 accumulator, for one more head product a step
    head_slice: int | None = None
    # GPU bytes per resident parameter besides its bf16 weights and gradient: fp32 master and moments (12),
    # or for compact state the master's bf16 lo half and bf16 moments (6), for 8-bit state 4.06, counted as 5
    resident_state_bytes: int = 12
    # the last layers keep their linears' outputs for backward, whose recompute then runs no matmul for them
    # (model/recompute.py); fit() fills what the GPU has left with them
    saved_layers: int = 0
    # the first offloaded layers also offload their residual sum after attention, whose recompute then skips
    # the attention's output projection (model/recompute.py); the resolver's call (``mid_layers_that_pay``)
    mid_layers: int = 0
    compute_bytes: int = 2  # the compute dtype's: fit() models bf16 and fp16 (fp32 compute keeps no saved layers)
    # pinned host bytes fit() may give layer inputs whose GPU memory then keeps more saved layers' products
    # (the resolver's call, from the RAM left and the time model: ``displace_inputs``)
    host_input_bytes: int = 0
    # micro-batches grow up to this many tokens before more layer inputs or saved layers stay on the GPU
    prefer_tokens: int | None = None  # None: LARGE_TOKENS
    fp8: bool = False  # the layers' linears in FP8: the visited layer's weights keep two e4m3 casts (model/fp8.py)
    min_gpu_inputs: int = 0  # fit() keeps at least this many layer inputs on the GPU where any placement does
    # the first streamed layer's fp32 state on the GPU around the step boundary (Placement.gpu_first_update);
    # fit() keeps it only where it fits beside what it chose without it
    gpu_first_update: bool = False

    @classmethod
    def of(cls, cfg, **kw) -> "Layout":
        """The parts an EngineConfig fixes; the planner chooses the rest (or ``kw`` sets them)."""
        if cfg.placement.offload_activations:  # without a budget the config's own split holds (fit() replaces it)
            kw.setdefault("gpu_activation_layers", cfg.placement.gpu_activation_layers)
        return cls(window_slots=cfg.placement.window_slots, loss_chunk_tokens=cfg.tuning.loss_chunk_tokens,
                   resident_layers=cfg.placement.resident_layers, loss_kernel=cfg.tuning.loss_kernel,
                   resident_edges=cfg.placement.resident_edges, mlp_chunk_tokens=cfg.tuning.mlp_chunk_tokens,
                   resident_state_bytes=resident_state_bytes(cfg.optimizer_state),
                   saved_layers=cfg.placement.saved_layers,
                   # (offloaded inputs on the disk keep no sums: engine/activations.py)
                   mid_layers=0 if cfg.placement.activations_to_nvme else cfg.placement.mid_layers,
                   compute_bytes=cfg.compute_dtype.itemsize,
                   host_input_bytes=cfg.placement.host_input_bytes, prefer_tokens=cfg.placement.micro_batch_tokens,
                   fp8=cfg.fp8, min_gpu_inputs=cfg.placement.min_gpu_inputs,
                   gpu_first_update=cfg.placement.gpu_first_update, **kw)

    def edges_resident(self, shape: "ModelShape") -> bool:
        return self.resident_edges or self.resident_layers >= shape.layers


_LAYOUT_FIELDS = frozenset(f.name for f in dataclasses.fields(Layout))


def embedding_by_rows(shape: ModelShape, p: Layout, state: str = "fp32", clipping: bool = False) -> bool:
    """Whether the embedding's CPU update runs by rows, the rows a step did not touch apart from the others
    (engine/embedding.py): where it streams, on one rank (each rank's batch touches other rows), with 8-bit
    state on rows of whole blocks; tied, only without clipping (there the rows wait for the verdict either
    way, and the head's gradient would hold the unit's one host buffer until then)."""
    return not p.edges_resident(shape) and shape.ranks == 1 and (state != "8bit" or shape.hidden % BLOCK8 == 0) \
        and not (shape.tied and clipping)


def gpu_bytes(shape: ModelShape, batch: int, seq: int, p: Layout, dtype_bytes: int = 2) -> dict[str, int]:
    T = batch * seq
    t = min(batch, p.micro_batch) * seq
    kept = min(shape.layers, p.gpu_activation_layers)
    H = shape.hidden
    k = min(p.resident_layers, shape.layers)
    edges = p.edges_resident(shape)
    # untied: the head's weights take the embedding's slot (window/schedule.py); tied: the head slot holds the norm
    edge = shape.embed_params + shape.head_params if shape.tied else max(shape.embed_params, shape.head_params)
    streamed_slots = (0 if edges else edge) + min(p.window_slots, shape.layers - k) * shape.layer_params
    resident = k * shape.layer_params + (shape.embed_params + shape.head_params if edges else 0)
    out = {
        # slots hold bf16 weights and gradients; a resident unit adds its optimizer state
        "window": 2 * dtype_bytes * (streamed_slots + resident) + p.resident_state_bytes * resident
        + (2 * shape.layer_params if p.fp8 else 0),
        "activations": kept * T * H * dtype_bytes,
        "saved_products": saved_layers(shape, p) * T * shape.kept_per_token * dtype_bytes,
        "hidden_flow": 2 * T * H * dtype_bytes,
        "loss_head": loss_head_bytes(shape, T, t, p, dtype_bytes),
        # (the first layer backward meets, the last, is a saved one if any is: its gate and up are kept products)
        "layer_backward": (min(t, p.mlp_chunk_tokens or t) * ((LAYER_TOKEN_FFN - 2 * bool(saved_layers(shape, p)))
                                                               * shape.ffn + 2 * shape.top_k * H)
                           + t * LAYER_TOKEN_HIDDEN * H) * dtype_bytes
                          + (shape.largest_param or H * shape.ffn) * dtype_bytes  # + one weight's gradient in flight
                          # mid layers: a layer's sums after attention, and the next one's fetched beside its
                          # inputs (in the offloaded layers' backward only: never beside the loss head)
                          + (2 * T * H * dtype_bytes if mid_layers(shape, p) else 0)
                          # fp8: the widest linear's operands in e4m3 while its gradients are made, a byte a value:
                          # g's rows and columns, x's columns (token-chunked MLPs' backward runs plain linears)
                          + (t * (2 * shape.ffn + H) if p.fp8 and not p.mlp_chunk_tokens else 0)
                          # eager attention's scores and their softmax, kept for backward (about 16 bytes an entry)
                          + min(batch, p.micro_batch) * shape.eager_heads * seq * seq * 16,
    }
    # The first streamed layer (k)'s state on the GPU (Placement.gpu_first_update) from the visit before its
    # backward into the next forward: kept inputs and saved products are the last layers', so of them only
    # layers 0..k's are alive then (in backward not yet spent, in the next forward already made); at least
    # two layers' inputs (its own and the one restored for the next backward), and a layer's backward.
    first = first_on_gpu(shape, p)
    out["first_update"] = 12 * shape.layer_params if first else 0
    inputs = max(2, k + 1 - (shape.layers - kept))
    products = max(0, k + 1 - (shape.layers - saved_layers(shape, p)))
    beside_first = out["first_update"] + (inputs * H + products * shape.kept_per_token) * T * dtype_bytes \
        + out["layer_backward"]
    # In the next forward the state goes back over ``back_visits`` visits (from layer k's), and the copier lets
    # go of what it offloads in the order of the copies (engine/copier.py ``to_host``), so the inputs and a mid
    # layer's sums of those visits' layers wait with it, beside a layer's forward.
    offloaded, back = shape.layers - kept, back_visits(shape, p, T)
    held = min(back + 1, offloaded) * (2 if mid_layers(shape, p) else 1) \
        + max(0, k + back + 1 - offloaded)  # (kept inputs already made)
    forward_layer = (min(t, p.mlp_chunk_tokens or t) * LAYER_FORWARD_FFN * shape.ffn + t * LAYER_FORWARD_HIDDEN * H) \
        * dtype_bytes + min(batch, p.micro_batch) * shape.eager_heads * seq * seq * 16
    made = max(0, k + back + 1 - (shape.layers - saved_layers(shape, p)))  # (saved products already made)
    forward_first = out["first_update"] + (held * H + made * shape.kept_per_token) * T * dtype_bytes + forward_layer
    # (the embedding's backward, last, holds the hidden gradient, a micro-batch's rows and, by rows, a packed
    # block of at most T rows: under the loss head's share, which holds at least T x H values beside those)
    out["peak"] = int(SAFETY * (out["window"] + out["hidden_flow"] + max(
        out["activations"] + out["saved_products"] + max(out["loss_head"], out["layer_backward"]),
        max(beside_first, forward_first) if first else 0)))
    return out


def first_on_gpu(shape: ModelShape, p: Layout, nvme_layers: int = 0) -> bool:
    """Whether the first streamed layer is updated on the GPU (Layout.gpu_first_update), as the engine
    decides it: fp32 state, one process, a layer off the NVMe tier (the tier's are the last ones)."""
    k = min(p.resident_layers, shape.layers)
    return p.gpu_first_update and k < shape.layers - nvme_layers and p.resident_state_bytes == 12 \
        and shape.ranks == 1


def largest_batch(shape: ModelShape, seq: int, limit: int, base: Layout, most: int) -> int:
    """The largest batch of at most ``most`` whose least layout (``least_layout``) fits ``limit`` (0: none),
    by bisection: that layout's bytes grow with the batch, and a refusal may be asked of any batch."""
    def fits(b: int) -> bool:
        return gpu_bytes(shape, b, seq, least_layout(shape, b, seq, base))["peak"] <= limit

    lo, hi = 0, most  # (fits(lo) holds, or lo is 0; the answer lies in [lo, hi])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def back_visits(shape: ModelShape, p: Layout, tokens: int, rates: MachineRates = MachineRates()) -> int:
    """The forward visits after its own that the first layer's GPU-updated state (Layout.gpu_first_update)
    takes to go back to the host: its copy's time over a visit's, so that the compute stream's wait for the
    copy, where its memory goes back to the pool (engine/copier.py ``to_host``: at the end of the visit after
    that many), finds it done. Fewer tokens a step make shorter visits, so more of them (and the inputs
    offloaded meanwhile wait too); the state is let go by the end of the last layer's forward visit at the
    latest, never beside the loss head (``tokens``: the step's rows times their longest sequence, as fit()
    sizes it)."""
    copy = 12 * shape.layer_params / BACK_BYTES_PER_S
    visit = 2 * shape.flop_params * max(1, tokens) / rates.gpu_flops
    rest = shape.layers - min(p.resident_layers, shape.layers) - 2  # (the layers after it, less the one it ends)
    return max(0, min(math.ceil(copy / visit), rest))


def mid_layers(shape: ModelShape, p: Layout) -> int:
    """The layers whose residual sum after attention ``p`` offloads beside their input: of the offloaded
    ones (not saved ones), where the model's layers can take it back, never with token-chunked MLPs."""
    offloaded = shape.layers - min(shape.layers, p.gpu_activation_layers)
    if not shape.mid_params or p.mlp_chunk_tokens:
        return 0
    return max(0, min(p.mid_layers, offloaded, shape.layers - saved_layers(shape, p)))


def saved_layers(shape: ModelShape, p: Layout) -> int:
    """The layers whose products ``p`` keeps for backward (none with token-chunked MLPs, whose chunks
    recompute under their own checkpoints)."""
    return 0 if p.mlp_chunk_tokens else min(p.saved_layers, shape.layers)


def loss_head_bytes(shape: ModelShape, T: int, t: int, p: Layout, dtype_bytes: int = 2) -> int:
    """The loss head's GPU bytes beyond the window, for a step of ``T`` tokens in micro-batches of ``t``."""
    V, H = shape.vocab, shape.hidden
    chunk = min(p.loss_chunk_tokens or LOSS_CHUNK_TOKENS[-1], t)
    norm = HEAD_TOKEN_HIDDEN[p.loss_kernel] * t * H * dtype_bytes
    if p.head_slice is None or p.loss_kernel != "fused":
        return V * H * HEAD_GRAD_BYTES[p.loss_kernel] + chunk * V * LOGIT_BYTES[p.loss_kernel] + norm
    # a chunk of whole-vocabulary logits (the second pass's, of a slice, are fewer), a slice's fp32 sum,
    # and every micro-batch's normed hidden state and per-token log-sum-exp, kept for the second pass
    return (chunk * V * LOGIT_BYTES["fused"] + min(p.head_slice, V) * H * 4
            + T * (H * dtype_bytes + 4) + norm)


def host_bytes(shape: ModelShape, batch: int, seq: int, p: Layout, host_weights: str = "persistent",
               dtype_bytes: int = 2, host_grad_buffers: int | None = 4, nvme_layers: int = 0,
               state: str = "fp32", nvme_master: bool = False, activations_to_nvme: bool = False,
               nvme_buffers: int = 4, spare_layers: int = 0) -> dict[str, int]:
    """Host RAM by category of the process that holds the most (``rank_host_bytes``'s heaviest rank; the
    only one without data parallel)."""
    return max(rank_host_bytes(shape, batch, seq, p, host_weights, dtype_bytes, host_grad_buffers, nvme_layers,
                               state, nvme_master, activations_to_nvme, nvme_buffers, spare_layers),
               key=lambda d: sum(d.values()))


def owned_units(shape: ModelShape) -> list[set[int]]:
    """The units (0: the embedding, 1..layers: the decoder layers, then the head) each of ``shape.ranks``
    data-parallel ranks owns: parallel.assign_units over the units' sizes, as the engine assigns them."""
    from ..parallel import assign_units

    sizes = [shape.embed_params] + [shape.layer_params] * shape.layers + [shape.head_params]
    owner = assign_units(sizes, shape.ranks)
    return [{u for u, o in enumerate(owner) if o == r} for r in range(shape.ranks)]


def held(shape: ModelShape, p: Layout) -> list[tuple[list[int], int]]:
    """Each rank's units the CPU updates: (its streamed decoder layers, the edges' parameters it keeps).
    Resident units (the first ``p.resident_layers`` layers; the edges where ``p`` trains them on the GPU)
    are every rank's, on the GPU."""
    L, k = shape.layers, min(p.resident_layers, shape.layers)
    return [([i for i in range(k, L) if i + 1 in owned],
             0 if p.edges_resident(shape) else
             (shape.embed_params if 0 in owned else 0) + (shape.head_params if L + 1 in owned else 0))
            for owned in owned_units(shape)]


def rank_host_bytes(shape: ModelShape, batch: int, seq: int, p: Layout, host_weights: str = "persistent",
                    dtype_bytes: int = 2, host_grad_buffers: int | None = 4, nvme_layers: int = 0,
                    state: str = "fp32", nvme_master: bool = False, activations_to_nvme: bool = False,
                    nvme_buffers: int = 4, spare_layers: int = 0) -> list[dict[str, int]]:
    """Host RAM by category of each data-parallel rank (``shape.ranks``; one without data parallel), as
    host/store.py holds it (pass ``host_grad_buffers=None`` when clipping: one buffer per layer;
    ``nvme_layers``: the last decoder layers, whose moments (and with ``nvme_master`` master) are on the
    NVMe tier, see ``nvme_bytes``; ``state``: the optimizer state format (optim/formats.py; the compact
    ones' master is bf16 hi + lo, the hi half being the GPU's weights); ``spare_layers``: spare copies of
    a layer's state for speculative updates under clipping). A rank keeps the state of the units it owns
    (``owned_units``); units trained on the GPU (``p``'s resident layers, the first ones, and edges) have
    none. The layer inputs a step offloads are every rank's own."""
    L = shape.layers
    tier_from = L - min(nvme_layers, L)
    staged_from = 0 if host_weights == "staged" else L if host_weights == "persistent" else L - min(host_weights, L)
    offloaded = L - min(L, p.gpu_activation_layers)
    # a layer updated on the GPU has no host compute copy: its loads copy the GPU's master (engine/engine.py)
    first = min(p.resident_layers, L) if first_on_gpu(shape, p, min(nvme_layers, L)) else None
    out = []
    for layers, edges in held(shape, p):
        N = edges + len(layers) * shape.layer_params  # the parameters this rank's CPU update covers
        tier = sum(i >= tier_from for i in layers)
        staged = sum(i >= staged_from for i in layers)  # (the last layers: streamed ones)
        # the window reads weights from the tier: compact state's (the master's hi half), or fp32 state's
        # staged layers' master, cast on the GPU
        read = nvme_master and tier and (compact_master(state) or min(tier, staged))
        width = (2 if compact_master(state) else 4) * shape.layer_params
        ring = len(layers) if host_grad_buffers is None else min(len(layers), host_grad_buffers)
        tier_master = 4 * tier * shape.layer_params if nvme_master else 0
        out.append({
            "master": 4 * N - tier_master,
            "moments": moment_bytes(state, N) - nvme_bytes(shape, tier, state),
            # a separate compute copy exists for persistent host weights in bf16/fp16 with fp32 state, and
            # whenever the master is on the tier ("staged": the edges too)
            "weights": dtype_bytes * (0 if host_weights == "staged" else
                                      N - (staged + (first in layers and first < staged_from)) * shape.layer_params)
            if not compact_master(state) and (dtype_bytes < 4 or tier_master) else 0,
            "grads": dtype_bytes * (edges + ring * shape.layer_params),
            # the tier's RAM buffers: a layer's state each (every field 4096-aligned), read ahead and written
            # behind (host/nvme.py); where the window reads weights from there, two pinned buffers of them
            "nvme_buffers": nvme_buffers * (nvme_bytes(shape, 1, state, nvme_master) + 4 * 4096)
            + (2 * (width + 4096) if read else 0) if tier else 0,
            # offloaded layer inputs in RAM, or on NVMe through 3 staging buffers (engine/activations.py)
            "activations": (min(offloaded, 3) if activations_to_nvme else offloaded + mid_layers(shape, p))
            * batch * seq * shape.hidden * dtype_bytes,
            "spares": min(spare_layers, len(layers)) * state_bytes(state, shape.layer_params),
        })
    return out


def nvme_layer_count(cfg, layers: int) -> int:
    """How many decoder layers an EngineConfig puts on the NVMe tier (the last ones; engine/engine.py)."""
    return round(cfg.placement.nvme_fraction * layers) if cfg.offload_dir else 0


def resident_state_bytes(state: str) -> int:
    """GPU bytes a resident parameter holds besides its weights and gradient (a compact master's hi half is
    those weights), rounded up."""
    extra = state_bytes(state, 1 << 20) / (1 << 20) - (2 if compact_master(state) else 0)
    return int(-(-extra // 1))


def speculative_spares(cfg, layers: int) -> int:
    """The spare states an EngineConfig gets: ``speculative_layers`` under clipping, at most one per decoder
    layer the CPU updates from RAM (resident layers update on the GPU, the tier's from their buffers)."""
    if cfg.max_grad_norm is None:
        return 0
    return max(0, min(cfg.placement.speculative_layers, layers - min(cfg.placement.resident_layers, layers) - nvme_layer_count(cfg, layers)))


def config_host_bytes(cfg, shape: ModelShape, batch: int, seq: int, p: Layout,
                      host_weights: str | int | None = None) -> dict[str, int]:
    """``host_bytes`` for an EngineConfig (``host_weights`` overrides the config's)."""
    return max(config_rank_host_bytes(cfg, shape, batch, seq, p, host_weights), key=lambda d: sum(d.values()))


def config_rank_host_bytes(cfg, shape: ModelShape, batch: int, seq: int, p: Layout,
                           host_weights: str | int | None = None) -> list[dict[str, int]]:
    """``rank_host_bytes`` for an EngineConfig; on the CPU with the step's working set ("compute": the GPU's
    bytes elsewhere), which every choice the planner makes for the host then leaves room for."""
    ranks = rank_host_bytes(shape, batch, seq, p, cfg.placement.host_weights if host_weights is None else host_weights,
                            cfg.compute_dtype.itemsize,
                            None if cfg.max_grad_norm is not None else cfg.placement.host_grad_buffers,
                            nvme_layer_count(cfg, shape.layers),
                            cfg.optimizer_state, cfg.placement.nvme_master, cfg.placement.activations_to_nvme,
                            cfg.placement.nvme_buffers, speculative_spares(cfg, shape.layers))
    if str(cfg.device).startswith("cuda"):
        return ranks
    compute = gpu_bytes(shape, batch, seq, p, cfg.compute_dtype.itemsize)["peak"]
    return [{**r, "compute": compute} for r in ranks]


RAM_FRACTION = 0.85  # of the machine's RAM, for the training state: the rest for the OS, Python, CUDA
# The process besides its training state: Python, torch and the CUDA libraries; RSS exceeded the host
# model by 1.5-2.0 GiB in every measured run (tests/test_plan.py)
PROCESS_BYTES = 2 * 2**30


HOST_SHARE = 0.95  # of the RAM, the most a run may take (the OS keeps the rest)

# Samples tokenized up front cost about 17 bytes of RAM per byte of their JSONL (Python lists of ints, measured
# on the bundled data); a dataset is tokenized up front while that is within this share of the allowance
DATA_BYTES_PER_SOURCE_BYTE = 17
DATA_RAM_SHARE = 0.05


def data_in_ram(source_bytes: int, allowance: int) -> bool:
    """Whether a dataset of ``source_bytes`` (its files') is tokenized up front, which counts and checks
    every record before the first step, or read as the steps reach it (data/lazy.py: RAM holds an index):
    up front while its samples take at most DATA_RAM_SHARE of the process's RAM ``allowance``."""
    return DATA_BYTES_PER_SOURCE_BYTE * source_bytes <= DATA_RAM_SHARE * allowance


def process_allowance(cfg, ram: int) -> int:
    """The whole process's RAM an EngineConfig allows on a machine with ``ram``: host_memory_limit, else
    HOST_SHARE of the RAM (what watchdog.MemoryGuard holds a run to)."""
    return parse_bytes(cfg.host_memory_limit) if cfg.host_memory_limit else int(HOST_SHARE * ram)


def host_budget(cfg, ram: int) -> tuple[int, int]:
    """(the host bytes of training state the planner aims at, the most it accepts), for an EngineConfig on a
    machine with ``ram``: what ``process_allowance`` holds the whole process to, less PROCESS_BYTES for the
    process itself; under ``host_memory_limit`` both, never more than 95% of the RAM (the OS keeps the
    rest); else at most RAM_FRACTION of the RAM aimed at."""
    most = int(HOST_SHARE * ram)
    if cfg.host_memory_limit:
        b = max(0, min(parse_bytes(cfg.host_memory_limit) - PROCESS_BYTES, most))
        return b, b
    most = max(0, most - PROCESS_BYTES)
    return min(int(RAM_FRACTION * ram), most), most


def check_host_limit(limit, ram: int, key: str, ram_from: str | None = None) -> None:
    """Refuse a host_memory_limit over the RAM there is (``ram``: this machine's, or what ``ram_from`` says):
    it would be no budget, and the run would end mid-way where it did not hold."""
    if limit and parse_bytes(limit) > ram:
        from ..config import ConfigError

        raise ConfigError(f"{key} {limit} is more than " + (f"the machine's {fmt_bytes(ram)} of RAM ({ram_from})"
                          if ram_from else f"this machine's {fmt_bytes(ram)} of RAM") + "; give at most that, or "
                          "leave it unset (95% of the RAM)")


def processes_over(ranks: int, allowance: int) -> str:
    """What the processes themselves take against a host budget that leaves each ``allowance`` (no more
    than PROCESS_BYTES): the start of a refusal, the budget's name to follow."""
    who = (f"the {ranks} processes on this machine take about {fmt_bytes(ranks * PROCESS_BYTES)} of host RAM "
           f"themselves ({fmt_bytes(PROCESS_BYTES)} each: " if ranks > 1 else
           f"the process itself takes about {fmt_bytes(PROCESS_BYTES)} of host RAM (")
    return f"{who}Python, torch, the data), more than the {fmt_bytes(ranks * allowance)}"


def check_host_fits(ram: dict[str, int], have: int, cfg, what: str = "training", prefix: str = "",
                    ranks: int = 1) -> None:
    """Refuse, before anything is allocated, host RAM (``ram`` by category, for EngineConfig ``cfg``) over
    what ``host_budget`` accepts on a machine with ``have``: the kernel's OOM killer would otherwise end
    the run mid-way, with nothing said. The message names the settings (``prefix``: the trainer's
    "offload.") that would need less and are not in use yet. Data parallel: ``have`` and ``cfg``'s limit
    are one of ``ranks`` processes' share of the machine's, and ``ram`` is that process's."""
    total = sum(ram.values())
    # (the limit that would hold this state, where the RAM does; up to the 0.1 GiB the line shows)
    need = fmt_bytes(math.ceil(ranks * (total + PROCESS_BYTES) / 2**30 * 10) * 2**30 / 10)
    if (allowance := process_allowance(cfg, have)) <= PROCESS_BYTES:  # (whatever the state: none may be left)
        fewer = " or fewer processes (nproc_per_node)" if ranks > 1 else ""
        raise DoesNotFit(processes_over(ranks, allowance) + " "
                         + (f"{prefix}host_memory_limit allows; set it to at least {need}{fewer}"
                            if cfg.host_memory_limit else
                            f"this machine allows ({HOST_SHARE:.0%} of its RAM); use one with more RAM{fewer}"))
    if total <= host_budget(cfg, have)[1]:
        return
    hints, k = [], prefix
    if ram.get("compute", 0) > total / 4 and prefix:  # (the trainer's step on the CPU: its tokens, not the state)
        hints.append("fewer tokens a micro-batch (micro_batch_size, cutoff_len)")
    if ram.get("spares"):
        hints.append(f"fewer spare states for clipping ({k}speculative_layers)")
    if ram.get("weights"):
        hints.append(f"staged host weights ({k}host_weights)")
    if not cfg.offload_dir:
        hints.append(f"the NVMe tier ({k}offload_dir, {k}nvme_fraction)")
    elif cfg.placement.nvme_fraction < 1:
        hints.append(f"more of the NVMe tier ({k}nvme_fraction)")
    elif not cfg.placement.nvme_master:
        hints.append(f"the master on the NVMe tier too ({k}nvme_master)")
    if cfg.optimizer_state == "fp32":
        hints.append(f"compact optimizer state ({k}optimizer_state)")
    if cfg.optimizer_state != "8bit":
        hints.append(f"8-bit optimizer state ({k}optimizer_state)")
    unlimited = host_budget(replace(cfg, host_memory_limit=None), have)[1]
    if cfg.host_memory_limit and host_budget(cfg, have)[1] < unlimited:  # (the limit binds, not the RAM)
        limit = parse_bytes(cfg.host_memory_limit)
        larger = (f"{k}host_memory_limit of at least {need}" if total <= unlimited
                  else f"a larger {k}host_memory_limit")
        hints = hints + [larger]
        whose = "each one's" if ranks > 1 else "the"
        has = (f"{k}host_memory_limit is {fmt_bytes(ranks * limit)} "
               + (f"shared by {ranks} processes " if ranks > 1 else "")
               + f"({fmt_bytes(host_budget(cfg, have)[1])} for {whose} training state, after about "
               f"{fmt_bytes(PROCESS_BYTES)} for {'each' if ranks > 1 else 'the'} process itself: Python, torch, the "
               "data)")
    else:
        has = f"this machine has {fmt_bytes(ranks * have)}" + (f" for {ranks} processes" if ranks > 1 else "")
    if ranks > 1:
        what = f"{what} in each of the {ranks} processes on this machine"
    raise DoesNotFit(f"{what} needs about {fmt_bytes(total)} of host RAM "
                     f"({', '.join(f'{k} {fmt_bytes(v)}' for k, v in ram.items())}), {has}; use "
                     f"{', '.join(hints + ['a smaller model'])}")


MIN_GRAD_BUFFERS = 4  # the gradient ring where RAM is short: backward then runs at most 4 layers ahead


def auto_host(cfg, shape: ModelShape, batch: int, seq: int, p: Layout, ram: int, *,
              weights: bool = True, buffers: bool = True, spares: bool = False):
    """The EngineConfig ``cfg`` with the host settings its caller leaves to the planner decided (``weights``:
    host_weights "auto", ``buffers``: host_grad_buffers "auto", ``spares``: speculative_layers "auto"),
    each where the training state stays within ``host_budget``'s aim.

    - host_weights: a persistent bf16 host copy (no cast at copy time); where it does not fit, the fewest
      staged layers (an int) that make it fit, else "staged" for all (2 bytes/param less). A staged
      layer crosses PCIe as its fp32 master (cast on the GPU): twice the bytes, twice a step.
    - host_grad_buffers: a buffer per streamed layer, else as many as fit and at least MIN_GRAD_BUFFERS.
      With few buffers backward waits for the CPU and the CPU then idles through the next forward; with
      one per layer the backlog waits in RAM. The weights are decided first, with the ring at its
      smallest: a staged layer costs PCIe bytes, a missing buffer less.
    - speculative_layers (clipping only; 0 without): a spare state for every streamed layer in RAM, else
      as many as fit. Decided last: without them clipping costs what it did before they existed."""
    budget = host_budget(cfg, ram)[0]
    streamed = shape.layers - min(p.resident_layers, shape.layers)  # resident layers keep no host state

    def total(c) -> int:
        return sum(config_host_bytes(c, shape, batch, seq, p).values())

    if spares:  # (decided last: none held while the others are)
        cfg = cfg.placed(speculative_layers=0)
    if buffers:
        cfg = cfg.placed(host_grad_buffers=MIN_GRAD_BUFFERS)
    if weights:
        full = cfg.placed(host_weights="persistent")
        need = total(full)
        per_layer = need - total(cfg.placed(host_weights=1))  # 0 where no copy is kept anyway
        if cfg.placement.nvme_master or not per_layer or need <= budget:  # (the tier's master needs the copy)
            cfg = full
        else:
            k = -int((budget - need) // per_layer)  # the fewest staged layers that fit (streamed ones only)
            cfg = cfg.placed(host_weights=k if k <= streamed else "staged")
    if buffers:  # (clipping holds one per layer whatever is asked)
        per_layer = cfg.compute_dtype.itemsize * shape.layer_params
        n = MIN_GRAD_BUFFERS + max(0, int((budget - total(cfg)) // per_layer) if per_layer else 0)
        cfg = cfg.placed(host_grad_buffers=None if cfg.max_grad_norm is not None or n >= shape.layers == streamed
                      else min(n, max(streamed, 1)))
    if spares and cfg.max_grad_norm is not None:  # as many as fit, at most one per layer updated from RAM
        per_layer = state_bytes(cfg.optimizer_state, shape.layer_params)
        fit_n = int((budget - total(cfg)) // per_layer) if per_layer else 0
        cfg = cfg.placed(speculative_layers=speculative_spares(cfg.placed(speculative_layers=max(0, fit_n)),
                                                                 shape.layers))
    return cfg


def auto_tier(cfg, shape: ModelShape, batch: int, seq: int, p: Layout, ram: int, *, buffers: bool = True,
              spares: bool = False, weights: bool = True, master: bool = True):
    """``nvme_fraction`` "auto" (with ``offload_dir``), for an EngineConfig whose host settings ``auto_host``
    decided without the tier: the fewest decoder layers (the last streamed ones) whose moments go to the
    NVMe tier for the training state to meet ``host_budget``'s aim; none where RAM holds it. The host
    weights stay as decided (a staged layer's extra bytes cross PCIe at ~55 GB/s, a tier layer's moments
    the disk at ~1 GB/s); gradient buffers and spares (where the caller leaves them to the planner) are
    decided again beside the tier. Where every streamed layer's moments are not enough, the tier layers'
    master goes there too (``nvme_master``; ``master``: the caller leaves it to the planner): fp32 state
    keeps the persistent bf16 copy in RAM the window reads (2 bytes a parameter in RAM instead of 4 staged;
    ``weights``: the caller leaves host_weights to the planner), and where that is not enough either, the
    tier layers are staged: the window reads their fp32 master from disk, twice a step, and casts it on
    the GPU; compact state's master is that copy, so those layers keep nothing in RAM and the window reads
    their weights from disk, twice a step. Where even that is not enough, the most is returned: the host
    check says what else would help."""
    n = shape.layers
    streamed = n - min(p.resident_layers, n)
    aim = host_budget(cfg, ram)[0]
    tiers = [(cfg, False)]  # (a base config, and whether the tier layers are the staged ones)
    on = cfg.placement.nvme_master
    if master and not on and compact_master(cfg.optimizer_state):
        tiers.append((cfg.placed(nvme_master=True), False))
    elif (master or on) and not compact_master(cfg.optimizer_state):
        if weights:  # host_weights the planner's: the bf16 copy kept, else the tier layers staged
            if not on:
                tiers.append((cfg.placed(nvme_master=True, host_weights="persistent"), False))
            tiers.append((cfg.placed(nvme_master=True), True))
        elif not on:  # the caller's host_weights: its staged tier layers are then read from disk
            tiers.append((cfg.placed(nvme_master=True), False))
    c = cfg
    for base, staged in tiers:
        if staged and sum(config_host_bytes(c, shape, batch, seq, p).values()) <= host_budget(cfg, ram)[1]:
            return c  # (the bf16 copy fits, if over the aim: cheaper than reading the master twice a step)
        for k in range(0, streamed + 1):
            c = base.placed(nvme_fraction=k / n, **({"host_weights": k} if staged else {}))
            if k:
                c = auto_host(c, shape, batch, seq, p, ram, weights=False, buffers=buffers, spares=spares)
            if sum(config_host_bytes(c, shape, batch, seq, p).values()) <= aim:
                return c
    return c


def spares_that_fit(cfg, shape: ModelShape, batch: int, seq: int, ram: int) -> int:
    """speculative_layers "auto" before the residency choice (which depends on it, auto_residency): the
    spare states that fit in RAM with every layer streamed and the host settings as ``cfg`` has them."""
    if cfg.max_grad_norm is None:
        return 0
    streamed = cfg.placed(resident_layers=0, resident_edges=False)  # (resident units keep no host state)
    return auto_host(streamed, shape, batch, seq, Layout.of(streamed), ram, weights=False, buffers=False,
                     spares=True).placement.speculative_layers


def gpu_budget(cfg, gpu: int | None = None) -> int:
    """An EngineConfig's GPU budget: its gpu_memory_limit, else the card's ``gpu`` bytes less
    ``GPU_MARGIN`` (room for the CUDA context, libraries' workspaces and the allocator's fragmentation,
    which do not grow with the card: SAFETY already scales with what is planned)."""
    if cfg.gpu_memory_limit:
        return parse_bytes(cfg.gpu_memory_limit)
    if gpu is None:
        raise ValueError("no GPU budget: set gpu_memory_limit, or give the GPU's memory")
    return int(gpu - min(GPU_MARGIN[0] * gpu, GPU_MARGIN[1]))


GPU_MARGIN = (0.1, 4 * 2**30)  # of the card: a tenth, and at most 4 GiB


WINDOW_SLOTS = (3, 2)  # layer slots of the streamed window, the most first (3 prefetch two visits ahead)


def choose_window_slots(shape: ModelShape, batch: int, seq: int, limit: int, base: Layout = Layout()) -> int:
    """``window_slots`` "auto": the most layer slots under which the step fits ``limit`` with its MLPs
    whole, else the most under which it fits at all (a slot less costs prefetch depth: the copy of a
    layer then overlaps one visit's compute, not two; token-chunked MLPs cost a forward)."""
    fitting = {}
    for k in WINDOW_SLOTS:
        try:
            fitting[k] = fit(shape, batch, seq, limit, replace(base, window_slots=k))
        except DoesNotFit:
            pass
    whole = [k for k, p in fitting.items() if p.mlp_chunk_tokens == base.mlp_chunk_tokens]
    return (whole or list(fitting) or [WINDOW_SLOTS[0]])[0]


def choose_resident_layers(shape: ModelShape, batch: int, seq: int, limit: int, base: Layout = Layout(),
                           rates: "MachineRates | None" = None, clipping: bool = False, score=None) -> int:
    """How many decoder layers to train on the GPU (``resident_layers="auto"``).

    As many as fit with micro-batches of at least EFFICIENT_TOKENS (or the whole batch): all of them
    when the whole model and every layer's products fit (then it is plain GPU training without
    recompute). But where resident layers take GPU memory that layer inputs or saved layers' products
    would otherwise keep, no more than the step needs: once the CPU optimizer's predicted time is under
    half the GPU's (with every other layer streamed and saving what fits), another resident layer saves no
    time and pushes inputs to pinned host memory and PCIe, or costs a layer's recompute. The half leaves
    room for the time model's error (its GPU rate underestimates 8B's); the layers of that margin are not
    taken where they cost smaller micro-batches, or GPU work that makes the step longer, and the update
    hides under the GPU work without them.
    With ``clipping`` the update follows backward and only the next forward (a quarter of the GPU work)
    can hide it: a quarter, with no margin (that model already counts no overlap with backward).
    ``score(k)``: a step's predicted seconds with k resident layers, where the rule above does not see all
    that k changes (the NVMe tier: a resident layer's state crosses no disk, but the layer inputs it pushes
    to RAM may push state onto it): then the k of the shortest step, the fewest among equals."""
    rates = rates or MachineRates()
    want = min(batch * seq, EFFICIENT_TOKENS)
    best, placed, micro, t_k = 0, None, {}, {}  # (each k's micro-batch and predicted times, as fit places it)
    for k in range(shape.layers + 1):
        try:
            p = fit(shape, batch, seq, limit, replace(base, resident_layers=k))
            if p.mlp_chunk_tokens != base.mlp_chunk_tokens:
                break  # this layer would cost the MLPs token chunks (recompute): not worth it
        except DoesNotFit:
            break
        if min(p.micro_batch, batch) * seq < want:
            break
        best, placed, micro[k] = k, p, min(p.micro_batch, batch)
        t_k[k] = step_time(shape, batch, seq, p, rates, clipping=clipping)
    if placed is None or (placed.gpu_activation_layers >= shape.layers
                          and (saved_layers(shape, placed) >= shape.layers or placed.mlp_chunk_tokens)):
        return best  # nothing competes for the memory
    t = step_time(shape, batch, seq, fit(shape, batch, seq, limit, replace(base, resident_layers=0)), rates)
    per_param = t["optimizer_s"] / max(1, shape.params - (shape.embed_params + shape.head_params
                                                          if base.resident_edges else 0))
    on_cpu = lambda k: shape.params - k * shape.layer_params - (  # noqa: E731
        shape.embed_params + shape.head_params if base.resident_edges else 0)
    if score is not None:
        return min(range(best + 1), key=lambda k: (score(k), k))
    needed = 0
    while needed < best and per_param * on_cpu(needed) > (0.25 if clipping else 0.5) * t["gpu_compute_s"]:
        needed += 1
    # The margin's layers give back the micro-batch they shrink, or the GPU work they add where the step
    # is then shorter without them (the sliced head's second product, saved layers' matmuls), where the
    # update still hides under the GPU work without them: micro-batches cost more the fewer tokens they
    # hold, which the time model does not count (FP8's shorter GPU work asks more layers of the margin).
    cover = t["gpu_compute_s"] * (0.25 if clipping else 1.0)
    more_work = lambda k: t_k[k]["gpu_compute_s"] > t_k[0]["gpu_compute_s"] and \
        t_k[k - 1]["step_s"] < t_k[k]["step_s"]  # noqa: E731
    while needed and per_param * on_cpu(needed - 1) <= cover and (micro[needed] < micro[0] or more_work(needed)):
        needed -= 1
    return needed


def auto_residency(cfg, shape: ModelShape, batch: int, seq: int, edges: bool | None = None,
                   gpu: int | None = None, rates: MachineRates = MachineRates(), ram: int | None = None) -> dict:
    """``resident_layers="auto"`` for an EngineConfig: the ``resident_layers`` and ``resident_edges`` to
    set, chosen by ``choose_resident_layers`` under its GPU budget (``gpu_budget``; the caller hands the
    engine that budget too, so that micro-batches and activations are planned for the memory the choice
    assumed). The embedding and head go resident too where that keeps micro-batches efficient and the
    predicted step gets shorter: they are the last gradient of a step and the first weights of the next,
    so streaming them also leaves the GPU idle at every step boundary while the CPU updates them
    (step_time's edge_stall_s). ``edges`` True or False fixes that part and leaves the layers to the
    planner. Layers on the NVMe tier stream. Under clipping the update waits for backward's global norm
    (a reason for more resident layers) unless ``speculative_layers`` covers every layer in RAM (where it
    is "auto", the trainer passes ``spares_that_fit``). That plans for the norm within the limit, as it
    is in most steps of a fine-tuning run; in steps where it is over, the updates run again after
    backward, as slow as waiting (``runtime.updates.speculation`` counts them)."""
    budget, base = gpu_budget(cfg, gpu), Layout.of(cfg)
    nvme = nvme_layer_count(cfg, shape.layers)
    clipping = cfg.max_grad_norm is not None and cfg.placement.speculative_layers < shape.layers - nvme
    plain = replace(base, resident_edges=False)

    def score(resident_edges: bool):
        """With ``offload_dir`` and an NVMe tier the planner places (``nvme_fraction`` 0 until after the
        residency), on a machine of ``ram``: the predicted step with k resident layers, the host settings
        and the tier decided as resolve would (infinite where the host state does not fit)."""
        if not cfg.offload_dir or ram is None or nvme:
            return None

        def seconds(k: int) -> float:
            c = cfg.placed(resident_layers=k, resident_edges=resident_edges)
            try:
                p = fit(shape, batch, seq, budget, Layout.of(c))
            except DoesNotFit:
                return math.inf
            c = auto_tier(auto_host(c, shape, batch, seq, p, ram), shape, batch, seq, p, ram)
            if sum(config_host_bytes(c, shape, batch, seq, p).values()) > host_budget(c, ram)[1]:
                return math.inf
            tiered = min(nvme_layer_count(c, shape.layers), shape.layers - k)
            return step_time(shape, batch, seq, p, rates, state=c.optimizer_state, nvme_layers=tiered,
                             nvme_master=c.placement.nvme_master, clipping=clipping,
                             speculative_layers=c.placement.speculative_layers)["step_s"]
        return seconds

    k = min(choose_resident_layers(shape, batch, seq, budget, plain, rates, clipping, score(False)),
            shape.layers - nvme)
    without = {"resident_layers": k, "resident_edges": False}
    if k == shape.layers or edges is False:
        return without  # (all layers resident: the edges too)
    with_edges = replace(base, resident_edges=True)
    ke = min(choose_resident_layers(shape, batch, seq, budget, with_edges, rates, clipping, score(True)),
             shape.layers - nvme)
    if edges:  # asked for: the layers that fit beside them (the engine's own check refuses if none does)
        return {"resident_layers": ke, "resident_edges": True}
    try:
        pe = fit(shape, batch, seq, budget, replace(with_edges, resident_layers=ke))
        p0 = fit(shape, batch, seq, budget, replace(plain, resident_layers=k))
    except DoesNotFit:
        return without
    if min(pe.micro_batch, batch) * seq < min(batch * seq, EFFICIENT_TOKENS, min(p0.micro_batch, batch) * seq):
        return without
    tier = dict(nvme_master=cfg.placement.nvme_master, activations_to_nvme=cfg.placement.activations_to_nvme,
                state=cfg.optimizer_state, clipping=clipping, rates=rates)
    # A gain under 2% is not worth the layer inputs their GPU memory pushes to pinned RAM (8B b64: 17 GB),
    # nor the time model's error; where they displace saved layers only, the time model counts that
    displaced_saved_only = pe.saved_layers < p0.saved_layers and pe.gpu_activation_layers >= p0.gpu_activation_layers
    margin = 0.99 if displaced_saved_only else 0.98
    if step_time(shape, batch, seq, pe, nvme_layers=min(nvme, shape.layers - ke), **tier)["step_s"] < \
            margin * step_time(shape, batch, seq, p0, nvme_layers=min(nvme, shape.layers - k), **tier)["step_s"]:
        return {"resident_layers": ke, "resident_edges": True}
    return without


def nvme_bytes(shape: ModelShape, nvme_layers: int, state: str = "fp32", master: bool = False) -> int:
    """Disk for the Adam moments (exp_avg and exp_avg_sq in the ``state`` format) of ``nvme_layers``
    decoder layers, and their master with ``master`` (fp32, or compact state's two bf16 halves)."""
    return min(nvme_layers, shape.layers) * (moment_bytes(state, shape.layer_params)
                                             + (4 * shape.layer_params if master else 0))


def fit(shape: ModelShape, batch: int, seq: int, limit: int, base: Layout = Layout()) -> Layout:
    """The placement to train ``batch`` x ``seq`` under ``limit`` GPU bytes (see the module docstring):
    ``base`` fixes the window, loss and resident layers; micro-batch and kept activations are chosen, then
    the loss head's chunk (unless ``base`` fixes it: then at most that, where a larger shape than the one
    it was chosen for needs less), and token-chunked MLPs where nothing fits without them.
    ``base.gpu_first_update`` is kept only where it fits beside that choice (it never costs kept inputs).
    Raises DoesNotFit with the largest batch that would fit."""
    p = _fit_chunks(shape, batch, seq, limit, replace(base, gpu_first_update=False))
    first = replace(p, gpu_first_update=True)
    return first if base.gpu_first_update and gpu_bytes(shape, batch, seq, first)["peak"] <= limit else p


def _fit_chunks(shape: ModelShape, batch: int, seq: int, limit: int, base: Layout) -> Layout:
    try:
        return _fit(shape, batch, seq, limit, base)
    except DoesNotFit:
        for chunk in (c for c in LOSS_CHUNK_TOKENS if c < (base.loss_chunk_tokens or 0)):
            try:
                return _fit(shape, batch, seq, limit, replace(base, loss_chunk_tokens=chunk))
            except DoesNotFit:
                pass
        raise


def _fit(shape: ModelShape, batch: int, seq: int, limit: int, base: Layout) -> Layout:
    options = []
    for head in heads(base):
        for mb in divisors(batch):
            least = replace(base, micro_batch=mb, gpu_activation_layers=0, head_slice=head, saved_layers=0)
            base_peak = gpu_bytes(shape, batch, seq, least)["peak"]
            if base_peak > limit:
                continue
            per_layer = batch * seq * shape.hidden * 2
            kept = min(shape.layers, int((limit - base_peak) / SAFETY) // per_layer)
            options.append(with_saved_layers(shape, batch, seq, limit, replace(least, gpu_activation_layers=kept)))
    # (the host's budget may hold only so many offloaded inputs: the placements that keep the rest, if any)
    options = [p for p in options if p.gpu_activation_layers >= min(base.min_gpu_inputs, shape.layers)] or options
    if options:  # (the sliced head only where it buys efficient micro-batches, or nothing fits without it)
        best = max(options, key=lambda p: (min(p.micro_batch * seq, EFFICIENT_TOKENS), p.head_slice is None,
                                           min(p.micro_batch * seq, base.prefer_tokens or LARGE_TOKENS),
                                           p.gpu_activation_layers,
                                           p.saved_layers, p.micro_batch))
        if base.loss_chunk_tokens is None:  # then the largest loss chunk that fits beside that choice
            best = next((q for q in (replace(best, loss_chunk_tokens=c) for c in LOSS_CHUNK_TOKENS)
                         if gpu_bytes(shape, batch, seq, q)["peak"] <= limit),
                        replace(best, loss_chunk_tokens=LOSS_CHUNK_TOKENS[-1]))
        return with_displaced_inputs(shape, batch, seq, limit, with_saved_layers(shape, batch, seq, limit, best))
    if base.mlp_chunk_tokens is None:  # a sequence too long for micro-batches: its MLPs in token chunks
        for chunk in MLP_CHUNK_TOKENS:
            if chunk < seq:
                try:
                    return fit(shape, batch, seq, limit, replace(base, mlp_chunk_tokens=chunk))
                except DoesNotFit:
                    pass
        base = replace(base, mlp_chunk_tokens=MLP_CHUNK_TOKENS[-1] if MLP_CHUNK_TOKENS[-1] < seq else None)
    best = largest_batch(shape, seq, limit, base, batch - 1)
    need = gpu_bytes(shape, batch, seq, least_layout(shape, batch, seq, base))["peak"]
    if batch == seq == 1:  # (the engine's first check, before any batch is known: the model's own floor)
        raise DoesNotFit(f"this model needs at least {fmt_bytes(need)} of GPU memory (its window of layers, every "
                         f"activation offloaded), over the {fmt_bytes(limit)} budget: raise gpu_memory_limit to "
                         f"{fmt_bytes(need)} or more")
    raise DoesNotFit(
        f"batch {batch} x seq {seq} needs at least {fmt_bytes(need)} of GPU memory with every activation "
        f"offloaded, one sequence per micro-batch"
        + (f" and MLPs in {base.mlp_chunk_tokens}-token chunks" if base.mlp_chunk_tokens else "")
        + f", over the {fmt_bytes(limit)} budget; "
        + (f"the largest batch that fits at seq {seq} is {best}" if best else
           f"not even batch 1 fits at seq {seq}: shorten the sequences or raise gpu_memory_limit"))


def divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending (the micro-batches that split a batch of ``n`` evenly), in sqrt(n) steps."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def with_saved_layers(shape: ModelShape, batch: int, seq: int, limit: int, p: Layout) -> Layout:
    """``p`` with as many saved layers (the last ones) as the GPU has left room for once every layer
    input is kept on it: a saved layer's products take about 11 x hidden values a token against the input's
    1, so they come after the inputs, which save PCIe traffic and pinned RAM. fit() fills them before it
    takes a larger loss chunk (a chunk of 8192 tokens takes what about two saved layers would at Qwen3-4B
    b32, for a similar share of the step). Only for 2-byte compute dtypes, which the model counts."""
    p = replace(p, saved_layers=0)
    per_layer = batch * seq * shape.kept_per_token * 2
    if p.gpu_activation_layers < shape.layers or p.mlp_chunk_tokens or not per_layer or p.compute_bytes != 2:
        return p
    room = int((limit / SAFETY - gpu_bytes(shape, batch, seq, p)["peak"] / SAFETY) // per_layer)
    return replace(p, saved_layers=max(0, min(shape.layers, room)))


def with_displaced_inputs(shape: ModelShape, batch: int, seq: int, limit: int, p: Layout) -> Layout:
    """``p`` with the first layers' inputs offloaded to pinned RAM, within ``p.host_input_bytes``, where
    their GPU memory keeps more saved layers: the most saved layers the allowance reaches, each for the
    fewest inputs (a layer's products take about 11 inputs' bytes, and an input crosses PCIe twice a step).
    ``p`` as it is where it keeps every layer's products, or not every input, or no allowance."""
    L, per_input = shape.layers, batch * seq * shape.hidden * 2
    most = min(L, p.host_input_bytes // per_input) if per_input else 0
    if not most or p.gpu_activation_layers < L or p.mlp_chunk_tokens or p.compute_bytes != 2:
        return p
    for s in range(L, saved_layers(shape, p), -1):
        q = replace(p, saved_layers=s)
        over = gpu_bytes(shape, batch, seq, q)["peak"] - limit
        d = max(0, math.ceil(over / (SAFETY * per_input)))  # (each input is SAFETY x its bytes of the peak)
        while d <= most and gpu_bytes(shape, batch, seq, replace(q, gpu_activation_layers=L - d))["peak"] > limit:
            d += 1  # (the peak's rounding)
        if d <= most:
            return replace(q, gpu_activation_layers=L - d)
    return p


def least_layout(shape: ModelShape, batch: int, seq: int, base: Layout) -> Layout:
    """The least GPU memory ``base`` allows: a sequence per micro-batch, every layer input offloaded, and
    the head of ``heads`` that needs less at this batch (the sliced head keeps every token's normed
    hidden state, which outgrows the accumulator it saves at long steps)."""
    options = [replace(base, micro_batch=1, gpu_activation_layers=0, head_slice=h, saved_layers=0)
               for h in heads(base)]
    return min(options, key=lambda p: gpu_bytes(shape, batch, seq, p)["peak"])


def heads(base: Layout) -> list:
    """The loss heads ``fit`` may choose from, least memory last: the fused head's lm_head gradient whole
    or by vocabulary slices, unless ``base`` fixes it."""
    if base.head_slice is not None or base.loss_kernel != "fused":
        return [base.head_slice]
    return [None, HEAD_SLICE_ROWS]


def step_time(shape: ModelShape, batch: int, seq: int, p: Layout, rates: MachineRates = MachineRates(),
              state: str = "fp32", nvme_layers: int = 0, nvme_master: bool = False,
              activations_to_nvme: bool = False, clipping: bool = False,
              speculative_layers: int = 0, staged_params: int = 0, small_head_chunk_cost: float = 1.0) -> dict[str, float]:
    """Predicted seconds per step: the largest of the GPU's work (the layers' and the head's products,
    recompute included, and the resident units' AdamW; +2%), the CPU optimizer plus the GPU work it cannot
    overlap, and the weight copies and the NVMe tier's moment traffic (read and written once per step;
    +10%), plus the embedding's update at the step boundary where it streams. With ``clipping`` the CPU
    update waits for the global norm, so it follows backward (6 of the 8 FLOP units) and only the next
    forward overlaps it; the embedding's update is then the first of that serial chain, not a stall on
    top. ``speculative_layers`` of the streamed layers are updated before the norm (engine/runtime.py):
    only the rest follows backward, where the norm stays within the limit. The GPU term takes one rate
    for every model: a little short of smaller models' GPU work and over larger ones' (larger GEMMs run
    faster). ``staged_params`` cross PCIe as their fp32 master. Steps under 24 GiB come within 6% of
    measured ones (tests/test_plan.py); not counted: a ring of few gradient buffers (it predicts such
    steps short)."""
    tokens = batch * seq
    k = min(p.resident_layers, shape.layers)
    everyone = shape.params - k * shape.layer_params - (shape.embed_params + shape.head_params
                                                        if p.edges_resident(shape) else 0)
    # Data parallel (shape.ranks): each rank loads, and the CPU updates, the units it owns; the heaviest
    # rank's share bounds the step. ``rates`` are then one rank's share of what the machine's ranks share
    # (Machine.rank_rates: the CPU's cores, the disk).
    mine = max(held(shape, p), key=lambda h: h[1] + len(h[0]) * shape.layer_params)
    # the first streamed layer updated on the GPU: its state crosses both ways instead (counted on the h2d side)
    first = gpu_bytes(shape, batch, seq, p)["first_update"]
    on_cpu = mine[1] + len(mine[0]) * shape.layer_params - first // 12
    nvme_layers = sum(i >= shape.layers - min(nvme_layers, shape.layers) for i in mine[0])
    reused = min(p.window_slots, shape.layers - k) * shape.layer_params  # the backward's first layers, kept
    streamed = max(0, on_cpu - reused // shape.ranks)
    offloaded = shape.layers - min(shape.layers, p.gpu_activation_layers)
    chunked = p.mlp_chunk_tokens and p.mlp_chunk_tokens < min(batch, p.micro_batch) * seq
    mids = 0 if activations_to_nvme else mid_layers(shape, p)
    cpu_rate = rates.optimizer_params_per_s * rates.state_speedup[state]
    # a token's logits and their two gradients, not recomputed; the sliced head computes the logits twice;
    # in chunks under 4096 tokens, ``small_head_chunk_cost`` times as long for each halving (SMALL_HEAD_CHUNK_COST,
    # weighed where the chunk is decided: plan/resolve.py)
    head_flops = (8 if p.head_slice else 6) * shape.vocab * shape.hidden
    head_chunk = min(p.loss_chunk_tokens or LOSS_CHUNK_TOKENS[-1], min(batch, p.micro_batch) * seq)
    if head_chunk < 4096:
        head_flops *= small_head_chunk_cost ** math.log2(4096 / head_chunk)
    # fp8: the linears' forward products, and (but for token-chunked MLPs, whose backward runs plain
    # linears) their recompute, input-gradient and weight-gradient products, a token
    linears = shape.kept_params + shape.down_params
    fp8_flops = (2 * shape.layers * linears + (0 if chunked else 4 * shape.layers * linears + 2 * (
        shape.layers - saved_layers(shape, p)) * shape.kept_params)) if p.fp8 else 0
    out = {
        # the layers' forward, recompute and backward (2 + 2 + 4 FLOPs a parameter and token), less the
        # recompute of the down projection (2 x hidden x ffn a token and layer; model/recompute.py);
        # token-chunked MLPs recompute it, and run their whole forward once more (6 x hidden x ffn); a
        # saved layer recomputes none of its products (the attention and elementwise work are left out), a mid
        # layer not its attention's output projection. The
        # head's three products are not recomputed (6 x vocab x hidden); the embedding is a lookup.
        "gpu_compute_s": (8 * shape.layers * shape.flop_params + head_flops
                          + shape.layers * (6 * shape.hidden * shape.ffn if chunked else -2 * shape.down_params)
                          - 2 * saved_layers(shape, p) * shape.kept_params
                          - 2 * mids * shape.mid_params
                          - fp8_flops * (1 - 1 / FP8_SPEEDUP))
                         * tokens / rates.gpu_flops,
        "gpu_adamw_s": (shape.params - everyone) / rates.gpu_adamw_params_per_s / rates.gpu_state_speedup[state],
        # data parallel: a streamed unit's weights broadcast from its owner at its two loads and its gradient
        # summed to it; a resident one's gradient summed on every rank (twice its bytes), on the compute stream
        "peer_s": (2 * 2 * max(0, everyone - reused) + 2 * everyone + 2 * 2 * (shape.params - everyone))
        / rates.peer_bytes_per_s if shape.ranks > 1 else 0.0,
        # offloaded layer inputs: out and back once a step, each way on its own copy engine
        "activations_s": (offloaded + mids) * tokens * shape.hidden * 2 / rates.pcie_bytes_per_s,
        "optimizer_s": on_cpu / cpu_rate,
        # bf16 weights, about twice a step; staged parameters cross as their fp32 master
        "h2d_s": (2 * (2 * streamed + 2 * min(staged_params, streamed)) + first) / rates.pcie_bytes_per_s,
        # the tier's state read and written once a step, offloaded layer inputs out and back, and the
        # weights the window reads from the tier for forward and again for backward (compact state's; fp32
        # state's staged layers' master)
        "nvme_s": rates.disk_s(nvme_bytes(shape, nvme_layers, state, nvme_master)
                               + (activations_to_nvme * (shape.layers - min(shape.layers, p.gpu_activation_layers))
                                  * tokens * shape.hidden * 2),
                               (2 * 2 * min(nvme_layers, shape.layers) if compact_master(state) else
                                2 * 4 * min(nvme_layers, staged_params // max(1, shape.layer_params)))
                               * shape.layer_params if nvme_master else 0),
    }
    # Streamed, the embedding is the last gradient of a step and the first weights of the next: the GPU
    # waits for its CPU update at every step boundary, whatever else overlaps. Counted whole: an upper
    # bound where the update runs by rows (embedding_by_rows), whose boundary holds the touched rows only.
    stall = 0.0 if p.edges_resident(shape) else \
        shape.embed_params / cpu_rate
    # What does not overlap. GPU-bound, little: prefetching two visits ahead hides nearly all copies (the
    # 2% below). CPU-bound, the head and the last streamed layer: between the last update the forward
    # needs and the first gradient of backward the CPU has nothing to do. Bound by the tier's disk, the
    # step is its traffic: the reads run ahead across the step boundary, so nothing waits on top.
    gap = (head_flops + 8 * shape.flop_params) * tokens / rates.gpu_flops if on_cpu else 0.0
    step = max(1.02 * (out["gpu_compute_s"] + out["gpu_adamw_s"] + out["peer_s"]), out["optimizer_s"] + gap,
               1.1 * max(out["activations_s"], out["h2d_s"]), out["nvme_s"]) + stall
    if clipping:
        ahead = max(0, min(speculative_layers, len(mine[0]) - nvme_layers)) * shape.layer_params
        out["after_backward_s"] = 0.75 * out["gpu_compute_s"] + \
            (on_cpu - ahead) / cpu_rate
        step = max(step, out["after_backward_s"])
    out["step_s"] = step
    out["edge_stall_s"] = stall
    return out
