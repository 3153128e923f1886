"""CUDA path against the CPU path on the same inputs (runs on an SM90 GPU; skipped elsewhere).

Quantization must match bit for bit (Triton kernels vs the torch reference, GPU vs CPU); the cuBLAS
GEMMs must match the CPU emulation up to FP32 summation order and the BF16 output rounding.
"""

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch

from fp8train import FP8Linear, compile_options, convert_to_fp8, make_recipe, quantize
from fp8train.fp8.operands import LinearPlan
from fp8train.fp8.recipe import Fp8Format, parse_recipe
from test_trainer import byte_tokenizer, corpus  # noqa: F401  (fixtures)

cuda_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
pytestmark = pytest.mark.skipif(not cuda_sm90, reason="needs a CUDA GPU with FP8 tensor cores (SM90)")


def _sqnr(x, ref):
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum().clamp_min(1e-300)))


def _bits(t):
    """Bit patterns, with every NaN made one value: NaN's sign bit differs between x86 and CUDA."""
    nan = torch.isnan(t.float())
    b = (t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)).clone()
    b[nan] = -1 if b.dtype == torch.int32 else 255
    return b


def _activation(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[1])[None, :]  # wide dynamic range
    x[3] = 0.0  # an all-zero token
    x[5, 7] = 1e4  # an outlier
    return x.to(dtype)


@pytest.mark.parametrize("shape,dtype,pow2,fmt", [
    ((8192, 1536), torch.bfloat16, True, "e4m3"), ((8192, 1536), torch.float32, False, "e4m3"),
    ((1000, 8960), torch.bfloat16, False, "e4m3"), ((1000, 8960), torch.float32, True, "e5m2"),
    ((257, 384), torch.bfloat16, True, "e5m2"), ((130, 200), torch.float32, True, "e4m3"),
    ((130, 200), torch.bfloat16, False, "e4m3"),
])
def test_activation_kernel_bitwise(shape, dtype, pow2, fmt):
    from fp8train.fp8 import kernels as _triton_quant

    fmt = Fp8Format.parse(fmt)
    x = _activation(shape, dtype)
    M, K = shape
    qr, sr, qc, sc = _triton_quant.quantize_tiles_and_transpose(x.cuda(), fmt, fmt, pow2, 512)
    rows_cpu = quantize(x, (1, 128), fmt, pow2)
    cols_cpu = quantize(x.t(), (1, 128), fmt, pow2)
    rows_gpu = quantize(x.cuda(), (1, 128), fmt, pow2)
    assert torch.equal(_bits(rows_gpu.data.cpu()), _bits(rows_cpu.data)), "torch reference differs GPU vs CPU"
    assert torch.equal(_bits(qr[:, :K].cpu()), _bits(rows_cpu.data))
    assert torch.equal(_bits(sr[:, : rows_cpu.scale.shape[1]].cpu()), _bits(rows_cpu.scale))
    assert torch.equal(_bits(qc[:, :M].cpu()), _bits(cols_cpu.data))
    assert torch.equal(_bits(sc[:, : cols_cpu.scale.shape[1]].cpu()), _bits(cols_cpu.scale))
    assert not qr[:, K:].float().any() and not qc[:, M:].float().any(), "padding must be zero"
    assert sr.stride() == (1, M) and sc.stride() == (1, K), "scales must be outer-dim major for cuBLAS"
    qr1, sr1, qc1, sc1 = _triton_quant.quantize_tiles_and_transpose(x.cuda(), fmt, fmt, pow2, 512, cols=False)
    assert qc1 is None and sc1 is None
    assert torch.equal(_bits(qr1), _bits(qr)) and torch.equal(_bits(sr1), _bits(sr)), "rows-only launch differs"
    for warps in (4, 16):  # the launch config must not change a bit
        got = _triton_quant.quantize_tiles_and_transpose(x.cuda(), fmt, fmt, pow2, 512, num_warps=warps)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, (qr, sr, qc, sc)))
    if fmt is Fp8Format.E4M3:  # input.T in 128x128 blocks (`wgrad_blocks`): rows as before, cols as the reference's
        from fp8train.fp8.operands import OperandSpec, quantize_operand

        qr2, sr2, qc2, sc2 = _triton_quant.quantize_tiles_and_transpose(x.cuda(), fmt, fmt, pow2, 512, col_blocks=True)
        want, want_scale = quantize_operand(x.t(), OperandSpec(fmt, (128, 128), 512), pow2)
        assert torch.equal(_bits(qr2), _bits(qr)) and torch.equal(_bits(sr2), _bits(sr))
        assert torch.equal(_bits(qc2.cpu()), _bits(want)) and torch.equal(_bits(sc2.t().cpu()), _bits(want_scale))


@pytest.mark.parametrize("shape", [(1536, 8960), (384, 200), (3584, 3584)])
@pytest.mark.parametrize("pow2", [True, False])
def test_weight_kernel_bitwise(shape, pow2):
    """W and W.T (one launch each, as the forward and the backward make them) against the reference."""
    from fp8train.fp8 import kernels as _triton_quant

    w = _activation(shape, torch.float32, seed=1)
    q, s = _triton_quant.quantize_blocks(w.cuda(), Fp8Format.E4M3, pow2, 512)
    qt, st = _triton_quant.quantize_blocks(w.cuda(), Fp8Format.E4M3, pow2, 512, transpose=True)
    ref = quantize(w, (128, 128), "e4m3", pow2)
    N, K = shape
    assert torch.equal(_bits(q[:, :K].cpu()), _bits(ref.data))
    assert torch.equal(_bits(qt[:, :N].cpu()), _bits(ref.data.t().contiguous()))
    assert torch.equal(_bits(s[:, : ref.scale.shape[1]].cpu()), _bits(ref.scale))
    assert torch.equal(_bits(st[:, : ref.scale.shape[0]].cpu()), _bits(ref.scale.t().contiguous()))
    assert not q[:, K:].float().any() and not qt[:, N:].float().any() and bool((st[:, ref.scale.shape[0]:] == 1).all())


def test_kernel_nonfinite_matches_reference():
    from fp8train.fp8 import kernels as _triton_quant

    x = torch.randn(256, 256)
    x[0, 0], x[130, 5] = float("nan"), float("inf")
    qr, sr, qc, sc = _triton_quant.quantize_tiles_and_transpose(x.cuda(), Fp8Format.E4M3, Fp8Format.E4M3, True, 1)
    ref = quantize(x, (1, 128))
    assert torch.equal(_bits(qr.cpu()), _bits(ref.data)) and torch.equal(_bits(sr.cpu()), _bits(ref.scale))
    assert torch.isnan(sr[0, 0]) and torch.isinf(sr[130, 0])


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise", "hybrid+wgrad_blocks"])
@pytest.mark.parametrize("shape", [(4, 512, 1536, 1536), (2, 1000, 1536, 8960), (1, 777, 8960, 1536), (2, 256, 384, 200)])
def test_linear_cuda_matches_cpu(recipe, shape):
    recipe = parse_recipe(recipe)
    B, S, N, K = shape
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=True)
    x = torch.randn(B, S, K) * 2
    g = torch.randn(B, S, N)
    outs = {}
    for dev in ("cpu", "cuda"):
        m = FP8Linear.from_linear(torch.nn.Linear(K, N).to(dev), recipe)
        with torch.no_grad():
            m.weight.copy_(lin.weight)
            m.bias.copy_(lin.bias)
        xd = x.detach().to(dev).clone().requires_grad_()
        with torch.autocast(dev, torch.bfloat16):
            y = m(xd)
        y.backward(g.to(dev, y.dtype))
        outs[dev] = [t.detach().float().cpu() for t in (y, xd.grad, m.weight.grad, m.bias.grad)]
    ref_y = (x.double() @ lin.weight.double().t() + lin.bias.double())
    ref_dx = g.double() @ lin.weight.double()
    ref_dw = g.reshape(-1, N).double().t() @ x.reshape(-1, K).double()
    for name, c, d, r in zip(("output", "grad_input", "grad_weight"), outs["cpu"], outs["cuda"], (ref_y, ref_dx, ref_dw)):
        assert _sqnr(d, c) > 38, f"{recipe.name} {name}: CUDA and CPU paths differ ({_sqnr(d, c):.1f} dB)"
        assert abs(_sqnr(d, r) - _sqnr(c, r)) < 1.0, f"{recipe.name} {name}: accuracy vs FP64 differs between paths"
        assert _sqnr(d, r) > 20


