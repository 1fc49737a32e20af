"""Mixture-of-Experts layers (model/moe.py): the router's load-balancing loss as transformers computes it, and
experts without tokens."""
import copy

import pytest
import torch

from slideformer import SlideEngine

from test_engine_parity import assert_same, engine_train, reference_noise, reference_train
from tiny import batch, build, engine_config


def padded(seed: int, rows: int = 2, seq: int = 12, pad: int = 4) -> dict:
    """A batch whose rows end in ``pad`` padding tokens: masked out of attention, labels and routing counts."""
    b = batch(97, b=rows, s=seq, seed=seed)
    mask = torch.ones(rows, seq, dtype=torch.long)
    mask[:, seq - pad:] = 0
    b["attention_mask"] = mask
    b["labels"] = b["labels"].masked_fill(mask == 0, -100)
    return b


def test_router_loss_counts_unpadded_tokens_and_accumulates_like_one_batch():
    """Two micro-batches a step with padding: the engine's loss and training equal transformers' on the step as
    one batch (its load-balancing loss over the attention mask's tokens, times router_aux_loss_coef), and the
    loss is not the one without it."""
    model = build("qwen3-moe")
    halves = [[padded(s), padded(s + 7, rows=3)] for s in range(3)]
    whole = [{k: torch.cat([h[k] for h in step]) for k in step[0]} for step in halves]
    state, losses = engine_train(model, halves, lr=1e-2)
    ref, ref_losses = reference_train(model, whole, lr=1e-2)
    assert_same(state, ref, losses, ref_losses, reference_noise(model, whole, lr=1e-2))
    plain = copy.deepcopy(model)
    plain.config.output_router_logits = False
    _, plain_losses = engine_train(plain, halves, lr=1e-2)
    assert plain_losses[0] < losses[0] - 0.1  # (coefficient 0.5 times a loss near 2 for 4 experts, 2 a token)


def test_an_expert_without_tokens_gets_a_zero_gradient_and_still_decays():
    """Sixteen experts, one a token, three tokens: most experts receive none. Their gradient is exactly zero
    (their first moment stays 0) and AdamW still applies weight decay to them, as PyTorch's AdamW does to a
    3-D parameter's slice whose gradient is zero; the experts that were used moved otherwise."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from tiny import COMMON

    cfg = Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=16, num_experts_per_tok=1, moe_intermediate_size=8,
                         tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    step = batch(97, b=1, s=3, ignore=False)
    with torch.no_grad():  # which experts each layer routes to (transformers' own router)
        out = model(input_ids=step["input_ids"], output_router_logits=True)
    # (the last token predicts nothing, and causal attention lets nothing else read it: its expert learns nothing)
    used = [set(logits[:-1].topk(1, dim=-1).indices.flatten().tolist()) for logits in out.router_logits]
    lr, wd = 1e-2, 0.1
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, lr=lr, weight_decay=wd)) as eng:
        eng.train_step(step)
        eng.synchronize()
        for i, chosen in enumerate(used):
            unit = eng.adapter.layer_unit(i)
            spec = next(p for p in unit.params if p.key.endswith("experts.gate_up_proj"))
            m = eng.store.exp_avg[unit.index][spec.offset: spec.offset + spec.numel].view(spec.shape)
            after = eng.store.master[unit.index][spec.offset: spec.offset + spec.numel].view(spec.shape)
            before = model.state_dict()[spec.key]
            for e in range(16):
                if e in chosen:
                    assert m[e].abs().sum() > 0
                    assert not torch.allclose(after[e], before[e] * (1 - lr * wd), rtol=1e-6, atol=0)
                else:
                    assert torch.equal(m[e], torch.zeros_like(m[e]))  # an exact zero gradient
                    torch.testing.assert_close(after[e], before[e] * (1 - lr * wd), rtol=1e-7, atol=0)
        assert sum(len(c) for c in used) < len(used) * 16 // 2  # (most experts idle: the test says something)


def test_evaluation_reports_the_router_loss_apart():
    """evaluate: the loss as transformers computes it (its load-balancing part included), and that part alone,
    so that perplexity is of the cross-entropy."""
    model = build("qwen3-moe")
    held = padded(3)
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, loss_kernel="torch")) as eng:
        r = eng.evaluate(held)
    with torch.no_grad():
        full = model(**held).loss.item()
        plain = copy.deepcopy(model)
        plain.config.output_router_logits = False
        ce = plain(**held).loss.item()
    assert r.router_loss > 0.1 and abs(r.loss - full) < 1e-5 * full and abs(r.loss - r.router_loss - ce) < 1e-5 * ce


@pytest.mark.parametrize("family, shard", [("qwen3-moe", None), ("mixtral", None), ("olmoe", None),
                                           ("mixtral", "30KB")])
def test_a_checkpoint_in_the_hubs_layout_loads(tmp_path, family, shard):
    """transformers saves (and the Hub holds) these families' experts one tensor each, Mixtral's under
    block_sparse_moe; its own conversions stack them into the fused parameters the modules hold. The engine
    reads the folder as transformers does: the same weights, whichever layout (a layer's experts across
    shards too)."""
    import json

    from slideformer import EngineConfig

    model = build(family)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    index = tmp_path / "model.safetensors.index.json"
    keys = json.loads(index.read_text())["weight_map"] if shard else None
    if keys is None:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            keys = dict.fromkeys(f.keys())
    assert any(".experts.0." in k for k in keys)  # (the per-expert layout, not the fused one)
    if shard:
        assert len(set(keys.values())) > 1
    with SlideEngine.from_pretrained(tmp_path, EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
        state = eng.state_dict()
    ref = model.state_dict()
    assert set(state) == {k for k in ref if k in state} and len(state) >= len(ref) - 1
    for k, v in state.items():
        assert torch.equal(v, ref[k]), k


def test_router_logits_the_engine_cannot_count_are_refused_in_one_line():
    """JetMoE's router logits are recorded from two kinds of module (attention's and the MLP's routers): a
    refusal naming the key to set, not an AttributeError."""
    from transformers import AutoModelForCausalLM, JetMoeConfig

    from slideformer import EngineConfig
    from slideformer.model.adapter import UnsupportedModelError

    cfg = JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, kv_channels=16, intermediate_size=32, num_local_experts=4,
                       num_experts_per_tok=2, output_router_logits=True)
    with pytest.raises(UnsupportedModelError, match="'jetmoe': output_router_logits is set but transformers records "
                                                    "its router logits from several modules.*set it false"):
        SlideEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu", compute_dtype=torch.float32))


def test_a_family_whose_forward_adds_no_router_loss_trains_without_one():
    """AfMoE's forward (as Llama 4's) returns the router logits under output_router_logits but adds no
    load-balancing loss, whatever router_aux_loss_coef says: the engine adds none either, so its loss is
    transformers' (it added coef x aux: 1.0 more here)."""
    from transformers import AfmoeConfig, AutoModelForCausalLM

    cfg = AfmoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, num_dense_layers=1, max_position_embeddings=64,
                      output_router_logits=True, tie_word_embeddings=False)
    cfg.router_aux_loss_coef = 0.5
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().requires_grad_(True)  # (its expert_bias is frozen)
    held = batch(97)
    with torch.no_grad():
        ref = model(**held).loss.item()
    with SlideEngine(model, engine_config(device="cpu", compute_dtype=torch.float32, loss_kernel="torch")) as eng:
        assert eng.router_loss is None
        r = eng.evaluate(held)
    assert abs(r.loss - ref) < 1e-5 * ref and r.router_loss == 0
