"""The `fp8train` command end to end on tiny configs: train (CPT and SFT), outputs, plot, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8train.cli import build_parser, main
from fp8train.train.config import load_config
from test_trainer import TINY_CONFIG, byte_tokenizer, corpus, one_thread, tiny_overrides  # noqa: F401

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
    (["train", str(TINY_CONFIG), "train.micro_batch=3"], 2, "'train.global_batch' (8) must be a multiple"),
    (["train", "missing.yaml"], 2, "config file missing.yaml does not exist"),
    (["train", str(TINY_CONFIG), "data.paths=[/no/such/dir]", "train.steps=1"], 1, "no such file or directory"),
    (["train"], 2, "give a config file"),
    (["train", str(TINY_CONFIG), "--no-progress", "train.stepz=1"], 2, "did you mean 'train.steps'"),
    (["plot", "/no/such/run", "-o", "x.png"], 1, "metrics.jsonl does not exist"),
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

