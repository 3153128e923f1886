"""The Triton quantization kernels on a CPU: their arithmetic in Triton's interpreter, and their SM90
machine code (registers, spills), both in subprocesses (TRITON_INTERPRET is read when kernels are defined).

Triton is not a dependency of the CPU install; `make test` puts Triton 3.6 (the version on the lent H200)
in .venv/triton-cpu, and these tests skip, saying so, where it is absent. The bit-exact FP8 conversion itself
runs on the GPU: tests/test_gpu.py.
"""

import functools

from _triton_cpu import needs_triton, run_check

pytestmark = needs_triton


@functools.cache
def _check(mode: str) -> dict:
    return run_check("_triton_kernel_checks.py", mode, interpret=mode in ("interpret", "exhaustive"))


def test_kernel_arithmetic_matches_the_reference_bit_for_bit():
    """Scales and pre-conversion values of both copies, E4M3 and E5M2, pow2 on and off, BF16 and FP32 inputs,
    ragged shapes, zeros, NaN/Inf and amax values next to powers of two: equal to fp8train.fp8.quant's; the
    power-of-two scale from bit patterns for every exponent. And no launch hands the kernel a tensor twice (inductor would copy it first: a
    measured 2.7% of a 7B step). And benchmarks/bench_quant.py's candidate launches give the library launch's
    bytes."""
    assert _check("interpret")["failures"] == []


def test_kernels_compile_for_sm90_without_spills():
    """The launches (the SwiGLU producers' included) fit in registers, with power-of-two and exact scales: a
    spill to local memory (STACK > 0) costs bandwidth, and more than 128 registers at 8 warps leaves one
    program per SM, so no load overlaps another's arithmetic (the exact-scale two-copy launch once took 167
    and ran 1.4x slower; one launch for both SwiGLU gradients took 255 and ran 1.4x slower than two)."""
    res = _check("compile")
    assert {f"swiglu {t} pow2=True rows=True cols=True" for t in ("h", "dg", "du")} <= res.keys()
    assert {f"{t}.T pow2=True rows=False cols=True" for t in ("activation x", "swiglu h")} <= res.keys()  # input.T alone
    assert "activation fp32 pow2=True rows=True cols=True" in res.keys()  # FP32 inputs: the norms' outputs
    assert {f"{t} col blocks pow2=True rows=True cols=True" for t in ("activation", "swiglu h")} <= res.keys()
    assert {f"rows_grad_weight block_n={n}" for n in (16, 32, 64)} <= res.keys()
    for name, r in res.items():
        assert r["STACK"] == 0, f"{name} spills: {r}"
        assert r["REG"] <= 128, f"{name} uses {r['REG']} registers"




def test_compiler_sees_the_kernels_inputs_as_read_only():
    """torch.compile copies every input it believes a user kernel writes before each launch (seen on the H200:
    torch 2.11 listed a pointer handed to a @triton.jit helper as written, so the kernels keep their loads in
    their own bodies). torch's own analysis of the kernels' Triton IR, with an SM90 target, must list as
    written exactly each launch's outputs: for every producer and copy choice, the weight kernel, and the
    grad_weight of a LoRA adapter from FP8 rows."""
    res = _check("mutation")
    assert len(res) == 23  # 4 producers x 5 copy choices (two with input.T in blocks), 2 weight launches, dW
    for name, acc in res.items():
        if name.startswith("weight"):
            outputs = {"q_ptr", "s_ptr"}
        elif name == "rows_grad_weight":
            outputs = {"out_ptr"}
        else:
            outputs = ({"qr_ptr", "sr_ptr"} if "rows=True" in name else set()) | (
                {"qc_ptr", "sc_ptr"} if "cols=True" in name else set())
        assert set(acc["writes"]) == outputs, f"{name}: {acc}"
        assert {"x_ptr", "w_ptr", "q_ptr"} & set(acc["reads"]), f"{name}: {acc}"


def test_each_op_name_is_defined_once():
    """The Triton kernels' ops (kernels.py) and the custom ops beside them (ops.py, gemm.py) share the
    `fp8train::` namespace, and are all defined only where Triton imports (a GPU machine): a name defined twice
    silently replaces the first op, whose callers (compiled on CUDA) then fail on a schema that is not theirs."""
    res = _check("ops")
    assert {"fp8train::rows_grad_weight", "fp8train::rows_grad_weight_kernel", "fp8train::quantize_tiles"} <= res.keys()
    for name, (count, schema_matches) in res.items():
        assert count == 1 and schema_matches, (name, count, schema_matches)
