"""The training loop on tiny models: golden per-step losses, learning, loss averaging, NaN handling.

Regenerate the golden files after an intended numerics change with:
    .venv/bin/python tests/test_trainer.py --regen
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from fp8train.train.config import load_config
from fp8train.train.loss import _bf16_gemm_in_fp32
from fp8train.train.trainer import NonFiniteLossError, Trainer

GOLDEN = Path(__file__).parent / "golden"
# Exact with the torch build and CPU kernels that wrote the file; elsewhere the tolerance absorbs
# other BF16 kernels.
GOLDEN_RTOL = 1e-3


# ------------------------------------------------------------------------------ shared test helpers


def make_byte_tokenizer(out_dir: Path) -> Path:
    """A 259-token byte-level tokenizer (256 bytes + EOS + ChatML markers): tiny models, real text."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    from fp8train.data import CHATML_TEMPLATE

    alphabet = sorted(ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            chat_template=CHATML_TEMPLATE).save_pretrained(out_dir)
    return out_dir


def write_corpus(path: Path, n_docs: int = 300, seed: int = 0) -> Path:
    """Documents of sums and short sentences: real structure a 2-layer model learns in a few steps."""
    rng = random.Random(seed)
    words = "the a cat dog sat ran on under mat log big small red blue".split()
    docs = []
    for _ in range(n_docs):
        parts = []
        for _ in range(rng.randint(3, 8)):
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            parts.append(f"{a} + {b} = {a + b}. the {rng.choice(words)} {rng.choice(words)} on the {rng.choice(words)}.")
        docs.append(" ".join(parts))
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def tiny_overrides(workdir: Path, tokenizer_dir: Path, corpus: Path, **extra) -> list[str]:
    """Overrides that turn configs/tiny_cpt.yaml into a seconds-long run with the byte tokenizer."""
    values = {
        "run_dir": workdir / "run", "device": "cpu", "model.source": "tiny-qwen2", "model.tokenizer": tokenizer_dir,
        "data.paths": f"[{corpus}]", "data.include": "['*.jsonl']", "data.seq_len": 64, "data.val_fraction": 0.1,
        "data.max_tokens": "null", "data.cache_dir": workdir.parent / "token_cache",
        "optim.lr": 3e-3, "optim.warmup_steps": 2, "optim.decay_steps": 3,
        "train.steps": 8, "train.global_batch": 8, "train.micro_batch": 4, "train.eval_every": 4,
        "train.eval_batches": 2, "train.save_every": 4, "train.health_every": 4, "train.log_every": 1,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


TINY_CONFIG = Path(__file__).parent.parent / "configs" / "tiny_cpt.yaml"


def tiny_config(workdir: Path, tokenizer_dir: Path, corpus: Path, **extra):
    return load_config(TINY_CONFIG, tiny_overrides(workdir, tokenizer_dir, corpus, **extra))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP threads that spin-wait crawl on a busy
    machine (10x here). The golden files are written with one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory) -> Path:
    return make_byte_tokenizer(tmp_path_factory.mktemp("byte_tokenizer"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


# -------------------------------------------------------------------------------------------- golden


def _golden_run(workdir: Path, tokenizer_dir: Path, corpus: Path, recipe: str) -> list[float]:
    # Every key spelled out (no preset file), so editing configs/tiny_cpt.yaml leaves the golden alone.
    pinned = {"stage": "cpt", "seed": 0, "recipe": recipe, "pow2_scale": "true", "optim.min_lr": 3e-4,
              "optim.weight_decay": 0.1, "optim.grad_clip": 1.0, "optim.schedule": "wsd", "train.steps": 10}
    cfg = load_config(None, tiny_overrides(workdir, tokenizer_dir, corpus, **pinned))
    result = Trainer(cfg, progress=False).fit()
    return [result.losses[s] for s in sorted(result.losses)] + [result.val_loss]


@pytest.fixture(scope="module")
def golden_runs(tmp_path_factory, byte_tokenizer, corpus) -> dict[str, list[float]]:
    return {recipe: _golden_run(tmp_path_factory.mktemp(recipe), byte_tokenizer, corpus, recipe)
            for recipe in ("bf16", "hybrid")}


def _kernel_fingerprint() -> dict:
    """What decides the CPU's floating-point results: the torch build, transformers, the vector ISA torch
    picked, and the BF16 matrix extensions oneDNN uses when present (AMX / AVX512-BF16 round differently)."""
    import transformers

    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].splitlines()[0].split()
    except (OSError, IndexError):
        flags = []
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16"))}


def _same_kernels(golden: dict) -> bool:
    """Same torch build, transformers and CPU kernel family as the machine that wrote the file: then exact."""
    return all(golden.get(k) == v for k, v in _kernel_fingerprint().items())


@pytest.mark.parametrize("recipe", ["bf16", "hybrid"])
def test_golden_losses(golden_runs, recipe):
    golden = json.loads((GOLDEN / f"tiny_{recipe}.json").read_text())
    got = golden_runs[recipe]
    assert len(got) == len(golden["losses"]) + 1
    if _same_kernels(golden):
        assert got == golden["losses"] + [golden["val_loss"]]  # bit for bit
        return
    torch.testing.assert_close(torch.tensor(got[:-1], dtype=torch.float64),
                               torch.tensor(golden["losses"], dtype=torch.float64), rtol=GOLDEN_RTOL, atol=0)
    assert got[-1] == pytest.approx(golden["val_loss"], rel=GOLDEN_RTOL)


def test_fp8_and_bf16_both_learn_and_agree(golden_runs):
    for recipe, losses in golden_runs.items():
        *train, val = losses
        assert train[0] > 5.0, recipe  # ~ln(320): a random init
        assert train[-1] < train[0] - 2.0, f"{recipe} did not learn: {train}"
        assert val < train[0] - 2.0
    fp8, bf16 = golden_runs["hybrid"], golden_runs["bf16"]
    assert fp8 != bf16  # FP8 really changed the numerics ...
    assert abs(fp8[-1] - bf16[-1]) / bf16[-1] < 0.02  # ... and stays near-lossless


# ------------------------------------------------------------------------------- loss averaging


class _ListDataset(list):
    pass


def _masked_dataset(n: int, seq: int, vocab: int, seed: int) -> _ListDataset:
    """Rows whose label counts differ a lot, so a per-micro-batch mean would differ from a per-token one."""
    g = torch.Generator().manual_seed(seed)
    rows = _ListDataset()
    for i in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = ids.clone()
        labels[: (i * 7) % (seq - 4)] = -100
        rows.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq)})
    return rows