def test_emulate_flag_and_no_grad_path_on_cuda():
    """recipe.emulate runs the reference GEMMs on the GPU (same function as cuBLAS up to summation order);
    under no_grad the rows-only kernels give the same output as the training path."""

    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 896).cuda()
    x = torch.randn(2, 512, 1536, device="cuda")
    outs = {}
    for name, recipe in (("cublas", "hybrid"), ("emulated", replace(make_recipe("hybrid"), emulate=True))):
        m = FP8Linear.from_linear(torch.nn.Linear(1536, 896).cuda(), recipe)
        m.load_state_dict(lin.state_dict())
        xr = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = m(xr)
            with torch.no_grad():
                y_ng = m(x)
        y.float().pow(2).sum().backward()
        outs[name] = (y.detach().float(), xr.grad.float(), m.weight.grad.float())
        assert torch.equal(y_ng, y.detach()), f"{name}: no_grad forward differs"
    for a, b in zip(outs["cublas"], outs["emulated"]):
        assert _sqnr(a, b) > 38


def test_weight_cache_and_x_t_from_fp8_on_cuda():
    """The paths that do not quantize the weight in the forward's op: the step's cached W (the backward
    transposes it into W.T) gives the uncached numbers bit for bit; `wgrad_input_from_fp8` gives the reference
    function (dequantize, transpose, re-quantize) up to cuBLAS summation order."""

    from fp8train import cache_fp8_weights
    from fp8train.fp8.ops import reference_fp8_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 8960, bias=False).cuda()
    x = torch.randn(1000, 1536, device="cuda")
    g = torch.randn(1000, 8960, device="cuda")

    def run(recipe, cached):
        m = FP8Linear.from_linear(torch.nn.Linear(1536, 8960, bias=False).cuda(), recipe)
        m.load_state_dict(lin.state_dict())
        xr = x.clone().requires_grad_()
        with cache_fp8_weights(m) if cached else contextlib.nullcontext():
            y = m(xr)
            y.backward(g)
        return y.detach(), xr.grad, m.weight.grad

    plain, cached = run("hybrid", False), run("hybrid", True)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))
    r = replace(make_recipe("hybrid"), wgrad_input_from_fp8=True)
    got, ref = run(r, False), reference_fp8_linear(x.cpu(), lin.weight.detach().cpu(), g.cpu(), r)
    for a, b in zip(got, ref):
        assert _sqnr(a.float().cpu(), b) > 60


def test_compiled_model_matches_eager_on_cuda():
    """The model compiled as the trainer compiles it (compile_options(): q/k/v and gate/up share one input
    quantization) gives eager's loss and gradients: a quantization shared between Linears that do not read
    the same tensor would leave some weight's gradient unrelated to eager's (SQNR near 0 dB)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).cuda()
    convert_to_fp8(model, "hybrid")
    ids = torch.randint(0, 1024, (2, 256), device="cuda")

    def run(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    eager, eager_grads = run(model)
    compiled, compiled_grads = run(torch.compile(model, options=compile_options()))
    assert torch.isfinite(eager) and abs(float(eager) - float(compiled)) < 1e-2
    for name, g in eager_grads.items():
        assert _sqnr(compiled_grads[name], g) > 20, name


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise"])
def test_custom_ops_fake_implementations_match_on_cuda(recipe):
    """On the GPU the ops' outputs come from the Triton kernels and cuBLAS: their shapes, strides and
    dtypes must be what the fake implementations (the reference path) tell the compiler."""
    from fp8train.fp8 import ops as _fp8_ops

    plan = LinearPlan.of(make_recipe(recipe), cublas=True)
    x = _activation((1000, 1536), torch.bfloat16).cuda()
    w = _activation((896, 1536), torch.float32, seed=2).cuda()
    dy = _activation((1000, 896), torch.bfloat16, seed=3).cuda()
    for make_cols, make_rows in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(_fp8_ops._quantize_input_op, (x, plan.key, make_cols, make_rows))
    xr, xr_s, xc, xc_s = _fp8_ops._quantize_input_op(x, plan.key, True, True)
    wq, wq_s = _fp8_ops.quantize_weight(w, plan.w, plan.pow2, False, True)
    fp8_in = ("test_faketensor", "test_aot_dispatch_dynamic")
    w_t = _fp8_ops.transpose_weight(wq, wq_s, plan, 1536) or (None, None)  # a frozen weight's kept W.T
    for w_op, w_t_op in (((None, None), (None, None)), ((wq, wq_s), (None, None)), ((wq, wq_s), w_t)):
        torch.library.opcheck(_fp8_ops._forward_op, (xr, xr_s, w, *w_op, plan.key, torch.bfloat16), test_utils=fp8_in)
        for want_dx, want_dw in ((True, True), (True, False), (False, True)):
            saved = (xc, xc_s) if want_dw else (None, None)
            torch.library.opcheck(_fp8_ops._backward_op, (dy, w, *w_op, *w_t_op, *saved, plan.key, want_dx, want_dw,
                                                          torch.bfloat16), test_utils=fp8_in)


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise"])
def test_inductor_compiled_fp8_layers_equal_eager_on_cuda(recipe):
    """Inductor on CUDA around the FP8 custom ops (Triton quantization, cuBLAS GEMMs): one graph, and with
    no BF16 elementwise op between the layers for inductor to fuse differently, eager's numbers bit for bit."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1536, 8960, bias=False), torch.nn.Linear(8960, 1536, bias=False)).cuda()
    convert_to_fp8(m, recipe, module_filter_fn=lambda mod, fqn: True)
    x = torch.randn(2, 1000, 1536, device="cuda")
    g = torch.randn(2, 1000, 1536, device="cuda").bfloat16()

    def run(fn):
        m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(xr)
        y.backward(g)
        return [y.detach(), xr.grad] + [p.grad for p in m.parameters()]

    ref = run(m)
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(m)
    run(compiled)
    got = run(compiled)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("keep_t", [False, True])
