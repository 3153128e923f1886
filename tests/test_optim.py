import math

import pytest
import torch
from torch import nn

from fp8train.train.optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm, lr_lambda, optimizer_step


def _cos_ref(peak, low, progress):
    """Independent closed form: cosine from peak to low."""
    return low + (peak - low) * (1 + math.cos(math.pi * progress)) / 2


# ------------------------------------------------------------------------------------------- schedules


def test_wsd_paper_cpt_values():
    # The paper's CPT: 40,000 steps, 5,000 warmup, peak 1e-4, cosine to 1e-5 over the last 5,000.
    cfg = OptimConfig(lr=1e-4, min_lr=1e-5, schedule="wsd", warmup_steps=5000, decay_steps=5000)
    f = lr_lambda(cfg, 40_000)
    assert f(0) == 1 / 5000                       # first step trains at peak / warmup, not 0
    assert f(2499) == 0.5                         # iteration 2,500: halfway up
    assert f(4999) == 1.0                         # end of warmup: peak
    assert f(20_000) == 1.0                       # middle of stable
    assert f(34_999) == 1.0                       # iteration 35,000: the checkpoint the decay restarts from
    assert 1e-4 * f(35_000) == pytest.approx(_cos_ref(1e-4, 1e-5, 1 / 5000), rel=1e-12)  # decay start
    assert f(35_000) < 1.0
    assert 1e-4 * f(37_499) == pytest.approx((1e-4 + 1e-5) / 2, rel=1e-12)  # decay midpoint
    assert 1e-4 * f(39_999) == pytest.approx(1e-5, rel=1e-12)               # last step: min_lr
    assert f(39_999) == 0.1
    assert f(50_000) == f(39_999)                 # past the end: stays at min


