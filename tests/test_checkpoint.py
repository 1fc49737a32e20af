"""Disk <-> host: loading (sharded or not), bad checkpoints, and export back to transformers."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slideformer import CheckpointError, EngineConfig, SlideEngine

from tiny import batch, build, engine_config

CPU = dict(device="cpu", compute_dtype=torch.float32)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_load_is_bit_identical(tmp_path, shard):
    model = build("qwen2")
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kw)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    with SlideEngine.from_pretrained(tmp_path, engine_config(**CPU)) as eng:
        state = eng.state_dict()
        ref = model.state_dict()
        assert set(state) <= set(ref)
        assert all(torch.equal(state[k], ref[k]) for k in state)


def test_missing_shard_is_named(tmp_path):
    build("llama").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        SlideEngine.from_pretrained(tmp_path, engine_config(**CPU))


def test_a_head_the_config_unties_and_the_files_lack_names_the_fix(tmp_path):
    """A tied model's files (no lm_head.weight) under a config that says untied: the line names the key to
    set, not only the tensor missing."""
    build("qwen3-tied").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match="holds no lm_head.weight.*set tie_word_embeddings: true"):
        SlideEngine.from_pretrained(tmp_path, engine_config(**CPU))


def test_truncated_shard_is_named(tmp_path):
    build("llama").save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        SlideEngine.from_pretrained(tmp_path, engine_config(**CPU))


def _loaded(path):
    with SlideEngine.from_pretrained(path, engine_config(**CPU)) as eng:
        return eng.state_dict()


def _same_as(state, model):
    ref = model.state_dict()
    return all(torch.equal(state[k], ref[k]) for k in state)


def test_the_weights_transformers_would_read_are_read(tmp_path):
    """A folder holding both a single file and an index (an earlier save's shards left beside a later one):
    transformers reads the single file; a key also in another shard than the index maps it to (a stale copy)
    is read from the index's shard; the base model saved alone (LlamaModel: names without "model.") loads."""
    from safetensors.torch import load_file, save_file

    old, new = build("llama"), build("llama")
    with torch.no_grad():
        for q in new.parameters():
            q.add_(1.0)
    old.save_pretrained(tmp_path / "both", max_shard_size="20KB")
    new.save_pretrained(tmp_path / "both")  # (the single file: transformers' choice)
    assert (tmp_path / "both" / "model.safetensors.index.json").is_file()
    assert _same_as(_loaded(tmp_path / "both"), AutoModelForCausalLM.from_pretrained(tmp_path / "both"))
    assert _same_as(_loaded(tmp_path / "both"), new)
    # a stale zero copy of a key in the first shard, the index naming its real one
    model, d = build("llama"), tmp_path / "dup"
    model.save_pretrained(d, max_shard_size="20KB")
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    first = sorted(set(wm.values()))[0]
    key = next(k for k, f in sorted(wm.items()) if f != first and k.startswith("model.layers."))
    tensors = load_file(d / first)
    tensors[key] = torch.zeros_like(model.state_dict()[key])
    save_file(tensors, d / first, metadata={"format": "pt"})
    assert _same_as(_loaded(d), model) and _same_as(_loaded(d), AutoModelForCausalLM.from_pretrained(d))
    # the base model's own save: every name without the causal LM's "model." (tied head: nothing else needed)
    tied = build("qwen3-tied")
    tied.model.save_pretrained(tmp_path / "bare")
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "bare" / "model.safetensors"))
    assert _same_as(_loaded(tmp_path / "bare"), tied)


@pytest.mark.parametrize("index", ['{"weight_map": ["a"]}', '["weight_map"]', '{"weight_map": {"a": 1}}',
                                   '{"metadata": {}}', "{"])
def test_a_malformed_index_is_named(tmp_path, index):
    build("llama").config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a valid safetensors index"):
        SlideEngine.from_pretrained(tmp_path, engine_config(**CPU))


def test_a_pytorch_bin_folder_is_told_how_to_convert(tmp_path):
    model = build("llama")  # (as older transformers saved: transformers 5 writes safetensors only)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="found pytorch_model.bin: convert it with transformers"):
        SlideEngine.from_pretrained(tmp_path, engine_config(**CPU))