@pytest.mark.parametrize("mode", ["eager", "default", "reduce-overhead"])
def test_frozen_offloaded_weights_on_cuda(mode, keep_t):
    """LoRA's base (`freeze_fp8_weights(offload=True)`): the GPU holds 1 byte per weight instead of 4 (2 with
    `keep_t`: W.T's operand kept too), the weights wait on the CPU, and eager, inductor and CUDA graphs (no
    graph skipped for the CPU weights) give the every-step quantization's y and dx bit for bit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from fp8train import freeze_fp8_weights

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1536, 8960, bias=False), torch.nn.Linear(8960, 1536, bias=False)).cuda()
    convert_to_fp8(m, "hybrid", module_filter_fn=lambda mod, fqn: True)
    m.requires_grad_(False)
    x = torch.randn(2, 1000, 1536, device="cuda")
    g = torch.randn(2, 1000, 1536, device="cuda").bfloat16()

    def run(fn):
        xr = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = fn(xr)
        y.backward(g)
        return y.detach().clone(), xr.grad

    ref = run(m)
    before = torch.cuda.memory_allocated()
    with freeze_fp8_weights(m, offload=True, keep_t=keep_t) as n:
        assert n == 2 and all(p.device.type == "cpu" for p in m.parameters())
        freed = before - torch.cuda.memory_allocated()
        kept = 2 if keep_t else 1  # bytes per weight kept on the GPU (plus block scales)
        assert freed >= (4 - kept) * 2 * 1536 * 8960 - 2**20, freed
        assert freed < (4 - kept) * 2 * 1536 * 8960 + 2**20, freed
        fn = m if mode == "eager" else torch.compile(m, mode=None if mode == "default" else mode)
        for _ in range(3):
            got = run(fn)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(p.device.type == "cuda" for p in m.parameters())
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("shape", [(8192, 16, 3584), (8192, 16, 18944), (1000, 40, 200), (4096, 100, 512)])
def test_rows_grad_weight_kernel_matches_the_cpu_path(shape):
    """A LoRA adapter's grad_weight from its input's FP8 rows (`ops.rows_grad_weight`, `model.lora.inputs_fp8`):
    on the rows the CUDA path makes (bit-identical to the CPU's), the Triton kernel equals the CPU path's FP32
    product up to the sums' order (its products are exact), eagerly and launched by inductor."""
    from fp8train.fp8 import ops

    M, N, K = shape
    x = _activation((M, K), torch.bfloat16)
    g = torch.randn(M, N, generator=torch.Generator().manual_seed(1)).bfloat16()
    recipe = make_recipe("hybrid")
    gpu, cpu = LinearPlan.of(recipe, True), LinearPlan.of(recipe, False)
    rows_gpu = ops.quantize_input(x.cuda(), gpu, False)[:2]
    rows_cpu = ops.quantize_input(x, cpu, False)[:2]
    assert torch.equal(_bits(rows_gpu[0][:, :K].cpu()), _bits(rows_cpu[0][:, :K]))
    got = ops.rows_grad_weight(g.cuda(), *rows_gpu, gpu, K)
    want = ops.rows_grad_weight(g, *rows_cpu, cpu, K)
    assert got.shape == (N, K) and got.dtype == torch.float32
    assert ((got.cpu().double() - want.double()).abs().max() / want.abs().max()).item() < 1e-5
    compiled = torch.compile(lambda g_, q, s: ops.rows_grad_weight(g_, q, s, gpu, K))
    assert ((compiled(g.cuda(), *rows_gpu) - got).abs().max() / got.abs().max()).item() < 1e-6


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_adapter_keeping_its_bases_fp8_input_on_cuda(mode):
    """FP8InputLinear beside a frozen FP8 base on CUDA (eagerly, and both compiled by inductor): y and dx as
    nn.Linear's under BF16 autocast (bit for bit eagerly), dW as the CPU path's on the same input, and eagerly
    the backward keeps the FP8 rows, no BF16 copy of x."""
    import torch._dynamo
    from torch.utils.weak import WeakIdKeyDictionary

    from fp8train import FP8InputLinear

    torch._dynamo.reset()
    torch.manual_seed(0)
    K, R = 3584, 16
    x = _activation((4096, K), torch.bfloat16)
    g = torch.randn(4096, R, generator=torch.Generator().manual_seed(2)).bfloat16()
    results = {}
    for dev in ("cpu", "cuda"):
        base = FP8Linear.from_linear(torch.nn.Linear(K, 512, bias=False), "hybrid", WeakIdKeyDictionary()).to(dev)
        base.weight.requires_grad_(False)
        lin = torch.nn.Linear(K, R, bias=False)
        lin.weight.data = torch.randn(R, K, generator=torch.Generator().manual_seed(3)) * 0.02
        ref = torch.nn.Linear(K, R, bias=False).to(dev)
        ref.load_state_dict(lin.state_dict())
        adapter = FP8InputLinear.beside(lin, base).to(dev)

        def both(t):
            base(t)
            return adapter(t)

        fn = torch.compile(both) if dev == "cuda" and mode != "eager" else both
        xr = x.to(dev, copy=True).requires_grad_()  # a leaf of its own on the CPU too, not x itself
        saved = []
        with torch.autocast(dev, torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t):
            y = fn(xr)
        y.backward(g.to(dev))
        xq = x.to(dev, copy=True).requires_grad_()
        with torch.autocast(dev, torch.bfloat16):
            ry = ref(xq.float())
        ry.backward(g.to(dev))
        if fn is both:
            assert torch.equal(y, ry) and torch.equal(xr.grad, xq.grad), dev
        else:  # inductor's own GEMM calls may round differently
            assert _sqnr(y.float(), ry.float()) > 40 and _sqnr(xr.grad.float(), xq.grad.float()) > 40
        if mode == "eager":
            assert not [t for t in saved if t.numel() == x.numel() and t.element_size() > 1], dev
        results[dev] = lin.weight.grad.cpu()
    rel = (results["cuda"].double() - results["cpu"].double()).abs().max() / results["cpu"].abs().max()
    assert rel.item() < 1e-5


def test_frozen_base_rows_traced_for_inductor():
    """`fuse_row_quantization` (`+fuse_rows`): compiled, a frozen FP8 base's rows-only quantizations (its input,
    its grad_output) are torch ops inductor fuses into their producers: the output and gradients are the tile
    kernels' run's, bit for bit, and as close to the FP64 product; the plan's key carries the flag."""
    import torch._dynamo
    from torch.utils.weak import WeakIdKeyDictionary

    K, N = 3584, 1024
    a, b = _activation((2048, K), torch.bfloat16), _activation((2048, K), torch.bfloat16, seed=1)
    dy = torch.randn(2048, N, generator=torch.Generator().manual_seed(2)).bfloat16()
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.02

    def fn(linear, a, b):
        return linear(torch.nn.functional.silu(a) * b) * 1.5  # producers on both sides of the GEMMs

    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    exact = torch.nn.Linear(K, N, bias=False).double()
    exact.weight.data = w.double()
    out64 = fn(exact, a64, b64)
    out64.backward(dy.double())
    exact_out = (out64.detach(), a64.grad, b64.grad)
    sqnr, results = {}, {}
    for spec in ("hybrid", "hybrid+fuse_rows"):
        torch._dynamo.reset()
        base = FP8Linear.from_linear(torch.nn.Linear(K, N, bias=False), parse_recipe(spec), WeakIdKeyDictionary())
        base.weight.data = w.clone()
        base = base.cuda()
        base.weight.requires_grad_(False)
        assert base.freeze_weight(True)
        plan = base.plan(dy.cuda())
        assert plan.fuse_rows == spec.endswith("fuse_rows")
        assert LinearPlan.parse(plan.key) == plan
        ar, br = a.cuda().requires_grad_(), b.cuda().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y = torch.compile(fn)(base, ar, br)
        y.backward(dy.cuda())
        sqnr[spec] = [_sqnr(t.cpu(), ref) for t, ref in zip((y, ar.grad, br.grad), exact_out)]
        results[spec] = (y, ar.grad, br.grad)
    for fused, kernel in zip(sqnr["hybrid+fuse_rows"], sqnr["hybrid"]):
        assert kernel > 20 and fused > kernel - 0.5, sqnr
    assert all(torch.equal(f, k) for f, k in zip(results["hybrid+fuse_rows"], results["hybrid"]))


def test_rows_traced_for_inductor_as_the_tile_kernel_makes_them():
    """The quantization `fuse_row_quantization` traces, fused by inductor into the kernel of h = silu(a) * b,
    against the tile kernel on the h inductor writes: the same scales and FP8 values (`ops._as_written` makes the
    fused kernel round h to BF16 first; printed: the share of values one E4M3 step apart, of scales that differ)."""
    from fp8train.fp8 import ops

    a, b = (_activation((4096, 3584), torch.bfloat16, seed=s).cuda() for s in (4, 5))
    fused_plan, kernel_plan = (LinearPlan.of(parse_recipe(r), True) for r in ("hybrid+fuse_rows", "hybrid"))
    quantize = torch.compile(lambda a, b: ops.quantize_input(torch.nn.functional.silu(a) * b, fused_plan, False)[:2])
    got, got_scale = quantize(a, b)
    h = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)(a, b)
    want, want_scale = ops.quantize_input(h, kernel_plan, False)[:2]
    same_scale = got_scale == want_scale  # [blocks, tokens]
    codes = lambda q: q.view(torch.int8).int()  # noqa: E731  (sign-magnitude: neighbours of one sign are 1 apart)
    tiles = same_scale.t().repeat_interleave(128, 1)[:, : got.shape[1]]
    step = (codes(got) - codes(want)).abs()[tiles]
    print(f"fuse_rows: {step.float().mean():.5f} of the values one step apart, {1 - same_scale.float().mean():.5f} "
          "of the scales differ")
    assert step.max() <= 1 and step.float().mean() < 0.05 and same_scale.float().mean() > 0.99  # the bound without it
    assert torch.equal(got_scale, want_scale) and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _run_qwen2_mlp(x, recipe, compiled):
    """A Qwen2 MLP at 1.5B width (seeded weights), converted whole by `recipe`, run on x (eagerly or
    compiled) under BF16 autocast: [output, x.grad, gate's, up's and down's weight gradients]."""
    import torch._dynamo
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    torch._dynamo.reset()
    torch.manual_seed(1)
    wrapper = torch.nn.Module()
    wrapper.mlp = Qwen2MLP(Qwen2Config(hidden_size=1536, intermediate_size=8960, hidden_act="silu")).cuda()
    report = convert_to_fp8(wrapper, recipe, lambda m, fqn: True)
    assert report.swiglu_mlps == (["mlp"] if recipe.fuse_swiglu or recipe.swiglu_inputs_fp8 else [])
    xr = x.clone().requires_grad_()
    fn = torch.compile(wrapper.mlp) if compiled else wrapper.mlp
    with torch.autocast("cuda", torch.bfloat16):
        y = fn(xr)
    y.float().pow(2).mean().backward()
    mlp = wrapper.mlp
    return [y.detach().float(), xr.grad] + [p.weight.grad for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


def test_swiglu_inputs_fp8_on_cuda():
    """The recipe's `swiglu_inputs_fp8` on CUDA (the Triton kernel quantizes g and u, padded to 512): the same
    saved values as the CPU's reference, so the gradients match the CPU path's; compiled by inductor, a
    converted MLP gives eager's forward and close gradients."""
    import torch.nn.functional as F

    from fp8train.fp8.swiglu import _SwiGLUFn

    torch.manual_seed(0)
    g, u = torch.randn(1000, 8960), torch.randn(1000, 8960)
    g[:2] *= 80
    dh = torch.randn(1000, 8960)
    hybrid = make_recipe("hybrid")

    def grads(device, cublas):
        a, b = g.bfloat16().to(device).requires_grad_(), u.bfloat16().to(device).requires_grad_()
        h = _SwiGLUFn.apply(a, b, LinearPlan.of(hybrid, cublas))
        h.backward(dh.bfloat16().to(device))
        return [t.float().cpu() for t in (h.detach(), a.grad, b.grad)]

    cuda, cpu = grads("cuda", True), grads("cpu", False)
    assert torch.equal(cuda[0], cpu[0])
    for a, b in zip(cuda[1:], cpu[1:]):
        assert _sqnr(a, b) > 45
    ref = [g.bfloat16().cuda().requires_grad_(), u.bfloat16().cuda().requires_grad_()]  # BF16 saved: close
    (F.silu(ref[0]) * ref[1]).backward(dh.bfloat16().cuda())
    assert _sqnr(cuda[1], ref[0].grad.float().cpu()) > 25 and _sqnr(cuda[2], ref[1].grad.float().cpu()) > 25

    # compiled: inductor fuses silu(g) * u without BF16's intermediate rounding (in either MLP), so the knob's
    # MLP is compared with the plain converted one, both compiled: the same forward, close gradients
    x = torch.randn(2, 1000, 1536, device="cuda")
    plain, knob = (_run_qwen2_mlp(x, make_recipe("hybrid", swiglu_inputs_fp8=on, fuse_swiglu=False), compiled=True)
                   for on in (False, True))  # the knob alone
    assert _sqnr(knob[0], plain[0]) > 60, _sqnr(knob[0], plain[0])
    assert _sqnr(knob[1], plain[1]) > 25 and _sqnr(knob[2], plain[2]) > 25, (_sqnr(knob[1], plain[1]), _sqnr(knob[2], plain[2]))


def test_fused_swiglu_kernels_equal_torch_on_cuda():
    """The fused SwiGLU kernels (`fuse_swiglu`) against torch's own CUDA ops on the same BF16 inputs, then the
    activation kernel: h = silu(g) * u, dg and du quantized, rows and cols. BF16 rounding where autograd
    rounds, the sigmoid as inductor computes it (the GPU's fast exp and division, a few FP32 ulps from torch's
    eager kernel): the FP8 bytes and scales match but for at most 1e-4 of them (a last-bit difference crossing
    a rounding boundary; the count is in the message)."""
    from fp8train.fp8 import ops as _ops

    torch.manual_seed(0)
    M, I = 1000, 8960
    g, u, dh = (torch.randn(M, I, device="cuda") for _ in range(3))
    g[:2] *= 80
    u[5] *= 1e-3
    g, u, dh = g.bfloat16(), u.bfloat16(), dh.bfloat16()
    plan = LinearPlan.of(make_recipe("hybrid"), True)
    dg, du = _ops.swiglu_grads_reference(dh, g, u)
    refs = [_ops.quantize_input(_ops.swiglu_reference(g, u), plan, True)]
    refs += [_ops.quantize_input(dg, plan, True), _ops.quantize_input(du, plan, True)]
    grads = _ops.quantize_swiglu_grads(dh, g, u, plan, True)
    gots = [_ops.quantize_swiglu(g, u, plan, True), grads[:4], grads[4:]]
    for name, got, ref in zip(("h", "dg", "du"), gots, refs):
        for a, b, what in zip(got, ref, ("rows", "rows scale", "cols", "cols scale")):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, what)
            if a.element_size() == 1:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            differ = int((a != b).sum())
            assert differ <= 1e-4 * a.numel(), f"{name} {what}: {differ} of {a.numel()} differ"
    rows_only = _ops.quantize_swiglu(g, u, plan, False)
    assert torch.equal(rows_only[0].view(torch.uint8), gots[0][0].view(torch.uint8)) and rows_only[2].numel() == 0
    cols_only = _ops.quantize_swiglu(g, u, plan, True, make_rows=False)  # h.T alone (`input_t_in_backward`)
    assert torch.equal(cols_only[2].view(torch.uint8), gots[0][2].view(torch.uint8))
    assert torch.equal(cols_only[3], gots[0][3]) and cols_only[0].numel() == cols_only[1].numel() == 0


