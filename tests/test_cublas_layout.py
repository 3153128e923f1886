"""The cuBLAS code path's operand layouts, checked on CPU against a strict stand-in for scaled_mm.

`_strict_scaled_mm` enforces the contract of torch's `_scaled_mm_v2` on SM90 (row-major a, column-major
b, 16-aligned dims, the per-recipe scale shapes and "outer-dim major" strides, the 128x128 rule that the
number of K blocks be a multiple of 4) and then computes the product by dequantizing. Running FP8Linear
with it proves the padding and layout logic without a GPU; tests/test_gpu.py checks the real kernels.
"""

import pytest
import torch
import torch.nn.functional as F

from fp8train import FP8Linear
from fp8train.fp8 import ops as _fp8_ops
from fp8train.fp8 import linear as fl

ST = F.ScalingType


def _cdiv(a, b):
    return -(-a // b)


def _strict_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=None, **kw):
    assert output_dtype is not None, "output_dtype must be given"
    assert not kw.get("use_fast_accum", False)
    M, K = a.shape
    N = b.shape[1]
    assert a.stride(1) == 1 and b.stride(0) == 1, "a row-major and b column-major"
    assert K % 16 == 0 and N % 16 == 0, f"dims must be multiples of 16: K={K} N={N}"
    kb = _cdiv(K, 128)
    if recipe_a == ST.TensorWise:
        assert recipe_b == ST.TensorWise and scale_a.numel() == 1 and scale_b.numel() == 1
        sa, sb = scale_a.reshape(1, 1), scale_b.reshape(1, 1)
    elif recipe_a == ST.RowWise:
        assert scale_a.shape == (M, 1) and scale_b.shape == (1, N) and scale_b.stride(1) == 1
        sa, sb = scale_a, scale_b
    else:
        assert recipe_a == ST.BlockWise1x128
        assert scale_a.shape == (M, kb) and scale_a.stride(0) == 1 and (scale_a.stride(1) == M or kb == 1)
        sa = scale_a.repeat_interleave(128, 1)[:, :K]
        if recipe_b == ST.BlockWise128x128:
            assert kb % 4 == 0, "number of K blocks must be a multiple of 4"
            assert scale_b.shape == (kb, _cdiv(N, 128)) and scale_b.stride() == (1, kb)
            sb = scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)[:K, :N]
        else:
            assert recipe_b == ST.BlockWise1x128
            assert scale_b.shape == (N, kb) and scale_b.stride(0) == 1 and (scale_b.stride(1) == N or kb == 1)
            sb = scale_b.repeat_interleave(128, 1)[:, :K].t()
    out = (a.float() * sa) @ (b.float() * sb)
    return out.to(output_dtype)


@pytest.fixture
def fake_cublas(monkeypatch):
    monkeypatch.setattr(fl, "_use_cublas", lambda t: True)
    monkeypatch.setattr(_fp8_ops, "_kernels", None)  # the reference quantizer with cuBLAS padding
    monkeypatch.setattr(F, "scaled_mm", _strict_scaled_mm)


@pytest.mark.parametrize("recipe", ["hybrid", "tensorwise", "rowwise"])
@pytest.mark.parametrize("shape", [(300, 256, 8960), (257, 8960, 1536), (130, 384, 200), (64, 1536, 512)])
def test_cublas_path_layouts_and_values(fake_cublas, recipe, shape):
    M, N, K = shape
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N)
    x, g = torch.randn(M, K), torch.randn(M, N)
    outs = []
    for cublas in (True, False):
        fl._use_cublas = (lambda t: True) if cublas else (lambda t: False)
        m = FP8Linear.from_linear(torch.nn.Linear(K, N), recipe)
        m.load_state_dict(lin.state_dict())
        xr = x.clone().requires_grad_()
        y = m(xr)
        y.backward(g)
        outs.append((y.detach(), xr.grad, m.weight.grad))
    for name, p, e in zip(("output", "grad_input", "grad_weight"), *outs):
        # padding adds exact zeros; only FP32 summation order may differ (rowwise: BF16 output rounding)
        tol = 1e-2 if recipe == "rowwise" else 1e-4
        assert torch.allclose(p, e, rtol=tol, atol=tol * e.abs().max()), f"{recipe} {name}"


def test_mixed_granularity_recipes_fall_back_to_emulation(fake_cublas):
    """A custom recipe whose operand pair cuBLAS has no kernel for (1x128 input with a per-tensor weight,
    E5M2 tiles) must still compute the right function (emulated), never a wrong scaled_mm call."""
    from fp8train.fp8.recipe import Fp8Format, GemmConfig, OperandConfig, make_recipe

    base = make_recipe("hybrid")
    e4, e5 = Fp8Format.E4M3, Fp8Format.E5M2
    odd = [
        base.__class__(base.name, GemmConfig(OperandConfig(e4, (1, 128)), OperandConfig(e4, None)),
                       GemmConfig(OperandConfig(e5, (1, 128)), OperandConfig(e4, None)),
                       base.grad_weight),
    ]
    torch.manual_seed(0)
    x, g = torch.randn(64, 256), torch.randn(64, 128)
    for recipe in odd:
        outs = []
        for cublas in (True, False):
            fl._use_cublas = (lambda t: True) if cublas else (lambda t: False)
            m = FP8Linear(256, 128, recipe=recipe)
            torch.manual_seed(1)
            torch.nn.init.normal_(m.weight)
            torch.nn.init.zeros_(m.bias)
            xr = x.clone().requires_grad_()
            y = m(xr)
            y.backward(g)
            outs.append((y.detach(), xr.grad, m.weight.grad))
        for p, e in zip(*outs):
            assert torch.allclose(p, e, rtol=1e-4, atol=1e-4 * e.abs().max())
