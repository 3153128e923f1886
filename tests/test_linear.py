"""FP8Linear: the three GEMMs against FP64 and against an independent fake-quant reference.

SQNR thresholds: E4M3 rounds to 3 mantissa bits, a relative error uniform in +-2^-4, i.e. noise power
2^-8/3 of the signal: ~28.8 dB for one quantized operand and ~25.8 dB for a product of two. We require
25 dB for the E4M3 recipes; E5M2 gradients (2 mantissa bits) lose ~6 dB, so 19 dB for tensorwise.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fp8train import FP8Linear, convert_to_fp8, dequantize, quantize
from fp8train.fp8 import gemm as gemm_module
from fp8train.fp8 import ops
from fp8train.fp8.operands import LinearPlan
from fp8train.fp8.ops import reference_fp8_linear
from fp8train.fp8.recipe import make_recipe, parse_recipe

THRESHOLD_DB = {"hybrid": 25.0, "rowwise": 25.0, "tensorwise": 19.0}


def sqnr(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def _setup(recipe, K=384, N=256, shape=(3, 70), seed=0, bias=True, outliers=False):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    x = torch.randn(*shape, K)
    if outliers:  # a few tokens with huge activations, as in real models (attention sinks)
        x[0, :2] *= 1e4
    g = torch.randn(*shape, N)
    m = FP8Linear.from_linear(torch.nn.Linear(K, N, bias=bias), recipe)
    with torch.no_grad():
        m.weight.copy_(lin.weight)
        if bias:
            m.bias.copy_(lin.bias)
    return lin, m, x, g


def _run(m, x, g):
    xr = x.clone().requires_grad_()
    y = m(xr)
    y.backward(g)
    return y.detach(), xr.grad, m.weight.grad, (m.bias.grad if m.bias is not None else None)


def _fp64(lin, x, g):
    K, N = lin.in_features, lin.out_features
    w = lin.weight.double()
    y = x.double() @ w.t() + lin.bias.double()
    return y, g.double() @ w, g.reshape(-1, N).double().t() @ x.reshape(-1, K).double(), g.double().sum((0, 1))


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise"])
def test_three_gemms_against_fp64(recipe):
    lin, m, x, g = _setup(recipe)
    got, ref = _run(m, x, g), _fp64(lin, x, g)
    for name, a, r in zip(("output", "grad_input", "grad_weight"), got, ref):
        assert sqnr(a, r) > THRESHOLD_DB[recipe], f"{recipe} {name}: {sqnr(a, r):.1f} dB"
        assert sqnr(a, r) < 45, "suspiciously exact: is FP8 quantization actually applied?"
    assert torch.allclose(got[3].double(), ref[3], rtol=1e-5, atol=1e-4)  # bias grad stays high precision


def test_hybrid_beats_tensorwise_on_outlier_channels():
    results = {}
    for recipe in ("hybrid", "tensorwise"):
        lin, m, x, g = _setup(recipe, outliers=True)
        # accuracy on the ordinary tokens, which a per-tensor scale pushes into FP8's subnormals
        results[recipe] = sqnr(_run(m, x, g)[0][1:], _fp64(lin, x, g)[0][1:])
    assert results["hybrid"] > 25 and results["hybrid"] > results["tensorwise"] + 5, results


def test_emulated_path_equals_fake_quant_reference():
    lin, m, x, g = _setup("hybrid", bias=False)
    y, dx, dw, _ = _run(m, x, g)
    fq = lambda t, block: dequantize(quantize(t, block))  # noqa: E731
    x2, g2, w = x.reshape(-1, 384), g.reshape(-1, 256), lin.weight.detach()
    assert torch.equal(y.reshape(-1, 256), fq(x2, (1, 128)) @ fq(w, (128, 128)).t())
    assert torch.equal(dx.reshape(-1, 384), fq(g2, (1, 128)) @ fq(w.t(), (128, 128)).t())
    assert torch.equal(dw, fq(g2.t(), (1, 128)) @ fq(x2.t(), (1, 128)).t())


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise", "hybrid+wgrad_from_fp8", "hybrid+exact",
                                    "hybrid+wgrad_blocks"])
def test_fp8linear_computes_the_reference_function(recipe):
    """`reference_fp8_linear` states what the three GEMMs compute; the emulated FP8Linear equals it bit for bit."""
    r = parse_recipe(recipe)
    lin, m, x, g = _setup(r, bias=False, shape=(3, 70))
    y, dx, dw, _ = _run(m, x, g)
    ry, rdx, rdw = reference_fp8_linear(x.reshape(-1, 384), lin.weight.detach(), g.reshape(-1, 256), r)
    assert torch.equal(y.reshape(-1, 256), ry) and torch.equal(dx.reshape(-1, 384), rdx) and torch.equal(dw, rdw)


def test_wgrad_blocks_scale_input_t_per_block_and_stay_fp8_grade():
    """`wgrad_blocks`: grad_weight's input.T takes one scale per 128x128 block (tokens x features), so a feature
    far smaller than its block's largest loses precision in grad_weight alone; on ordinary inputs grad_weight
    stays FP8-grade, and output and grad_input are hybrid's bit for bit."""
    lin, hyb, x, g = _setup("hybrid", K=384, N=256, shape=(2, 192))
    blocks = FP8Linear.from_linear(torch.nn.Linear(384, 256), parse_recipe("hybrid+wgrad_blocks"))
    with torch.no_grad():
        blocks.weight.copy_(lin.weight)
        blocks.bias.copy_(lin.bias)
    (y0, dx0, dw0, _), (y1, dx1, dw1, _) = _run(hyb, x, g), _run(blocks, x, g)
    ref = _fp64(lin, x, g)[2]
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and not torch.equal(dw0, dw1)
    assert sqnr(dw1, ref) > THRESHOLD_DB["hybrid"], sqnr(dw1, ref)
    # a feature 1e5 times smaller than the rest of its block (beyond E4M3's ~2^15 range of normals): token tiles
    # keep it, its block's scale flushes it to zero
    x_small = x.clone()
    x_small[..., 5] *= 1e-5
    for m in (hyb, blocks):
        m.zero_grad(set_to_none=True)
    got = {name: _run(m, x_small, g)[2][:, 5] for name, m in (("hybrid", hyb), ("blocks", blocks))}
    want = _fp64(lin, x_small, g)[2][:, 5]
    assert sqnr(got["hybrid"], want) > sqnr(got["blocks"], want) + 10, {k: sqnr(v, want) for k, v in got.items()}


