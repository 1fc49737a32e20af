"""Stream a Hugging Face safetensors checkpoint into the training state: the host store's flat fp32
masters, or the GPU's for units trained there.

Tensors are read one at a time through safetensors' memory map and copied (with the dtype cast)
straight into their slot in the unit's flat buffer, so the model is never held twice in RAM; a unit is
committed (its compute copy refreshed, or its master written to the NVMe tier or the GPU) once all its
tensors are in.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..host.store import HostStore
from ..model.adapter import ModelAdapter

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BASE = "model."  # the causal LM's name for its base model, before the base model's tensor names


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match the model."""


def checkpoint_files(path: str | os.PathLike) -> list[tuple[Path, set[str] | None]]:
    """The files a model folder's weights are read from, each with the keys to take from it (None: all), as
    transformers picks them: ``model.safetensors`` where there is one, else the shards the index maps each
    key to (a key also in another shard, a stale copy, is not taken from that one)."""
    root = Path(path)
    if (root / SINGLE).is_file():
        return [(root / SINGLE, None)]
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise ValueError("its weight_map is not a map of tensor names to file names")
        except (ValueError, KeyError, TypeError) as e:  # (a JSON error is a ValueError; a list has no key)
            why = e if isinstance(e, ValueError) else "no weight_map"
            raise CheckpointError(f"{root / INDEX}: not a valid safetensors index ({why}); save the model again "
                                  "with transformers' save_pretrained") from e
        keys: dict[str, set[str]] = {}
        for key, name in weight_map.items():
            keys.setdefault(name, set()).add(key)
        files = [(root / name, keys[name]) for name in sorted(keys)]
        missing = [str(f) for f, _ in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint shard(s) listed in {root / INDEX} are missing: {', '.join(missing)}")
        return files
    bins = sorted(p.name for p in root.glob("*.bin")) if root.is_dir() else []
    raise CheckpointError(f"no {SINGLE} or {INDEX} in {root}: slideformer loads safetensors checkpoints"
                          + (f" (found {bins[0]}: convert it with transformers, from_pretrained then "
                             "save_pretrained(..., safe_serialization=True))" if bins else ""))


def readable_weights(path: str | os.PathLike) -> None:
    """CheckpointError naming the first weight file of ``path`` whose header or size is not a whole
    safetensors file's (truncated or corrupt); no tensor is read."""
    for file, _ in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:  # (safetensors' own error types)
            raise CheckpointError(f"cannot read checkpoint shard {file}: {e} (truncated or corrupt?)") from e


class _UnitWriter:
    """Collects a unit's parameters into its master and commits the unit when all have arrived: straight
    into RAM, or (master on the NVMe tier or the GPU) into a temporary buffer written there at once, so
    that only the units still being filled are ever held in RAM; a GPU unit's buffer is on the GPU (an
    embedding's is a GiB or more, which a host budget has no room for)."""

    def __init__(self, store: HostStore):
        self.store = store
        self.open: dict[int, tuple[torch.Tensor, set[str]]] = {}

    def put(self, unit, spec, value: torch.Tensor, row: int = 0, last: bool = True) -> None:
        """``value``: the parameter, or its rows from ``row`` on (``last``: the final block of them). Another
        rank's unit is skipped: its owner writes it."""
        if not self.store.owns(unit.index):
            return
        if unit.index not in self.open:
            buf = self.store.master[unit.index]
            if buf is None:
                on = self.store.gpu.device if self.store.is_resident(unit.index) else "cpu"
                buf = torch.zeros(unit.numel, dtype=self.store.master_dtype, device=on)
            self.open[unit.index] = (buf, set())
        buf, seen = self.open[unit.index]
        buf[spec.offset: spec.offset + spec.numel].view(spec.shape)[row: row + value.shape[0]].copy_(value)
        if not last:
            return
        seen.add(spec.key)
        if len(seen) == len(unit.params):
            self.store.set_master(unit.index, buf)
            del self.open[unit.index]


class _Layout:
    """transformers' own conversions from a family's checkpoint layout to its modules' (conversion_mapping):
    names renamed (Mixtral's ``block_sparse_moe.`` is ``mlp.``), and each expert's tensors, as the Hub holds
    Qwen3-MoE, Mixtral and OLMoE, stacked into the fused parameter a layer's experts share. A fused
    parameter is built by transformers' operations once its layer's experts are all read, then let go."""

    def __init__(self, adapter: ModelAdapter, wanted: dict):
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming

            steps = get_checkpoint_conversion_mapping(adapter.model_type) or []
        except (ImportError, ValueError, KeyError):  # (a transformers without them: names as they are)
            steps = []
        self.renames = [t for t in steps if isinstance(t, WeightRenaming)]
        self.merges = [t for t in steps if isinstance(t, WeightConverter)]
        self.wanted, self.experts = wanted, adapter.experts
        self.parts: dict[str, tuple] = {}  # target key -> (its converter, {source pattern: {expert: tensor}})

    def name(self, stored: str) -> str:
        for t in self.renames:
            stored = t.rename_source_key(stored)[0]
        return stored

    def merge(self, key: str) -> tuple | None:
        """(the fused key this stored tensor is a part of, its converter, its source pattern, its expert), or
        None."""
        index = re.search(r"experts\.(\d+)\.", key)
        for c in self.merges if index and self.experts else ():
            target, pattern = c.rename_source_key(key)
            if pattern is not None and target in self.wanted:
                return target, c, pattern, int(index.group(1))
        return None

    def add(self, target: str, c, pattern: str, expert: int, t: torch.Tensor) -> torch.Tensor | None:
        """The fused tensor once every part of ``target`` is in, else None."""
        parts = self.parts.setdefault(target, (c, {}))[1]
        parts.setdefault(pattern, {})[expert] = t
        if sum(len(v) for v in parts.values()) < self.experts * len(c.source_patterns):
            return None
        del self.parts[target]
        stacked = {p: [parts[p][e] for e in range(self.experts)] for p in c.source_patterns if p in parts}
        for op in c.operations:
            stacked = op.convert(stacked, source_patterns=c.source_patterns, target_patterns=c.target_patterns)
        (fused,) = stacked.values()
        return fused


def load_safetensors(path: str | os.PathLike, adapter: ModelAdapter, store: HostStore) -> None:
    wanted = adapter.checkpoint_keys()
    seen: set[str] = set()
    writer = _UnitWriter(store)
    layout = _Layout(adapter, wanted)
    for file, mapped in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = set(f.keys())
                for stored in f.keys():
                    # (the base model saved alone, LlamaModel's save_pretrained: its names lack the prefix, as
                    # transformers reads them; a name stored with it too is the one taken)
                    key = stored if stored in wanted or BASE + stored not in wanted or BASE + stored in names \
                        else BASE + stored
                    key = key if key in wanted else layout.name(key)
                    if mapped is not None and stored not in mapped:
                        continue  # (a stale copy)
                    part = None if key in wanted else layout.merge(key)
                    if part is not None:
                        unit, spec = wanted[part[0]]
                        if part[0] in seen or not store.owns(unit.index):  # (another rank's: its owner reads it)
                            seen.add(part[0])
                            continue
                        fused = layout.add(*part, f.get_tensor(stored))
                        if fused is None:
                            continue
                        key, t, stored = part[0], fused, f"{part[0]} (its experts' tensors)"
                    elif key not in wanted or key in seen:
                        continue  # e.g. a tied lm_head.weight, rotary buffers saved by old versions
                    else:
                        unit, spec = wanted[key]
                        if not store.owns(unit.index):  # another rank's unit: not read (its owner does)
                            seen.add(key)
                            continue
                        t = f.get_tensor(stored)
                    if tuple(t.shape) != spec.shape:
                        raise CheckpointError(f"{file}: {stored} has shape {tuple(t.shape)}, the config implies "
                                              f"{spec.shape}")
                    writer.put(unit, spec, t)
                    seen.add(key)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise CheckpointError(f"cannot read checkpoint shard {file}: {e} (truncated or corrupt?)") from e
    missing = sorted(set(wanted) - seen)
    if missing == ["lm_head.weight"]:  # (a head tied to the embedding, its config saying otherwise)
        raise CheckpointError(f"checkpoint {path} holds no lm_head.weight, and its config.json unties the head "
                              "(tie_word_embeddings: false); where the head is the embedding, set tie_word_embeddings: "
                              "true there, else the folder lacks the head's file")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")


INIT_PIECE = 1 << 26  # elements of a random matrix drawn at once on the device (256 MiB in fp32)


def random_init(adapter: ModelAdapter, store: HostStore, seed: int = 0, device: str | torch.device = "cpu") -> None:
    """Hugging Face's default init (normal(0, initializer_range), norms as the model initialises them: at 1,
    or 0 where they scale by 1 + weight; biases at 0), per unit.

    The random numbers are drawn on ``device``: on a GPU this takes seconds for billions of weights. A
    matrix over INIT_PIECE elements is drawn and stored in row blocks, so that neither the GPU nor the
    host holds more than one block beside the engine's own memory (an fp32 [vocab, hidden] is 1.5-2 GiB:
    more than a tight gpu_memory_limit leaves, and a host budget would count it).
    """
    std = getattr(adapter.config, "initializer_range", 0.02)
    gen = torch.Generator(device=device).manual_seed(seed)
    writer = _UnitWriter(store)
    for u in adapter.units:
        for spec in u.params:
            if spec.key.endswith("norm.weight"):
                v = _norm_init(adapter.skeleton, spec.key, spec.shape)
            elif spec.key.endswith(".bias"):
                v = torch.zeros(spec.shape)
            else:
                n, rest = spec.shape[0], spec.shape[1:]
                rows = max(1, INIT_PIECE // math.prod(rest)) if math.prod(spec.shape) > INIT_PIECE else n
                for r in range(0, n, rows):
                    v = torch.empty((min(rows, n - r), *rest), device=device).normal_(0.0, std, generator=gen)
                    writer.put(u, spec, v, row=r, last=r + rows >= n)
                continue
            writer.put(u, spec, v)


def _norm_init(skeleton: torch.nn.Module, key: str, shape: tuple) -> torch.Tensor:
    """A norm's weight as transformers initialises it (its ``_init_weights`` on a copy of the module): 1, or 0
    where the norm scales by 1 + weight (Gemma's); 1 where the model's init leaves it alone."""
    try:
        module = copy.deepcopy(skeleton.get_submodule(key.rsplit(".", 1)[0])).to_empty(device="cpu")
        with torch.no_grad():
            module.weight.fill_(float("nan"))
        skeleton._init_weights(module)
        v = module.weight.detach().float()
        if tuple(v.shape) == tuple(shape) and bool(torch.isfinite(v).all()):
            return v
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    return torch.ones(shape)


def trainable_module(model) -> torch.nn.Module:
    """``model`` as ``SlideEngine(model)`` trains it: a Hugging Face causal LM whose weights are loaded
    (``load_state_from_module`` refuses frozen parameters: the engine updates every one); ``torch.compile``'s
    wrapper is looked through (its parameters are the model's)."""
    from ..config import ConfigError

    model = getattr(model, "_orig_mod", model)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise ConfigError(f"SlideEngine(model) takes a Hugging Face causal LM (a torch module with a config), got "
                          f"{type(model).__name__}; for a model folder use SlideEngine.from_pretrained(path), for a "
                          "config SlideEngine.from_config(config)")
    if meta := [n for n, p in model.named_parameters() if p.device.type == "meta"]:
        raise CheckpointError(f"model's {meta[0]} (and {len(meta) - 1} more) is on the meta device: its weights "
                              "were never loaded; load them (from_pretrained), or use SlideEngine.from_pretrained")
    return model


def load_state_from_module(model: torch.nn.Module, adapter: ModelAdapter, store: HostStore) -> None:
    """Copy an in-memory Hugging Face model's weights into the store (``trainable_module``'s), every one
    trainable: the engine updates them all, as AdamW over ``model.parameters()`` does where none is frozen."""
    state, wanted = model.state_dict(), adapter.checkpoint_keys()
    for key, (unit, spec) in wanted.items():
        if key not in state:
            raise CheckpointError(f"model has no parameter {key}" + (
                " (it is wrapped: pass the Hugging Face model itself)" if any(k.endswith(key) for k in state) else ""))
        if tuple(state[key].shape) != spec.shape:
            raise CheckpointError(f"model's {key} has shape {tuple(state[key].shape)}, its config implies "
                                  f"{spec.shape}; make model.config match the model")
    # (after the names: a wrapper, PEFT's, freezes the base model, and is refused for its names first)
    if frozen := [n for n, p in model.named_parameters() if not p.requires_grad]:
        from ..config import ConfigError

        raise ConfigError(f"model has {len(frozen)} frozen parameter(s) (requires_grad False, e.g. {frozen[0]}): "
                          "slideformer trains every parameter (full fine-tuning) and would update them; unfreeze "
                          "them (model.requires_grad_(True)), or train the frozen setup with plain PyTorch")
    writer = _UnitWriter(store)
    for key, (unit, spec) in wanted.items():
        writer.put(unit, spec, state[key])