@pytest.mark.parametrize("fp8_inputs", [False, True])
def test_fused_swiglu_mlp_on_cuda(fp8_inputs):
    """A converted Qwen2 MLP at 1.5B width, fused against the three FP8Linears, on CUDA: eagerly the same
    outputs and gradients up to the kernels' rare last-bit differences; compiled (inductor launches the
    kernels), the fused MLP's forward equals its eager forward and its gradients stay close."""
    x = torch.randn(2, 1000, 1536, device="cuda")
    x[:, 0] *= 30

    def run(fuse, compiled):
        return _run_qwen2_mlp(x, make_recipe("hybrid", swiglu_inputs_fp8=fp8_inputs, fuse_swiglu=fuse), compiled)

    plain, fused, fused_compiled = run(False, False), run(True, False), run(True, True)
    for i, (a, b) in enumerate(zip(fused, plain)):
        assert _sqnr(a, b) > 50, (i, _sqnr(a, b))
    assert _sqnr(fused_compiled[0], fused[0]) > 60, _sqnr(fused_compiled[0], fused[0])
    for i, (a, b) in enumerate(zip(fused_compiled[1:], fused[1:])):
        assert _sqnr(a, b) > 30, (i, _sqnr(a, b))


def test_wgrad_blocks_on_cuda():
    """`wgrad_blocks` on CUDA: grad_weight on cuBLAS's tile x block kernel. On the kernels' operands (x.T's blocks
    from the activation kernel, dg.T's and du.T's tiles from the SwiGLU producer) cuBLAS gives the emulated GEMM up
    to summation order. A fused Qwen2 MLP at 1.5B width: the output and the input gradient are hybrid's bit for
    bit, eagerly and compiled; the weight gradients are the three Linears' (fused or not, the same numbers), and
    their distance from the emulated run is hybrid's own (~32 dB for both: cuBLAS's BF16 outputs differ from the
    emulation's in a last bit here and there, which the next quantization turns into a different FP8 code)."""
    from fp8train.fp8 import ops as _ops
    from fp8train.fp8.gemm import Route, gemm, gemm_route

    recipe = parse_recipe("hybrid+wgrad_blocks")
    plan = LinearPlan.of(recipe, True)
    assert gemm_route(plan.g_t, plan.x_t) is Route.TILE_BLOCK
    torch.manual_seed(0)
    x = torch.randn(2, 1000, 1536, device="cuda")
    x[:, 0] *= 30
    M, I = 2000, 8960
    dh, g, u = (torch.randn(M, I, device="cuda").bfloat16() for _ in range(3))
    x_t, x_t_scale = _ops.quantize_input(x.reshape(M, -1).bfloat16(), plan, True)[2:]
    grads = _ops.quantize_swiglu_grads(dh, g, u, plan, True)
    for g_t, g_t_scale in (grads[2:4], grads[6:8]):
        on_cublas, emulated = (gemm(g_t, g_t_scale, plan.g_t, x_t, x_t_scale, plan.x_t, torch.float32, cublas)
                               for cublas in (True, False))
        assert _sqnr(on_cublas, emulated) > 60, _sqnr(on_cublas, emulated)

    hybrid = make_recipe("hybrid")
    emulated = {r: _run_qwen2_mlp(x, replace(r, emulate=True), False) for r in (hybrid, recipe)}
    unfused = _run_qwen2_mlp(x, replace(recipe, fuse_swiglu=False), False)
    for compiled in (False, True):
        runs = {r: _run_qwen2_mlp(x, r, compiled) for r in (hybrid, recipe)}
        assert all(torch.equal(a, b) for a, b in zip(runs[hybrid][:2], runs[recipe][:2])), compiled
        for i in range(2, 5):
            blocks, tiles = runs[recipe][i], runs[hybrid][i]
            gap = _sqnr(blocks, emulated[recipe][i]) - _sqnr(tiles, emulated[hybrid][i])
            assert abs(gap) < 1.0, (compiled, i, gap)
            assert _sqnr(blocks, tiles) > 25, (compiled, i, _sqnr(blocks, tiles))  # a different quantization
            if not compiled:
                assert _sqnr(blocks, unfused[i]) > 50, (i, _sqnr(blocks, unfused[i]))