def test_wgrad_input_from_fp8_is_double_quantized_and_saves_one_copy():
    """With `wgrad_input_from_fp8` the forward makes only the FP8 rows of the input and saves them; the
    grad_weight operand is re-quantized from them (slightly less accurate than from BF16, still FP8-grade)."""
    from dataclasses import replace

    r = replace(make_recipe("hybrid"), wgrad_input_from_fp8=True)
    lin, m, x, g = _setup(r, K=512, N=512, shape=(4, 128))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = m(x.bfloat16().requires_grad_())
    fp8 = [t for t in saved if t.element_size() == 1]
    assert len(fp8) == 1 and fp8[0].shape == (512, 512)  # the rows [M, K], not input.T [K, M]
    y.backward(g.bfloat16())
    assert sqnr(m.weight.grad, _fp64(lin, x, g)[2]) > THRESHOLD_DB["hybrid"]


def test_wgrad_operands_requantized_from_high_precision():
    x = torch.randn(300, 256) * torch.logspace(-2, 2, 256)
    plan = LinearPlan.of(make_recipe("hybrid"), cublas=False)
    rows, rows_s, cols, cols_s = ops.quantize_input(x, plan, make_cols=True)
    assert torch.equal(cols.view(torch.uint8), quantize(x.t(), (1, 128)).data.view(torch.uint8))
    double = quantize(dequantize(quantize(x, (1, 128))).t(), (1, 128))
    assert not torch.equal(cols.view(torch.uint8), double.data.view(torch.uint8))


def test_saves_fp8_not_bf16_for_backward():
    """What the forward keeps for backward: the FP8 input.T (1 byte per element, not the BF16 input) and the
    weight Parameter itself (W.T is quantized again in the backward: no FP8 copy of the weight stays alive)."""
    _, m, x, g = _setup("hybrid", K=512, N=384, shape=(4, 160))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = m(x.bfloat16().requires_grad_())
    big = [t for t in saved if t.numel() >= 384 * 512]
    assert any(t is m.weight for t in big), [(t.dtype, t.shape) for t in big]
    copies = [t for t in big if t is not m.weight]
    assert [(t.dtype, tuple(t.shape)) for t in copies] == [(torch.float8_e4m3fn, (512, 640))]  # input.T [K, M]
    y.backward(g.bfloat16())


