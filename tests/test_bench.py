"""`fp8train bench` on a CPU (the harness; its numbers mean something only on a GPU) and the profile split."""

import json
import re
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from fp8train.bench import (categorize_profile, kernel_launches, main, markdown_table, top_kernel_times,
                            top_kernels_table)


def test_bench_runs_every_variant_in_one_harness(capsys):
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
               "hybrid", "--modes", "eager", "--steps", "1", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("| tiny-qwen2 |")]
    assert len(rows) == 2 and "| bf16 |" in rows[0] and "| 1.000 |" in rows[0]
    assert "| hybrid |" in rows[1]


def test_optim_impl_runs_every_variant_with_each_optimizer(capsys):
    """--optim-impl foreach fused: each variant with each AdamW step, each ratio against the BF16 of its own
    optimizer, the optimizer named where it is not the default."""
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
               "hybrid", "--modes", "eager", "--steps", "1", "--warmup", "1", "--optim-impl", "foreach", "fused"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("| tiny-qwen2 |")]
    assert [r.split(" | ")[4] for r in rows] == ["bf16 (foreach AdamW)", "hybrid (foreach AdamW)",
                                                 "bf16 (fused AdamW)", "hybrid (fused AdamW)"]
    assert "| 1.000 |" in rows[2]  # the fused BF16 against itself
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["optim_impl"] for r in results] == ["foreach", "foreach", "fused", "fused"]


def test_rounds_interleave_the_variants_and_report_their_spread(capsys):
    """--rounds 2: bf16, hybrid, bf16, hybrid in one process; each round's ratio against its own BF16, and a
    table of each ratio's median and range over the rounds."""
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
               "hybrid", "--modes", "eager", "--steps", "1", "--warmup", "1", "--rounds", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith("| tiny-qwen2 |")]
    assert [r.split(" | ")[4] for r in rows[:4]] == ["bf16", "hybrid", "bf16 [round 2]", "hybrid [round 2]"]
    assert "| 1.000 |" in rows[2]  # round 2's BF16 against itself, not against round 1's
    summary = rows[4:]
    assert len(summary) == 1 and "| hybrid | 2 |" in summary[0], summary
    ratios = [float(x) for x in re.findall(r"(\d\.\d{3})", summary[0].split(" | ")[6])]
    assert len(ratios) == 3 and ratios[1] <= ratios[0] <= ratios[2]  # median within (lowest-highest)


def test_variant_modifiers(capsys):
    """`+wgrad_from_fp8`, `+swiglu_fp8`, `+deep_gemm` convert with those recipe knobs (the trainer finds the layers converted)."""
    from fp8train import make_recipe
    from fp8train.bench import BenchCase, parse_variant, run_case

    variants = ("hybrid", "hybrid+wgrad_from_fp8", "hybrid+swiglu_fp8", "hybrid+wgrad_from_fp8+swiglu_fp8",
                "hybrid+deep_gemm", "hybrid+unfused")  # deep_gemm: ignored when emulated
    assert parse_variant("hybrid+exact+deep_gemm")[1] == make_recipe("hybrid", pow2_scale=False, deep_gemm=True)
    assert parse_variant("tensorwise+fused")[1] == make_recipe("tensorwise", fuse_swiglu=True)
    assert parse_variant("hybrid+unfused")[1] == make_recipe("hybrid", fuse_swiglu=False) != make_recipe("hybrid")
    assert parse_variant("hybrid+held") == ("hybrid", None, {"held"})  # the trainer's hold_fp8_weights
    assert parse_variant("hybrid+exact+held")[1:] == (make_recipe("hybrid", pow2_scale=False), {"held"})
    assert parse_variant("hybrid+keep_t+deep_gemm")[1:] == (make_recipe("hybrid", deep_gemm=True), {"keep_t"})
    with pytest.raises(ValueError, match="held"):
        parse_variant("bf16+held")
    res = {v: run_case(BenchCase("tiny-qwen2", None, 64, v, "eager", 512), steps=1, warmup=1, device="cpu")
           for v in variants}
    assert all(r["fp8_layers"] == 14 for r in res.values()), res
    out = capsys.readouterr().out  # the bench names the recipe it converted with (the trainer, its base's)
    assert "fp8train: recipe hybrid+wgrad_from_fp8+swiglu_fp8: 14 Linear layers in FP8" in out, out[-2000:]
    assert all(r["step_ms_range"][0] <= r["step_ms"] <= r["step_ms_range"][1] for r in res.values()), res
    for v in variants[1:]:
        assert res[v]["loss_first"] == res["hybrid"]["loss_first"], v  # the same forward
    with pytest.raises(ValueError, match="unknown variant 'hybrid\\+fast'"):
        run_case(BenchCase("tiny-qwen2", None, 64, "hybrid+fast", "eager", 512), device="cpu")