def test_loss_is_mean_over_target_tokens_of_global_batch(tmp_path, byte_tokenizer, corpus):
    data = _masked_dataset(16, 32, 259, seed=1)
    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, recipe="bf16", **{"train.micro_batch": 1})
    trainer = Trainer(cfg, progress=False, tokenizer=None, train_data=data, val_data=None,
                      model=_tiny_model(byte_tokenizer))
    indices = trainer.sampler.batch(0)
    batch = {k: torch.stack([data[i][k] for i in indices]) for k in data[0]}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.float()
    targets = batch["labels"][:, 1:]
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           ignore_index=-100, reduction="sum")
    expected = float(ce / (targets != -100).sum())
    loss, grad_norm, _ = trainer.train_step(trainer.next_micro_batches())
    assert loss == pytest.approx(expected, rel=2e-3)
    per_micro_mean = sum(float(torch.nn.functional.cross_entropy(
        logits[i, :-1], targets[i], ignore_index=-100)) for i in range(len(indices))) / len(indices)
    assert abs(per_micro_mean - expected) > 5 * abs(loss - expected)  # the two averages differ here
    assert math.isfinite(grad_norm) and grad_norm > 0


def _tiny_model(tokenizer_dir: Path):
    from fp8train.data import load_tokenizer
    from fp8train.train.model import ModelConfig, build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(source="tiny-qwen2"), load_tokenizer(str(tokenizer_dir)))


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path, byte_tokenizer, corpus):
    losses = {}
    for mb in (1, 8):
        cfg = tiny_config(tmp_path / f"mb{mb}", byte_tokenizer, corpus, recipe="bf16",
                          **{"train.micro_batch": mb, "train.steps": 3, "train.save_every": 0,
                             "optim.warmup_steps": 1, "optim.decay_steps": 1})
        trainer = Trainer(cfg, progress=False)
        losses[mb] = [trainer.train_step(trainer.next_micro_batches())[0] for _ in range(3)]
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[8]), rtol=5e-3, atol=0)


