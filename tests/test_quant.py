"""Quantization against an independent per-block loop and the formats' rounding bounds."""

import math

import pytest
import torch

from fp8train import Fp8Format, dequantize, quantize

FORMATS = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}  # max, mantissa bits, min normal exponent


def _wide(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-4, 4, shape[-1])
    return x.to(dtype)


def _loop_reference(x2d, block, fmax, pow2):
    """Independent reference: one Python iteration per block."""
    R, C = x2d.shape
    br, bc = block
    out = torch.empty(R, C)
    scales = torch.empty(math.ceil(R / br), math.ceil(C / bc))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x2d[i * br:(i + 1) * br, j * bc:(j + 1) * bc].double()
            amax = blk.abs().max().item()
            s = amax / fmax if amax > 0 else 1.0
            if pow2:
                s = 2.0 ** math.ceil(math.log2(s))
            s = float(torch.tensor(s, dtype=torch.float32))
            scales[i, j] = s
            # times the FP32 reciprocal (1 / s in double, then FP32: correctly rounded, double rounding is
            # innocuous for a quotient); for a power-of-two s that is exactly / s
            inv = torch.tensor(1.0 / s, dtype=torch.float32)
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = blk.float() * inv
    return out, scales


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 1), (128, 128), (1, -1), None])
@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (7, 1000)])
def test_bounds_and_rounding(fmt, block, shape):
    fmax, mbits, emin = FORMATS[fmt]
    x = _wide(shape)
    q = quantize(x, block, fmt)
    assert q.data.dtype == Fp8Format.parse(fmt).dtype and q.data.shape == x.shape
    assert q.data.float().abs().max() <= fmax
    scale = q.scale if block is None else q.scale.repeat_interleave(
        1 if block[0] == -1 else block[0], 0).repeat_interleave(x.shape[1] if block[1] == -1 else block[1], 1)[
        : shape[0], : shape[1]]
    err = (dequantize(q) - x).abs()
    # round-to-nearest: half an ulp of |x| in the normal range, half the subnormal step below it
    bound = torch.maximum(x.abs() * 2.0 ** -(mbits + 1), scale * 2.0 ** (emin - mbits - 1))
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0  # something was actually rounded


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1), (3, 5)])
@pytest.mark.parametrize("pow2", [True, False])
def test_matches_loop_reference_on_ragged_shapes(block, pow2):
    x = _wide((261, 389), seed=1)
    q = quantize(x, block, "e4m3", pow2)
    scaled, scales = _loop_reference(x, block, 448.0, pow2)
    assert q.scale.shape == (math.ceil(261 / block[0]), math.ceil(389 / block[1]))
    assert torch.equal(q.scale, scales)
    assert torch.equal(q.data.float(), scaled.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_pow2_scales_are_exact_powers_of_two_and_exact_scales_hit_fmax():
    x = _wide((256, 512), seed=2)
    s = quantize(x, (1, 128), pow2_scale=True).scale
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)
    q = quantize(x, (1, 128), pow2_scale=False)
    # with exact FP32 scales, each tile's amax lands on the top of the range
    assert torch.all(q.data.float().abs().view(256, 4, 128).amax(-1) == 448)
    assert torch.equal(q.scale, x.abs().view(256, 4, 128).amax(-1) / 448)


