import pytest
import torch

from slideformer.optim import adamw_update_, lr_at


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", [1, 37, 1000])
def test_adamw_matches_torch(wd, n):
    torch.manual_seed(n)
    p = torch.randn(n)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        adamw_update_(p, g.clone(), m, v, step=step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


def test_bf16_grad_is_cast_and_scaled():
    torch.manual_seed(0)
    p, g = torch.randn(50), torch.randn(50).bfloat16()
    a, b = p.clone(), p.clone()
    ma, va, mb, vb = (torch.zeros(50) for _ in range(4))
    adamw_update_(a, g, ma, va, step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  grad_coef=0.5, scratch=torch.empty(64))
    adamw_update_(b, g.float() * 0.5, mb, vb, step=1, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert torch.equal(a, b) and torch.equal(va, vb)
    with pytest.raises(ValueError, match="scratch"):
        adamw_update_(a, g, ma, va, step=2, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_schedules_match_transformers():
    from transformers import get_scheduler

    for kind in ("constant", "linear", "cosine"):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=2.0)
        name = "constant_with_warmup" if kind == "constant" else kind
        sched = get_scheduler(name, opt, num_warmup_steps=3, num_training_steps=10)
        for step in range(10):
            assert lr_at(step, 2.0, kind, warmup_steps=3, total_steps=10) == pytest.approx(sched.get_last_lr()[0])
            opt.step()
            sched.step()
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_at(0, 1.0, "step")