def test_fp8_weight_cache_only_across_micro_batches(tmp_path, byte_tokenizer, corpus):
    """The FP8 weight copies are kept across the micro-batches of a step (one quantization per step), and not
    at all when a step has one micro-batch (the forward's copy of W then dies with the forward)."""
    from fp8train import FP8Linear

    for mb, expect in ((4, True), (8, False)):  # global batch 8
        cfg = tiny_config(tmp_path / f"mb{mb}", byte_tokenizer, corpus, recipe="hybrid",
                          **{"train.micro_batch": mb, "train.steps": 3, "train.save_every": 0,
                             "optim.warmup_steps": 1, "optim.decay_steps": 1})
        trainer = Trainer(cfg, progress=False)
        layer = next(m for m in trainer.model.modules() if isinstance(m, FP8Linear))
        seen = []
        layer.register_forward_hook(lambda m, a, o: seen.append(m._cache_weight))
        trainer.train_step(trainer.next_micro_batches())
        assert seen == [expect] * (8 // mb) and layer._weight_cache is None and not layer._cache_weight


def test_chunked_loss_matches_the_plain_hf_loss(tmp_path, byte_tokenizer, corpus):
    """`train.loss_impl`. The default (chunked) fits a tiny-vocabulary micro-batch in one chunk, where it runs
    the plain path's own ops: every training and validation loss is the same, bit for bit. With 100-token
    chunks (256 tokens a micro-batch: 100 + 100 + 56) the first loss differs only by the order of FP32
    sums (< 1e-6), and later ones through the head's weight gradient, summed over chunks in FP32 instead
    of rounded once to BF16: within GOLDEN_RTOL, the suite's allowance for differently rounded BF16
    kernels (measured: 1.1e-4 over 10 steps). On a CPU without AVX-512 the chunked head's GEMMs run in FP32
    (loss.py), so there the one-chunk run too is only within GOLDEN_RTOL."""
    runs = {}
    for name, extra in {"hf": {"train.loss_impl": "hf"}, "chunked": {},
                        "chunks": {"train.loss_impl": "chunked", "train.loss_chunk_tokens": 100}}.items():
        cfg = tiny_config(tmp_path / name, byte_tokenizer, corpus, recipe="bf16",
                          **{"train.steps": 6, "train.eval_every": 3, "train.save_every": 0, **extra})
        result = Trainer(cfg, progress=False).fit()
        runs[name] = [result.losses[s] for s in sorted(result.losses)] + [result.val_loss]
    plain, chunks = torch.tensor(runs["hf"], dtype=torch.float64), torch.tensor(runs["chunks"], dtype=torch.float64)
    if _bf16_gemm_in_fp32(torch.device("cpu")):  # the head's GEMMs in FP32 here: sums in another order
        torch.testing.assert_close(torch.tensor(runs["chunked"], dtype=torch.float64), plain, rtol=GOLDEN_RTOL, atol=0)
    else:
        assert runs["chunked"] == runs["hf"]
    assert chunks[0].item() == pytest.approx(plain[0].item(), rel=1e-6)
    assert not torch.equal(chunks, plain)
    torch.testing.assert_close(chunks, plain, rtol=GOLDEN_RTOL, atol=0)


def test_sft_head_runs_on_the_rows_with_a_target_only(tmp_path, byte_tokenizer):
    """SFT: each micro-batch reaches the model with `loss_rows`, the rows whose label is a target (topped up to a
    multiple of 64), made on the host; CPT rows get none. The losses equal those of the plain HF head on every
    row within GOLDEN_RTOL (the same values summed in another order, the head's weight gradient over fewer zero
    rows)."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}? Say it in words and digits, please.",
                                        "answer": f"{2 * i}."}) + "\n" for i in range(48)))
    runs, rows_seen = {}, []
    for name, extra in {"hf": {"train.loss_impl": "hf"}, "chunked": {}}.items():
        values = {"run_dir": tmp_path / name, "device": "cpu", "recipe": "bf16", "model.tokenizer": byte_tokenizer,
                  "data.paths": f"[{data}]", "data.seq_len": 256, "data.max_samples": "null", "train.steps": 4,
                  "train.epochs": "null", "train.eval_every": 2, "train.save_every": 0, "train.health_every": 0,
                  **extra}
        cfg = load_config(TINY_CONFIG.with_name("tiny_sft.yaml"), [f"{k}={v}" for k, v in values.items()])
        trainer = Trainer(cfg, progress=False)
        for batch in trainer.next_micro_batches():
            moved = trainer._to_device(batch)
            has_target = (batch["labels"][:, 1:] != -100).sum().item()
            assert ("loss_rows" in moved) == (name == "chunked")
            if name == "chunked":
                rows = moved["loss_rows"]
                assert rows.numel() % 64 == 0 and has_target <= rows.numel() < batch["labels"].numel()
                rows_seen.append((rows.numel(), batch["labels"].numel()))
        result = trainer.fit()
        runs[name] = [result.losses[s] for s in sorted(result.losses)] + [result.val_loss]
    # the export stops generating at the chat template's end of turn as well as at the tokenizer's EOS
    from transformers import GenerationConfig

    tok = trainer.tokenizer
    stop = GenerationConfig.from_pretrained(result.final_dir).eos_token_id
    assert {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id} <= set(stop), stop
    assert tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    assert rows_seen and all(r * 2 <= n for r, n in rows_seen)  # the head runs on half the rows or fewer
    torch.testing.assert_close(torch.tensor(runs["chunked"], dtype=torch.float64),
                               torch.tensor(runs["hf"], dtype=torch.float64), rtol=GOLDEN_RTOL, atol=0)
    cpt = Trainer(tiny_config(tmp_path / "cpt", byte_tokenizer, write_corpus(tmp_path / "c.jsonl")), progress=False)
    assert all("loss_rows" not in cpt._to_device(b) for b in cpt.next_micro_batches())


def test_fsdp_always_needs_torchrun(tmp_path, byte_tokenizer, corpus):
    from fp8train.train.trainer import train

    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, **{"distributed.fsdp": "always"})
    with pytest.raises(ValueError, match="distributed.fsdp"):
        train(cfg, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------------------------- NaN / Inf


def _nan_on_steps(trainer: Trainer, steps: set[int]):
    """Make the final norm emit NaN during the forward passes of the given (1-based) steps."""
    def hook(module, args, output):
        return output * float("nan") if trainer.step + 1 in steps and module.training else output
    return trainer.model.model.norm.register_forward_hook(hook)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_nonfinite_step_is_skipped_and_counted(tmp_path, byte_tokenizer, corpus, impl):
    """foreach AdamW reads the loss and norm before its step and skips on the host; torch's fused AdamW (as
    TritonAdamW on CUDA) skips on the device and the loop reads each step after enqueueing the next. Either
    way the NaN step moves nothing, is counted once and logged under its own step, and the loop reads a step
    after enqueueing the next unless the step evaluates, saves or ends the run."""
    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, recipe="hybrid",
                      **{"train.steps": 5, "train.save_every": 0, "optim.impl": impl})
    trainer = Trainer(cfg, progress=False)
    _nan_on_steps(trainer, {3})
    snapshots, finished = {}, []
    enqueue, finish = trainer.enqueue_step, trainer.finish_step

    def spy(batches, track_health=False):  # on the CPU the step has run when enqueue_step returns
        before = [p.detach().clone() for p in trainer.model.parameters()]
        out = enqueue(batches, track_health)
        snapshots[out.step] = all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
        return out

    def finish_spy(step):
        finished.append((step.step, trainer.step))  # (the step read, the steps enqueued by then)
        return finish(step)

    trainer.enqueue_step, trainer.finish_step = spy, finish_spy
    result = trainer.fit()
    assert result.skipped_steps == 1 and result.step == 5
    assert math.isnan(result.losses[3]) and all(math.isfinite(result.losses[s]) for s in (1, 2, 4, 5))
    assert snapshots == {1: False, 2: False, 3: True, 4: False, 5: False}  # no update on the NaN step only
    state = trainer.optimizer.state_dict()["state"]
    assert {float(v["step"]) for v in state.values()} == {4.0}  # the skipped step not counted by AdamW either
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records if "loss" in r] == [0, 0, 1, 1, 1]
    # steps 1-3 read after the next one is enqueued; 4 (it evaluates) and 5 (the last) before
    assert finished == [(1, 2), (2, 3), (3, 4), (4, 4), (5, 5)]


def test_overlapped_loop_equals_steps_waited_for(tmp_path, byte_tokenizer, corpus):
    """The loop that reads each step after enqueueing the next (fused AdamW) trains exactly as steps waited
    for one by one: the same losses, gradient norms and parameters, bit for bit; each logged step carries
    the learning rate it stepped with (warmup: step 1 at lr / 2)."""
    from fp8train.train.optim import skips_on_device

    runs = {}
    for how in ("loop", "steps"):
        cfg = tiny_config(tmp_path / how, byte_tokenizer, corpus, recipe="hybrid",
                          **{"train.steps": 4, "train.save_every": 0, "train.eval_every": 0, "optim.impl": "fused",
                             "optim.warmup_steps": 2, "optim.decay_steps": 1})
        trainer = Trainer(cfg, progress=False)
        assert skips_on_device(trainer.optimizer)
        if how == "loop":
            trainer.fit()
            records = [json.loads(line) for line in (tmp_path / how / "run" / "metrics.jsonl").read_text().splitlines()]
            steps = [(r["loss"], r["grad_norm"], r["lr"]) for r in records if "loss" in r]
        else:
            steps = []
            for _ in range(4):
                lr = trainer.scheduler.get_last_lr()[0]
                steps.append((*trainer.train_step(trainer.next_micro_batches())[:2], lr))
        runs[how] = (steps, [p.detach().clone() for p in trainer.model.parameters()])
    assert runs["loop"][0] == runs["steps"][0] and len(runs["loop"][0]) == 4
    assert runs["loop"][0][0][2] == pytest.approx(cfg.optim.lr / 2)
    assert all(torch.equal(a, b) for a, b in zip(runs["loop"][1], runs["steps"][1]))


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_stops_after_max_nonfinite_steps_keeping_last_good_checkpoint(tmp_path, byte_tokenizer, corpus, impl):
    from fp8train.train.checkpoint import find_latest_checkpoint, load_checkpoint

    cfg = tiny_config(tmp_path, byte_tokenizer, corpus, recipe="hybrid",
                      **{"train.steps": 10, "train.save_every": 3, "train.max_nonfinite_steps": 2, "optim.impl": impl})
    trainer = Trainer(cfg, progress=False)
    _nan_on_steps(trainer, set(range(4, 11)))
    with pytest.raises(NonFiniteLossError, match=r"2 non-finite steps in a row at step 5.*step_00000003"):
        trainer.fit()
    # step 6 was enqueued (its update skipped too) before step 5 was read
    assert trainer.step == 6 and trainer.skipped_steps == 2
    latest = find_latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest.name == "step_00000003"
    fresh = _tiny_model(byte_tokenizer)
    state = load_checkpoint(latest, model=fresh)
    assert state["step"] == 3
    for a, b in zip(fresh.parameters(), trainer.model.parameters()):  # nothing moved after step 3
        assert torch.equal(a, b.detach())


# ------------------------------------------------------------------------------------------ regen


def _regenerate() -> None:
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok, corpus_path = make_byte_tokenizer(tmp / "tok"), write_corpus(tmp / "corpus.jsonl")
        for recipe in ("bf16", "hybrid"):
            *losses, val = _golden_run(tmp / recipe, tok, corpus_path, recipe)
            out = {"recipe": recipe, "losses": losses, "val_loss": val, **_kernel_fingerprint(),
                   "command": "python tests/test_trainer.py --regen"}
            (GOLDEN / f"tiny_{recipe}.json").write_text(json.dumps(out, indent=1) + "\n")
            print(f"wrote {GOLDEN / f'tiny_{recipe}.json'}: {[round(x, 4) for x in losses]}, val {val:.4f}")


if __name__ == "__main__":
    if "--regen" not in sys.argv:
        sys.exit("usage: python tests/test_trainer.py --regen   (rewrites tests/golden/tiny_*.json)")
    _regenerate()


def test_bf16_layers_config_key(tmp_path, byte_tokenizer, corpus):
    """`bf16_layers` keeps the listed decoder layers in BF16 (the conversion summary says which); an index
    the model does not have is one clear error naming the key."""
    from fp8train import FP8Linear

    trainer = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, bf16_layers="[-1]"),
                      progress=False)
    layers = trainer.model.model.layers
    assert not any(isinstance(m, FP8Linear) for m in layers[-1].modules())
    assert sum(isinstance(m, FP8Linear) for m in layers[0].modules()) == 7
    assert "bf16_layers: decoder layers [1]" in str(trainer.fp8_report)
    with pytest.raises(ValueError, match="bf16_layers: 2 is not a decoder layer index of a 2-layer model"):
        Trainer(tiny_config(tmp_path / "b", byte_tokenizer, corpus, bf16_layers="[2]"), progress=False)


def test_deep_gemm_config_key(tmp_path, byte_tokenizer, corpus, monkeypatch):
    """`deep_gemm: true` reaches every converted layer's recipe; on the CPU (emulated GEMMs) it is ignored, so
    nothing needs DeepGEMM; on a CUDA device a missing DeepGEMM is one error naming the key, before anything
    is built or written."""
    from fp8train import FP8Linear
    from fp8train.fp8 import gemm
    from fp8train.train import trainer as trainer_module

    trainer = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, deep_gemm="true"), progress=False)
    fp8 = [m for m in trainer.model.modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == 14 and all(m.recipe.deep_gemm for m in fp8)

    def missing():
        raise ValueError("config key 'deep_gemm' is true but DeepGEMM does not import (test)")

    monkeypatch.setattr(trainer_module, "_pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(trainer_module, "load_deep_gemm", missing)
    run_dir = tmp_path / "cuda-run"
    with pytest.raises(ValueError, match="config key 'deep_gemm' is true but DeepGEMM does not import"):
        Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, deep_gemm="true", run_dir=str(run_dir)), progress=False)
    assert not run_dir.exists()
    assert gemm.load_deep_gemm is not missing  # the module's own function untouched


@pytest.mark.parametrize("cap", [None, 2])
def test_evaluation_covers_the_same_rows_at_any_number_of_ranks(tmp_path, byte_tokenizer, corpus, cap):
    """`evaluate` dealt out to 2 and 3 ranks (each rank's sums recorded where they would be all-reduced): the
    ranks' rows together are the single process's (the whole split, or the first eval_batches x micro_batch
    rows), every rank runs as many forwards (a sharded model all-gathers in each), and the summed loss is the
    single process's. Before, each rank took eval_batches micro-batches of its own and several ranks dropped
    the split's remainder."""
    from fp8train.train.distributed import World

    trainer = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **{"train.micro_batch": 3, "train.global_batch": 6,
                                                                       "train.eval_batches": cap or "null"}),
                      progress=False)
    assert len(trainer.val_data) % 3 and len(trainer.val_data) > 6  # a remainder for 2 and 3 ranks alike
    one = trainer.evaluate()
    forwards = []
    real_forward = trainer.model.forward
    trainer.model.forward = lambda *a, **k: forwards.append(1) or real_forward(*a, **k)
    for ws in (2, 3):
        sums = []

        class Recording(World):
            @staticmethod
            def all_reduce_sum(value):
                sums.append(value.item())
                return value

        runs = []
        for rank in range(ws):
            trainer.world, forwards[:] = Recording(rank=rank, world_size=ws), []
            trainer.evaluate()
            runs.append(len(forwards))
        total, count = sum(sums[0::2]), sum(sums[1::2])
        assert len(set(runs)) == 1, runs
        assert abs(total / count - one) <= 1e-6 * one, (ws, total / count, one)
    trainer.world = World()