def _division_then_pow2(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """What a power-of-two scale means: the IEEE division amax / fmax (1 for 0, at least FP32's smallest
    normal), rounded up to a power of two by frexp."""
    s = torch.where(amax == 0, 1.0, amax / torch.full_like(amax, fmax)).clamp_min(torch.finfo(torch.float32).tiny)
    mant, exp = torch.frexp(s)
    up = torch.where(mant == 0.5, s, torch.ldexp(torch.ones_like(s), exp))
    return torch.where(torch.isfinite(s), up, s)


def _pow2_differences(amax: torch.Tensor, f: Fp8Format) -> int:
    """How many of `amax`'s power-of-two scales (`compute_scale`) differ from the division's bit for bit (a NaN
    amax: a scale that is not NaN), plus how many of their multipliers (`reciprocal`) differ from 1 / scale."""
    from fp8train.fp8.quant import compute_scale, reciprocal

    got, want, nan = compute_scale(amax, f, True), _division_then_pow2(amax, f.max), amax.isnan()
    differ = int((got.view(torch.int32) != want.view(torch.int32))[~nan].sum() + (~got[nan].isnan()).sum())
    finite = got[torch.isfinite(got)]  # the quantize multiplier: 1 / scale exactly (a power of two: no rounding)
    return differ + int((reciprocal(finite, True) != 1.0 / finite).sum())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pow2_scales_from_bits_are_the_division_rounded_up(fmt):
    """The reference makes a power-of-two scale from amax's bit patterns (no division a compiler could
    approximate). Against the division for every non-negative BF16 amax, and for FP32 amax at every exponent
    (subnormals included) with the mantissas around fmax's, where the scale steps up, their extremes and random
    ones; 0, Inf and NaN. (Every one of the 2^31 FP32 patterns: `_exhaustive_pow2_differences`, run by
    `PYTHONPATH=. python tests/test_quant.py`: none differ, docs/benchmarks.md thirty-seventh session.)"""
    from fp8train.fp8.quant import compute_scale, reciprocal  # (the step and non-finite checks below)

    fmax = FORMATS[fmt][0]
    f = Fp8Format.parse(fmt)
    m_fmt = int(torch.tensor(fmax).view(torch.int32)) & 0x7FFFFF
    g = torch.Generator().manual_seed(7)
    mantissas = torch.cat([torch.tensor([0, 1, m_fmt - 1, m_fmt, m_fmt + 1, 0x7FFFFF]),
                           torch.randint(0, 1 << 23, (200,), generator=g)])
    fp32 = ((torch.arange(256)[:, None] << 23) | mantissas[None, :]).flatten().to(torch.int32).view(torch.float32)
    bf16 = (torch.arange(1 << 15, dtype=torch.int32) << 16).view(torch.float32)  # every BF16 >= 0, Inf and NaNs
    for amax in (fp32, bf16):
        assert _pow2_differences(amax, f) == 0
    steps = torch.tensor([fmax, fmax * (1 + 2.0 ** -23), 0.0, float("inf"), float("nan")])
    assert compute_scale(steps, f, True)[:3].tolist() == [1.0, 2.0, 1.0]  # above fmax's mantissa: one step up
    inv = reciprocal(torch.tensor([float("inf"), float("nan")]), True)
    assert inv[0] == 0 and inv[1].isnan()


def test_pow2_quantization_traces_without_a_division():
    """What a compiler sees of the reference's quantization (traced to aten ops, as inductor gets it when
    `fuse_row_quantization` fuses it into a producer): with power-of-two scales no division or reciprocal
    at all, so an approximate division in generated code (inductor's Triton `/`) cannot change a scale;
    exact scales do divide (`fuse_row_quantization` refuses them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp8train.fp8.quant import quantize_2d

    x = _wide((4, 256), seed=4).bfloat16()
    ops = {torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar, torch.ops.aten.reciprocal.default}
    for pow2 in (True, False):
        gm = make_fx(lambda t: quantize_2d(t, (1, 128), Fp8Format.E4M3, pow2))(x)
        divides = {n.target for n in gm.graph.nodes} & ops
        assert (not divides) if pow2 else divides
        (q, s), (want_q, want_s) = gm(x), quantize_2d(x, (1, 128), Fp8Format.E4M3, pow2)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def _exact_scale_data(f):
    """Several magnitudes (1e-6 .. 1e6 along the columns), all-zero blocks both ways, a block of values just
    below +-fmax (scale a little under 1: x * inv can round above fmax, the clamp brings it back), and in
    row 131 every tie between two FP8 values times 7, beside amax 7 * fmax: scale 7 for that row's 1x128
    block and its 128x128 block (the rest of both is below 1e-3), x / 7 lands exactly on the tie, and
    x * RN(1 / 7) (RN(1 / 7) > 1 / 7) lands just above it, often enough rounding the other way."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 1024, generator=g) * torch.logspace(-6, 6, 1024)[None, :]
    x[:128, :128] = 0
    x[130] = 0
    near = f.max * (1 - torch.rand(256, 128, generator=g) * 2.0 ** -6)
    x[256:, 512:640] = torch.where(torch.rand(256, 128, generator=g) < 0.5, -near, near)
    values = torch.arange(256, dtype=torch.uint8).view(f.dtype).float()
    values = values[torch.isfinite(values) & (values > 0)].unique()  # sorted
    ties = (values[1:] + values[:-1]) / 2
    x[131, :128] = 0
    x[131, 0] = 7 * f.max
    x[131, 1:1 + len(ties)] = 7 * ties  # exact: at most 8 significant bits
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), None])
def test_exact_scales_multiply_by_the_correctly_rounded_reciprocal(fmt, block):
    """pow2_scale=False quantizes clamp(x * RN(1 / scale)), one IEEE division per block (as the GPU kernels:
    a division per element is slow there), not clamp(RN(x / scale)). The two FP8 results differ only where
    x * RN(1 / s) and RN(x / s) straddle an FP8 rounding boundary. Measured on this data (524288 elements per
    case): none in the random part; 30 of row 131's ties (e4m3 and e5m2 alike) with 1x128 and 128x128 blocks
    (elsewhere about 1 element in 2 million: 5 and 2 of 10.5M randn * 1e-6..1e6, e4m3 and e5m2, 1x128
    tiles). Power-of-two scales stay exactly the division."""
    f = Fp8Format.parse(fmt)
    x = _exact_scale_data(f)
    q = quantize(x, block, fmt, pow2_scale=False)
    nr, nc = (1, 1) if block is None else (512 // block[0], 1024 // block[1])
    amax = x.view(nr, 512 // nr, nc, 1024 // nc).abs().amax(dim=(1, 3))
    want_scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, f.max))
    assert torch.equal(q.scale.reshape(nr, nc), want_scale)  # the stored (dequantize) scale is amax / fmax

    def expand(t):
        return t.reshape(nr, nc).repeat_interleave(512 // nr, 0).repeat_interleave(1024 // nc, 1)

    s = expand(q.scale)
    inv = expand((1.0 / q.scale.double()).float())  # RN(1 / s): double then FP32 is correctly rounded
    mul = (x * inv).clamp(-f.max, f.max)
    assert torch.equal(q.data.view(torch.uint8), mul.to(f.dtype).view(torch.uint8))
    assert int(((x * inv).abs() > f.max).sum()) >= 1  # the clamp was needed somewhere
    div = (x / s).clamp(-f.max, f.max)
    assert (mul != div).any()  # the FP32 values do differ, in the last bit
    differ = int((div.to(f.dtype).view(torch.uint8) != q.data.view(torch.uint8)).sum())
    assert differ / x.numel() < 1e-3, differ
    if block is not None:
        assert s[131, 0] == 7 and differ >= 1  # the ties of row 131
    # power-of-two scales: x * 2^-e is x / 2^e exactly, so quantizing is the division bit for bit
    p = quantize(x, block, fmt, pow2_scale=True)
    want = (x / expand(p.scale)).clamp(-f.max, f.max).to(f.dtype)
    assert torch.equal(p.data.view(torch.uint8), want.view(torch.uint8))


def test_zeros_and_zero_blocks():
    q = quantize(torch.zeros(4, 300))
    assert torch.all(q.scale == 1) and not q.data.float().any()
    x = _wide((4, 256))
    x[1] = 0
    x[2, :128] = 0
    q = quantize(x)
    assert q.scale[1].eq(1).all() and q.scale[2, 0] == 1 and q.scale[2, 1] != 1
    assert torch.equal(dequantize(q)[1], torch.zeros(256))


def test_shapes_1d_3d_and_dtypes():
    x = _wide((2, 3, 260))
    q = quantize(x, (1, 128))
    assert q.data.shape == x.shape and q.scale.shape == (6, 3)
    assert torch.equal(q.data.view(torch.uint8), quantize(x.reshape(6, 260)).data.view(torch.uint8).view(2, 3, 260))
    v = quantize(x[0, 0], (1, 128))
    assert v.data.shape == (260,) and v.scale.shape == (1, 3)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dt)
        assert torch.equal(quantize(xd).data.view(torch.uint8), quantize(xd.float()).data.view(torch.uint8))
    assert dequantize(quantize(x.bfloat16())).dtype == torch.float32


