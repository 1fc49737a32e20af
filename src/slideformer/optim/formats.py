"""The optimizer state formats (config ``optimizer_state``): how a parameter's master and Adam moments are
stored, and what they cost. The store, the checkpoint, the NVMe tier and the planner all read it here.

- ``fp32``: fp32 master and moments (12 bytes a parameter; exact AdamW).
- ``compact``: the master as two bf16 halves, hi + lo (hi is the weights the GPU reads), and bf16 moments
  rounded stochastically (8 bytes).
- ``8bit``: the compact master, and each moment as 8-bit codes of the dynamic quantization map with an fp32
  absolute-maximum scale per block of ``BLOCK8`` values (Dettmers et al. 2022, as bitsandbytes and
  torchao store them): 6.06 bytes.

An 8-bit moment is one uint8 buffer per unit: ``n`` codes, then ``n / BLOCK8`` fp32 scales. Units are
padded to multiples of 128 elements (model/adapter.py ALIGN), so blocks never straddle units and the
scales stay 4-byte aligned; everything that moves state (tier, checkpoint, spares) treats it as bytes.
"""
from __future__ import annotations

import functools

import torch

BLOCK8 = 128  # values per 8-bit block; a divisor of the units' alignment


def compact_master(state: str) -> bool:
    """Whether the master is bf16 hi + lo, hi doubling as the GPU's weights (no separate compute copy)."""
    return state != "fp32"


def moment_dtype(state: str) -> torch.dtype:
    return {"fp32": torch.float32, "compact": torch.bfloat16, "8bit": torch.uint8}[state]


def moment_numel(state: str, n: int) -> int:
    """Elements of one moment's buffer for a unit of ``n`` parameters (a multiple of BLOCK8 for 8bit)."""
    if state != "8bit":
        return n
    if n % BLOCK8:
        raise ValueError(f"8-bit moments need units padded to {BLOCK8} elements, got {n}")
    return n + 4 * (n // BLOCK8)


def moment_bytes(state: str, n: int) -> int:
    """Bytes of both moments of ``n`` parameters (``n`` rounded up to a block)."""
    n = -(-n // BLOCK8) * BLOCK8 if state == "8bit" else n
    return 2 * moment_numel(state, n) * moment_dtype(state).itemsize


def master_bytes(state: str) -> int:
    """Bytes a parameter of the master: fp32, or bf16 hi + lo."""
    return 4


def state_bytes(state: str, n: int) -> int:
    """Master and moments of ``n`` parameters: what a spare state or a GPU-trained unit holds besides its
    weights' copy (for compact formats the hi half is those weights)."""
    return master_bytes(state) * n + moment_bytes(state, n)


def split_moment(buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit moment buffer of ``n`` parameters as (codes uint8 [n], scales fp32 [n / BLOCK8])."""
    return buf[:n], buf[n:].view(torch.float32)


def _dynamic_map(signed: bool) -> list[float]:
    """The 256 values of the dynamic quantization map (Dettmers 2016, "8-bit approximations for
    parallelism"): per decade 10^-6 .. 10^0, midpoints of linearly spaced fractions in [0.1, 1], the
    finest decade nearest 1; plus 0 and 1. ``signed`` mirrors them (7 magnitude bits), else 8 bits of
    magnitude. The same values as bitsandbytes' and torchao's maps (tests/test_optim.py)."""
    decades, magnitude_bits = 7, 7
    values = []
    for i in range(decades):
        items = 2 ** (i + magnitude_bits - decades) + 1 if signed else 2 ** (i + magnitude_bits - decades + 1) + 1
        edges = torch.linspace(0.1, 1, items)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += (10 ** (i - decades + 1) * mids).tolist()  # (products in fp32, as those maps round them)
        if signed:
            values += (-(10 ** (i - decades + 1)) * mids).tolist()
    values += [0.0, 1.0]
    if len(values) != 256:
        raise AssertionError(len(values))
    return sorted(values)


@functools.lru_cache(maxsize=None)
def _qmaps() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(_dynamic_map(True), dtype=torch.float32),
            torch.tensor(_dynamic_map(False), dtype=torch.float32))


def qmap(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The sorted fp32 map: exp_avg's is signed, exp_avg_sq's unsigned (a copy kept per device)."""
    return _qmap_on(signed, torch.device(device))


@functools.lru_cache(maxsize=None)
def _qmap_on(signed: bool, device: torch.device) -> torch.Tensor:
    t = _qmaps()[0 if signed else 1]
    return t if device.type == "cpu" else t.to(device)


def nearest_codes(y: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The definition of a code: the nearest value of the sorted map ``q`` to ``y`` (in [-1, 1]), a midpoint
    rounding up (the largest q[c] <= y by a branch-free binary search, then one step up where y is past
    the midpoint, each in fp32 as bitsandbytes' and torchao's quantizers compute it). int64 codes."""
    c = torch.where(y >= q[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        c += torch.where(y >= q[c + step], step, 0)
    up = (c + 1).clamp_max(255)
    return torch.where(y - q[c] >= (q[up] - q[c]) * 0.5, up, c)


@functools.lru_cache(maxsize=None)
def code_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``nearest_codes`` as two lookups by the top 16 bits of y's fp32 pattern (its bf16 truncation):
    code = base[k] + (y >= threshold[k]). A binary search costs 8 dependent loads an element; the C++
    kernel's lookup costs two. Exact, because the code is monotone in y and no bucket of 2^16 fp32 values
    holds two of its jumps (the map is coarser than bf16 everywhere; checked here).
    Returns (base int32 [65536], threshold fp32 [65536], +inf where the bucket has no jump)."""
    q = qmap(signed)
    k = torch.arange(1 << 16, dtype=torch.int64)
    negative = k >= 1 << 15

    def value(t):  # the t-th smallest fp32 of each bucket (negative buckets count their low bits down)
        low = torch.where(negative, 0xFFFF - t, t)
        bits = (k << 16) | low
        return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)

    first, last = value(torch.zeros_like(k)), value(torch.full_like(k, 0xFFFF))
    finite = torch.isfinite(first) & torch.isfinite(last)
    base = torch.where(finite, nearest_codes(first.clamp(-1, 1), q), 0)
    top = torch.where(finite, nearest_codes(last.clamp(-1, 1), q), 0)
    if int((top - base).max()) > 1:
        raise AssertionError("a bf16 bucket holds two code jumps")
    lo, hi = torch.zeros_like(k), torch.full_like(k, 0xFFFF)  # the smallest t whose code passes base
    for _ in range(16):
        mid = (lo + hi) // 2
        past = nearest_codes(value(mid).clamp(-1, 1), q) > base
        hi, lo = torch.where(past, mid, hi), torch.where(past, lo, mid + 1)
    threshold = torch.where(top > base, value(lo), torch.tensor(float("inf")))
    return base.to(torch.int32), threshold
