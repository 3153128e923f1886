"""`fp8train demo`: its configs, its generated SFT task, and the whole flow (CPT, SFT, evaluation, fp8-block
export, table, plots) scaled down to seconds; the full-size run is `fp8train demo` (README: measured time)."""

from __future__ import annotations

import json

import pytest
import yaml

from fp8train import demo
from fp8train.data import load_tokenizer
from fp8train.demo import DemoConfig, _demo_config, stdlib_sources
from test_trainer import byte_tokenizer, one_thread  # noqa: F401


def test_demo_config_is_valid_and_reads_capped_stdlib(tmp_path):
    files = stdlib_sources(300_000)
    assert files and sum(f.stat().st_size for f in files) <= 300_000
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    for recipe in ("hybrid", "bf16"):
        cfg = _demo_config(DemoConfig(out_dir=str(tmp_path)), "cpu", recipe, files, tmp_path)
        cfg.validate()
        assert cfg.model.source == "tiny-qwen2" and cfg.model.tokenizer is None  # the real Qwen2.5 tokenizer
        assert cfg.recipe == recipe and cfg.run_dir == str(tmp_path / ("bf16" if recipe == "bf16" else "fp8_hybrid"))
        assert yaml.safe_dump(cfg.train.__dict__)


def test_sft_task_is_deterministic_and_holds_out_its_eval_problems():
    train, held_out = demo.sft_task(500, seed=1)
    assert (train, held_out) == demo.sft_task(500, seed=1)
    assert len(train) == 500 and len(held_out) == 12 and len({p["answer"] for p in held_out}) == 12
    for p in train + held_out:
        assert set(p) == {"question", "answer", "response"} and p["answer"] in p["response"]
    # the held-out questions are phrased in a way training never uses
    assert not {p["question"] for p in held_out} & {p["question"] for p in train}


def test_demo_flow_end_to_end_scaled_down(tmp_path, monkeypatch, byte_tokenizer, capfd):
    """Every stage with the byte tokenizer and a few steps each: the arms side by side in two processes, then
    again into the same folder one after the other, which must give the same numbers bit for bit."""
    small = dict(demo._SIZES["cpu"], steps=4, source_bytes=300_000, max_tokens=None)
    small["sft"] = dict(small["sft"], steps=4, samples=200)
    monkeypatch.setitem(demo._SIZES, "cpu", small)  # read in this process: the arms get their configs made
    monkeypatch.setattr(demo, "_side_by_side", lambda d, device: d.parallel)  # whatever this machine's cores
    results = demo.run_demo(DemoConfig(out_dir=str(tmp_path), device="cpu", tokenizer=str(byte_tokenizer)))
    out = capfd.readouterr().out
    assert set(results) == {"hybrid", "bf16"} and "relative gap FP8 vs BF16" in out
    assert "run side by side, in two processes" in out
    assert "[fp8] " in out and "[bf16] " in out  # the arms' own lines, each labelled
    for label in ("CPT train loss", "SFT val loss", "task accuracy (held out)", "fp8-block export"):
        assert label in out
    for r in results.values():
        assert r["loss"] < r["first_loss"] and r["val_loss"] is not None
        assert r["sft_loss"] > 0 and r["sft_val_loss"] is not None and 0.0 <= r["accuracy"] <= 1.0
    for png in ("loss.png", "sft_loss.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    export = results["hybrid"]["export"]
    config = json.loads((export / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (tmp_path / "sft_bf16" / "final" / "config.json").is_file()
    assert json.loads((tmp_path / "eval_fp8_hybrid" / "metrics.json").read_text())["num_problems"] == 12
    # again into the same folder (`make demo` twice: the demo owns its runs, evaluations and export), one arm after
    # the other in this process: each arm computes what it computed in its own process
    (tmp_path / "eval_bf16" / "metrics.json").unlink()
    again = demo.run_demo(DemoConfig(out_dir=str(tmp_path), device="cpu", tokenizer=str(byte_tokenizer),
                                     parallel=False))
    assert "side by side" not in capfd.readouterr().out
    assert (tmp_path / "eval_bf16" / "metrics.json").is_file()
    for recipe, r in results.items():
        timeless = {k: v for k, v in r.items() if not k.endswith("seconds") and k != "export"}
        assert timeless == {k: again[recipe][k] for k in timeless}, recipe


def _long_arm(tmp_path, byte_tokenizer, recipe, files=None):
    """An arm of 400 CPT steps (minutes), or one that fails at once where `files` do not exist."""
    from fp8train.eval import EvalConfig

    config = DemoConfig(out_dir=str(tmp_path), steps=400, tokenizer=str(byte_tokenizer))
    cpt = _demo_config(config, "cpu", recipe, files or stdlib_sources(300_000), tmp_path)
    cpt.data.max_tokens = None
    return demo._Arm(recipe, cpt, demo._sft_config(config, "cpu", recipe, tmp_path / "none.jsonl", tmp_path),
                     EvalConfig(model="", data="", out=str(tmp_path / f"eval_{recipe}")), str(byte_tokenizer))


def test_an_arm_that_fails_stops_the_other_and_raises_its_error(tmp_path, byte_tokenizer):
    """Side by side, the first arm to fail raises its own error at once, and the other arm is stopped rather than
    waited for (it would have run 400 steps)."""
    long = _long_arm(tmp_path, byte_tokenizer, "bf16")
    broken = _long_arm(tmp_path, byte_tokenizer, "hybrid", [tmp_path / "missing.py"])
    with pytest.raises(FileNotFoundError, match="missing.py"):
        demo._run_side_by_side([long, broken], threads=1)
    assert not list((tmp_path / "bf16").glob("checkpoints/*")) and not (tmp_path / "sft_bf16").exists()


def test_an_arm_whose_process_dies_raises_instead_of_hanging(tmp_path, byte_tokenizer):
    """The OOM killer or a signal ends an arm's process without a word: the demo says so and stops the other arm,
    where a pool would have waited for the lost arm forever."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    arms = [_long_arm(tmp_path, byte_tokenizer, recipe) for recipe in ("hybrid", "bf16")]
    outcome = []

    def side_by_side():
        try:
            demo._run_side_by_side(arms, threads=1)
        except Exception as e:
            outcome.append(e)

    runner = threading.Thread(target=side_by_side)
    runner.start()
    while len(multiprocessing.active_children()) < 2 and runner.is_alive():
        time.sleep(0.1)
    victim = next(p for p in multiprocessing.active_children() if p.name == "fp8train-demo-bf16")
    time.sleep(2)
    os.kill(victim.pid, signal.SIGKILL)
    runner.join(timeout=60)
    assert not runner.is_alive(), "the demo waited for an arm whose process had died"
    assert len(outcome) == 1 and "bf16 arm's process ended without a result (killed by signal 9" in str(outcome[0])
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fp8train-demo")]  # fp8 stopped


def test_prefixed_stream_labels_each_visible_line_once():
    import io

    sink = io.StringIO()
    stream = demo._Prefixed(sink, "[x] ")
    for text in ("a\nb", "c\n\rbar 1\rbar 2\n", "\n", "d\r\n"):
        assert stream.write(text) == len(text)
    assert sink.getvalue() == "[x] a\n[x] bc\n\r[x] bar 1\r[x] bar 2\n\n[x] d\r\n"