def test_token_dim_tiles_are_tiles_of_the_transpose():
    x = _wide((300, 200), seed=3)
    a, b = quantize(x, (128, 1)), quantize(x.t(), (1, 128))
    assert torch.equal(a.data.t().view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scale.t(), b.scale)


def test_nonfinite_blocks_become_nan_and_stay_contained():
    x = _wide((4, 256))
    x[0, 3] = float("nan")
    x[2, 200] = float("inf")
    d = dequantize(quantize(x))
    assert torch.isnan(d[0, :128]).all() and torch.isnan(d[2, 128:]).all()
    finite = torch.ones_like(d, dtype=torch.bool)
    finite[0, :128] = finite[2, 128:] = False
    assert torch.isfinite(d[finite]).all()


def test_bad_input_errors():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.arange(10))
    with pytest.raises(ValueError, match="unknown FP8 format"):
        quantize(torch.randn(4, 4), fmt="e3m4")
    with pytest.raises(ValueError, match="block"):
        quantize(torch.randn(4, 4), block=(0, 128))
    with pytest.raises(ValueError, match="scalar"):
        quantize(torch.tensor(1.0))


def _exhaustive_pow2_differences() -> dict:
    """`_pow2_differences` for every one of the 2^31 non-negative FP32 amax patterns, both formats (~5 minutes)."""
    out = {}
    for fmt in ("e4m3", "e5m2"):
        f = Fp8Format.parse(fmt)
        out[fmt] = sum(_pow2_differences(torch.arange(start, start + (1 << 25), dtype=torch.int64).to(torch.int32)
                                         .view(torch.float32), f) for start in range(0, 1 << 31, 1 << 25))
    return out


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_quant.py
    print(_exhaustive_pow2_differences())