def test_autocast_3d_bias_and_dtypes():
    _, m, x, g = _setup("hybrid", shape=(2, 5, 7))
    with torch.autocast("cpu", torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 7, 256)
    assert m(x).dtype == torch.float32
    xr = x.bfloat16().requires_grad_()
    m(xr).backward(g.bfloat16())
    assert xr.grad.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32


def test_weight_cache_only_inside_a_step_and_never_stale():
    from fp8train import cache_fp8_weights

    _, m, x, _ = _setup("hybrid")
    y1 = m(x)
    assert m._weight_cache is None  # no cache outside a step
    with torch.no_grad():
        m.weight.data.mul_(2)  # how fused AdamW updates: no version-counter bump
    y2 = m(x)
    assert not torch.equal(y1, y2), "a weight update must always be seen"
    with cache_fp8_weights(m):
        m(x)
        cached = m._weight_cache
        assert cached is not None
        m(x).sum().backward()
        assert m._weight_cache is cached  # micro-batches of one step reuse one quantization
    assert m._weight_cache is None
    opt = torch.optim.AdamW(m.parameters(), lr=1.0, fused=True)
    opt.step()
    assert not torch.equal(m(x), y2)


def test_activation_checkpointing_gives_identical_grads():
    _, m, x, g = _setup("hybrid")
    ref = _run(m, x, g)
    m.weight.grad = m.bias.grad = None
    xr = x.clone().requires_grad_()
    checkpoint(m, xr, use_reentrant=False).backward(g)
    assert torch.equal(xr.grad, ref[1]) and torch.equal(m.weight.grad, ref[2])


