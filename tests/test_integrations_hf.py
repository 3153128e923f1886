"""fp8train inside transformers' Trainer and TRL's SFTTrainer: the same per-step losses as fp8train's own trainer.

Every run trains the same tiny converted Qwen2 model (seed 0) on the same 64-token rows, in the same global
batches (fp8train's GlobalBatchSampler order, handed to the HF trainers with sequential sampling), with
micro-batch 4 x 2 accumulation, bf16 autocast, AdamW (0.9, 0.95), weight decay 0.1 (biases and norms none),
clip 1.0 and a constant learning rate: the same training step written three times.

The bound. Two correct implementations of one step still differ by FP32 rounding (here: HF's fused AdamW vs
our foreach one, TRL's chunked LM-head loss vs the model's own), i.e. by about one ulp of some weights
after an update. How much that moves the loss after k steps is measured, not guessed: our own trainer is
rerun with every initial weight moved by one ulp (random sign, three draws), giving d_k = max |loss_k - loss'_k|. A
correct integration must stay within 4 x max(d_1..d_k) + 4 ulps of the loss at step k. What the bound
catches is shown too: an FP8 weight cache left open across optimizer steps falls far outside it.
"""

from __future__ import annotations

import copy
import json
import random
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from transformers import Trainer, TrainingArguments, TrainerCallback  # noqa: E402

from fp8train import FP8InputLinear, FP8Linear, cache_fp8_weights  # noqa: E402
from fp8train.data import CptDataConfig, GlobalBatchSampler, collate, load_tokenizer  # noqa: E402
from fp8train.integrations.hf import FP8TrainerCallback, convert_for_training  # noqa: E402
from fp8train.train.config import LoopConfig, TrainConfig  # noqa: E402
from fp8train.train.model import ModelConfig, build_model  # noqa: E402
from fp8train.train.optim import OptimConfig  # noqa: E402
from fp8train.train.trainer import Trainer as Fp8Trainer  # noqa: E402
from test_trainer import byte_tokenizer, one_thread  # noqa: E402,F401
from _benchmarks import load_benchmark  # noqa: E402

SEQ, ROWS, GLOBAL, MICRO, STEPS, LR = 64, 32, 8, 4, 4, 3e-3