def test_export_loads_in_transformers(tmp_path):
    model = build("qwen3-tied")
    with SlideEngine(model, engine_config(lr=1e-2, **CPU)) as eng:
        eng.train_step(batch(97))
        eng.save_pretrained(tmp_path, dtype=torch.float32)
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ref = loaded.state_dict()
    assert all(torch.equal(state[k], ref[k]) for k in state)
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    out = loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_sharded_export_round_trips(tmp_path, monkeypatch, family):
    """Shards and their index under the names written (a MoE's: each expert's), read back by the engine and
    by transformers."""
    from safetensors import safe_open

    from slideformer.checkpoint import export

    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 10_000)
    model = build(family)
    with SlideEngine(model, engine_config(**CPU)) as eng:
        eng.save_pretrained(tmp_path, dtype=torch.float32)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    files = {}
    for key, name in index.items():
        files.setdefault(name, set()).add(key)
    for name, keys in files.items():
        with safe_open(str(tmp_path / name), framework="pt") as f:
            assert set(f.keys()) == keys
    assert sum(len(k) for k in files.values()) == len(index) and len(files) == len(list(tmp_path.glob("model-*")))
    with SlideEngine.from_pretrained(tmp_path, engine_config(**CPU)) as eng:
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in eng.state_dict().items())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items())


def test_an_export_of_several_ranks_is_undone_on_every_rank_when_one_ranks_part_fails(tmp_path, monkeypatch):
    """Each rank renames its own units' files into place: where rank 1's rename fails, rank 0 (whose part went
    in) puts back what it replaced (``agree``: parallel.together, which raises on every rank), so the folder
    holds the earlier export whole, never rank 0's new shards beside rank 1's old ones."""
    import os

    from slideformer.checkpoint import export

    monkeypatch.setattr(export, "MAX_SHARD_BYTES", 10_000)
    model = build("llama")
    out = tmp_path / "out"

    def agree_with(other):
        def agree(err):
            if err is not None or other is not None:
                raise err or other
        return agree

    with SlideEngine(model, engine_config(lr=1e-2, **CPU)) as eng:
        owner = [u.index % 2 for u in eng.adapter.units]
        assert set(export.files_of(eng.adapter, torch.float32, owner, 1))  # (rank 1 writes some shards)

        def save(rank, other=None):
            staged = export.stage_pretrained(out, eng.adapter, eng.store, torch.float32, owner, rank)
            export.place_pretrained(out, eng.adapter, torch.float32, staged, owner, rank, agree=agree_with(other))

        for rank in (0, 1):
            save(rank)
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        eng.train_step(batch(97))
        real, calls = os.replace, []

        def refused(src, dst, *a, **k):  # (rank 1's second shard; putting back its first is allowed)
            calls.append(dst)
            if len(calls) == 2:
                raise PermissionError(13, "Permission denied", str(dst))
            return real(src, dst, *a, **k)

        failed = PermissionError(13, "rank 1's part failed")
        with pytest.raises(PermissionError, match="rank 1's part failed"):
            save(0, other=failed)  # (its files went in; rank 1's error comes through agree)
        monkeypatch.setattr(os, "replace", refused)
        with pytest.raises(PermissionError, match="Permission denied"):
            save(1)
        monkeypatch.setattr(os, "replace", real)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_random_init_draws_large_matrices_in_blocks(monkeypatch):
    """A matrix over INIT_PIECE elements is drawn block by block (the GPU holds one block, not the whole
    embedding): every row is drawn, each block differently, at the config's std."""
    from slideformer.checkpoint import loader

    monkeypatch.setattr(loader, "INIT_PIECE", 100)  # the tiny embedding [97, 32]: blocks of 3 rows
    calls, put = [], loader._UnitWriter.put

    def spy(self, unit, spec, value, row=0, last=True):
        if spec.key == "model.embed_tokens.weight":
            calls.append((row, value.shape[0], last))
        return put(self, unit, spec, value, row, last)

    monkeypatch.setattr(loader._UnitWriter, "put", spy)
    # bf16 compute: the GPU's copy is written from the master only once the unit is complete
    with SlideEngine.from_config(build("llama").config, EngineConfig(device="cpu", compute_dtype=torch.bfloat16)) as e:
        w = e.state_dict()["model.embed_tokens.weight"]
        copy = e.store.weights[e.adapter.embed_unit.index]
        assert torch.equal(copy[: w.numel()], w.flatten().bfloat16())
    assert calls == [(r, min(3, 97 - r), r == 96) for r in range(0, 97, 3)]
    assert w.shape == (97, 32) and bool((w.abs().sum(1) > 0).all())
    assert not torch.equal(w[0:3], w[3:6])
    assert 0.015 < float(w.std()) < 0.025