def test_packed_documents_restart_positions_and_are_attended_apart(capsys):
    """`--docs N`: each row holds N documents (position_ids restart at each); the model attends within each, so
    the same tokens give another first loss than one document a row. Labelled and matched to their own BF16."""
    from fp8train.bench import BenchCase, markdown_table, run_case

    res = [run_case(BenchCase("tiny-qwen2", None, 64, v, "eager", 512, docs=d), steps=1, warmup=1, device="cpu")
           for d in (1, 4) for v in ("bf16", "hybrid")]
    assert [r["docs"] for r in res] == [1, 1, 4, 4] and res[0]["loss_first"] != res[2]["loss_first"]
    table = markdown_table(res)
    assert "hybrid (4 documents a sequence)" in table and "bf16 (4 documents a sequence) | " in table
    assert table.count("| 1.000 |") == 2  # each BF16 is its own base, no row compared across counts


def test_targets_leave_each_documents_prompt_without_a_target():
    """`--targets F`: SFT-like rows, only the last share F of each document trained (the prompt labelled -100),
    so the head runs on those rows (`loss_rows`); labelled and matched to their own BF16."""
    from fp8train.bench import BenchCase, markdown_table, run_case

    res = [run_case(BenchCase("tiny-qwen2", None, 512, v, "eager", 512, docs=2, targets=t), steps=1, warmup=1,
                    device="cpu") for t in (1.0, 0.25) for v in ("bf16", "hybrid")]
    assert [r["targets"] for r in res] == [1.0, 1.0, 0.25, 0.25] and res[0]["loss_first"] != res[2]["loss_first"]
    table = markdown_table(res)
    assert "hybrid (2 documents a sequence) (25% of tokens with a target)" in table
    assert table.count("| 1.000 |") == 2