def test_input_t_in_backward_on_cuda():
    """`input_t_in_backward` on CUDA: input.T made in the backward (h.T from g and u; compiled, x's from x saved
    by reference) gives the forward-made operands' output and gradients bit for bit, eagerly and compiled by
    inductor."""
    x = torch.randn(2, 1000, 1536, device="cuda")
    x[:, 0] *= 30
    for compiled in (False, True):
        runs = [_run_qwen2_mlp(x, make_recipe("hybrid", input_t_in_backward=on), compiled) for on in (False, True)]
        for i, (a, b) in enumerate(zip(*runs)):
            assert torch.equal(a, b), (compiled, i)


@pytest.mark.parametrize("fuse", [False, True])
def test_compiled_model_launches_the_fp8_kernels_from_inductor_code(fuse):
    """On CUDA the FP8 pieces are traced into the graph: inductor's generated code launches the Triton
    quantization kernels and the scaled_mm GEMMs itself (no fp8train custom op, so no Python per Linear at
    run time), and with compile_options() q/k/v and gate/up share one quantization of their input (4 per
    layer, not 7)."""
    import re

    import torch._dynamo
    from torch._inductor.utils import run_and_get_code
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).cuda()
    recipe = make_recipe("hybrid", fuse_swiglu=fuse)
    convert_to_fp8(model, recipe)
    compiled = torch.compile(model, options=compile_options())
    ids = torch.randint(0, 1024, (1, 512), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    counts = {name: len(re.findall(rf"\b{name}\w*\.run\(", code)) for name in ("_act_kernel", "_weight_kernel")}
    assert "fp8train." not in code, "an opaque fp8train op is left in the compiled code"
    # forward: inputs of q/k/v (one), o, gate/up (one), down (fused: made from g and u); backward: the 7
    # grad_outputs (fused: gate's and up's made from dh, g, u). Weights: W in the forward, W.T in the
    # backward (no FP8 copy of the weight is kept between them); with `input_t_in_backward` one more launch makes
    # down's h.T in the backward
    h_t = int(fuse and recipe.input_t_in_backward)
    assert counts == {"_act_kernel": 4 + 7 + h_t, "_weight_kernel": 7 + 7}, counts
    assert len(re.findall(r"_scaled_mm", code)) >= 21, "7 Linears x 3 GEMMs on cuBLAS"


def test_cuda_graphs_replay_the_compiled_fp8_step():
    """`train.cuda_graphs`: the trainer's compiled FP8 step replayed as CUDA graphs (no graph skipped for
    a reason such as a CPU tensor or a mutated input) trains to the same losses as plain compiled."""
    from torch._dynamo.utils import counters

    from fp8train.bench import BenchCase, run_case

    runs = {}
    for mode in ("compiled", "cudagraphs"):
        counters.clear()
        runs[mode] = run_case(BenchCase("tiny-qwen2", None, 256, "hybrid", mode, 512), steps=3, warmup=2, device="cuda")
        if mode == "cudagraphs":
            assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert runs["compiled"]["fp8_layers"] > 0
    for key in ("loss_first", "loss_last"):
        assert abs(runs["compiled"][key] - runs["cudagraphs"][key]) < 1e-5, (key, runs)


def test_cuda_graphs_replay_the_compiled_lora_step_on_a_frozen_fp8_base():
    """LoRA on a frozen FP8 base (its BF16 weights offloaded), each layer compiled and replayed as CUDA graphs
    (`benchmarks/lora_gpu.py --cuda-graphs`, as `train.cuda_graphs` with `model.lora`): no graph skipped (the
    offloaded weight stays out of the graph), no recompilation after warm-up, the losses of plain compiled."""
    from torch._dynamo.utils import counters

    from _benchmarks import load_benchmark

    bench = load_benchmark("lora_gpu")
    args = ["--device", "cuda", "--tiny", "--recipes", "hybrid", "--warmup", "2", "--steps", "3"]
    plain = bench.main(args)[0]
    graphs = bench.main(args + ["--cuda-graphs"])[0]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert graphs["cuda_graphs"] and graphs["recompiles_after_warmup"] == 0
    # cuBLAS may pick other algorithms while capturing (rounding, not arithmetic, differs); a stale or skipped
    # replay would be off by far more
    for key in ("loss_first", "loss_last"):
        assert abs(plain[key] - graphs[key]) < 1e-4, (key, plain, graphs)



def test_host_overhead_benchmark_calls_the_ops_as_they_are_declared():
    """`benchmarks/host_overhead.py` calls the FP8 custom ops by hand (to time their host cost); a change of an
    op's signature broke it silently once. Every piece runs and takes some host time."""
    from _benchmarks import load_benchmark

    rows = load_benchmark("host_overhead").pieces()
    assert len(rows) == 10 and all(us > 0 for _, us in rows), rows

def _deep_gemm_importable() -> bool:
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _deep_gemm_importable(), reason="needs DeepGEMM (the recipe's deep_gemm; docs/benchmarks.md)")
@pytest.mark.parametrize("mode", ["eager", "compiled", "cudagraphs"])
@pytest.mark.parametrize("base", ["hybrid", "hybrid+wgrad_blocks"])
def test_deep_gemm_route_equals_cublas_on_cuda(mode, base):
    """The recipe's `deep_gemm`: output and grad_input on DeepGEMM's kernel give cuBLAS's numbers bit for bit
    (outputs, input and weight gradients of two Linears at 7B-like widths), eagerly, compiled and replayed
    as CUDA graphs, and the GEMMs really ran there (DeepGEMM's kernel in the profile). With `wgrad_blocks`
    grad_weight is a tile x block GEMM too, but with an FP32 output: it stays on cuBLAS (DeepGEMM's SM90
    tile x block kernel writes BF16 only)."""
    import torch._dynamo

    def run(recipe, compile_mode):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3584, 2048, bias=False), torch.nn.Linear(2048, 3584, bias=False)).cuda()
        convert_to_fp8(m, recipe, module_filter_fn=lambda mod, fqn: True)
        fn = m if compile_mode is None else torch.compile(m, mode=compile_mode)
        x = torch.randn(4096, 3584, device="cuda")
        g = torch.randn(4096, 3584, device="cuda").bfloat16()
        out = None
        for _ in range(3):  # warm-up and capture for CUDA graphs; the last run is compared
            m.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                y = fn(xr)
            y.backward(g)
            out = [y.detach().clone(), xr.grad.clone()] + [p.grad.clone() for p in m.parameters()]
        return out, fn, x

    compile_mode = {"eager": None, "compiled": "default", "cudagraphs": "reduce-overhead"}[mode]
    ref, _, _ = run(parse_recipe(base), compile_mode)
    got, fn, x = run(parse_recipe(base + "+deep_gemm"), compile_mode)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", torch.bfloat16):
            fn(x.clone().requires_grad_()).float().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("fp8_gemm_1d2d" in n for n in names), sorted(set(names))[:20]