def test_torch_compile_matches_eager():
    _, m, x, g = _setup("hybrid")
    ref = _run(m, x, g)
    m.weight.grad = m.bias.grad = None
    compiled = torch.compile(m, backend="aot_eager")
    got = _run(compiled, x, g)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_no_grad_and_frozen_weight_skip_the_transposed_copy(monkeypatch):
    """Without a grad_weight to compute (no_grad, or a frozen weight) the FP8 input.T is not made, and
    the results are the same numbers as the full path's."""
    from fp8train.fp8 import ops as _fp8_ops

    _, m, x, g = _setup("hybrid")
    ref = _run(m, x, g)
    made = []
    real = _fp8_ops._quantize_activation
    monkeypatch.setattr(_fp8_ops, "_quantize_activation", lambda *a: made.append(a[4]) or real(*a))
    with torch.no_grad():
        y = m(x)
    assert torch.equal(y, ref[0]) and made == [False]
    made.clear()
    m.weight.requires_grad_(False)
    m.weight.grad = m.bias.grad = None
    xr = x.clone().requires_grad_()
    m(xr).backward(g)
    assert torch.equal(xr.grad, ref[1]) and m.weight.grad is None and torch.equal(m.bias.grad, ref[3])
    assert made == [False, False]  # input and grad_output: rows only


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "hybrid-exact-scales"])
def test_frozen_weight_quantized_once_same_numbers(recipe, monkeypatch):
    """A frozen weight kept in FP8 (`freeze_fp8_weights`: LoRA's base) gives the same y and dx bit for bit as
    quantizing it every forward and backward, quantizes W once for any number of steps (W.T is the copy's
    transpose), and comes back unchanged on exit. Compiled (the CPU's opaque ops) it computes the same."""
    from dataclasses import replace

    from fp8train import freeze_fp8_weights

    r = make_recipe(recipe.split("-")[0])
    r = replace(r, pow2_scale=False) if "exact" in recipe else r
    _, m, x, g = _setup(r, outliers=True)
    m.weight.requires_grad_(False)
    ref = _run(m, x, g)
    weight = m.weight.detach().clone()
    calls = []
    real = ops.quantize_weight
    monkeypatch.setattr(ops, "quantize_weight", lambda *a: calls.append(a[3]) or real(*a))
    with freeze_fp8_weights(m, offload=True) as n:
        assert n == 1 and m.frozen and "frozen in FP8" in repr(m)
        assert m.freeze_weight(True) and calls == [False]  # freezing again keeps the copy
        for _ in range(3):
            got = _run(m, x, g)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2] is None
        compiled = _run(torch.compile(m, backend="aot_eager"), x, g)
        assert torch.equal(compiled[0], ref[0]) and torch.equal(compiled[1], ref[1])
        assert calls == [False], "W quantized once, W.T never"
        m.weight.requires_grad_(True)  # unfrozen under the copy: refused, never trained on the stale copy
        with pytest.raises(RuntimeError, match="freeze_weight"):
            m(x)
        m.weight.requires_grad_(False)
    assert not m.frozen and torch.equal(m.weight, weight)
    with pytest.raises(ValueError, match="requires grad"):
        FP8Linear.from_linear(torch.nn.Linear(128, 128), "hybrid").freeze_weight(True)


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise"])
def test_frozen_weight_keeps_its_transpose(recipe, monkeypatch):
    """`keep_t`: a frozen weight's W.T operand kept beside W's, made once (the copy's exact transpose), gives the
    same y and dx bit for bit, eagerly and compiled, and no backward transposes or quantizes W again; grad_input
    reads the kept W.T (changed, dx changes). Asked of a layer frozen already (weight offloaded), it is added."""
    from fp8train import freeze_fp8_weights

    _, m, x, g = _setup(recipe, outliers=True)
    m.weight.requires_grad_(False)
    ref = _run(m, x, g)
    plan = m.plan(m.weight)
    with freeze_fp8_weights(m, offload=True):  # frozen without W.T, then asked again with it
        assert m._fp8_w_t is None and m.freeze_weight(True, keep_t=True) and "with W.T" in repr(m)
        want = ops.transpose_weight(m._fp8_w, m._fp8_w_scale, plan, m.in_features)
        assert torch.equal(m._fp8_w_t.view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(m._fp8_w_t_scale, want[1]) and m._fp8_w_t.shape == (384, 256)
        calls = []
        for name in ("quantize_weight", "transpose_weight"):
            real = getattr(ops, name)
            monkeypatch.setattr(ops, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
        for fn in (m, torch.compile(m, backend="aot_eager")):
            got = _run(fn, x, g)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert calls == [], "W.T neither transposed nor quantized in a backward"
        m._fp8_w_t_scale.mul_(2.0)  # the kept copy is what grad_input reads
        assert torch.equal(_run(m, x, g)[1], 2 * ref[1])
    assert not m.frozen and m._fp8_w_t is None and m._fp8_w_t_scale is None and m.weight.device.type == "cpu"


def test_frozen_weight_not_kept_where_w_t_is_no_transpose():
    """Row-wise scales of W are not W.T's: such a layer keeps quantizing its weight (freeze_weight says False)."""
    _, m, x, g = _setup("rowwise")
    m.weight.requires_grad_(False)
    assert m.freeze_weight(True) is False and not m.frozen


@pytest.mark.parametrize("pow2", [True, False])
def test_held_weight_is_the_copy_the_optimizer_writes(pow2, monkeypatch):
    """A weight that trains, held in FP8 (`hold_weight`): y, dx and dW equal quantizing it every forward and
    backward bit for bit (eagerly and compiled), and no step quantizes W or W.T. The layer reads the copy and
    nothing else: a weight changed behind it still computes with the old copy, and with the new one once the
    copy is rewritten in place (what the optimizer's step does). Released, it quantizes the weight again."""
    from dataclasses import replace

    _, m, x, g = _setup(replace(make_recipe("hybrid"), pow2_scale=pow2), outliers=True)
    ref = _run(m, x, g)
    calls = []
    real = ops.quantize_weight
    monkeypatch.setattr(ops, "quantize_weight", lambda *a: calls.append(a[3]) or real(*a))
    data, scale = m.hold_weight(True)
    assert m.held and not m.frozen and "held in FP8" in repr(m) and m.hold_weight(True)[0] is data
    assert data.dtype == torch.float8_e4m3fn and data.shape == (256, 384) and scale.shape == (2, 3)
    for fn in (m, torch.compile(m, backend="aot_eager")):
        m.weight.grad = None
        got = _run(fn, x, g)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert calls == [False], "W quantized once, when held; W.T never"
    with torch.no_grad():
        m.weight.mul_(-2.0)
    assert torch.equal(_run(m, x, g)[0], ref[0])  # the copy, not the weight
    plan = m.plan(m.weight)
    new = real(m.weight.detach(), plan.w, plan.pow2, False, plan.cublas)
    data.copy_(new[0])
    scale.copy_(new[1])
    m.hold_weight(False)
    assert not m.held and m.hold_weight(False) is None
    want = _run(m, x, g)
    m.hold_weight(True)
    assert torch.equal(_run(m, x, g)[0], want[0]) and not torch.equal(want[0], ref[0])


def test_weight_not_held_where_the_optimizer_cannot_write_it():
    """Held copies are E4M3 128x128 blocks of a weight that trains: a frozen weight (`freeze_weight` keeps those),
    tensor-wise and row-wise scales and E5M2 blocks are not held (None), and the layer goes on quantizing its
    weight."""
    from dataclasses import replace

    from fp8train.fp8.recipe import BLOCK, TILE, Fp8Format, GemmConfig, OperandConfig

    for recipe in ("tensorwise", "rowwise"):
        assert _setup(recipe)[1].hold_weight(True) is None
    e5 = GemmConfig(OperandConfig(Fp8Format.E4M3, TILE), OperandConfig(Fp8Format.E5M2, BLOCK))
    assert _setup(replace(make_recipe("hybrid"), output=e5, grad_input=e5))[1].hold_weight(True) is None
    _, m, _, _ = _setup("hybrid")
    m.weight.requires_grad_(False)
    assert m.hold_weight(True) is None and not m.held
    assert m.freeze_weight(True) and m.hold_weight(True) is None and m.frozen


def test_hold_fp8_weights_hands_each_copy_to_the_optimizer():
    """`hold_fp8_weights(model, optimizer)`: every FP8Linear weight that trains and that the optimizer steps hands
    its copy to the optimizer's `write_fp8_blocks` (with its recipe's scale kind), and takes it back on exit. A
    weight the optimizer does not step (another optimizer's) is not held, nor is a weight a second time (shared by
    two layers: the second would read a copy nobody writes); an optimizer that cannot write copies is refused in
    one line."""
    from fp8train import hold_fp8_weights

    class Recorder:
        def __init__(self, params):
            self.param_groups = [{"params": list(params)}]
            self.calls = []

        def write_fp8_blocks(self, param, data, scale, *, pow2):
            self.calls.append((param, data, scale, pow2))

    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128), torch.nn.Linear(128, 128),
                                torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    convert_to_fp8(model, "hybrid", module_filter_fn=lambda mod, fqn: fqn != "2")
    model[1].weight.requires_grad_(False)
    model[4].weight = model[3].weight  # tied
    opt = Recorder(p for i, m in enumerate(model) if i != 0 for p in m.parameters())  # all but layer 0's
    opt.param_groups[0]["params"].insert(0, model[0].weight)
    other = Recorder([model[0].bias])
    with hold_fp8_weights(model, opt) as n:
        assert n == 2 and model[0].held and not model[1].held and model[3].held and not model[4].held
        (param, data, scale, pow2), _ = opt.calls
        assert param is model[0].weight and data.shape == (256, 128) and scale.shape == (2, 1) and pow2
    assert not model[0].held and [c[1] for c in opt.calls[2:]] == [None, None]
    with hold_fp8_weights(model, other) as n:  # steps none of the weights
        assert n == 0 and not other.calls
    with pytest.raises(TypeError, match="cannot write FP8 weights"):
        with hold_fp8_weights(model, torch.optim.AdamW(model.parameters())):
            pass


def test_bad_inputs():
    _, m, x, _ = _setup("hybrid")
    with pytest.raises(ValueError, match="floating-point"):
        m(torch.ones(2, 384, dtype=torch.int64))
    with pytest.raises(ValueError, match="in_features=384"):
        m(torch.randn(2, 100))
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        FP8Linear(16, 16, recipe="fp4")


def test_high_precision_operands_and_emulate_flag():
    """fmt=None keeps an operand in BF16: a recipe with every operand so computes nn.Linear's BF16 numbers;
    one with only the output GEMM in FP8 changes the output but leaves grad_input and grad_weight exact."""
    from dataclasses import replace

    from fp8train.fp8.recipe import GemmConfig, OperandConfig

    h = make_recipe("hybrid")
    hp = OperandConfig(None, None)
    bf16_gemm = GemmConfig(hp, hp)
    lin, m, x, g = _setup("hybrid")
    ref = _run(m, x, g)
    none = replace(h, output=bf16_gemm, grad_input=bf16_gemm, grad_weight=bf16_gemm, emulate=True)
    out_only = replace(h, grad_input=bf16_gemm, grad_weight=bf16_gemm, emulate=True)
    results = {}
    for name, recipe in (("none", none), ("output only", out_only)):
        _, mr, _, _ = _setup(recipe)
        with torch.autocast("cpu", torch.bfloat16):
            results[name] = _run(mr, x, g)
    lin_ref = _setup("bf16")[1]  # the same weights, plain nn.Linear under autocast
    with torch.autocast("cpu", torch.bfloat16):
        plain = _run(lin_ref, x, g)
    for a, b in zip(results["none"][:3], plain[:3]):
        assert sqnr(a.float(), b.float()) > 45  # BF16 operands, FP32 accumulation; outputs differ by BF16 rounding
    assert sqnr(results["output only"][0].float(), plain[0].float()) < 35  # FP8 output GEMM
    assert sqnr(results["output only"][1].float(), plain[1].float()) > 45  # BF16 grad_input
    assert sqnr(results["output only"][2].float(), plain[2].float()) > 45  # BF16 grad_weight
    assert not torch.equal(results["output only"][0], ref[0].to(results["output only"][0].dtype))


def test_deep_gemm_knob_routes_only_cublas_tile_block_gemms(monkeypatch):
    """The recipe's `deep_gemm` travels in the plan key; it is set only where the GEMMs run on cuBLAS (the
    emulation ignores it: the same numbers on the CPU), and on cuBLAS it sends exactly the tile x block GEMMs
    with BF16 output (output, grad_input) to DeepGEMM, with the operands in DeepGEMM's NT layout."""
    r = make_recipe("hybrid", deep_gemm=True)
    assert r.deep_gemm and not make_recipe("hybrid").deep_gemm and make_recipe(r, deep_gemm=False) == make_recipe("hybrid")
    on, off = LinearPlan.of(r, cublas=True), LinearPlan.of(r, cublas=False)
    assert on.deep_gemm and not off.deep_gemm and LinearPlan.parse(on.key) == on and LinearPlan.parse(off.key) == off
    assert LinearPlan.of(make_recipe("hybrid"), cublas=False) == off  # emulated: the knob changes nothing

    calls = []

    class FakeDeepGemm:  # records the call instead of launching a kernel (no GPU here)
        @staticmethod
        def fp8_gemm_nt(a, b, out):
            calls.append((a[0].shape, a[1].shape, a[1].stride(), b[0].shape, b[1].shape, out.dtype))
            out.zero_()

    def fake_cublas(a, b, scale_a, recipe_a, scale_b, recipe_b, out_dtype):
        calls.append(("cublas", recipe_a, recipe_b, out_dtype))
        return a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)

    monkeypatch.setattr(gemm_module, "load_deep_gemm", lambda: FakeDeepGemm)
    monkeypatch.setattr(gemm_module, "_scaled_mm", fake_cublas)
    x = torch.randn(256, 512) * torch.logspace(-2, 2, 512)
    xa, xa_s, xc, xc_s = ops.quantize_input(x, on, make_cols=True)
    w, w_s = ops.quantize_weight(torch.randn(384, 512), on.w, True, False, False)
    out = gemm_module.gemm(xa, xa_s, on.x, w, w_s, on.w, torch.bfloat16, cublas=True, deep_gemm=True)  # output
    assert out.shape == (256, 384) and out.dtype == torch.bfloat16
    assert calls == [((256, 512), (256, 4), (1, 256), (384, 512), (3, 4), torch.bfloat16)]
    # grad_weight's tile x tile pair (FP32 out) stays on cuBLAS; so does a tile x block GEMM with FP32 output
    gemm_module.gemm(xc, xc_s, on.g_t, xc, xc_s, on.x_t, torch.float32, cublas=True, deep_gemm=True)
    gemm_module.gemm(xa, xa_s, on.x, w, w_s, on.w, torch.float32, cublas=True, deep_gemm=True)
    ST = torch.nn.functional.ScalingType
    assert calls[1:] == [("cublas", ST.BlockWise1x128, ST.BlockWise1x128, torch.float32),
                         ("cublas", ST.BlockWise1x128, ST.BlockWise128x128, torch.float32)]