def test_wsd_through_lambdalr_every_step():
    peak, low, total, warmup, decay = 3e-3, 3e-4, 20, 4, 6
    model = nn.Linear(4, 4)
    cfg = OptimConfig(lr=peak, min_lr=low, schedule="wsd", warmup_steps=warmup, decay_steps=decay, weight_decay=0.0)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, total)
    seen = []
    for _ in range(total):
        seen.append([g["lr"] for g in opt.param_groups])
        model(torch.randn(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert all(a == b for a, b in seen)  # both groups share the schedule
    lrs = [s[0] for s in seen]
    expected = ([peak * i / warmup for i in range(1, warmup + 1)] + [peak] * (total - warmup - decay)
                + [_cos_ref(peak, low, k / decay) for k in range(1, decay + 1)])
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[warmup - 1] == peak and lrs[total - decay - 1] == peak
    assert lrs[total - decay + decay // 2 - 1] == pytest.approx((peak + low) / 2, rel=1e-12)
    assert lrs[-1] == pytest.approx(low, rel=1e-12)
    assert all(a > b for a, b in zip(lrs[total - decay - 1:], lrs[total - decay:]))  # strictly decreasing


def test_wsd_decay_ratio_default():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, schedule="wsd", warmup_steps=10)  # decay_ratio 0.1 -> 10 of 100
    f = lr_lambda(cfg, 100)
    assert f(89) == 1.0 and f(90) < 1.0 and f(94) == pytest.approx(0.5, abs=1e-15) and f(99) == 0.0


def test_cosine_paper_sft_values():
    # SFT (1.5B): 5% warmup, peak 5e-5 -> 5e-6, cosine to the end.
    cfg = OptimConfig(lr=5e-5, min_lr=5e-6, schedule="cosine", warmup_ratio=0.05, weight_decay=0.0)
    f = lr_lambda(cfg, 1000)  # 50 warmup steps, 950 decay
    assert f(0) == 1 / 50
    assert f(49) == 1.0
    assert 5e-5 * f(50) == pytest.approx(_cos_ref(5e-5, 5e-6, 1 / 950), rel=1e-12)
    assert 5e-5 * f(49 + 475) == pytest.approx((5e-5 + 5e-6) / 2, rel=1e-12)
    assert 5e-5 * f(999) == pytest.approx(5e-6, rel=1e-12)
    vals = [f(s) for s in range(1000)]
    assert all(a < b for a, b in zip(vals[:49], vals[1:50])) and all(a > b for a, b in zip(vals[49:], vals[50:]))


def test_warmup_ratio_rounds_up_and_steps_take_precedence():
    assert lr_lambda(OptimConfig(schedule="cosine", warmup_ratio=0.05), 30)(1) == 1.0  # ceil(1.5) = 2 steps
    assert lr_lambda(OptimConfig(schedule="cosine", warmup_ratio=0.05), 20)(0) == 1.0  # 0.05*20 is 1, not 2
    cfg = OptimConfig(schedule="cosine", warmup_steps=4, warmup_ratio=0.5)
    assert lr_lambda(cfg, 100)(3) == 1.0 and lr_lambda(cfg, 100)(2) == 0.75


def test_constant_and_no_warmup():
    f = lr_lambda(OptimConfig(schedule="constant", warmup_steps=3), 10)
    assert [f(s) for s in range(6)] == [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0] and f(1000) == 1.0
    assert lr_lambda(OptimConfig(schedule="wsd", decay_steps=2), 10)(0) == 1.0
    g = lr_lambda(OptimConfig(lr=1.0, min_lr=0.25, schedule="cosine"), 4)
    assert [g(s) for s in range(4)] == pytest.approx([_cos_ref(1, 0.25, k / 4) for k in range(1, 5)], rel=1e-15)


@pytest.mark.parametrize("kwargs, total, match", [
    (dict(schedule="wsd", warmup_steps=60, decay_steps=50), 100, "decay_steps"),
    (dict(schedule="wsd", warmup_steps=95, decay_ratio=0.1), 100, "decay_ratio"),
    (dict(schedule="cosine", warmup_steps=101), 100, "warmup_steps"),
    (dict(schedule="cosine", warmup_ratio=0.5), 0, "total_steps"),
])
def test_schedule_does_not_fit(kwargs, total, match):
    with pytest.raises(ValueError, match=match):
        lr_lambda(OptimConfig(**kwargs), total)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), r"optim\.lr must be > 0"),
    (dict(lr=-1e-4), r"optim\.lr must be > 0"),
    (dict(lr="1e-4"), r"optim\.lr must be a number"),  # what YAML 1.1 makes of 1e-4
    (dict(lr=float("nan")), r"optim\.lr must be finite"),
    (dict(lr=1e-5, min_lr=1e-4), r"optim\.min_lr .* must be <= optim\.lr"),
    (dict(min_lr=-1.0), r"optim\.min_lr must be >= 0"),
    (dict(betas=(0.9, 1.0)), r"optim\.betas\[1\] must be < 1"),
    (dict(betas=(0.9,)), r"optim\.betas must be a pair"),
    (dict(eps=0.0), r"optim\.eps must be > 0"),
    (dict(weight_decay=-0.1), r"optim\.weight_decay must be >= 0"),
    (dict(grad_clip=-1.0), r"optim\.grad_clip must be >= 0"),
    (dict(schedule="linear"), r"optim\.schedule must be one of"),
    (dict(warmup_steps=-1), r"optim\.warmup_steps must be >= 0"),
    (dict(warmup_steps=2.5), r"optim\.warmup_steps must be an integer"),
    (dict(warmup_ratio=1.0), r"optim\.warmup_ratio must be < 1"),
    (dict(decay_steps=True), r"optim\.decay_steps must be an integer"),
    (dict(decay_ratio=1.5), r"optim\.decay_ratio must be <= 1"),
    (dict(impl="apex"), r"optim\.impl must be one of"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_config_normalizes_yaml_values():
    cfg = OptimConfig(lr=1, betas=[0.9, 0.95])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.betas == (0.9, 0.95)


# ---------------------------------------------------------------------------------------- weight decay


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: must appear once
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))