def arithmetic_rows(tok, n: int = ROWS, seq: int = SEQ, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = " ".join(f"{a} + {b} = {a + b}." for a, b in ((rng.randint(0, 50), rng.randint(0, 50)) for _ in range(9)))
        ids = torch.tensor(tok(text)["input_ids"][:seq])
        assert len(ids) == seq
        rows.append({"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq)})
    return rows


@pytest.fixture(scope="module")
def setup(byte_tokenizer):
    tok = load_tokenizer(str(byte_tokenizer))
    rows = arithmetic_rows(tok)
    torch.manual_seed(0)
    base = build_model(ModelConfig(source="tiny-qwen2"), tok)
    sampler = GlobalBatchSampler(len(rows), GLOBAL, seed=0)
    ordered = [rows[i] for step in range(STEPS) for i in sampler.batch(step)]  # fp8train's batches, in order
    return tok, rows, base, ordered


def _ours(setup, tmp_path, perturb: float = 0.0, seed: int = 1) -> np.ndarray:
    tok, rows, base, _ = setup
    model = copy.deepcopy(base)
    if perturb:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + perturb * torch.randn(p.shape, generator=g).sign())
    cfg = TrainConfig(stage="cpt", run_dir=str(tmp_path), resume="none", device="cpu", recipe="hybrid",
                      data=CptDataConfig(paths=["unused"]),
                      optim=OptimConfig(lr=LR, weight_decay=0.1, grad_clip=1.0, schedule="constant"),
                      train=LoopConfig(steps=STEPS, global_batch=GLOBAL, micro_batch=MICRO))
    result = Fp8Trainer(cfg, model=model, tokenizer=tok, train_data=rows, progress=False).fit()
    shutil.rmtree(tmp_path)
    return np.array([result.losses[s] for s in sorted(result.losses)])


def _bound(losses: np.ndarray, moved: list[np.ndarray], factor: float) -> np.ndarray:
    d = np.max([np.abs(m - losses) for m in moved], axis=0)  # the largest of the perturbed runs' moves
    return factor * np.maximum.accumulate(d) + 4 * np.spacing(losses.astype(np.float32))


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """fp8train's own per-step losses, and the bound derived from its one-ulp sensitivity (module docstring)."""
    losses = _ours(setup, tmp_path_factory.mktemp("ours"))
    # one-ulp perturbations with three sign patterns: one draw under-reads the sensitivity (a CPU with AMX BF16
    # matmuls put TRL's run at 1.15x a single draw's bound at step 3)
    moved = [_ours(setup, tmp_path_factory.mktemp("ours_ulp"), perturb=2.0**-23, seed=s) for s in (1, 2, 3)]
    assert losses[-1] < losses[0] - 1.0  # it learns: the comparison is over a moving trajectory
    return losses, _bound(losses, moved, 4)


def _args(cls=TrainingArguments, **extra):
    kw = dict(output_dir="unused", per_device_train_batch_size=MICRO, gradient_accumulation_steps=GLOBAL // MICRO,
              max_steps=STEPS, learning_rate=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
              max_grad_norm=1.0, lr_scheduler_type="constant", bf16=True, use_cpu=True, seed=0,
              train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to=[],
              disable_tqdm=True)
    return cls(**(kw | extra))


def _losses(trainer) -> np.ndarray:
    return np.array([h["loss"] for h in trainer.state.log_history if "loss" in h])


def _converted(setup):
    model = copy.deepcopy(setup[2])
    report = convert_for_training(model)
    assert len(report.converted) == 14  # 2 layers x 7 projections
    return model


def _within(losses, reference, tag):
    ours, bound = reference
    diff = np.abs(losses - ours)
    assert len(losses) == STEPS and (diff <= bound).all(), f"{tag}: |diff| {diff} > bound {bound}"


def test_trainer_matches_fp8train_and_logs_fp8_health(setup, reference, tmp_path):
    trainer = Trainer(model=_converted(setup), args=_args(output_dir=str(tmp_path)), train_dataset=setup[3],
                      data_collator=collate)
    trainer.add_callback(FP8TrainerCallback(trainer, health_every=2))
    trainer.train()
    _within(_losses(trainer), reference, "Trainer")
    health = [h for h in trainer.state.log_history if "fp8_health/q_proj/input/underflow" in h]
    assert [h["step"] for h in health] == [2, 4]
    h = health[0]
    assert len([k for k in h if k.startswith("fp8_health/")]) == 7 * 3 * 4  # projections x roles x statistics
    assert h["fp8_health/down_proj/grad_output/scale_max"] > 0  # the FP8 backward ran
    assert all(0 <= h[f"fp8_health/{p}/{r}/saturation"] < 0.05 for p in ("q_proj", "down_proj")
               for r in ("input", "weight", "grad_output"))
    # the health records do not cost the loss records of their steps
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]


@pytest.mark.parametrize("reentrant", [False, True])
def test_trainer_with_gradient_checkpointing(setup, reference, tmp_path, reentrant):
    args = _args(output_dir=str(tmp_path), activation_checkpointing=True,
                 activation_checkpointing_kwargs={"use_reentrant": reentrant})
    trainer = Trainer(model=_converted(setup), args=args, train_dataset=setup[3], data_collator=collate)
    trainer.add_callback(FP8TrainerCallback(trainer))
    trainer.train()
    _within(_losses(trainer), reference, f"gradient checkpointing (use_reentrant={reentrant})")


def test_sft_trainer_matches_fp8train(setup, reference, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = setup[3]
    data = Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]}).with_format("torch")
    # SFTConfig turns activation checkpointing on by default: kept, so that it is covered here too
    args = _args(SFTConfig, output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": True},
                 remove_unused_columns=False)
    trainer = SFTTrainer(model=_converted(setup), args=args, train_dataset=data, data_collator=collate,
                         processing_class=setup[0])
    trainer.add_callback(FP8TrainerCallback(trainer, health_every=4))
    trainer.train()
    _within(_losses(trainer), reference, "SFTTrainer")
    logged = trainer.state.log_history
    assert "mean_token_accuracy" in next(h for h in logged if h["step"] == 4 and "loss" in h)  # TRL's own metrics stay
    assert any("fp8_health/o_proj/weight/underflow" in h for h in logged if h["step"] == 4)


