"""Mixture-of-Experts layers: what the planner and the engine need to know of them, and the router's
load-balancing loss.

A Hugging Face MoE decoder layer (Qwen3-MoE, Mixtral, OLMoE) holds its experts as 3-D parameters of one
module and runs them through transformers' experts implementation ("grouped_mm" on CUDA: one grouped GEMM
for all experts, not a loop). The engine streams such a layer like any other; an expert that received no
token gets an exact zero gradient (its slice of the 3-D gradient is never written) and AdamW still decays
it, as PyTorch's AdamW does a parameter whose gradient is zero.

The load-balancing loss (Switch Transformer; transformers' ``load_balancing_loss_func``, added to the loss
times ``router_aux_loss_coef`` when ``output_router_logits`` is set) is a function of every layer's
routing: E x sum_e f_e P_e, with f_e the share of (unpadded) tokens whose top-k includes expert e and P_e
its mean router probability, both over all layers. The engine computes it over the whole step, as over
one batch, so accumulation trains like one large batch: forward counts f and P layer by layer (no
gradient); backward's recompute of a layer adds the loss's gradient through that layer's router
probabilities, coef x E x f_e / R per token and expert (R: the step's unpadded tokens times the
layers). f is a count (top-k has no gradient), so this is the whole gradient.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def experts_of(config) -> tuple[int, int]:
    """(experts, experts per token) of a config; (0, 0) for a dense model."""
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    return (n, getattr(config, "num_experts_per_tok", None) or 0) if n > 1 else (0, 0)


def expert_params(layer: nn.Module, experts: int) -> int:
    """The parameters of a layer that belong to its experts (3-D, one slice an expert)."""
    return sum(p.numel() for p in layer.parameters() if p.dim() == 3 and p.shape[0] == experts)


def forward_adds_router_loss(adapter) -> bool:
    """Whether the family's forward adds the load-balancing loss where output_router_logits is set: most MoE
    families' does; AfMoE's, Llama 4's and a few others' only return the logits, so the engine adds none for
    them either (a forward whose source cannot be read: as most)."""
    from .adapter import _source

    src = _source(type(adapter.skeleton).forward)
    return not src or "load_balancing_loss_func" in src


class RouterLoss:
    """The step's load-balancing loss (module docstring): one owner of its counts, fed by forward hooks on
    each layer's router (the module class transformers records ``router_logits`` from)."""

    def __init__(self, adapter):
        cfg = adapter.config
        self.experts, self.top_k = experts_of(cfg)
        self.coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
        rec = getattr(type(adapter.skeleton.model), "_can_record_outputs", {}).get("router_logits")
        if rec is None or not hasattr(rec, "target_class"):  # (none, or several recorders: JetMoE's)
            from .adapter import UnsupportedModelError

            raise UnsupportedModelError(f"model_type {adapter.model_type!r}: output_router_logits is set but "
                                        "transformers records " + ("no router logits" if rec is None else
                                                                   "its router logits from several modules")
                                        + " for it, which the engine does not count yet; set it false")
        self._index = getattr(rec, "index", 0)
        self._phase: str | None = None  # "count" (forward), "grad" (backward's recompute), None: ignore
        self._mask: torch.Tensor | None = None
        self._seen = 0  # tokens of the micro-batch routed so far in this layer
        self._logits: list[torch.Tensor] = []
        for layer in adapter.layers:
            for m in layer.modules():
                if isinstance(m, rec.target_class):
                    m.register_forward_hook(self._hook)
        self.counts = self.probs = None
        self.rows = 0.0

    def begin_step(self, device) -> None:
        self.counts = torch.zeros(self.experts, dtype=torch.float32, device=device)
        self.probs = torch.zeros(self.experts, dtype=torch.float32, device=device)
        self.rows = torch.zeros((), dtype=torch.float32, device=device)

    @contextlib.contextmanager
    def counting(self, mask: torch.Tensor):
        """Forward of one micro-batch through a layer: its routing counts (``mask``: [tokens] 1 or 0)."""
        self._phase, self._mask, self._seen = "count", mask, 0
        try:
            yield
        finally:
            self._phase = None

    @contextlib.contextmanager
    def recording(self, mask: torch.Tensor):
        """Backward's recompute of one micro-batch through a layer: yields a function giving the loss's term
        for that layer and micro-batch, whose gradient is the loss's (None where the layer has no router)."""
        self._phase, self._mask, self._logits = "grad", mask, []
        try:
            yield self._term
        finally:
            self._phase = None

    def _hook(self, module, args, output) -> None:
        if self._phase is None:
            return
        logits = output[self._index] if isinstance(output, tuple) else output
        if self._phase == "grad":
            self._logits.append(logits)
            return
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        # (token-chunked MLPs route a chunk at a time, in token order)
        mask = self._mask[self._seen: self._seen + probs.shape[0]].to(torch.float32)
        self._seen += probs.shape[0]
        self.counts.scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(self.top_k))
        self.probs += (probs.float() * mask.unsqueeze(-1)).sum(0)
        self.rows += mask.sum()

    def _term(self) -> torch.Tensor | None:
        if not self._logits:
            return None
        probs = torch.softmax(torch.cat(self._logits), dim=-1)  # (token chunks come in token order)
        self._logits = []
        weight = self.coef * self.experts * self.counts / self.rows ** 2  # d loss / d P_e's sum
        return (probs.float() * self._mask.to(torch.float32).unsqueeze(-1) * weight).sum()

    def combine(self, sum_all) -> None:
        """The counts summed over the ranks of a data-parallel step (``sum_all``: parallel.sum_all), so that
        the loss and its gradient are the global batch's."""
        both = sum_all(torch.cat([self.counts, self.probs, self.rows.view(1)]))
        self.counts, self.probs, self.rows = both[: self.experts], both[self.experts: -1], both[-1]

    def loss(self) -> torch.Tensor:
        """coef x the step's load-balancing loss (once forward has counted every layer)."""
        share, prob = self.counts / self.rows, self.probs / self.rows  # (transformers' order of operations)
        return (share * prob).sum() * self.experts * self.coef