def _names(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_weight_decay_groups():
    torch.manual_seed(0)
    model = _Tiny()
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert (decay["name"], decay["weight_decay"], no_decay["name"], no_decay["weight_decay"]) == \
        ("decay", 0.1, "no_decay", 0.0)
    assert _names(model, decay["params"]) == ["embed.weight", "proj.weight"]
    assert _names(model, no_decay["params"]) == ["scale", "proj.bias", "norm.weight", "norm.bias"]  # named_parameters order
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8
    # deterministic: a second build yields the same order
    opt2 = build_optimizer(model, OptimConfig(lr=1e-3))
    assert [_names(model, g["params"]) for g in opt2.param_groups] == \
        [_names(model, g["params"]) for g in opt.param_groups]


def test_weight_decay_applies_only_to_decay_group():
    torch.manual_seed(0)
    model = _Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # every parameter non-zero and distinct
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam update is exactly 0: only decoupled decay moves weights
    opt.step()
    for n, p in model.named_parameters():
        if n in ("embed.weight", "proj.weight"):
            torch.testing.assert_close(p, before[n] * (1 - 0.5 * 0.1), rtol=1e-6, atol=0)
            assert not torch.equal(p, before[n])
        else:
            assert torch.equal(p, before[n]), n


def test_optimizer_rejects_non_fp32_and_picks_foreach_on_cpu():
    opt = build_optimizer(nn.Linear(4, 4), OptimConfig())
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    assert build_optimizer(nn.Linear(4, 4), OptimConfig(impl="fused")).param_groups[0]["fused"] is True
    with pytest.raises(ValueError, match=r"optim\.impl: triton: .*(Triton|CUDA)"):
        build_optimizer(nn.Linear(4, 4), OptimConfig(impl="triton"))  # CPU parameters (or no Triton)
    with pytest.raises(ValueError, match=r"parameter 'weight' is torch.bfloat16"):
        build_optimizer(nn.Linear(4, 4).to(torch.bfloat16), OptimConfig())


# ------------------------------------------------------------------------------------------- clipping


def _params_with_grads(*grads):
    params = []
    for g in grads:
        p = nn.Parameter(torch.ones(len(g)))
        p.grad = torch.tensor(g, dtype=torch.float32)
        params.append(p)
    return params


def test_clip_grad_norm_clips_and_returns_float():
    params = _params_with_grads([3.0, 4.0], [12.0])  # norm 13
    norm = clip_grad_norm(params, 1.0)
    assert isinstance(norm, float) and norm == 13.0
    clipped = torch.cat([p.grad for p in params])
    torch.testing.assert_close(clipped, torch.tensor([3.0, 4.0, 12.0]) / (13.0 + 1e-6))
    assert clipped.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norm_below_threshold_and_measure_only():
    params = _params_with_grads([3.0, 4.0])
    assert clip_grad_norm(params, 10.0) == 5.0
    assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0]))
    assert clip_grad_norm(params, 0.0) == 5.0 and clip_grad_norm(params, None) == 5.0
    assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0]))


