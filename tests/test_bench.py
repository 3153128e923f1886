"""`fp8train bench` on a CPU (the harness; its numbers mean something only on a GPU) and the profile split."""

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from fp8train.bench import categorize_profile, main, markdown_table


def test_bench_runs_every_variant_in_one_harness(capsys):
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
               "hybrid", "--modes", "eager", "--steps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("| tiny-qwen2 |")]
    assert len(rows) == 2 and "| bf16 |" in rows[0] and "| 1.000 |" in rows[0]
    assert "| hybrid |" in rows[1]


def test_variant_modifiers(capsys):
    """`+wgrad_from_fp8`, `+swiglu_fp8` convert with those recipe knobs (the trainer finds the layers converted)."""
    from fp8train.bench import BenchCase, run_case

    variants = ("hybrid", "hybrid+wgrad_from_fp8", "hybrid+swiglu_fp8", "hybrid+wgrad_from_fp8+swiglu_fp8")
    res = {v: run_case(BenchCase("tiny-qwen2", None, 64, v, "eager", 512), steps=1, warmup=1, device="cpu")
           for v in variants}
    assert all(r["fp8_layers"] == 14 for r in res.values()), res
    for v in variants[1:]:
        assert res[v]["loss_first"] == res["hybrid"]["loss_first"], v  # the same forward
    with pytest.raises(ValueError, match="unknown variant 'hybrid\\+fast'"):
        run_case(BenchCase("tiny-qwen2", None, 64, "hybrid+fast", "eager", 512), device="cpu")


def test_a_failing_variant_is_reported_not_fatal(capsys):
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants",
               "torchao-rowwise", "--modes", "eager", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED" in out  # torchao is not installed on the CPU test machine


def _evt(key, device, ms, annotation=False):
    return SimpleNamespace(key=key, device_type=device, self_device_time_total=ms * 1e3, is_user_annotation=annotation)


def test_profile_counts_kernels_once_and_splits_fp8_gemms_by_kernel_name():
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU

    class Prof:
        def key_averages(self):
            return [_evt("aten::mm", cpu, 5.0), _evt("aten::_scaled_mm_v2", cpu, 3.0),  # CPU ops: not summed
                    _evt("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopB_TNT", cuda, 5.0),  # BF16 operands
                    _evt("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", cuda, 2.0),
                    _evt("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", cuda, 1.0),
                    _evt("_act_kernel", cuda, 1.0), _evt("pytorch_flash::flash_fwd_kernel", cuda, 2.0),
                    _evt("multi_tensor_apply_kernel<Adam>", cuda, 0.5), _evt("triton_red_fused_rms", cuda, 0.25),
                    _evt("Optimizer.step#AdamW.step", cuda, 0.5, annotation=True)]  # spans the Adam kernel

    p = categorize_profile(Prof())
    assert p["fp8 gemm"] == pytest.approx(3.0) and p["bf16/fp32 gemm"] == pytest.approx(5.0)
    assert p["quantization"] == 1.0 and p["attention"] == 2.0 and p["optimizer"] == 0.5
    assert p["norms and elementwise"] == 0.25 and p["total"] == pytest.approx(11.75)
    table = markdown_table([{"model": "m", "layers": 1, "seq": 8, "variant": "bf16", "mode": "eager", "step_ms": 2.0,
                             "tokens_per_s": 4.0, "tflops": 1.0, "mfu_bf16_peak": 0.1, "peak_mem_gib": 1.0,
                             "loss_first": 1.0, "loss_last": 0.5, "profile_ms": p}])
    assert "| 3.0 | 5.0 | 1.0 | 2.0 | 0.2 | 0.5 | 0.0 | 11.8 |" in table