_FIRST_USE_IN_GRAPHS = """
import sys, torch
from fp8train import convert_to_fp8
from fp8train.fp8 import convert, gemm
from fp8train.fp8.recipe import parse_recipe
if sys.argv[1] == "without-init":  # DeepGEMM's device state left to its first GEMM, as before the fix
    import deep_gemm
    convert.load_deep_gemm = gemm.load_deep_gemm = lambda: deep_gemm
m = torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False), torch.nn.Linear(2048, 1024, bias=False)).cuda()
convert_to_fp8(m, parse_recipe("hybrid+deep_gemm"), module_filter_fn=lambda mod, fqn: True)
fn = torch.compile(m, mode="reduce-overhead")
for _ in range(4):
    torch.compiler.cudagraph_mark_step_begin()  # a new step: the last one's graph outputs may be overwritten
    m.zero_grad(set_to_none=True)  # (accumulating into a graph's output of the last step would read it)
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", torch.bfloat16):
        fn(x).float().square().mean().backward()
torch.cuda.synchronize()
print("ok")
"""


@pytest.mark.skipif(not _deep_gemm_importable(), reason="needs DeepGEMM (the recipe's deep_gemm; docs/benchmarks.md)")
def test_deep_gemm_first_used_inside_cuda_graphs():
    """DeepGEMM's first GEMM of the process inside a CUDA graph's warm-up (a layer compiled with CUDA graphs):
    its device state (a workspace tensor kept for the process) must already exist, made by convert_to_fp8, or
    it lands in the graph's pool, which cudagraph trees refuse. A fresh process, as a training run is, and a
    control process without the early state, which must fail that way."""
    import subprocess
    import sys

    def run(arm):
        return subprocess.run([sys.executable, "-c", _FIRST_USE_IN_GRAPHS, arm], capture_output=True, text=True,
                              timeout=600)

    r = run("with-init")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    # The control arm: the same process with DeepGEMM's state left to its first GEMM must fail, or this test
    # would pass whatever convert_to_fp8 does (DeepGEMM 54e2261, the build docs/benchmarks.md section 0a names).
    before = run("without-init")
    assert before.returncode != 0 and "cudagraph pool" in before.stderr, (
        "without the early device state the run should hit the cudagraph pool check: "
        f"rc {before.returncode}, {before.stderr[-1000:]}")