def test_hold_fp8_weights_config_key(tmp_path, byte_tokenizer, corpus, capsys):
    """`hold_fp8_weights: true`: the steps' context (`Trainer.fp8_weights`) has the optimizer write every converted
    layer's FP8 weight, and gives the copies back after; where the optimizer cannot (torch's AdamW: the CPU's),
    one line of the log says so and every layer quantizes its weight as before."""
    from fp8train import FP8Linear

    trainer = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, hold_fp8_weights="true"), progress=False)
    fp8 = [m for m in trainer.model.modules() if isinstance(m, FP8Linear)]
    with trainer.fp8_weights():
        assert not any(m.held for m in fp8)
    assert ("hold_fp8_weights: off (optim.impl auto on cpu: AdamW cannot write FP8 weights; "
            "fp8train.train.adamw.TritonAdamW (CUDA) can)") in \
        capsys.readouterr().out

    class Writer:  # stands in for TritonAdamW, which needs Triton and CUDA
        def __init__(self, param_groups):
            self.param_groups = param_groups
            self.copies = {}

        def write_fp8_blocks(self, param, data, scale, *, pow2):
            self.copies[param] = data

    trainer.optimizer = writer = Writer(trainer.optimizer.param_groups)
    with trainer.fp8_weights():
        assert all(m.held for m in fp8) and len([d for d in writer.copies.values() if d is not None]) == 14
    assert "hold_fp8_weights: 14 layers hold their FP8 weights, written by the optimizer" in capsys.readouterr().out
    assert not any(m.held for m in fp8) and all(d is None for d in writer.copies.values())