def test_deep_gemm_missing_is_one_clear_error():
    import importlib.util

    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("DeepGEMM is installed here")
    gemm_module.load_deep_gemm.cache_clear()
    with pytest.raises(ValueError, match="config key 'deep_gemm' is true but DeepGEMM does not import"):
        gemm_module.load_deep_gemm()


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise"])
def test_adapter_keeps_its_bases_fp8_input(recipe, monkeypatch):
    """FP8InputLinear, a LoRA adapter's A beside its frozen FP8 base: output and grad_input equal nn.Linear's
    (PEFT's cast of the input included) bit for bit, under BF16 autocast as the trainer runs it and without;
    grad_weight is g.T @ x with x the FP8 copy the base made (one quantization for both), within FP32 rounding
    of an FP64 product of the reference quantization, and off the exact gradient by FP8's rounding alone; the
    backward keeps no high-precision copy of x. Compiled, the same numbers. Without a weight gradient to
    compute it is nn.Linear."""
    from torch.utils.weak import WeakIdKeyDictionary

    from fp8train import FP8InputLinear

    torch.manual_seed(0)
    K, R = 384, 16
    base = FP8Linear.from_linear(torch.nn.Linear(K, 256, bias=False), recipe, WeakIdKeyDictionary())
    base.weight.requires_grad_(False)
    lin = torch.nn.Linear(K, R, bias=False)
    ref_lin = torch.nn.Linear(K, R, bias=False)
    ref_lin.load_state_dict(lin.state_dict())
    adapter = FP8InputLinear.beside(lin, base)
    assert adapter.weight is lin.weight and "input kept in FP8" in repr(adapter)
    x = torch.randn(3, 70, K)
    x[0, :2] *= 1e3  # outlier tokens: per-token scales matter
    g = torch.randn(3, 70, R)
    calls = []
    real = ops.quantize_input
    monkeypatch.setattr(ops, "quantize_input", lambda *a: calls.append(1) or real(*a))

    def run(fn, m, autocast):
        xr = x.clone().requires_grad_()
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            base(xr)  # the base reads x first, as PEFT's layer runs them
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                y = fn(xr)
        y.backward(g.to(y.dtype))
        out = y.detach(), xr.grad, m.weight.grad
        m.weight.grad = None
        return out, saved

    block = (1, 128) if recipe == "hybrid" else None
    rows = dequantize(quantize(x.reshape(-1, K), block)).double()
    exact = g.reshape(-1, R).double().t() @ x.reshape(-1, K).double()
    for autocast in (False, True):
        calls.clear()
        (y, dx, dw), saved = run(adapter, lin, autocast)
        assert len(calls) == 1, "the base's quantization serves the adapter too"
        (ry, rdx, _), _ = run(lambda t: ref_lin(t.to(ref_lin.weight.dtype)), ref_lin, autocast)
        assert torch.equal(y, ry) and torch.equal(dx, rdx)
        gy = g.reshape(-1, R).to(y.dtype).double()  # the output gradient as the backward sees it
        want = gy.t() @ rows
        assert ((dw.double() - want).abs().max() / want.abs().max()).item() < 1e-5
        assert 25 < sqnr(dw, exact) < 45, f"grad_weight {sqnr(dw, exact):.1f} dB from the exact one"
        assert not [t for t in saved if t.numel() == x.numel() and t.element_size() > 1], "x kept in high precision"
        assert any(t.dtype == torch.float8_e4m3fn and t.numel() >= x.numel() for t in saved)
        (cy, cdx, cdw), _ = run(torch.compile(adapter, backend="aot_eager"), lin, autocast)
        assert torch.equal(cy, y) and torch.equal(cdx, dx) and torch.equal(cdw, dw)
    with torch.no_grad():
        assert torch.equal(adapter(x.bfloat16()), ref_lin(x.bfloat16().float()))
    with pytest.raises(ValueError, match="FP8InputLinear.beside"):
        FP8InputLinear.beside(torch.nn.Linear(128, R), base)
