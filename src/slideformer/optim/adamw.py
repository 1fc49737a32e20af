"""AdamW on one unit's flat fp32 buffers.

Two interchangeable backends, exact to rounding against ``torch.optim.AdamW``:
- "native": our one-pass C++ kernel (optim/csrc/adamw.cpp). It reads a bf16/fp16/fp32 gradient,
  updates master and moments and writes the compute-dtype copy in a single pass, with the gradient
  clipping coefficient folded in (28 bytes per parameter for bf16), on its own threads, GIL released.
- "torch": torch's fused CPU kernel. It needs an fp32 gradient, so a bf16 gradient is first cast into
  a reusable fp32 scratch, and the compute copy is refreshed by a separate cast (40 bytes per parameter).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import native
from .formats import BLOCK8, code_tables, nearest_codes, qmap, split_moment


@dataclass
class Landing:
    """How a unit's gradient arrives: in chunks of ``chunk`` elements, chunk k on the host once
    ``flags[k] >= ticket`` (the runtime's copy stream writes the ticket after each chunk). The native
    kernel updates each chunk as it lands, in one call; ``abort[0] != 0`` ends the wait (the GPU failed)."""

    flags: torch.Tensor  # int64, one entry per chunk (pinned on a GPU run)
    ticket: int
    chunk: int
    abort: torch.Tensor  # int64 [1]

    def landed(self, k: int = 0) -> bool:
        return int(self.flags[k]) >= self.ticket

    def wait(self, numel: int) -> float:
        """Until the last chunk has landed (the torch backend updates a unit in one piece); returns the
        seconds waited."""
        last = (numel - 1) // self.chunk
        t0 = time.monotonic()
        while not self.landed(last):
            if int(self.abort[0]) or time.monotonic() - t0 > 120:
                raise RuntimeError("the gradient stream was aborted" if int(self.abort[0]) else
                                   f"gradient chunk {last} never landed (no copy for 120 s)")
            time.sleep(2e-5)
        return time.monotonic() - t0

    def kwargs(self) -> dict:
        return dict(flags=self.flags, ticket=self.ticket, chunk=self.chunk, abort=self.abort)


@dataclass(frozen=True)
class Rows:
    """One part of a row-wise update (the native kernels only): the unit as rows of ``length`` elements,
    ``ids`` sorted unique row indices (int64, CPU). ``touched``: those rows, their gradient packed in
    ``ids``' order (len(ids) x length elements); else every other element of the unit, with a zero
    gradient (an empty one: none is read), or with the unit's whole gradient read at their places (a tied
    embedding's head gradient). The two parts, in either order, are one update of the whole unit to the
    bit (the engine's embedding: engine/embedding.py)."""

    ids: torch.Tensor
    length: int
    touched: bool

    def kwargs(self) -> dict:
        return dict(rows=self.ids, row_len=self.length, touched=self.touched)


class Undecayed:
    """The elements of a unit that weight decay leaves alone (its biases and norms: model/adapter.py
    ``decays``). Every kernel decays all of a unit's elements in its one pass; these few are read before the
    update (``before``) and have their decay taken back after it (``after``): p_new + lr * wd * p_old, the
    undecayed update to within a rounding of the weight (the moments do not depend on the decay). They are
    read and written as slices (adjacent ranges joined): a gather by index from a unit's buffer of
    hundreds of millions of elements costs milliseconds."""

    def __init__(self, ranges: tuple[tuple[int, int], ...]):
        joined: list[list[int]] = []
        for a, b in sorted(ranges):
            if joined and joined[-1][1] == a:
                joined[-1][1] = b
            else:
                joined.append([a, b])
        self.ranges = [(a, b) for a, b in joined]

    def before(self, weight_decay: float, hi: torch.Tensor, lo: torch.Tensor | None = None) -> list | None:
        """The elements' master before the update (``hi`` + ``lo`` for compact and 8-bit state); None where
        there is nothing to take back."""
        if not self.ranges or weight_decay == 0.0:
            return None
        return [hi[a:b].double() + (0.0 if lo is None else lo[a:b].double()) for a, b in self.ranges]

    def after(self, saved: list | None, lr: float, weight_decay: float, hi: torch.Tensor,
              lo: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
        """The decay taken back off the updated master (and ``out``, its compute copy, where one is written),
        rounded as the kernels round: the fp32 master to nearest even, or compact's hi + lo split."""
        for (a, b), old in zip(self.ranges, saved or ()):
            p = (hi[a:b].double() + (0.0 if lo is None else lo[a:b].double()) + old * (lr * weight_decay)).float()
            hi[a:b] = p
            if lo is not None:
                lo[a:b] = p - hi[a:b].float()
            if out is not None:
                out[a:b] = p


def _check_rows(rows: "Rows | None", backend: str) -> None:
    if rows is not None and backend != "native":
        raise ValueError("a row-wise update needs the native backend")


def adamw_update_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  *, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                  grad_coef: float = 1.0, out: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
                  backend: str = "torch", threads: int | None = None, landing: Landing | None = None,
                  src: tuple[torch.Tensor, ...] | None = None, rows: Rows | None = None) -> float:
    """Decoupled-weight-decay Adam, exactly torch.optim.AdamW's update for the ``step``-th step.

    ``out``, when given, receives the updated weights in its dtype (the compute copy sent to the GPU).
    ``landing``, when given, says when each chunk of ``grad`` is there to be read. ``src``, when given
    (master, exp_avg, exp_avg_sq), is the state the update starts from, left as it was: the update is
    written out of place. ``rows``: one part of a row-wise update (``Rows``). Returns the seconds spent
    waiting for chunks (the rest of the call is the update's own time).
    """
    _check_rows(rows, backend)
    if backend == "native":
        mod = native.load(strict=True)
        return mod.adamw_step(master, grad, exp_avg, exp_avg_sq, out, step, lr, betas[0], betas[1], eps, weight_decay,
                              grad_coef, threads or native.default_threads(), **(landing.kwargs() if landing else {}),
                              src=None if src is None else list(src), **(rows.kwargs() if rows else {}))
    if backend != "torch":
        raise ValueError(f"unknown optimizer backend {backend!r}; use 'native' or 'torch'")
    waited = landing.wait(grad.numel()) if landing is not None else 0.0
    if src is not None:  # (torch's kernel works in place: start from a copy)
        for d, a in zip((master, exp_avg, exp_avg_sq), src):
            d.copy_(a)
    if grad.dtype != torch.float32:
        if scratch is None or scratch.numel() < grad.numel():
            raise ValueError("a non-fp32 gradient needs an fp32 scratch buffer at least as large")
        g = scratch[: grad.numel()]
        g.copy_(grad)
    else:
        g = grad
    if grad_coef != 1.0:
        g.mul_(grad_coef)  # fp32 grads are host-side copies owned by the store: scaling in place is safe
    step_t = torch.tensor(float(step))
    torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=betas[0],
                        beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    if out is not None:
        out.copy_(master)
    return waited


M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """x * c mod 2**32 for uint32 values held in int64 (tensors or ints) without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def _mix32(x):
    """The kernel's integer hash (lowbias32), for ints or int64 tensors of uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def compact_seeds(seed: int, step: int) -> tuple[int, int]:
    base = _mix32((seed & M32) ^ _mix32(step & M32))
    return _mix32(base ^ 0x6D6D6D6D), _mix32(base ^ 0x76767676)


def _bf16_stochastic(x: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    noise = _mix32(torch.arange(offset, offset + x.numel(), dtype=torch.int64, device=x.device) ^ seed) & 0xFFFF
    bits = x.view(torch.int32).to(torch.int64) & M32
    return ((bits + noise) >> 16).to(torch.int16).view(torch.bfloat16)


def adamw_compact_(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                   weight_decay: float, grad_coef: float = 1.0, seed: int = 0, offset: int = 0,
                   backend: str = "native", threads: int | None = None, landing: Landing | None = None,
                   src: tuple[torch.Tensor, ...] | None = None, rows: Rows | None = None) -> float:
    """AdamW on compact state: master = hi + lo (bf16 each), bf16 moments rounded stochastically.

    ``offset``: where these tensors start in their unit (the rounding bits hash the position in the unit,
    so updating a unit in chunks gives the same result as in one call). ``src``: (hi, lo, exp_avg,
    exp_avg_sq) to start from, left as they were (see ``adamw_update_``).

    Same arithmetic in both backends, equal to rounding (this kernel fuses multiply-adds); the PyTorch one
    is the reference and the fallback. Returns the seconds spent waiting for gradient chunks.
    """
    _check_rows(rows, backend)
    if backend == "native":
        return _native("adamw_step_compact", hi, lo, grad, exp_avg, exp_avg_sq, step, lr, betas[0], betas[1], eps,
                       weight_decay, grad_coef, seed, offset, threads=threads, landing=landing, src=src, rows=rows)
    waited = _torch_start(grad.numel(), (hi, lo, exp_avg, exp_avg_sq), landing, src)
    b1, b2 = betas
    w1 = torch.tensor(1.0 - b1, dtype=torch.float32)
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731  (fp32 scalars, as the kernel has)
    g = grad.float() * f(grad_coef)
    m0 = exp_avg.float()
    m = m0 + w1 * (g - m0) if float(w1) < 0.5 else g - (g - m0) * (f(1.0) - w1)
    v = exp_avg_sq.float() * f(b2) + f(1.0 - b2) * g * g
    denom = torch.sqrt(v) / f((1.0 - b2 ** step) ** 0.5) + f(eps)
    p = (hi.float() + lo.float()) * f(1.0 - lr * weight_decay) - f(lr / (1.0 - b1 ** step)) * m / denom
    hi.copy_(p)  # round to nearest even
    lo.copy_(p - hi.float())
    seed_m, seed_v = compact_seeds(seed, step)
    exp_avg.copy_(_bf16_stochastic(m, seed_m, offset))
    exp_avg_sq.copy_(_bf16_stochastic(v, seed_v, offset))
    return waited


def adamw_8bit_(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float], eps: float,
                weight_decay: float, grad_coef: float = 1.0, backend: str = "native", threads: int | None = None,
                landing: Landing | None = None, src: tuple[torch.Tensor, ...] | None = None,
                rows: Rows | None = None) -> float:
    """AdamW on 8-bit state (optim/formats.py): master = hi + lo (bf16 each), each moment 8-bit codes of the
    dynamic map with an fp32 absolute-maximum scale per block. A block's new moments are computed in fp32,
    used for this step's update unrounded, then stored to the nearest code (as torchao's AdamW8bit does;
    deterministic, so a resumed run repeats the same rounding). ``src`` and the return value as in
    ``adamw_compact_``.

    The PyTorch code below is the reference and the fallback (and runs on any device, in pieces); the C++
    kernel is its arithmetic (no contracted multiply-adds, which would move a value across a code's
    midpoint now and then), equal but for a rare last bit of a lo half."""
    _check_rows(rows, backend)
    if backend == "native":
        return _native("adamw_step_8bit", hi, lo, grad, exp_avg, exp_avg_sq, qmap(True), qmap(False),
                       *code_tables(True), *code_tables(False), step, lr, betas[0], betas[1], eps, weight_decay,
                       grad_coef, threads=threads, landing=landing, src=src, rows=rows)
    waited = _torch_start(grad.numel(), (hi, lo, exp_avg, exp_avg_sq), landing, src)
    n = hi.numel()
    (mc, ms), (vc, vs) = split_moment(exp_avg, n), split_moment(exp_avg_sq, n)
    for a in range(0, n, PIECE_8BIT):  # blocks are independent: pieces bound the temporaries, not the result
        b, ba, bb = min(n, a + PIECE_8BIT), a // BLOCK8, min(n, a + PIECE_8BIT) // BLOCK8
        _adamw_8bit_piece_(hi[a:b], lo[a:b], grad[a:b], (mc[a:b], ms[ba:bb]), (vc[a:b], vs[ba:bb]), step=step,
                           lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grad_coef=grad_coef)
    return waited


PIECE_8BIT = 4 * 2**20  # elements per PyTorch 8-bit update: about 72 bytes of fp32 and int64 temporaries each


def _adamw_8bit_piece_(hi: torch.Tensor, lo: torch.Tensor, grad: torch.Tensor, m: tuple[torch.Tensor, torch.Tensor],
                       v: tuple[torch.Tensor, torch.Tensor], *, step: int, lr: float, betas: tuple[float, float],
                       eps: float, weight_decay: float, grad_coef: float = 1.0) -> None:
    """The reference arithmetic on a piece of a unit (whole blocks), each moment as (codes, scales)."""
    b1, b2 = betas
    # fp32 scalars, as the kernel has: 0-dim CPU tensors, which a GPU op takes as arguments (no copy, no sync)
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    qs, qu = qmap(True, hi.device), qmap(False, hi.device)
    g = grad.float() * f(grad_coef)
    m_new = _lerp(_dequantize(*m, qs), g, 1.0 - b1, f)
    v_new = _lerp(_dequantize(*v, qu), g * g, 1.0 - b2, f)
    denom = torch.sqrt(v_new) / f((1.0 - b2 ** step) ** 0.5) + f(eps)
    p = (hi.float() + lo.float()) * f(1.0 - lr * weight_decay) - f(lr / (1.0 - b1 ** step)) * m_new / denom
    hi.copy_(p)  # round to nearest even
    lo.copy_(p - hi.float())
    _quantize_(*m, m_new, qs)
    _quantize_(*v, v_new, qu)


def _lerp(a: torch.Tensor, b: torch.Tensor, w: float, f) -> torch.Tensor:
    """torch.lerp's two forms, whichever is exact for its weight (the kernels compute the same)."""
    return a + f(w) * (b - a) if w < 0.5 else b - (b - a) * f(1.0 - w)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (q[codes.long()].view(-1, BLOCK8) * scales.view(-1, 1)).view(-1)


def _quantize_(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> None:
    """Each block of ``x`` over its absolute maximum, to the nearest code of ``q`` (a midpoint rounds up)."""
    xb = x.view(-1, BLOCK8)
    scale = xb.abs().amax(1).clamp_min(1e-12)
    y = xb / scale.view(-1, 1)
    codes.copy_(nearest_codes(y, q).view(-1))
    scales.copy_(scale)


def _native(kernel: str, *args, threads: int | None, landing: Landing | None, src, rows: Rows | None = None) -> float:
    """A C++ update (optim/csrc/adamw.cpp) on its threads, chunk by chunk as the gradient lands."""
    return getattr(native.load(strict=True), kernel)(*args, threads or native.default_threads(),
                                                       **(landing.kwargs() if landing else {}),
                                                       src=None if src is None else list(src),
                                                       **(rows.kwargs() if rows else {}))


def _torch_start(numel: int, dst: tuple[torch.Tensor, ...], landing: Landing | None, src) -> float:
    """The PyTorch backend updates a unit in one piece: it waits for every chunk, and starts an update out
    of place from a copy of ``src``; returns the seconds waited."""
    waited = landing.wait(numel) if landing is not None else 0.0
    if src is not None:
        for d, a in zip(dst, src):
            d.copy_(a)
    return waited


def resolve_backend(requested: str) -> str:
    """"auto" becomes "native" when the C++ kernel builds here, else "torch" (with one warning)."""
    if requested == "auto":
        return "native" if native.load() is not None else "torch"
    if requested == "native":
        native.load(strict=True)
    return requested


def compact_seed(seed: int, unit: int) -> int:
    """The seed of a unit's compact-state rounding bits: the same wherever the unit is updated (the CPU
    worker, or the GPU for a resident unit), so that both update it alike."""
    return seed * 1_000_003 + unit