def test_save_pretrained_keeps_the_source_models_sampling_defaults(tmp_path):
    """An engine made by from_pretrained writes the folder's generation_config.json with its weights (generate
    reads its eos and sampling from there); one from a config or a module has none to write."""
    from transformers import GenerationConfig

    build("llama").save_pretrained(tmp_path / "src")
    GenerationConfig(eos_token_id=[2, 7], temperature=0.6, do_sample=True).save_pretrained(tmp_path / "src")
    with SlideEngine.from_pretrained(tmp_path / "src", engine_config(**CPU)) as eng:
        eng.save_pretrained(tmp_path / "out")
        eng.save_pretrained(tmp_path / "src")  # (over its own source: the file stays as it is)
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [2, 7]
    assert GenerationConfig.from_pretrained(tmp_path / "src").temperature == 0.6
    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.save_pretrained(tmp_path / "mod")
    assert not (tmp_path / "mod" / "generation_config.json").exists()


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma3", "olmo2"])
def test_random_init_sets_norms_as_transformers_does(family):
    """from_config's norms are transformers' init of them: 1, or 0 for Gemma's, which scale by 1 + weight (at
    1 they started at twice their scale)."""
    config = build(family).config
    reference = AutoModelForCausalLM.from_config(config).state_dict()
    with SlideEngine.from_config(config, engine_config(**CPU, attn_implementation="eager")) as e:
        norms = {k: v for k, v in e.state_dict().items() if k.endswith("norm.weight")}
    assert norms and all(torch.equal(v, reference[k]) for k, v in norms.items())
    assert {float(v[0]) for v in norms.values()} == ({0.0} if family.startswith("gemma") else {1.0})


@pytest.mark.parametrize("family", ["olmo2", "phi3", "mistral-sliding", "granite", "cohere", "gemma3", "gemma", "gemma2",
                                    "qwen3-moe", "mixtral", "olmoe"])
def test_each_familys_export_gives_the_engines_logits(tmp_path, family):
    """A trained model of each family exported and loaded in transformers gives the logits of the same
    Hugging Face model holding the engine's weights; the files hold what transformers' own save_pretrained
    writes of it (the Hub's layout: a MoE's experts one tensor each, which vLLM and converters read)."""
    from safetensors.torch import load_file

    model = build(family)
    ids = torch.tensor([[5, 9, 2, 40, 7, 3]])
    with SlideEngine(model, engine_config(lr=1e-2, **CPU)) as eng:
        eng.train_step(batch(97))
        eng.save_pretrained(tmp_path, dtype=torch.float32)
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    ours = load_file(tmp_path / "model.safetensors")
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    model.save_pretrained(tmp_path / "hf")
    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (".experts.0." in "".join(ours)) == bool(getattr(model.config, "num_experts", 0)
                                                    or getattr(model.config, "num_local_experts", 0))
    # (Gemma 2's soft-capped attention runs eagerly, as transformers advises for it)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=model.config._attn_implementation)
    with torch.no_grad():  # (weights read from a file sit at other alignments, which some CPUs' kernels round
        for p in loaded.parameters():  # differently: copies, aligned as the model's own)
            p.data = p.data.clone()
    assert type(loaded) is type(model) and not torch.equal(state["model.embed_tokens.weight"],
                                                           build(family).model.embed_tokens.weight)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_checkpoint_of_a_model_with_more_layers_is_refused(tmp_path):
    """A model with fewer layers found its own units' files and took them, training on silently."""
    from slideformer.checkpoint.state import CorruptCheckpointError

    with SlideEngine(build("llama"), engine_config(device="cpu", compute_dtype=torch.float32)) as big:
        big.train_step(batch(97))
        big.save_checkpoint(tmp_path / "ck")
        layers = big.adapter.num_layers
    small = build("llama")
    small.model.layers = small.model.layers[:1]
    small.config.num_hidden_layers = 1
    with SlideEngine(small, engine_config(device="cpu", compute_dtype=torch.float32)) as eng:
        assert layers > 1
        with pytest.raises(CorruptCheckpointError, match=r"holds the state of layer1.*this model \(1 layers\)"):
            eng.load_checkpoint(tmp_path / "ck")