def test_lora_trains_only_the_adapters_on_the_frozen_fp8_base(capsys):
    """--lora RANK: the trainer's LoRA (adapters on the seven projections, the base frozen), as `Trainer.fit` runs
    it (the base's FP8 weights made once, `Trainer.fp8_weights`); labelled, matched to its own BF16, and its
    TFLOP/s counted without the frozen weights' grad_weight GEMMs."""
    from fp8train.bench import BenchCase, markdown_table, run_case
    from fp8train.train.metrics import flops_per_token
    from fp8train.train.model import ModelConfig, build_model

    res = [run_case(BenchCase("tiny-qwen2", None, 64, v, "eager", 512, lora=r), steps=2, warmup=1, device="cpu")
           for r in (0, 8) for v in ("bf16", "hybrid")]
    assert [r["lora"] for r in res] == [0, 0, 8, 8] and res[3]["fp8_layers"] == 14
    assert all(r["loss_last"] != r["loss_first"] for r in res)  # the adapters train
    # +keep_t (the base keeps W.T too) computes the same steps bit for bit; without LoRA it (and +inputs_fp8) is
    # refused
    kept = run_case(BenchCase("tiny-qwen2", None, 64, "hybrid+keep_t", "eager", 512, lora=8), steps=2, warmup=1,
                    device="cpu")
    assert (kept["loss_first"], kept["loss_last"]) == (res[3]["loss_first"], res[3]["loss_last"])
    for mod in ("keep_t", "inputs_fp8"):
        with pytest.raises(ValueError, match=mod):
            run_case(BenchCase("tiny-qwen2", None, 64, f"hybrid+{mod}", "eager", 512), steps=1, warmup=0,
                     device="cpu")
    # +inputs_fp8 (the adapters keep the base's FP8 input; tests/test_lora.py has its numbers): the same first
    # loss (the forward is unchanged)
    fp8_in = run_case(BenchCase("tiny-qwen2", None, 64, "hybrid+inputs_fp8", "eager", 512, lora=8), steps=2,
                      warmup=1, device="cpu")
    assert fp8_in["loss_first"] == res[3]["loss_first"] and fp8_in["variant"] == "hybrid+inputs_fp8"
    table = markdown_table(res)
    assert "hybrid (LoRA r=8)" in table and table.count("| 1.000 |") == 2
    cfg = build_model(ModelConfig(source="tiny-qwen2", vocab_size=512)).config
    frozen, full = (flops_per_token(cfg, 64, weight_grads=w) for w in (False, True))
    assert frozen < full
    for r in res:
        assert abs(r["tflops"] * 1e12 * r["step_ms"] / 1e3 / 64 - (frozen if r["lora"] else full)) < 1e-3 * full


def test_a_failing_variant_is_reported_not_fatal(capsys):
    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants",
               "torchao-rowwise", "--modes", "eager", "--steps", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED" in out  # torchao is not installed on the CPU test machine


def test_memory_under_cudagraphs_says_why_there_is_no_breakdown(capsys):
    """--memory takes no breakdown under CUDA graphs; the run says so under its table instead of leaving it out."""
    argv = ["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
            "--steps", "1", "--warmup", "0", "--memory", "--modes"]
    main(argv + ["eager"])
    assert "no breakdown for the cudagraphs rows" not in capsys.readouterr().out
    main(argv + ["eager", "cudagraphs"])  # cudagraphs on a CPU fails its case (reported); the note is the run's
    assert "--memory: no breakdown for the cudagraphs rows" in capsys.readouterr().out


def _evt(key, device, ms, annotation=False, count=1):
    return SimpleNamespace(key=key, device_type=device, self_device_time_total=ms * 1e3, is_user_annotation=annotation,
                           count=count)