def test_clip_grad_norm_module_and_missing_grads():
    model = nn.Linear(3, 2)
    assert clip_grad_norm(model, 1.0) == 0.0  # no grads yet
    model(torch.ones(1, 3)).sum().backward()  # weight grad all ones (6), bias grad ones (2): norm sqrt(8)
    assert clip_grad_norm(model, 100.0) == pytest.approx(math.sqrt(8), rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_grad_norm_reports_non_finite(bad):
    params = _params_with_grads([3.0, bad], [1.0])
    norm = clip_grad_norm(params, 1.0)
    assert not math.isfinite(norm) and (math.isnan(norm) == math.isnan(bad))
    assert params[1].grad.item() == 1.0  # left untouched for the caller to skip the step


# ------------------------------------------------------------------------- clip folded into the step


def _model_and_grads(seed: int, grad_std: float, steps: int):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    grads = [[torch.randn(p.shape, generator=g) * grad_std for p in model.parameters()] for _ in range(steps)]
    return model, grads


def _run(fold: bool, fused: bool, grad_std: float, steps: int = 4, max_norm: float = 1.0, clip: bool = True):
    """`steps` AdamW steps over fixed gradients: `optimizer_step` (fold) or clip_grad_norm then step."""
    model, grads = _model_and_grads(0, grad_std, steps)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1, impl="fused" if fused else "foreach"))
    norms = []
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        if fold:
            norms.append(optimizer_step(opt, model, max_norm))
        else:
            norms.append(clip_grad_norm(model, max_norm if clip else 0.0))
            opt.step()
        assert not hasattr(opt, "grad_scale")
    return torch.cat([p.detach().flatten() for p in model.parameters()]), norms, opt


def test_fused_optimizer_step_folds_the_clip_into_adamw():
    """Fused AdamW (CPU fused kernels in torch >= 2.4) divides the gradients by grad_scale inside its step.
    Clipping active (norm ~100 > 1): one clipped gradient is g * c (clip) or g / (1 / c) (folded), each
    within 2 FP32 roundings (2**-23 relative); Adam's update m / (sqrt(v) + eps) then moves by at most
    ~2x that relative, and the parameter's own rounding may flip one ulp per step: |dp| <=
    steps x 2**-21 x (max|p| + lr) with lr 1e-2 and |update| <= ~1. Not clipping (norm ~0.1 < 1): the
    folded scale is exactly 1 and the result is clip-then-step bit for bit."""
    steps, lr = 4, 1e-2
    folded, norms, opt = _run(True, True, grad_std=10.0, steps=steps)
    assert opt.param_groups[0]["fused"] and min(norms) > 50  # clipping was active every step
    reference, ref_norms, _ = _run(False, True, grad_std=10.0, steps=steps)
    assert norms == ref_norms  # the norm before clipping, measured the same way
    bound = steps * 2.0**-21 * (reference.abs().max().item() + lr)
    assert (folded - reference).abs().max().item() <= bound
    unclipped, _, _ = _run(False, True, grad_std=10.0, steps=steps, clip=False)
    assert (unclipped - reference).abs().max().item() > 100 * bound  # the bound would catch a lost clip

    small, small_norms, _ = _run(True, True, grad_std=1e-2, steps=steps)
    assert max(small_norms) < 1.0
    assert torch.equal(small, _run(False, True, grad_std=1e-2, steps=steps)[0])


