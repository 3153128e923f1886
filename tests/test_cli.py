"""The `fp8train` command end to end on tiny configs: train (CPT and SFT), outputs, plot, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8train.cli import build_parser, main
from fp8train.train.config import load_config
import test_trainer
from test_trainer import TINY_CONFIG, tiny_overrides

# test_trainer's fixtures, bound here by assignment: imported, pyflakes would call them unused and redefined.
byte_tokenizer, corpus, one_thread = test_trainer.byte_tokenizer, test_trainer.corpus, test_trainer.one_thread

_STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_gib", "tokens",
              "skipped_steps"}


@pytest.fixture(scope="module")
def cpt_runs(tmp_path_factory, byte_tokenizer, corpus) -> dict[str, Path]:
    """One FP8 and one BF16 run of the tiny CPT config through the CLI, 6 steps each."""
    runs = {}
    for recipe in ("hybrid", "bf16"):
        work = tmp_path_factory.mktemp(f"cli_{recipe}")
        extra = {"recipe": recipe, "train.steps": 6, "train.save_every": 2, "train.eval_every": 3,
                 "train.health_every": 3, "train.keep_last": 2}
        assert main(["train", "--no-progress", str(TINY_CONFIG), *tiny_overrides(work, byte_tokenizer, corpus, **extra)]) == 0
        runs[recipe] = work / "run"
    return runs


def test_train_writes_metrics_config_checkpoints_and_health(cpt_runs):
    run = cpt_runs["hybrid"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert _STEP_KEYS <= set(r)
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None  # no GPU peak
    assert records[-1]["tokens"] == 6 * 8 * 64
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0

    cfg = load_config(run / "config.yaml")  # the resolved config reads back
    assert cfg.recipe == "hybrid" and cfg.train.steps == 6 and cfg.data.seq_len == 64

    health = [json.loads(line) for line in (run / "fp8_health.jsonl").read_text().splitlines()]
    assert [h["step"] for h in health] == [3, 6]
    layers = health[0]["layers"]
    assert len(layers) == 14 and "model.layers.1.mlp.down_proj" in layers
    for roles in layers.values():
        assert set(roles) == {"input", "weight", "grad_output"}
        for s in roles.values():
            assert 0 <= s["underflow"] <= 1 and 0 <= s["saturation"] <= 1 and 0 < s["scale_min"] <= s["scale_max"]

    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    assert any((run / "tensorboard").iterdir())
    assert not (cpt_runs["bf16"] / "fp8_health.jsonl").exists()  # nothing to report without FP8 layers


def test_final_export_loads_with_transformers(cpt_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = cpt_runs["hybrid"] / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.bfloat16 and len(tok) == 259
    trained = load_file(cpt_runs["hybrid"] / "checkpoints" / "step_00000006" / "model" / "model.safetensors")
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[name].to(torch.bfloat16)), name
    ids = tok("12 + 30 = 42.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and loss < 5.0  # trained, below the ~5.8 of a random init


def test_plot_overlays_runs(cpt_runs, tmp_path, capsys):
    out = tmp_path / "fig" / "loss.png"
    assert main(["plot", str(cpt_runs["hybrid"]), str(cpt_runs["bf16"]), "-o", str(out), "--smooth", "0.5"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert "wrote" in capsys.readouterr().out
    from fp8train.plot import load_curves

    curves = load_curves(cpt_runs["bf16"])
    assert curves["label"] == "run (bf16)" and len(curves["train"]) == 6 and len(curves["val"]) == 2


def test_sft_end_to_end(tmp_path, byte_tokenizer):
    data = tmp_path / "chats.jsonl"
    rows = []
    for i in range(40):
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                      {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]})
        else:
            rows.append({"question": f"Double {i}.", "answer": f"Doubling {i} gives {2 * i}."})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"run_dir={tmp_path / 'run'}", "model.source=tiny-llama", f"model.tokenizer={byte_tokenizer}",
                 f"data.paths=[{data}]", "data.seq_len=128", "data.max_samples=null", "train.epochs=2",
                 "train.health_every=0", "train.eval_every=0"]
    assert main(["train", "--no-progress", str(TINY_CONFIG.with_name("tiny_sft.yaml")), *overrides]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(tmp_path / "run" / "config.yaml")
    assert cfg.stage == "sft" and cfg.data.prompt_field == "question"
    assert len(records) >= 2 and all(r["loss"] > 0 for r in records)
    assert "val_loss" in records[-1]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv,code,message", [
    (["train", str(TINY_CONFIG), "optim.lrr=1"], 2, "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["train", str(TINY_CONFIG), "lr=1"], 2, "unknown config key 'lr' (did you mean 'optim.lr'?)"),
    (["train", str(TINY_CONFIG), "seq_len=64"], 2, "unknown config key 'seq_len' (did you mean 'data.seq_len'?)"),
    (["train", str(TINY_CONFIG), "train.micro_batch=3"], 2, "'train.global_batch' (8) must be a multiple"),
    (["train", "missing.yaml"], 2, "config file missing.yaml does not exist"),
    (["train", str(TINY_CONFIG), "data.paths=[/no/such/dir]"], 2,
     "data.paths=[/no/such/dir] (command line): data.paths: /no/such/dir: no such file or directory"),
    (["train"], 2, "give a config file"),
    (["train", str(TINY_CONFIG), "--no-progress", "train.stepz=1"], 2, "did you mean 'train.steps'"),
    (["plot", "/no/such/run", "-o", "x.png"], 2, "metrics.jsonl does not exist"),
    (["eval", "m", "--data", "d.jsonl", "--samples", "0"], 2, "eval: invalid samples=0 (--samples)"),
    (["eval", "m", "--data", "d.jsonl", "--greedy", "--samples", "2"], 2, "use --samples 1"),
    (["export", "/no/such/ckpt", "-o", "out", "--max-shard-size", "5XB"], 2,
     "export: --max-shard-size '5XB': expected a positive size such as 5GB"),
])
def test_cli_errors_are_one_line_messages(argv, code, message, capsys, tmp_path, monkeypatch, byte_tokenizer):
    monkeypatch.chdir(tmp_path)
    if argv[0] == "train" and len(argv) > 2:
        argv = argv + [f"run_dir={tmp_path / 'run'}", f"model.tokenizer={byte_tokenizer}"]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_config_and_subcommands(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "train.global_batch" in out and "Sequences per optimizer step" in out
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"train", "plot", "demo", "export", "eval"} <= set(sub.choices)


def test_demo_command_passes_its_options(monkeypatch):
    import fp8train.demo

    seen = []
    monkeypatch.setattr(fp8train.demo, "run_demo", seen.append)
    assert main(["demo", "--out", "x", "--sequential", "--threads", "0"]) == 0
    assert main(["demo"]) == 0
    assert (seen[0].out_dir, seen[0].parallel, seen[0].cpu_threads) == ("x", False, None)
    assert (seen[1].out_dir, seen[1].parallel, seen[1].cpu_threads) == ("runs/demo", True, 1)


@pytest.mark.parametrize("steps", ["0", "1", "-3"])
def test_demo_refuses_too_few_steps_before_any_work(steps, tmp_path, capsys):
    assert main(["demo", "--steps", steps, "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--steps must be at least 2 (a warmup and a decay step), got {steps}" in err
    assert not (tmp_path / "demo").exists()  # nothing tokenized, nothing written


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing written


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, byte_tokenizer) -> dict[str, Path]:
    """A tiny saved model, and broken copies: no weights, truncated weights, config.json that disagrees."""
    from fp8train.data import load_tokenizer
    from fp8train.train.model import ModelConfig, build_model

    root = tmp_path_factory.mktemp("hf_dirs")
    tok = load_tokenizer(str(byte_tokenizer))
    torch.manual_seed(0)
    good = root / "good"
    model = build_model(ModelConfig(source="tiny-qwen2", max_seq_len=512), tok)
    model.save_pretrained(good)
    tok.save_pretrained(good)
    dirs = {"good": good}
    for name in ("no_weights", "truncated", "shape"):
        dirs[name] = root / name
        dirs[name].mkdir()
        for f in good.iterdir():
            (dirs[name] / f.name).write_bytes(f.read_bytes())
    (dirs["no_weights"] / "model.safetensors").unlink()
    data = (good / "model.safetensors").read_bytes()
    (dirs["truncated"] / "model.safetensors").write_bytes(data[: len(data) // 2])
    cfg = json.loads((good / "config.json").read_text())
    (dirs["shape"] / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 384}))
    return dirs


def _fails_in_one_line(argv: list[str], capsys, message: str, *, code: int = 2, unwritten=()) -> str:
    assert main(argv) == code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err + captured.out
    last = err.splitlines()[-1]
    assert last.startswith(f"fp8train {argv[0]}: error: ") and message in last, err
    for path in unwritten:
        assert not Path(path).exists(), f"{path} was written"
    return last


def _train_argv(tmp_path, byte_tokenizer, corpus, *extra) -> list[str]:
    """The tiny CPT run in `tmp_path` (its own token cache, tmp_path/cache), `extra` overrides last."""
    return ["train", "--no-progress", str(TINY_CONFIG), *tiny_overrides(
        tmp_path, byte_tokenizer, corpus, **{"train.steps": 8, "data.cache_dir": tmp_path / "cache"}), *extra]


@pytest.mark.parametrize("broken,message", [
    ("no_weights", "has config.json but no *.safetensors weights"),
    ("truncated", "model.safetensors: not a complete safetensors file"),
    ("shape", "model.layers.0.mlp.gate_proj.weight"),
])
def test_train_refuses_broken_model_source(broken, message, hf_dirs, tmp_path, capsys, byte_tokenizer, corpus):
    line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, f"model.source={hf_dirs[broken]}"),
                              capsys, message, unwritten=[tmp_path / "run", tmp_path / "cache"])
    assert "model.source" in line and str(hf_dirs[broken]) in line


def test_train_refuses_rope_breaking_preset_override(tmp_path, capsys, byte_tokenizer, corpus):
    line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, "model.hidden_size=100"), capsys,
                              "head dimension", unwritten=[tmp_path / "run"])
    assert "model.hidden_size=100" in line  # the override the user typed


def test_resume_from_a_checkpoint_of_another_shape_is_refused(hf_dirs, tmp_path, capsys, byte_tokenizer, corpus):
    first = tmp_path / "first"
    assert main(_train_argv(first, byte_tokenizer, corpus, "train.steps=4", "optim.decay_steps=2",
                            "train.save_every=4", "train.eval_every=0", "train.health_every=0")) == 0
    ckpt = first / "run" / "checkpoints" / "step_00000004"
    assert ckpt.is_dir()
    _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, "model.intermediate_size=384", f"resume={ckpt}"),
                       capsys, "do not match the model", unwritten=[tmp_path / "run"])


def test_export_and_eval_refuse_truncated_weights(hf_dirs, tmp_path, capsys):
    out = tmp_path / "export"
    _fails_in_one_line(["export", str(hf_dirs["truncated"]), "-o", str(out)], capsys,
                       "model.safetensors: not a complete safetensors file", unwritten=[out])
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"question": "1 + 1?", "answer": "#### 2"}\n')
    out = tmp_path / "eval"
    _fails_in_one_line(["eval", str(hf_dirs["truncated"]), "--data", str(problems), "--out", str(out)], capsys,
                       "model.safetensors: not a complete safetensors file", unwritten=[out])
    line = _fails_in_one_line(["eval", str(tmp_path / "nope"), "--data", str(problems), "--out", str(out)], capsys,
                              "does not exist", unwritten=[out])
    assert "repo" not in line.lower()


def test_refusals_before_any_data_is_read(hf_dirs, tmp_path, capsys, byte_tokenizer, corpus):
    nothing = [tmp_path / "run", tmp_path / "cache"]
    _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, "train.steps=4"), capsys,
                       "train.steps=4 (command line): optim.warmup_steps (2 steps) plus optim.decay_steps (3 steps) "
                       "exceed the 4 total steps", unwritten=nothing)
    line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, f"model.source={hf_dirs['good']}",
                                          "data.seq_len=1024"), capsys, "max_position_embeddings (512)",
                              unwritten=nothing)
    assert "data.seq_len=1024 (command line)" in line and "(1024)" in line
    (tmp_path / "run").write_text("not a folder")
    _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus), capsys, "is a file; run_dir names the folder",
                       unwritten=[tmp_path / "cache"])


def test_a_path_that_is_not_there_names_its_key(tmp_path, capsys, byte_tokenizer, corpus):
    """A tokenizer, a file pattern or a checkpoint path the user typed wrong: the line names the key as typed."""
    cases = ((["model.tokenizer=" + str(tmp_path / "nope")], "config key 'model.tokenizer': "),
             ([f"data.paths=[{corpus.parent}]", "data.include=[*.zzz]"], "has no file matching data.include ['*.zzz']"),
             (["resume=" + str(tmp_path / "step_x")], "config key 'resume': checkpoint directory"))
    for overrides, message in cases:
        line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, *overrides), capsys, message,
                                  unwritten=[tmp_path / "run"])
        assert f"{overrides[-1]} (command line): " in line, line


def test_malformed_jsonl_names_the_file_line_and_column(tmp_path, capsys, byte_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"}\n{"text": }\n')
    line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, data, "data.include=['*.jsonl']"), capsys,
                              f"{data}:4: malformed JSON (Expecting value at column 10)")
    assert "line 2" not in line  # (json's own position, counted within the line's bytes)


def test_a_bad_record_is_not_blamed_on_a_correct_override(tmp_path, capsys, byte_tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n{"body": "two"}\n')
    line = _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, data, "data.include=['*.jsonl']",
                                          "data.text_field=text"), capsys, "no string field 'text' (data.text_field)")
    assert line.startswith(f"fp8train train: error: {data}:2: "), line  # the record, not data.text_field=text


def test_blame_override_leaves_record_errors_alone():
    from fp8train.cli import _blame_override

    overrides = ["data.response_field=answer", "data.text_field=body"]
    for record_error in ("/d/x.parquet row 3: 'answer' is missing (null)",
                         "data.hf_dataset: 'someone/qa' (main)[train] row 0: neither ... data.response_field ...",
                         "/d/x.jsonl:12: 'answer' must be a string, got int (data.response_field)"):
        assert _blame_override(record_error, overrides) == record_error
    # an error about the key itself still names the override that set it
    message = "/d/x.parquet: no column 'body' (data.text_field); columns: ['text']"
    assert _blame_override(message, overrides) == f"data.text_field=body (command line): {message}"


def test_a_binary_program_is_not_trained_on(tmp_path, capsys, byte_tokenizer, corpus):
    import sys

    _fails_in_one_line(_train_argv(tmp_path, byte_tokenizer, corpus, f"data.paths=[{sys.executable}]"), capsys,
                       f"data.paths: {Path(sys.executable).resolve()} is not text (NUL bytes",
                       unwritten=[tmp_path / "run"])


def test_cpt_from_one_large_text_file(tmp_path, capsys, byte_tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"{a} + {b} = {a + b}." for a in range(40) for b in range(8)))
    argv = _train_argv(tmp_path, byte_tokenizer, corpus, "data.include=[*.txt]", "train.steps=6",
                       "train.eval_every=0", "train.save_every=0", "train.health_every=0")
    assert main(argv) == 0
    assert "val_loss" in capsys.readouterr().out


def test_train_runs_with_the_configured_cpu_threads(tmp_path, monkeypatch, byte_tokenizer, corpus):
    from fp8train.train import trainer as trainer_module

    seen = []

    def fit(self):
        seen.append(torch.get_num_threads())
        return trainer_module.TrainResult(self.run_dir, 0)

    monkeypatch.setattr(trainer_module.Trainer, "fit", fit)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads in ("1", "0"):
            assert main(_train_argv(tmp_path, byte_tokenizer, corpus, f"cpu_threads={threads}")) == 0
            assert torch.get_num_threads() == 2  # restored after the run
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_plot_writes_the_file_it_names_and_documents_its_arguments(cpt_runs, tmp_path, capsys):
    assert main(["plot", str(cpt_runs["bf16"]), "-o", str(tmp_path / "p4")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "p4.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "p4").exists()
    assert f"wrote {tmp_path / 'p4.png'}" in out
    assert main(["plot", str(cpt_runs["bf16"]), "-o", str(tmp_path / "p.svg")]) == 0
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = capsys.readouterr().out
    for words in ("RUN_DIR", "metrics.jsonl", "--output", ".png", "--smooth", "EMA", "--title"):
        assert words in text, words


def test_progress_bar_shows_the_current_steps_loss(tmp_path, capsys):
    import time

    from fp8train.train.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, total_steps=3, report_to="none", progress=True)
    for step, loss in ((1, 9.8765), (2, 5.4321), (3, 1.2345)):
        time.sleep(0.15)  # past tqdm's minimum refresh interval: every update draws
        logger.progress(step, loss, 1e-3, 100.0)
        shown = capsys.readouterr().err.split("\r")[-1]
        assert f"loss={loss:.4f}" in shown and f"{step}/3" in shown, shown
    logger.close()
