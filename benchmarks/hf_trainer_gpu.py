"""transformers `Trainer` and TRL `SFTTrainer` with fp8train's FP8 layers vs plain BF16, on one GPU.

    PYTHONPATH=. python benchmarks/hf_trainer_gpu.py --out $OUT/hf_trainer.jsonl            # H200, ~10 min
    PYTHONPATH=. python benchmarks/hf_trainer_gpu.py --device cpu --tiny                     # the CPU check

A Qwen2.5-1.5B-shaped model (random init, FP32 master weights) trains for `--steps` optimizer steps with
`bf16=True`, fused AdamW and micro-batch x accumulation sequences of `--seq` tokens, once per trainer and
recipe (`bf16`: nothing converted; `hybrid`: `convert_for_training` + `FP8TrainerCallback`). The data is
synthetic and learnable (each row an arithmetic progression of token ids, mod the vocabulary), the same rows
in the same order for every run, so the losses of one trainer are comparable across recipes. Printed per
run: ms per optimizer step and tokens/s (median over the steps after `--warmup`), peak GPU memory, the loss
of step 1 and of the last step. `--compile` sets `torch_compile=True`. Needs transformers, trl, peft,
datasets and accelerate (`pip install 'fp8train[hf]'`; on the H200 install the wheels with --no-deps).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8train.data import collate
from fp8train.integrations.hf import FP8TrainerCallback, convert_for_training
from fp8train.train.model import ModelConfig, build_model
from _harness import append_jsonl, device_for, fill_defaults  # a sibling: benchmarks/ is on sys.path

SHAPES = {"full": dict(source="qwen2.5-1.5b"),
          "tiny": dict(source="tiny-qwen2", vocab_size=512)}


def synthetic_rows(n: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Rows of arithmetic progressions of token ids (start and stride random per row): learnable data."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    return [{"input_ids": r, "labels": r.clone(), "position_ids": torch.arange(seq)} for r in ids]


class _StepTimer:
    """Wall time of each optimizer step (device-synchronized), from TrainerCallback events."""

    def __init__(self, device: torch.device):
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.seconds.append(time.perf_counter() - timer._t0)

        self.device, self.seconds, self._t0 = device, [], 0.0
        self.callback = Callback()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_one(trainer_kind: str, recipe: str, a: argparse.Namespace, rows: list[dict], device: torch.device) -> dict:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = build_model(ModelConfig(**SHAPES["tiny" if a.tiny else "full"])).to(device)
    if recipe != "bf16":
        convert_for_training(model, recipe)
    work = tempfile.mkdtemp(prefix="hf_bench_")
    common = dict(output_dir=work, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.accum,
                  max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, bf16=True,
                  use_cpu=device.type == "cpu", optim="adamw_torch_fused", logging_steps=1, save_strategy="no",
                  report_to="none", disable_tqdm=True, seed=0, train_sampling_strategy="sequential",
                  dataloader_num_workers=0, torch_compile=a.compile)
    common[_checkpointing_key()] = a.activation_checkpointing
    common = {k: v for k, v in common.items() if k in TrainingArguments.__dataclass_fields__}  # older releases
    timer = _StepTimer(device)
    if trainer_kind == "trainer":
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=rows, data_collator=collate,
                          callbacks=[timer.callback])
    else:
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]}).with_format("torch")
        args = SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                             processing_class=_tokenizer(model.config.vocab_size), callbacks=[timer.callback])
    if recipe != "bf16":
        trainer.add_callback(FP8TrainerCallback(trainer, health_every=a.health_every))
    trainer.remove_callback(PrinterCallback)  # one table line per run instead of a dict per step
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = timer.seconds[a.warmup:] or timer.seconds
    step_s = statistics.median(timed)
    tokens = a.micro_batch * a.accum * a.seq
    out = {"trainer": trainer_kind, "recipe": recipe, "steps": len(losses), "seq": a.seq,
           "tokens_per_step": tokens, "ms_per_step": 1e3 * step_s, "tokens_per_s": tokens / step_s,
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "loss_first": losses[0], "loss_last": losses[-1], "compile": a.compile,
           "activation_checkpointing": a.activation_checkpointing}
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _tokenizer(vocab: int):
    """A word-level tokenizer with one token per id: SFTTrainer wants one, and the rows are token ids already."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), pad_token="t0", eos_token="t1")


def _checkpointing_key() -> str:
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, short rows, 3 steps: the CPU check")
    p.add_argument("--trainers", nargs="+", default=["trainer", "sft"], choices=["trainer", "sft"])
    p.add_argument("--recipes", nargs="+", default=["bf16", "hybrid"])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default 5; --tiny 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 4096; --tiny 64)")
    p.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (default 2; --tiny 2)")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--compile", action="store_true", help="torch_compile=True")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--health-every", type=int, default=0, help="FP8 health every N steps (0 = off)")
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per run here")
    return fill_defaults(p.parse_args(argv), dict(steps=(3, 20), warmup=(1, 5), seq=(64, 4096), micro_batch=(2, 2)))


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    device = device_for(a.device, "hf_trainer_gpu")
    vocab = 512 if a.tiny else 151936
    rows = synthetic_rows(a.steps * a.micro_batch * a.accum, a.seq, vocab)
    results = []
    print(f"{'trainer':<8} {'recipe':<8} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss 1':>8} "
          f"{'loss last':>9}", flush=True)
    for kind in a.trainers:
        for recipe in a.recipes:
            r = run_one(kind, recipe, a, rows, device)
            results.append(r)
            mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
            print(f"{kind:<8} {recipe:<8} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10,.0f} {mem:>9} "
                  f"{r['loss_first']:>8.4f} {r['loss_last']:>9.4f}", flush=True)
            append_jsonl(a.out, r)
    for kind in a.trainers:
        by = {r["recipe"]: r for r in results if r["trainer"] == kind}
        if "bf16" in by:
            for recipe, r in by.items():
                if recipe != "bf16":
                    print(f"{kind}: {recipe} vs bf16: {r['tokens_per_s'] / by['bf16']['tokens_per_s']:.3f}x tokens/s, "
                          f"last loss {r['loss_last'] - by['bf16']['loss_last']:+.4f}")
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