def test_profile_counts_kernels_once_and_splits_fp8_gemms_by_kernel_name():
    cuda, cpu = DeviceType.CUDA, DeviceType.CPU

    class Prof:
        def key_averages(self):
            return [_evt("aten::mm", cpu, 5.0), _evt("aten::_scaled_mm_v2", cpu, 3.0),  # CPU ops: not summed
                    _evt("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopB_TNT", cuda, 5.0),  # BF16 operands
                    _evt("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", cuda, 2.0),
                    _evt("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n", cuda, 1.0),
                    _evt("_act_kernel", cuda, 1.0, count=8), _evt("pytorch_flash::flash_fwd_kernel", cuda, 2.0),
                    _evt("multi_tensor_apply_kernel<Adam>", cuda, 0.5), _evt("triton_red_fused_rms", cuda, 0.25),
                    # inductor's kernel with a traced quantization fused in, named after the GEMM it feeds
                    _evt("triton_per_fused_abs_amax_clamp_deep_gemm_silu", cuda, 0.5),
                    _evt("Optimizer.step#AdamW.step", cuda, 0.5, annotation=True)]  # spans the Adam kernel

    p = categorize_profile(Prof())
    assert p["fp8 gemm"] == pytest.approx(3.0) and p["bf16/fp32 gemm"] == pytest.approx(5.0)
    assert p["quantization"] == 1.0 and p["attention"] == 2.0 and p["optimizer"] == 0.5
    assert p["norms and elementwise"] == 0.75 and p["total"] == pytest.approx(12.25)
    table = markdown_table([{"model": "m", "layers": 1, "seq": 8, "variant": "bf16", "mode": "eager", "step_ms": 2.0,
                             "tokens_per_s": 4.0, "tflops": 1.0, "mfu_bf16_peak": 0.1, "peak_mem_gib": 1.0,
                             "loss_first": 1.0, "loss_last": 0.5, "profile_ms": p,
                             "kernel_launches": kernel_launches(Prof())}])
    assert kernel_launches(Prof()) == 15  # the _act_kernel's 8 launches counted, CPU ops and the annotation not
    assert "| 3.0 | 5.0 | 1.0 | 2.0 | 0.8 | 0.5 | 0.0 | 12.2 | 15 | -10.2 |" in table  # step 2.0 - kernels 12.25
    assert "| bf16 | 2.0 | 4 |" in table  # a result without the steps' range (older JSON lines)
    ranged = markdown_table([{"model": "m", "layers": 1, "seq": 8, "variant": "bf16", "mode": "eager", "step_ms": 2.0,
                              "step_ms_range": [1.94, 2.31], "tokens_per_s": 4.0, "tflops": 1.0, "mfu_bf16_peak": 0.1,
                              "peak_mem_gib": 1.0, "loss_first": 1.0, "loss_last": 0.5}])
    assert "| bf16 | 2.0 (1.9-2.3) | 4 |" in ranged
    top = top_kernel_times(Prof(), 3)  # by time; the launches and the mean per launch beside it
    assert [(c, t) for c, _, t, _ in top] == [("gemm", 5.0), ("gemm", 2.0), ("attention", 2.0)]
    assert "| quantization | `_act_kernel` | 1.00 | 8 | 125.0 |" in top_kernels_table("t", top_kernel_times(Prof(), 9))


def test_gemm_backends_table_routes_grad_weight_to_cublas():
    """benchmarks/gemm_backends.py's per-layer sum: each shape as often as a decoder layer has it, and the
    `deep_gemm` column takes DeepGEMM's time for output / grad_input but cuBLAS's for grad_weight."""
    from _benchmarks import load_benchmark

    gb = load_benchmark("gemm_backends")
    rows = []
    for shape, n in gb._PER_LAYER.items():
        for gemm, (cub, deep) in {"output": (1.0, 0.5), "grad_input": (1.0, 0.5), "grad_weight": (1.0, 3.0)}.items():
            rows.append({"model": "7b", "shape": shape, "gemm": gemm, "M": 8192, "N": 128, "K": 128, "cublas_ms": cub,
                         "cublas_tflops": 1.0, "cublas_sqnr": 55.0, "deepgemm_ms": deep, "deepgemm_tflops": 2.0,
                         "deepgemm_sqnr": 55.0, "deepgemm_bit_identical": True})
    text = gb.table(rows)
    layers = sum(gb._PER_LAYER.values())
    assert layers == 7 and text.count("| 7b |") == 12
    assert (f"cuBLAS {3 * layers:.2f} ms; with `deep_gemm` (output and grad_input on DeepGEMM) {2 * layers:.2f} ms "
            f"({3 / 2:.3f}x); all on DeepGEMM {4 * layers:.2f} ms") in text