def test_triton_adamw_on_cuda_equals_its_reference_on_cpu():
    """fp8train's AdamW kernel, as the trainer launches it (the build_optimizer default on CUDA), against
    `adamw_reference` on CPU copies, bit for bit: two groups, sizes across chunk boundaries, the clip folded
    in through `optimizer_step` (with the optimizer's own norm, within 1e-6 of FP64's); and torch's fused AdamW
    within 1e-4 of the distance moved."""
    from torch import nn

    from fp8train.train.adamw import TritonAdamW, adamw_reference, step_scalars
    from fp8train.train.optim import OptimConfig, build_optimizer, optimizer_step

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1000, 3000), nn.LayerNorm(3000), nn.Linear(3000, 257)).cuda()

    m, fused = model(), model()
    cfg = OptimConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    opt = build_optimizer(m, cfg)
    ref_opt = build_optimizer(fused, OptimConfig(**{**vars(cfg), "impl": "fused"}))
    assert isinstance(opt, TritonAdamW)
    cpu = [p.detach().cpu() for p in m.parameters()]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in cpu]
    decays = [0.1 if p.ndim >= 2 else 0.0 for p in m.parameters()]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) * (30.0 if step % 2 else 1e-3) for p in cpu]
        for net in (m, fused):
            for p, grad in zip(net.parameters(), grads):
                p.grad = grad.cuda()
        norm = optimizer_step(opt, m, 1.0)  # the optimizer's own norm (`grad_norm`), torch's for the fused step
        want = torch.cat([grad.double().flatten() for grad in grads]).norm().item()
        assert abs(norm - want) <= 1e-6 * want and abs(optimizer_step(ref_opt, fused, 1.0) - want) <= 1e-5 * want
        scale = torch.clamp((torch.tensor(norm, dtype=torch.float32) + 1e-6) / 1.0, min=1.0).reshape(1)  # as folded
        for p, grad, (mm, vv), wd in zip(cpu, grads, moments, decays):
            adamw_reference(p, grad, mm, vv, step_scalars(3e-3, wd, (0.9, 0.95), 1e-8, step), scale)
        for p, want, (mm, _), q in zip(m.parameters(), cpu, moments, fused.parameters()):
            assert torch.equal(_bits(p.detach().cpu()), _bits(want)), f"step {step}: {tuple(p.shape)}"
            assert torch.equal(_bits(opt.state[p]["exp_avg"].cpu()), _bits(mm))
            assert (q.detach().cpu() - want).abs().max() <= 1e-4 * step * 3e-3 * 10


@pytest.mark.parametrize("mode", ["eager", "compiled", "cudagraphs"])
def test_held_weights_train_as_every_step_quantizing_does_on_cuda(mode):
    """`hold_fp8_weights`: the optimizer's step writes each weight's FP8 copy (`_adamw_blocks_kernel`, the GPU's
    FP8 cast) and the layers read it. Three steps of a Linear and a fused Qwen2 MLP at 1.5B width (one weight's
    rows ragged), one with the clip folded in, one skipped on the device: the outputs, input gradients, weights
    and moments equal the every-step quantization's bit for bit, eagerly, compiled and replayed as CUDA graphs,
    and each copy is the weight's `quantize_weight` (data and scales) after every step."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from fp8train import hold_fp8_weights
    from fp8train.fp8 import ops
    from fp8train.train.adamw import TritonAdamW

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(1536, 1040, bias=False), torch.nn.Linear(1040, 1536, bias=False),
                                Qwen2MLP(Qwen2Config(hidden_size=1536, intermediate_size=8960, hidden_act="silu")))
        convert_to_fp8(m.cuda(), "hybrid", module_filter_fn=lambda mod, fqn: True)
        return m, TritonAdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def same(a, b):  # bit for bit, any dtype (NaNs of the skipped step's gradients included)
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    x = torch.randn(2, 1000, 1536, device="cuda")
    g = torch.randn(2, 1000, 1536, device="cuda").bfloat16()
    runs = []
    for hold in (False, True):
        torch._dynamo.reset()
        counters.clear()
        m, opt = build()
        fn = m if mode == "eager" else torch.compile(m, mode="reduce-overhead" if mode == "cudagraphs" else None)
        got = []
        with hold_fp8_weights(m, opt) if hold else contextlib.nullcontext(5) as n:
            assert n == 5
            for step in range(3):
                xr = x.clone().requires_grad_()
                with torch.autocast("cuda", torch.bfloat16):
                    y = fn(xr)
                y.backward(g * (float("inf") if step == 1 else 1.0))  # step 1: non-finite, skipped on the device
                opt.found_inf = (~torch.stack([p.grad.isfinite().all() for p in m.parameters()]).all()).float()
                opt.grad_scale = torch.tensor([2.0 if step == 2 else 1.0], device="cuda")
                opt.step()
                opt.zero_grad(set_to_none=True)
                got.append([y.detach().clone(), xr.grad.clone()])
                got[-1] += [t.detach().clone() for p in m.parameters() for t in (p, opt.state[p]["exp_avg"])]
                if hold:
                    for lin in [mod for mod in m.modules() if isinstance(mod, FP8Linear)]:
                        plan = lin.plan(lin.weight)
                        want = ops.quantize_weight(lin.weight.detach(), plan.w, plan.pow2, False, plan.cublas)
                        assert lin.held and same(lin._fp8_w, want[0]), f"step {step}"
                        assert torch.equal(lin._fp8_w_scale, want[1])
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        runs.append(got)
    assert all(not lin.held for lin in m.modules() if isinstance(lin, FP8Linear))  # the context dropped them
    for step, (a, b) in enumerate(zip(*runs)):
        assert all(same(u, v) for u, v in zip(a, b)), f"step {step}"


def test_trainer_holds_fp8_weights_on_the_gpu(tmp_path, byte_tokenizer, corpus, capsys):
    """`hold_fp8_weights: true` in the trainer (compiled, Triton AdamW): the log says that every converted layer
    holds its copy, and the run's losses equal the every-step quantization's within 1e-3 (the attention's
    backward may sum in another order)."""
    from test_trainer import tiny_config

    from fp8train.train.trainer import Trainer

    losses = []
    for hold in (False, True):
        cfg = tiny_config(tmp_path / str(hold), byte_tokenizer, corpus, **{
            "device": "cuda", "recipe": "hybrid", "train.steps": 6, "train.compile": True, "hold_fp8_weights": hold})
        losses.append(list(Trainer(cfg, progress=False).fit().losses.values()))
    out = capsys.readouterr().out
    assert "hold_fp8_weights: 14 layers hold their FP8 weights, written by the optimizer" in out, out[-2000:]
    assert max(abs(a - b) / abs(a) for a, b in zip(*losses)) < 1e-3, losses


def test_a_step_skipped_on_the_device_writes_nothing_on_cuda():
    """`optimizer_step_on_device` with a non-finite gradient (its flag made on the GPU, never read by the host
    before the step): TritonAdamW and torch's fused AdamW leave parameters and moments as they were and count
    no step; the step after it equals `adamw_reference`'s next step bit for bit."""
    from torch import nn

    from fp8train.train.adamw import adamw_reference, step_scalars
    from fp8train.train.optim import OptimConfig, build_optimizer, gradient_norm, optimizer_step_on_device

    for impl in ("triton", "fused"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(300, 2000), nn.Linear(2000, 129)).cuda()
        opt = build_optimizer(m, OptimConfig(lr=3e-3, weight_decay=0.0, impl=impl))
        cpu = [p.detach().cpu() for p in m.parameters()]
        moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in cpu]
        g = torch.Generator().manual_seed(2)
        for step, bad in ((1, False), (2, True), (2, False)):  # the skipped step is not counted
            grads = [torch.randn(p.shape, generator=g) for p in cpu]
            if bad:
                grads[1][7] = float("inf")
            for p, grad in zip(m.parameters(), grads):
                p.grad = grad.cuda()
            norm = gradient_norm(opt, m)
            optimizer_step_on_device(opt, m, 1.0, norm, found_inf=~torch.isfinite(norm))
            if not bad:
                scale = torch.clamp((norm.cpu() + 1e-6) / 1.0, min=1.0).reshape(1)
                for p, grad, (mm, vv) in zip(cpu, grads, moments):
                    adamw_reference(p, grad, mm, vv, step_scalars(3e-3, 0.0, (0.9, 0.95), 1e-8, step), scale)
            for p, want in zip(m.parameters(), cpu):
                if impl == "triton":
                    assert torch.equal(_bits(p.detach().cpu()), _bits(want)), (impl, step, bad)
                else:  # torch's own rounding: near the reference, and unchanged by the skipped step
                    assert (p.detach().cpu() - want).abs().max() <= 1e-6, (impl, step, bad)
        assert {int(v["step"]) for v in opt.state_dict()["state"].values()} == {2}, impl


