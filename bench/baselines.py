"""The baselines users would otherwise pick, run by the benchmark harness (`slideformer bench --system
deepspeed|torchao`, from a checkout): DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU,
and torchao's CPUOffloadOptimizer. Kept out of the installed package: users do not install our
competitors' harness."""
from __future__ import annotations

import os

import torch

from slideformer.bench.harness import _head_step, random_batch, sync


def run_torchao(args, config):
    """torchao's CPUOffloadOptimizer as its README runs it: an fp32 model on the GPU under bf16 autocast,
    the fused torch AdamW on pinned host copies, gradients moved to the host as backward produces them."""
    if args.device != "cuda":
        raise SystemExit("torchao's CPUOffloadOptimizer needs a CUDA device")
    from torchao.optim import CPUOffloadOptimizer
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    args.fused_ops = "none"
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=1e-5)
    gen = torch.Generator().manual_seed(0)

    def step():
        loss = _head_step(args, config, model, gen, autocast=True)
        opt.step()  # waits for every host update and the weights' copy back
        opt.zero_grad()
        return loss

    return sum(p.numel() for p in model.parameters()), step, (lambda: sync(args)), (lambda: {}), None


def run_deepspeed(args, config):
    import deepspeed
    from transformers import AutoModelForCausalLM

    args.fused_ops = "none"  # transformers' modules

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed()
    ds = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "bf16": {"enabled": True}, "gradient_clipping": args.max_grad_norm or 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    config._attn_implementation = "sdpa"
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    n_params = sum(p.ds_numel for p in model.parameters())
    if args.ds_loss == "fused":  # the full [tokens x vocab] logits of HF's loss do not fit a 24 GiB cap at b32
        model = _FusedLossLM(model)
        deepspeed.zero.register_external_parameter(model, model.lm.lm_head.weight)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    gen = torch.Generator().manual_seed(0)

    def step():
        ids = random_batch(config.vocab_size, args.batch, args.seq, gen)["input_ids"].to(args.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    return n_params, step, lambda: sync(args), (lambda: {}), None


class _FusedLossLM(torch.nn.Module):
    """An HF causal LM whose loss is our fused linear cross-entropy, so DeepSpeed's ZeRO-3 sees the
    lm_head weight used inside this module's forward (registered as an external parameter)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        from slideformer.kernels import fused_linear_cross_entropy

        h = self.lm.model(input_ids=input_ids).last_hidden_state
        shifted = torch.full_like(labels, -100)
        shifted[:, :-1] = labels[:, 1:]
        return SimpleNamespace(loss=fused_linear_cross_entropy(h, self.lm.lm_head.weight, shifted))