class _CacheAcrossSteps(TrainerCallback):
    """The mistake the callback avoids: one FP8 weight cache over the whole run."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._ctx = cache_fp8_weights(model)
        self._ctx.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self._ctx.__exit__(None, None, None)


def test_the_bound_catches_a_weight_cache_left_open(setup, reference, tmp_path):
    trainer = Trainer(model=_converted(setup), args=_args(output_dir=str(tmp_path)), train_dataset=setup[3],
                      data_collator=collate, callbacks=[_CacheAcrossSteps()])
    trainer.train()
    diff = np.abs(_losses(trainer) - reference[0])
    assert diff[0] <= reference[1][0]  # the first step has no stale weights yet
    assert (diff[1:] > 100 * reference[1][1:]).all()  # then the fused AdamW updates go unseen


def test_trainer_with_torch_compile(setup, reference, tmp_path_factory):
    """Inductor fuses elementwise chains and skips the BF16 roundings between their ops: it computes with other
    BF16 rounding errors (each up to 2^-9 relative) than eager mode. Its bound is therefore the sensitivity of
    our trainer to moving every initial weight by one such error (2^-9, random sign), with a factor 2."""
    ours = reference[0]
    bound = _bound(ours, [_ours(setup, tmp_path_factory.mktemp("ours_bf16"), perturb=2.0**-9)], 2)
    torch._dynamo.reset()
    trainer = Trainer(model=_converted(setup), args=_args(output_dir=str(tmp_path_factory.mktemp("hf")),
                                                          torch_compile=True),
                      train_dataset=setup[3], data_collator=collate)
    trainer.add_callback(FP8TrainerCallback(trainer))
    # what accelerate hands to torch.compile: fp8train's inductor pass, no `mode` beside `options`
    kwargs = trainer.accelerator.state.dynamo_plugin.to_kwargs()
    assert "joint_custom_pre_pass" in kwargs["options"] and kwargs.get("mode") is None
    trainer.train()
    torch._dynamo.reset()
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    _within(_losses(trainer), (ours, bound), "torch_compile")


def test_sft_trainer_tokenizes_and_trains_a_converted_lora_model(setup, tmp_path, monkeypatch):
    """The way SFT users run it: TRL tokenizes a conversational prompt/completion dataset itself, PEFT wraps
    the converted model (peft_config=...): the FP8 base stays frozen and unchanged, the adapters learn, and
    the callback quantizes each base weight once for the run (and with `keep_frozen_t` transposes it once),
    handing the layers back plain at the end; with `adapter_inputs_fp8` the adapters keep the base's FP8 input."""
    peft = pytest.importorskip("peft")
    from fp8train.fp8 import ops

    calls, transposes = [], []
    real, real_t = ops.quantize_weight, ops.transpose_weight
    monkeypatch.setattr(ops, "quantize_weight", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr(ops, "transpose_weight", lambda *a: transposes.append(a[2]) or real_t(*a))
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(0)
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(32)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"{a} + {b} ="}],
                               "completion": [{"role": "assistant", "content": f"{a + b}"}]} for a, b in pairs])
    model = _converted(setup)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _args(SFTConfig, output_dir=str(tmp_path), max_steps=6, learning_rate=1e-2, max_length=64)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=setup[0],
                         peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                     lora_dropout=0.0))
    trainer.add_callback(FP8TrainerCallback(trainer, health_every=3, offload_frozen=True, keep_frozen_t=True,
                                            adapter_inputs_fp8=True))
    trainer.train()
    wrapped = trainer.model
    layers = [m for m in wrapped.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 14 and calls == [False] * 14 and not any(m.frozen for m in layers)
    assert sum(isinstance(m, FP8InputLinear) for m in wrapped.modules()) == 14  # `adapter_inputs_fp8`
    assert len(transposes) == 14, "W.T made once a layer (keep_frozen_t), never in a backward"
    assert isinstance(wrapped.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer"), FP8Linear)
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.5, losses
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
        else:
            plain = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            assert not p.requires_grad and torch.equal(p, base_before[plain]), name
    assert any("fp8_health/gate_proj/input/underflow" in h for h in trainer.state.log_history), trainer.state.log_history


def test_training_stopped_by_an_exception_gives_the_frozen_base_back(setup, tmp_path):
    """A LoRA run that stops with an exception (a Ctrl-C in a notebook: the Trainer calls no on_train_end) gives
    the frozen base back as the end of training does: no FP8 copy outlives it, so adapters merged afterwards
    reach the forward, and offloaded weights are back where they lived."""
    peft = pytest.importorskip("peft")

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise KeyboardInterrupt

    model = peft.get_peft_model(_converted(setup), peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainer = Trainer(model=model, args=_args(output_dir=str(tmp_path), max_steps=4), train_dataset=setup[3],
                      data_collator=collate)
    callback = FP8TrainerCallback(trainer, offload_frozen=True)
    trainer.add_callback(callback)
    trainer.add_callback(Interrupt())
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert len(layers) == 14 and not any(m.frozen for m in layers)
    x = setup[1][0]["input_ids"][None, :16]
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # adapters that change the output
                p.add_(0.05)
        before = model(x).logits
        merged = model.merge_and_unload()(x).logits
    assert (merged - before).abs().max() < 0.05 * before.abs().max(), "the merged base is not what runs"
    callback.release()  # again: nothing left to end


def test_the_trainer_trains_without_a_kv_cache(setup, tmp_path):
    """Packed rows' document boundaries reach the attention only without a KV cache (transformers derives the
    mask from position_ids then): the Trainer turns `config.use_cache` off itself (`TrainingArguments.use_cache`,
    False by default), which docs/integrations.md relies on."""
    seen = []

    class Look(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.append(model.config.use_cache)

    model = _converted(setup)
    model.config.use_cache = True
    trainer = Trainer(model=model, args=_args(output_dir=str(tmp_path), max_steps=2), train_dataset=setup[3],
                      data_collator=collate)
    trainer.add_callback(FP8TrainerCallback(trainer))
    trainer.add_callback(Look())
    trainer.train()
    assert seen == [False, False]


def test_convert_for_training_refuses_a_peft_model_and_warns_on_bf16_weights(setup, caplog):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(copy.deepcopy(setup[2]), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="convert it first"):
        convert_for_training(wrapped)
    bf16 = copy.deepcopy(setup[2]).to(torch.bfloat16)
    with caplog.at_level("WARNING"):
        convert_for_training(bf16)
    assert "torch.bfloat16, not float32" in caplog.text


def test_adapter_inputs_fp8_needs_lora_on_fp8_layers(setup, tmp_path):
    """`FP8TrainerCallback(adapter_inputs_fp8=True)` on a converted model without adapters is refused, naming
    what it needs, rather than silently keeping BF16 inputs."""
    trainer = Trainer(model=_converted(setup), args=_args(output_dir=str(tmp_path), max_steps=1),
                      train_dataset=setup[3], data_collator=collate)
    with pytest.raises(ValueError, match="adapter_inputs_fp8 needs PEFT LoRA adapters"):
        FP8TrainerCallback(trainer, adapter_inputs_fp8=True)


def test_gpu_benchmark_script_runs_on_cpu(tmp_path):
    """benchmarks/hf_trainer_gpu.py (the lead's H200 run) in its CPU mode, SFTTrainer only (a Trainer subclass):
    both recipes train and write their JSON lines."""
    out = tmp_path / "runs.jsonl"
    results = load_benchmark("hf_trainer_gpu").main(["--device", "cpu", "--tiny", "--trainers", "sft", "--steps", "2",
                                                     "--out", str(out)])
    assert [(r["trainer"], r["recipe"]) for r in results] == [("sft", "bf16"), ("sft", "hybrid")]
    assert [json.loads(line)["recipe"] for line in out.read_text().splitlines()] == ["bf16", "hybrid"]
    for r in results:
        assert r["steps"] == 2 and r["tokens_per_s"] > 0 and np.isfinite(r["loss_last"])
    # the same rows and seed: FP8 and BF16 start from the same loss up to FP8's effect on it
    assert abs(results[1]["loss_first"] - results[0]["loss_first"]) < 1e-2 * results[0]["loss_first"]
