"""A Hugging Face decoder-only LM, seen as units: embedding, each decoder layer, final norm + lm_head.

Notable choices:
- The model's own modules run the compute. The adapter builds them on the meta device (no memory)
  and the GPU window binds their parameters to views of a slot's flat buffer, so a layer's code is
  exactly Hugging Face's, for every family, and weights never live in a module.
- Each unit's parameters are laid out in one flat buffer, each tensor starting on a 128-element
  boundary (256 bytes in bf16) so that views stay aligned for matmuls and vector code.
- Tied embeddings: the single [vocab, hidden] matrix belongs to the embedding unit; the head unit
  then holds only the final norm and borrows the embedding's slot for its matmul.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError

# The families named and tested (tests/tiny.py); others are accepted by their structure (_config_missing,
# _structure_missing), less those whose model-level forward does what the engine's parts do not.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "phi3", "granite", "cohere", "gemma",
                         "gemma2", "gemma3_text", "qwen3_moe", "mixtral", "olmoe")
ALIGN = 128


class UnsupportedModelError(ValueError):
    """The architecture is not one the engine knows how to split into units."""


@dataclass(frozen=True)
class ParamSpec:
    key: str  # name in a Hugging Face checkpoint
    local: str  # name inside the unit's module ("" prefix for embed/head)
    shape: tuple[int, ...]
    offset: int  # into the unit's flat buffer, in elements

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class UnitSpec:
    index: int
    kind: str  # "embed" | "layer" | "head"
    layer: int | None  # decoder layer index for kind == "layer"
    params: tuple[ParamSpec, ...]
    numel: int  # padded size of the flat buffer
    no_decay: tuple[tuple[int, int], ...] = ()  # [begin, end) ranges weight decay leaves (``decays``)

    @property
    def name(self) -> str:
        return f"layer{self.layer}" if self.kind == "layer" else self.kind


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# transformers' Trainer decays no bias and no norm weight: these patterns of its get_decay_parameter_names, on
# the lower-cased name, or a parameter of an nn.LayerNorm
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decays(key: str, in_layer_norm: bool = False) -> bool:
    """Whether weight decay applies to the parameter of this checkpoint name, as transformers' Trainer groups
    them (the config's keys are its TrainingArguments', so a run means the same training)."""
    return not (in_layer_norm or _NO_DECAY.search(key.lower()))


def _layout(index: int, kind: str, layer: int | None, named: list[tuple[str, str, tuple[int, ...]]],
            layer_norms: frozenset[str] = frozenset()) -> UnitSpec:
    specs, off, no_decay = [], 0, []
    for key, local, shape in named:
        spec = ParamSpec(key=key, local=local, shape=tuple(shape), offset=off)
        specs.append(spec)
        if not decays(key, local in layer_norms):
            no_decay.append((off, off + spec.numel))
        off += _padded(spec.numel)
    return UnitSpec(index=index, kind=kind, layer=layer, params=tuple(specs), numel=off, no_decay=tuple(no_decay))


def _layer_norm_params(module: nn.Module, prefix: str = "") -> frozenset[str]:
    """The names (in ``module``, with ``prefix``) of the parameters of its nn.LayerNorm modules."""
    return frozenset(prefix + n for m_name, m in module.named_modules() if isinstance(m, nn.LayerNorm)
                     for n, _ in m.named_parameters(prefix=m_name))


class ModelAdapter:
    """Owns the meta-device skeleton of one model and its unit layout."""

    def __init__(self, config, compute_dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
        from transformers import AutoModelForCausalLM

        model_type = getattr(config, "model_type", None)
        if missing := _config_missing(config):
            raise UnsupportedModelError(f"model_type {model_type!r}: {missing}; slideformer trains decoder-only "
                                        f"models such as {', '.join(SUPPORTED_MODEL_TYPES)}")
        if bad := _bad_size(config):
            raise ConfigError(f"the model's config.json: {bad}")
        self.config = config
        self.model_type = model_type
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        # The skeleton's compute runs through the attention asked for (EngineConfig.attn_implementation), by
        # default SDPA whatever the checkpoint named (the window has no KV cache and flash-attn is optional),
        # or, where the attention scores are soft-capped (Gemma 2), which SDPA cannot do, transformers' eager
        # attention. The masks follow (built for this config).
        capped = getattr(config, "attn_logit_softcapping", None)
        if attn_implementation == "sdpa" and capped:
            raise UnsupportedModelError(f"model_type {model_type!r}: its attention scores are soft-capped "
                                        f"(attn_logit_softcapping={capped}), which SDPA cannot do; set "
                                        "attn_implementation to eager or flash_attention_2, or leave it unset")
        self.attn_implementation = attn_implementation or ("eager" if capped else "sdpa")
        config._attn_implementation = self.attn_implementation
        try:
            with torch.device("meta"):
                self.skeleton = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        except ValueError as e:  # (transformers: no causal LM class for this config, or not this attention)
            if self.attn_implementation == "sdpa" and "scaled_dot_product_attention" in str(e):
                raise UnsupportedModelError(f"model_type {model_type!r}: transformers runs its attention without "
                                            "SDPA; set attn_implementation: eager") from None
            raise UnsupportedModelError(f"model_type {model_type!r}: not a causal language model transformers "
                                        f"knows ({e})") from None
        if type(self.skeleton.config) is not type(config):  # (a composite config: its causal LM built from a part)
            raise UnsupportedModelError(f"model_type {model_type!r}: a composite config whose causal LM is built from "
                                        f"its {type(self.skeleton.config).__name__} part, which the engine's checks, "
                                        "masks and export would not read; not supported yet")
        if missing := _structure_missing(self.skeleton) or _noise(config):
            raise UnsupportedModelError(f"model_type {model_type!r}: {missing}; slideformer trains decoder-only "
                                        f"models such as {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.skeleton.train()
        from .moe import expert_params, experts_of

        self.experts, self.top_k = experts_of(config)  # (0, 0): dense
        inner = self.skeleton.model
        if self.experts and not any(expert_params(m, self.experts) for m in inner.layers):
            self.experts, self.top_k = 0, 0  # (every layer dense: mlp_only_layers, or a count the layers do not use)
        # Masks: per layer type where the config names them, else the model's forward takes the sliding one
        # for every layer wherever the config has a window (Mistral's, Phi-3's, Mixtral's code), or none.
        windowed = getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None
        code = _source(type(inner).forward) if windowed else ""
        if windowed and not code:
            raise UnsupportedModelError(f"model_type {model_type!r}: sliding_window={config.sliding_window} without "
                                        "layer_types, and its model's code cannot be read to tell which layers slide")
        self._all_sliding = "create_sliding_window_causal_mask" in code
        if unknown := sorted(set(getattr(config, "layer_types", None) or ()) - set(_MASKS)):
            raise UnsupportedModelError(f"model_type {model_type!r}: layers of type {', '.join(unknown)}: not "
                                        f"supported yet (the engine builds {' and '.join(_MASKS)} masks)")
        self.layers: list[nn.Module] = list(inner.layers)
        self.norm: nn.Module = inner.norm
        self.padding_idx = getattr(inner.embed_tokens, "padding_idx", None)
        self.num_layers = len(self.layers)
        self.units = self._build_units()
        # the attention types present (one mask and one rotary pair each), and whether the rotary module
        # rotates each type by its own frequencies (Gemma 3's takes the layer type)
        self.attention_types = sorted({self.layer_attention_type(i) for i in range(self.num_layers)})
        self._rotary_by_type = "layer_type" in inspect.signature(type(inner.rotary_emb).forward).parameters
        # What the model's own forward does around its layers, which the engine's embedding lookup and loss
        # head repeat: the embedding times a constant (Granite's embedding_multiplier), and the logits times
        # one (Cohere's logit_scale) or divided by one (Granite's logits_scaling).
        self.embed_scale = float(getattr(config, "embedding_multiplier", None) or 1.0)
        # Gemma 3's embedding scales itself by a constant rounded to the weights' dtype
        self.embed_scale_in_dtype = hasattr(inner.embed_tokens, "scalar_embed_scale")
        if self.embed_scale_in_dtype:
            self.embed_scale = float(inner.embed_tokens.scalar_embed_scale)
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        self.logit_divisor = float(getattr(config, "logits_scaling", None) or 1.0)
        if self.logit_divisor != 1.0:  # (Granite divides by it, HyperCLOVA X multiplies: as its forward reads)
            code = _source(type(self.skeleton).forward)
            if re.search(r"\*\s*self\.config\.logits_scaling", code):
                self.logit_scale, self.logit_divisor = self.logit_scale * self.logit_divisor, 1.0
            elif not re.search(r"logits\s*/\s*self\.config\.logits_scaling", code):
                raise UnsupportedModelError(f"model_type {model_type!r}: logits_scaling={self.logit_divisor} "
                                            "applied other than to the logits: not supported yet")
        # Gemma 2's logits soft-capped, cap * tanh(logits / cap), after any scale (the loss head does it)
        cap = getattr(config, "final_logit_softcapping", None)
        self.logit_softcap = float(cap) if cap else None

    @property
    def head_norm(self) -> nn.Module:
        """The final norm as the loss head runs it: with the logits' scale folded into its output (the
        head's product is linear), its ``weight`` the norm's own."""
        scale = self.logit_scale / self.logit_divisor
        return self.norm if scale == 1.0 else _Scaled(self.norm, scale)

    # -- layout -------------------------------------------------------------------------------
    def _build_units(self) -> list[UnitSpec]:
        inner = self.skeleton.model
        units = [_layout(0, "embed", None, [("model.embed_tokens.weight", "weight", tuple(inner.embed_tokens.weight.shape))])]
        for i, layer in enumerate(self.layers):
            named = [(f"model.layers.{i}.{n}", n, tuple(p.shape)) for n, p in layer.named_parameters()]
            units.append(_layout(i + 1, "layer", i, named, _layer_norm_params(layer)))
        head = [("model.norm.weight", "norm.weight", tuple(inner.norm.weight.shape))]
        if not self.tied:
            head.append(("lm_head.weight", "lm_head.weight", tuple(self.skeleton.lm_head.weight.shape)))
        units.append(_layout(len(units), "head", None, head, _layer_norm_params(inner.norm, "norm.")))
        return units

    @property
    def embed_unit(self) -> UnitSpec:
        return self.units[0]

    @property
    def head_unit(self) -> UnitSpec:
        return self.units[-1]

    def layer_unit(self, layer: int) -> UnitSpec:
        return self.units[layer + 1]

    def checkpoint_keys(self) -> dict[str, tuple[UnitSpec, ParamSpec]]:
        return {p.key: (u, p) for u in self.units for p in u.params}

    @property
    def num_params(self) -> int:
        return sum(p.numel for u in self.units for p in u.params)

    # -- compute helpers ------------------------------------------------------------------------
    def rotary(self, device: torch.device) -> nn.Module:
        """The model's rotary embedding, materialised on ``device`` (it is a buffer, not a weight)."""
        with torch.device(device):
            return type(self.skeleton.model.rotary_emb)(config=self.config)

    def positions(self, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """``rotary``'s (cos, sin) per attention type: the same pair for all, or, where the layers of each
        type rotate by their own frequencies, each type's."""
        if not self._rotary_by_type:
            pair = rotary(hidden, position_ids)
            return dict.fromkeys(self.attention_types, pair)
        return {t: rotary(hidden, position_ids, t) for t in self.attention_types}

    def embed_scaled(self, h: torch.Tensor) -> torch.Tensor:
        """The embedding lookup ``h`` (or its gradient) times the model's embedding scale, as its forward does."""
        if self.embed_scale == 1.0:
            return h
        return h * (torch.tensor(self.embed_scale, dtype=h.dtype, device=h.device) if self.embed_scale_in_dtype
                    else self.embed_scale)

    def layer_attention_type(self, layer: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types is not None:
            return types[layer]
        return "sliding_attention" if self._all_sliding else "full_attention"

    def attention_masks(self, embeds: torch.Tensor, attention_mask, position_ids) -> dict:
        """One mask per attention type present, built by transformers' own mask functions."""
        from transformers import masking_utils

        out = {}
        for kind in self.attention_types:
            fn = getattr(masking_utils, _MASKS[kind])
            params = inspect.signature(fn).parameters
            kw = dict(config=self.config, inputs_embeds=embeds, attention_mask=attention_mask,
                      position_ids=position_ids)
            kw["past_key_values" if "past_key_values" in params else "cache"] = None
            if "cache_position" in params:
                kw["cache_position"] = torch.arange(embeds.shape[1], device=embeds.device)
            out[kind] = fn(**kw)
        return out


def _source(fn) -> str:
    """A function's source, or "" where Python cannot read it (no .py file beside it)."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


_MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


class _Scaled(nn.Module):
    """``module(x) * scale``, exposing the module's ``weight``."""

    def __init__(self, module: nn.Module, scale: float):
        super().__init__()
        self.inner, self.scale = module, scale

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _bad_size(config) -> str | None:
    """A size no model has (a hand-edited config.json), in words: found here, not as an error deep in the
    planner or the skeleton."""
    text = config.get_text_config()

    def size(key):  # (None where the config has no one value: absent, per layer, or a list)
        try:
            v = getattr(text, key, None)
        except (AttributeError, RuntimeError):  # (transformers: a per-layer attribute asked as one)
            return None
        return None if isinstance(v, (list, tuple, dict)) else v

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size"):
        v = size(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return f"{key} is {v!r}; it must be a whole number >= 1"
    heads, kv = size("num_attention_heads"), size("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        return f"num_key_value_heads {kv} does not divide num_attention_heads {heads}"
    return None


def _config_missing(config) -> str | None:
    """What a config asks of the compute that the engine's own parts (the embedding lookup, the loss
    head) do not do yet, in words; None where nothing is missing."""
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (the engine trains decoder-only models)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention): not a causal language model's training"
    for key, neutral, what in (("scale_emb", 1, "a scaled embedding"), ("scale_depth", None, "scaled residuals")):
        if getattr(config, key, neutral) not in (neutral, None):
            return f"{what} ({key}={getattr(config, key)}): not supported yet"

    return None


def _noise(config) -> str | None:
    """Random noise a model's forward draws in training (dropout, router jitter): backward recomputes each layer
    and would draw it again, differently."""
    keys = [k for k in sorted(config.to_dict()) if re.search(r"dropout|pdrop|jitter", k)
            and not k.startswith(("classifier", "summary"))]  # (heads the engine does not train)
    for key in keys:
        v = getattr(config, key, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
            return (f"random noise in the forward ({key}={getattr(config, key)}), which backward's recompute would draw "
                    f"again, differently; set {key}: 0 in the model's config.json to fine-tune it")
    return None


def _structure_missing(skeleton: nn.Module) -> str | None:
    """The parts the engine splits a model into (an embedding lookup, a stack of decoder layers of one
    kind, a final norm, rotary positions and an unbiased linear head), named where one is missing."""
    inner = getattr(skeleton, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    if isinstance(emb, nn.Embedding) and type(emb) is not nn.Embedding and not hasattr(emb, "scalar_embed_scale"):
        return f"an embedding of its own kind ({type(emb).__name__}): not supported yet"
    needs = {"model.embed_tokens (an nn.Embedding)": isinstance(emb, nn.Embedding),
             "model.layers (a list of decoder layers)": isinstance(getattr(inner, "layers", None), nn.ModuleList),
             "model.norm": isinstance(getattr(inner, "norm", None), nn.Module),
             "model.rotary_emb": isinstance(getattr(inner, "rotary_emb", None), nn.Module),
             "lm_head (an nn.Linear without bias)": type(getattr(skeleton, "lm_head", None)) is nn.Linear
             and skeleton.lm_head.bias is None}
    absent = [k for k, ok in needs.items() if not ok]
    if absent:
        return f"no {', no '.join(absent)}"
    kinds = {type(layer).__name__ for layer in inner.layers}
    if len(kinds) > 1:
        return f"decoder layers of several kinds ({', '.join(sorted(kinds))})"
    layer, kind = inner.layers[0], kinds.pop() if kinds else ""
    norm_params = sorted(n for n, _ in inner.norm.named_parameters())
    if norm_params != ["weight"]:
        return f"a final norm with parameters {norm_params or 'none'} (the engine's loss head takes a weight only)"
    if not isinstance(getattr(layer, "mlp", None), nn.Module):
        return f"decoder layers ({kind}) without an mlp module"
    if buffers := sorted({n for m in inner.layers for n, _ in m.named_buffers()}):
        return f"decoder layers ({kind}) that hold buffers ({', '.join(buffers[:3])}), which the engine does not load"
    params = inspect.signature(type(layer).forward).parameters
    if extra := [n for n, p in params.items() if n not in _LAYER_INPUTS and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]:
        return f"decoder layers ({kind}) that take {', '.join(extra)} from the model's forward"
    return None


# What the engine passes a decoder layer (engine.py's _run_layer), and what transformers' layers take unused.
_LAYER_INPUTS = {"self", "hidden_states", "attention_mask", "position_ids", "position_embeddings", "past_key_values",
                 "past_key_value", "use_cache", "cache_position", "output_attentions", "output_router_logits"}


def bind_parameters(module: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """Point ``module``'s parameters at ``params`` (views of a slot's flat buffer)."""
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        sub._parameters[leaf] = p
