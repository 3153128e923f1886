"""`train.report_to`: the metrics and FP8 health reach TensorBoard, Weights & Biases (offline mode) and MLflow
(local file store), read back from what each wrote; a tracker that is not installed is a one-line error."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct

import pytest

from fp8train.train.config import ConfigError
from fp8train.train.metrics import read_jsonl, resolve_report_to
from fp8train.train.trainer import Trainer
from test_trainer import byte_tokenizer, corpus, one_thread, tiny_config  # noqa: F401

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def _wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline W&B run: its .wandb file is a LevelDB-style log (32 KiB blocks of
    records with a 7-byte header: crc, length, type) of `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, chunks, part = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer too short for a header
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            chunks.append(part)
    rows = []
    for raw in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_metrics_and_health_reach_every_tracker(tmp_path, byte_tokenizer, corpus, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 wants an opt-in for the file store
    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, **{"train.steps": 4, "train.health_every": 2,
                                                           "train.eval_every": 2, "train.save_every": 0, "optim.decay_steps": 1,
                                                           "train.report_to": "[tensorboard, wandb, mlflow]"})
    Trainer(cfg, progress=False).fit()
    run_dir = tmp_path / "run"
    records = read_jsonl(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and sorted(val) == [2, 4]
    health_key = "fp8_health/down_proj/grad_output/underflow"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {e.step: e.value for e in tb.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)
    assert [e.step for e in tb.Scalars("val/loss")] == [2, 4]
    assert [e.step for e in tb.Scalars(health_key)] == [2, 4]

    rows = _wandb_history(run_dir)
    assert {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r} == pytest.approx(losses, rel=1e-6)
    assert sorted(r["_step"] for r in rows if health_key in r) == [2, 4]

    client = mlflow.tracking.MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "run" and run.data.params["train.steps"] == "4"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")} == \
        pytest.approx(losses, rel=1e-6)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, health_key)) == [2, 4]
    assert {m.step for m in client.get_metric_history(run.info.run_id, "val/loss")} == {2, 4}


def test_report_to_values_and_one_line_errors(tmp_path, byte_tokenizer, corpus, monkeypatch):
    assert resolve_report_to(None) == ["tensorboard"]  # installed in the dev extra
    assert resolve_report_to("none") == [] and resolve_report_to([]) == []
    assert resolve_report_to("all") == ["tensorboard", "wandb", "mlflow"]
    assert resolve_report_to(["wandb", "wandb"]) == ["wandb"]
    with pytest.raises(ConfigError, match=r"train.report_to.*'comet'"):
        tiny_config(tmp_path, byte_tokenizer, corpus, **{"train.report_to": "comet"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        tiny_config(tmp_path, byte_tokenizer, corpus, **{"train.report_to": "[tensorboard, wandb]"})
    message = str(info.value)
    assert "\n" not in message and "train.report_to" in message and "pip install wandb" in message
    assert resolve_report_to("all") == ["tensorboard", "mlflow"]  # `all` = the installed ones


def test_a_tracker_that_cannot_start_is_a_one_line_config_error(tmp_path, byte_tokenizer, corpus, monkeypatch,
                                                                capsys):
    """MLflow 3's default store (SQLite, which mlflow-skinny cannot open) fails its first run: one line naming the
    key, the tracker's own message and what to set, exit 2; no metrics written."""
    from fp8train.cli import main
    from test_trainer import TINY_CONFIG, tiny_overrides

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    overrides = tiny_overrides(tmp_path, byte_tokenizer, corpus, **{"train.steps": 8, "train.report_to": "[mlflow]"})
    try:
        mlflow.start_run()
    except Exception:
        pass
    else:
        mlflow.end_run()
        pytest.skip("this MLflow opens a SQLite store (the full package): nothing fails to start")
    assert main(["train", "--no-progress", str(TINY_CONFIG), *overrides]) == 2
    err = capsys.readouterr().err
    line = err.splitlines()[-1]  # (after the tokenizer's progress bar)
    assert line.startswith("fp8train train: error: train.report_to=[mlflow] (command line): config key "
                           "'train.report_to': mlflow could not start a run ("), err
    assert line.endswith("MLFLOW_ALLOW_FILE_STORE=true (MLflow 3)") and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
