"""fp8train's AdamW kernel (fp8train.train.adamw) on a CPU: in Triton's interpreter against its reference,
torch's AdamW and FP64, and its SM90 machine code. Both in subprocesses, as tests/test_triton_kernels.py runs
the quantization kernels (TRITON_INTERPRET is read when a kernel is defined); skipped where Triton for the CPU
checks is absent. The CUDA launch is checked on the device: tests/test_gpu.py."""

import functools

import torch
from _triton_cpu import needs_triton, run_check

from fp8train.train.adamw import adamw_reference, step_scalars


@functools.cache
def _check(mode: str) -> dict:
    return run_check("_adamw_kernel_checks.py", mode, interpret=mode in ("interpret", "fsdp"))


@needs_triton
def test_triton_adamw_equals_its_reference_and_tracks_torch():
    """Five steps over two parameter groups (decay and none), ragged sizes across chunk boundaries, a parameter
    without a gradient in one step, the clip folded in for two: parameters and both moments equal
    `adamw_reference` bit for bit; torch's AdamW within 1e-4 of the distance moved, FP64 AdamW as close as
    torch's own; a state_dict loads into torch's AdamW and back without changing the next step. `grad_norm`
    within 1e-6 of the FP64 norm; the step after it reads a gradient replaced in between and the moments of a
    state_dict loaded in between, and a step skipped after it keeps no gradient alive. Parameters with an FP8
    copy (`write_fp8_blocks`: stepped a 128x128 block per program, the copy written from the updated values),
    beside flat ones in both groups, ragged and padded: the step is the reference's and the copy and its scales
    the reference quantization of the updated weight (the values before the FP8 cast), both scale kinds; a
    skipped step writes no copy, a copy let go is not written, a copy of the wrong shape is refused."""
    res = _check("interpret")
    assert res["failures"] == []
    assert res["worst"]["vs fp64"] <= 2 * res["worst"]["torch vs fp64"] + 1e-3


@needs_triton
def test_triton_adamw_steps_fsdp2_shards_as_one_process_steps_the_whole():
    """Two CPU ranks, FSDP2: each rank's kernel steps its own shards of parameters, gradients and moments
    (DTensors); the gathered parameters after three steps equal one process's bit for bit, and after a fourth
    with the clip (its norm reduced across ranks, so summed in another order) within 1e-5 of the step's move;
    the optimizer's own gradient norm (`grad_norm`: this rank's sum of squares, all-reduced) equals one
    process's within 1e-6."""
    res = _check("fsdp")
    assert res["same"] and res["shards"] == [[150, 64], [150], [5, 300], [5]]
    assert res["clipped_step_diff"] < 1e-5
    assert res["norm_diff"] < 1e-6  # each rank's sum of squares, all-reduced, is the whole model's norm


@needs_triton
def test_triton_adamw_compiles_for_sm90_without_spills():
    """As launched (no fused multiply-add, so that the GPU rounds each operation as the reference does), the
    gradient norm's kernel and the step that writes FP8 copies (both scale kinds): no spills, and few enough
    registers for several programs per SM (a streaming kernel needs bytes in flight)."""
    res = _check("compile")
    for name, r in res.items():
        assert r["STACK"] == 0, f"{name} spills: {r}"
        assert r["REG"] <= 96, f"{name} uses {r['REG']} registers"
    # the option reaches the compiler: with fusion the multiply-adds of the update become FMAs
    assert res["grad_scale=True fp_fusion=True"]["FFMA"] > res["grad_scale=True fp_fusion=False"]["FFMA"]
    assert "grad_norm" in res and "fp8 blocks pow2=True" in res and "fp8 blocks pow2=False" in res


def test_reference_is_adamw():
    """The reference against a textbook FP64 AdamW step (decoupled decay, bias corrections, the gradient divided
    by the clip's scale): each result within a few FP32 roundings of the magnitudes it is made from."""
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(4096, generator=g), torch.randn(4096, generator=g) * 1e-2
    m, v = torch.randn(4096, generator=g) * 1e-3, torch.rand(4096, generator=g) * 1e-4
    p64, m64, v64, g64 = p.double(), m.double(), v.double(), grad.double() / 3.0
    lr, wd, (b1, b2), eps, t = 1e-3, 0.1, (0.9, 0.95), 1e-8, 7
    adamw_reference(p, grad, m, v, step_scalars(lr, wd, (b1, b2), eps, t), torch.tensor([3.0]))
    m_terms = (b1 * m64).abs() + ((1 - b1) * g64).abs()
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 ** 2
    update = lr / (1 - b1 ** t) * m64 / ((v64 / (1 - b2 ** t)).sqrt() + eps)
    p_terms = (p64 * (1 - lr * wd)).abs() + update.abs()
    p64 = p64 * (1 - lr * wd) - update
    for got, want, terms in ((m, m64, m_terms), (v, v64, v64), (p, p64, p_terms)):
        assert ((got.double() - want).abs() <= 4 * 2.0 ** -24 * terms).all()
