"""Token-chunked MLPs: a bound on one layer's memory for sequences too long for micro-batches to bound.

The engine recomputes each layer in backward from its saved input, and autograd then holds the MLP's
intermediates (about 10 x ffn bf16 values per token) for every token of the micro-batch. Micro-batches
bound that down to one sequence. The MLP acts on each token alone, so for a longer sequence it can run
chunk by chunk, each chunk under its own checkpoint: backward then holds one chunk's intermediates at a
time, for one more MLP forward. Without gradients (the engine's forward pass) the chunks just run in turn.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class MlpChunking:
    """Wraps the ``forward`` of each given MLP (whatever is bound there, Liger's included); ``tokens``,
    shared by all of them and set by the engine per placement, is the chunk size, or None: whole."""

    def __init__(self, mlps: list[nn.Module], tokens: int | None = None):
        self.tokens = tokens
        for m in mlps:
            m.forward = self._chunked(m.forward)

    def _chunked(self, forward):
        def run(x: torch.Tensor) -> torch.Tensor:
            n = self.tokens
            if n is None or x.numel() <= n * x.shape[-1]:
                return forward(x)
            # (each chunk a sequence of its own: a Mixture-of-Experts block reads [batch, seq, hidden])
            chunks = x.reshape(1, -1, x.shape[-1]).split(n, dim=1)
            if torch.is_grad_enabled():
                out = [checkpoint(forward, c, use_reentrant=False, preserve_rng_state=False) for c in chunks]
            else:
                out = [forward(c) for c in chunks]
            return torch.cat(out, dim=1).view(*x.shape[:-1], -1)
        run.__wrapped__ = forward  # (what it runs whole: model/recompute.py swiglu_mlp reads it)
        return run