def test_foreach_optimizer_step_is_clip_then_step_bit_for_bit():
    folded, norms, opt = _run(True, False, grad_std=10.0)
    assert opt.param_groups[0]["foreach"] and not opt.param_groups[0]["fused"]
    reference, ref_norms, _ = _run(False, False, grad_std=10.0)
    assert torch.equal(folded, reference) and norms == ref_norms


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_step_skips_non_finite_and_on_request(fused):
    model, (grads,) = _model_and_grads(1, 1.0, 1)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, impl="fused" if fused else "foreach"))
    before = [p.detach().clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    first = next(model.parameters())
    first.grad[0, 0] = float("nan")
    assert math.isnan(optimizer_step(opt, model, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    assert math.isnan(first.grad[0, 0]) and first.grad[0, 1] == grads[0][0, 1]  # left for the caller
    first.grad[0, 0] = 0.0
    norm = optimizer_step(opt, model, 1.0, skip=True)  # e.g. a non-finite loss with finite gradients
    assert math.isfinite(norm) and not opt.state and not hasattr(opt, "grad_scale")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert optimizer_step(opt, model, 0.0) == pytest.approx(norm, rel=1e-6)  # measure-only clip still steps
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_optimizer_step_takes_the_norm_enqueued_before(impl):
    """The trainer enqueues `gradient_norm` before its loss read and hands it to `optimizer_step` as `norm`: the
    same norm and, bit for bit, the same update as `optimizer_step` measuring it itself; with `skip`, no step."""
    from fp8train.train.optim import gradient_norm

    results = []
    for enqueued in (False, True):
        model, (grads,) = _model_and_grads(1, 10.0, 1)
        opt = build_optimizer(model, OptimConfig(lr=1e-2, impl=impl))
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        norm = gradient_norm(opt, model) if enqueued else None
        assert norm is None or (norm.ndim == 0 and norm.dtype == torch.float32)
        value = optimizer_step(opt, model, 1.0, norm=norm)
        results.append((value, torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert results[0][0] == results[1][0] > 1.0  # clipping active
    assert torch.equal(results[0][1], results[1][1])
    model, (grads,) = _model_and_grads(1, 10.0, 1)
    opt = build_optimizer(model, OptimConfig(lr=1e-2, impl=impl))
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    assert optimizer_step(opt, model, 1.0, skip=True, norm=gradient_norm(opt, model)) == results[0][0]
    assert optimizer_step(opt, model, 1.0, skip=True, norm=torch.tensor(3.0)) == 3.0  # the one given is used
    assert not opt.state


def test_restore_step_impl_keeps_the_built_step_across_a_checkpoint():
    """A checkpoint's param_groups carry the saving run's `fused` / `foreach` flags, which load_state_dict
    restores; `restore_step_impl` puts back the ones this optimizer was built with (`optim.impl` is free to
    change on resume) and the step counters where that step keeps them; the state itself is the checkpoint's."""
    from fp8train.train.optim import restore_step_impl

    model, (grads,) = _model_and_grads(0, 1.0, 1)
    saved_opt = build_optimizer(model, OptimConfig(lr=1e-2, impl="foreach"))
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    saved_opt.step()
    fused = build_optimizer(model, OptimConfig(lr=1e-2, impl="fused"))
    built = [{k: v for k, v in g.items() if k != "params"} for g in fused.param_groups]
    fused.load_state_dict(saved_opt.state_dict())
    assert not fused.param_groups[0]["fused"]  # what torch does: the saving run's flags
    restore_step_impl(fused, built)
    assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
    first = next(model.parameters())
    assert fused.state[first]["step"].item() == 1 and fused.state[first]["step"].dtype == torch.float32
    fused.step()  # the fused step runs on the restored state
    assert fused.state[first]["step"].item() == 2


def test_only_a_fused_step_skips_on_the_device():
    """`optimizer_step_on_device` needs an optimizer that reads `found_inf` (torch's fused AdamW, TritonAdamW):
    foreach AdamW is refused, with the function to use instead; with torch's fused AdamW a set flag leaves the
    parameters and the step count as they were, and a clear one steps."""
    from fp8train.train.optim import optimizer_step_on_device, skips_on_device

    p = torch.nn.Parameter(torch.randn(8))
    p.grad = torch.randn(8)
    foreach = torch.optim.AdamW([p], foreach=True)
    assert not skips_on_device(foreach)
    with pytest.raises(ValueError, match="use optimizer_step"):
        optimizer_step_on_device(foreach, [p], 1.0, p.grad.norm(), torch.ones(()))
    fused = torch.optim.AdamW([p], fused=True)
    before = p.detach().clone()
    optimizer_step_on_device(fused, [p], 1.0, p.grad.norm(), torch.ones((), dtype=torch.bool))
    assert torch.equal(p.detach(), before) and float(fused.state[p]["step"]) == 0
    assert not hasattr(fused, "found_inf") and not hasattr(fused, "grad_scale")  # set for the one step only
    optimizer_step_on_device(fused, [p], 1.0, p.grad.norm(), torch.zeros((), dtype=torch.bool))
    assert not torch.equal(p.detach(), before) and float(fused.state[p]["step"]) == 1