@pytest.mark.parametrize("mode", ["eager", "compiled", "cudagraphs"])
@pytest.mark.parametrize("variant", ["bf16", "hybrid"])
def test_trainer_enqueues_a_step_without_waiting_for_the_gpu(mode, variant):
    """`Trainer.enqueue_step` after warm-up makes no host sync (torch's sync debug mode: no `.item()`, no
    blocking copy), so the loop keeps the GPU fed across steps; the overlapped steps train (finite losses) with
    no step skipped. Rows of one document: the trainer's causal block mask spares HF's check of `position_ids`
    (transformers' masking_utils, `find_packed_sequence_indices`), which plain `sdpa` still makes, and runs as
    that same SDPA call (the first step's loss bit for bit; the backward's kernels may sum in any order, so
    the last step's within BF16 rounding); packed rows: the test below."""
    from fp8train.bench import BenchCase, run_case

    res, sdpa = (run_case(BenchCase("tiny-qwen2", None, 256, variant, mode, 512, packed_attention=a), steps=4,
                          warmup=2, device="cuda") for a in ("flex", "sdpa"))
    assert res["host_syncs"] == []
    assert all("transformers/masking_utils.py" in s for s in sdpa["host_syncs"]), sdpa["host_syncs"]
    assert res["loss_first"] == sdpa["loss_first"]
    assert abs(res["loss_last"] - sdpa["loss_last"]) <= 1e-3 * abs(sdpa["loss_last"])
    # (bench's steps: random tokens at lr 1e-5, so the loss need not fall in six steps)
    assert res["skipped_steps"] == 0 and math.isfinite(res["loss_first"]) and math.isfinite(res["loss_last"])


def test_fit_times_each_logged_step_on_the_gpu_between_cuda_events(tmp_path, byte_tokenizer, corpus):
    """The trainer's loop on CUDA, logging every step, with evaluation and saves between: each step's tokens/s is
    timed between CUDA events (the end of the step before it, or of an evaluation or save, and its own end), read
    once the next step is queued; every rate is finite and positive, and the steps around an evaluation or save
    are within 10x of the others (a window that closed on a step finished at once read ~0 s: 200x on a CPU)."""
    from test_trainer import tiny_config

    from fp8train.train.trainer import Trainer

    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, **{"device": "cuda", "recipe": "hybrid", "train.steps": 9,
                                                            "train.eval_every": 3, "train.save_every": 3})
    Trainer(cfg, progress=False).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    assert sorted(rates) == list(range(1, 10)) and all(math.isfinite(v) and v > 0 for v in rates.values()), rates
    later = sorted(rates[s] for s in range(2, 10))  # (step 1 compiles nothing, but warms the allocator)
    assert later[-1] <= 10 * later[len(later) // 2] and later[0] >= later[len(later) // 2] / 10, rates


@pytest.mark.parametrize("mode", ["compiled", "cudagraphs"])
def test_sft_rows_run_the_head_on_their_targets_without_waiting_for_the_gpu(mode):
    """SFT-like rows (4 documents, the last quarter of each with a target): the trainer hands the model the rows
    with a target (`loss_rows`, made on the host), so the head runs on 512 of 2048 rows and still no step waits
    for the GPU; the losses are those of the plain HF head on every row within BF16 rounding."""
    from fp8train.bench import BenchCase, run_case

    res = {impl: run_case(BenchCase("tiny-qwen2", None, 2048, "hybrid", mode, 512, loss_impl=impl, docs=4,
                                    targets=0.25), steps=4, warmup=2, device="cuda") for impl in ("chunked", "hf")}
    assert res["chunked"]["host_syncs"] == []
    for key in ("loss_first", "loss_last"):
        assert abs(res["chunked"][key] - res["hf"][key]) <= 1e-3 * abs(res["hf"][key]), key
    assert res["chunked"]["skipped_steps"] == 0


def test_packed_attention_kernel_matches_an_fp32_reference_on_cuda():
    """The flex path of fp8train/train/attention.py (compiled, grouped-query heads not repeated) at the 1.5B
    shape, four documents of 512 tokens: output and input gradients as close to an FP32 dense-mask reference as
    BF16 SDPA with the dense mask is (the path it replaces)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask

    from fp8train.train.attention import _attention

    s, docs = 2048, 4
    doc = torch.arange(s, device="cuda") // (s // docs)
    dense = (torch.ones(s, s, dtype=torch.bool, device="cuda").tril() & (doc[:, None] == doc[None, :]))[None, None]
    block = create_block_mask(lambda b, h, q, k: (q >= k) & (doc[q] == doc[k]), None, None, s, s, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 128, device="cuda", generator=g) for h in (12, 2, 2))
    up = torch.randn(1, s, 12, 128, device="cuda", generator=g)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.float().backward(up)
        return [out.float()] + [t.grad.float() for t in leaves]

    module = torch.nn.Module()
    ref = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense, enable_gqa=True).transpose(1, 2),
              torch.float32)
    sdpa = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense, enable_gqa=True).transpose(1, 2),
               torch.bfloat16)
    flex = run(lambda a, b, c: _attention(module, a, b, c, block)[0], torch.bfloat16)
    for name, r, a, b in zip(("out", "dq", "dk", "dv"), ref, sdpa, flex):
        err_sdpa, err_flex = ((x - r).norm() / r.norm() for x in (a, b))
        assert err_flex <= 2 * err_sdpa + 1e-3, (name, err_flex.item(), err_sdpa.item())


@pytest.mark.parametrize("mode", ["eager", "compiled", "cudagraphs"])
def test_packed_rows_train_alike_with_flex_and_dense_sdpa_on_cuda(mode):
    """Rows of four documents: `train.packed_attention: flex` trains to the losses of HF's SDPA with the dense
    mask, within BF16 rounding, and the host never waits for the GPU (the trainer makes their masks from the
    host's position ids: `document_mask`)."""
    from fp8train.bench import BenchCase, run_case

    res = {a: run_case(BenchCase("tiny-qwen2", None, 256, "hybrid", mode, 512, docs=4, packed_attention=a),
                       steps=3, warmup=2, device="cuda") for a in ("flex", "sdpa")}
    for key in ("loss_first", "loss_last"):
        assert abs(res["flex"][key] - res["sdpa"][key]) <= 2e-3 * abs(res["sdpa"][key]), (key, res)
    assert res["flex"]["host_syncs"] == [] and res["sdpa"]["host_syncs"] == []