def test_logged_throughput_times_each_step_and_not_its_neighbours(tmp_path, byte_tokenizer, corpus, monkeypatch):
    """Steps overlap (step N is logged after step N + 1 is enqueued), and a step that evaluates or saves is finished
    at once: each step's tokens/s is still its own, timed from the end of the step before it (or of an evaluation
    or save) to its own end. On a clock that only the steps (1 s each) and evaluation and saving (5 s) advance,
    every logged rate is exactly tokens / 1 s; a window timed from the last report read ~0 s for a step finished
    at once (76,401 tokens/s among ~375 on a CPU) and two steps for the step after it."""
    from fp8train.train import metrics, trainer as trainer_module

    clock = [0.0]
    monkeypatch.setattr(metrics, "device_clock", lambda device: clock[0])
    monkeypatch.setattr(trainer_module, "device_clock", lambda device: clock[0])
    t = Trainer(tiny_config(tmp_path, byte_tokenizer, corpus, **{"train.steps": 8, "train.eval_every": 3,
                                                                  "train.save_every": 4, "train.health_every": 0}),
                progress=False)

    def costs(seconds, method):
        def timed(*args, **kwargs):
            clock[0] += seconds  # the work, done as it is issued (a CPU)
            return method(*args, **kwargs)
        return timed

    monkeypatch.setattr(t, "enqueue_step", costs(1.0, t.enqueue_step))
    monkeypatch.setattr(t, "evaluate", costs(5.0, t.evaluate))
    monkeypatch.setattr(t, "save", costs(5.0, t.save))
    t.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    assert sorted(rates) == list(range(1, 9)) and set(rates.values()) == {8 * 64 / 1.0}, rates