def test_trace_writes_the_profiled_steps_chrome_trace(tmp_path, capsys):
    """--trace DIR: each variant's profiled step as a gzipped Chrome trace, named so that any file system
    (and the device tool's file transfer) takes it: the variant's '+' becomes '_'."""
    import gzip

    rc = main(["--models", "tiny-qwen2", "--vocab", "512", "--seq", "64", "--device", "cpu", "--variants", "bf16",
               "hybrid+t_bwd", "--modes", "eager", "--steps", "1", "--warmup", "1", "--trace", str(tmp_path / "tr")])
    assert rc == 0
    files = sorted(p.name for p in (tmp_path / "tr").iterdir())
    assert files == ["tiny-qwen2-2-64-eager-bf16.json.gz", "tiny-qwen2-2-64-eager-hybrid_t_bwd.json.gz"], files
    names = {e.get("name") for e in json.loads(gzip.open(tmp_path / "tr" / files[1]).read())["traceEvents"]}
    # one whole training step: the FP8 Linears' and the fused MLP's autograd Functions both ways, the optimizer
    assert {"_Fp8LinearFn", "_Fp8LinearFnBackward", "_SwiGLUMLPFn", "_SwiGLUMLPFnBackward",
            "Optimizer.step#AdamW.step"} <= names


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_trace_gaps_finds_the_idle_time_and_who_launched_the_work_after_it(tmp_path):
    """benchmarks/trace_gaps.py on a Kineto trace made by hand: busy time is the union of the kernels (an
    overlap counts once), each gap is told by the launch of the kernel after it (the CPU ops around the
    launch, on the launching thread; "host-bound" when the launch began after the GPU went idle)."""
    import gzip
    import json

    from _benchmarks import load_benchmark

    tg = load_benchmark("trace_gaps")
    events = [
        _x("cpu_op", "ProfilerStep#3", 0, 1000),
        _x("cpu_op", "layer forward", 0, 300), _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 5, correlation=1),
        _x("cpu_op", "aten::add", 200, 10), _x("cuda_runtime", "cudaLaunchKernel", 202, 4, correlation=2),
        _x("user_annotation", "Optimizer.step", 260, 100, tid=2),
        _x("cuda_runtime", "cudaGraphLaunch", 270, 5, tid=2, correlation=3),
        _x("kernel", "gemm_a", 20, 100, tid=7, correlation=1),     # busy 20-120
        _x("kernel", "gemm_b", 100, 50, tid=8, correlation=9),    # overlaps: busy to 150
        _x("kernel", "add_k", 210, 30, tid=7, correlation=2),     # gap 150-210, launched at 202 (host-bound)
        _x("gpu_memcpy", "Memcpy DtoH", 242, 8, tid=7),           # gap 240-242 (2 us)
        _x("kernel", "adam", 300, 40, tid=7, correlation=3),      # gap 250-300, launched at 270 (host-bound)
    ]
    summary, found = tg.gaps(events)
    assert summary["window_us"] == 320 and summary["busy_us"] == 130 + 30 + 8 + 40
    assert summary["idle_us"] == 320 - 208 and summary["kernels"] == 4
    assert summary["host_lead_us"] == 20 and summary["host_tail_us"] == 360 - 340  # ops 0-360, kernels 20-340
    assert [(g.start_us, g.us, g.before, g.after) for g in found] == [
        (130, 60, "gemm_b", "add_k"), (220, 2, "add_k", "Memcpy DtoH"), (230, 50, "Memcpy DtoH", "adam")]
    first, _, last = found
    assert (first.op, first.context, first.host_bound) == ("aten::add", "layer forward", True)
    assert (last.op, last.context, last.host_bound) == ("Optimizer.step", "Optimizer.step", True)
    assert found[1].op == "?"  # a copy with no launch in the trace
    assert [(c, us, n) for c, us, _, n in tg.by_context(found)] == [("layer forward", 60, 1), ("Optimizer.step", 50, 1),
                                                                   ("?", 2, 1)]
    assert [(lo, n) for lo, _, _, n in summary["by_length"]] == [(1.0, 1), (5.0, 0), (50.0, 2), (500.0, 0)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert tg.main([str(path), "--top", "2"]) == 0
    with pytest.raises(ValueError, match="no GPU kernels"):
        tg.gaps([e for e in events if e["cat"] != "kernel" and e["cat"] != "gpu_memcpy"])
