"""`fp8train bench`: the end-to-end training step, BF16 vs FP8 recipes vs torchao float8, on your GPU.

    fp8train bench --models qwen2.5-1.5b qwen2.5-7b:22 --seq 4096 8192 --profile

Every variant runs the trainer's own step (FP32 master weights, AdamW, BF16 autocast,
grad clipping) on the same random tokens from the same initial weights; only the Linears differ:
  bf16                 nn.Linear under autocast (the standard mixed-precision baseline)
  hybrid, tensorwise   fp8train.convert_to_fp8 with that recipe
  torchao-tensorwise,  torchao.float8.convert_to_float8_training (LM head left in BF16), when torchao
  torchao-rowwise      is importable
A variant may carry recipe modifiers, for A/B runs in one process: `hybrid+wgrad_from_fp8` (the recipe's
`wgrad_input_from_fp8`: one FP8 copy of each input, input.T re-quantized from it in the backward),
`hybrid+swiglu_fp8` (`swiglu_inputs_fp8`: the SwiGLU's inputs saved for backward in FP8), `hybrid+deep_gemm`
(`deep_gemm`: output and grad_input on DeepGEMM's kernel), `hybrid+exact` (`pow2_scale: false`),
`hybrid+unfused` (`fuse_swiglu: false`: three FP8 Linears per MLP instead of the SwiGLU fused into its FP8
producers, hybrid's default; `+fused` turns it on for the other recipes), `hybrid+t_bwd` (`input_t_in_backward`:
grad_weight's input.T made in the backward instead of saved), `hybrid+wgrad_blocks` (grad_weight's input.T in
128x128 blocks: grad_weight on cuBLAS's tile x block kernel), `hybrid+fuse_rows` (`fuse_row_quantization`,
compiled: rows-only quantizations, LoRA's, inside the inductor kernels that produce the activations); `+held` is
the trainer's `hold_fp8_weights` (each weight's FP8 copy written by the optimizer's step, no weight quantized in
a step) and, with `--lora`, `+keep_t` the trainer's `model.lora.keep_weight_t` (the frozen base keeps W.T's FP8
operand too: no backward transposes W) and `+inputs_fp8` its `model.lora.inputs_fp8` (the adapters keep their
base's FP8 copy of their input).
`compiled` applies torch.compile to each decoder layer, for every variant alike (the trainer's
`train.compile`); `cudagraphs` also replays each layer as CUDA graphs (`train.cuda_graphs`). Steps run as the
trainer's loop runs them, each enqueued before the last is read (`Trainer.enqueue_step`); a step's time is from
its start to the next one's on the GPU's clock, the GPU's idle time included. Step time
is the median of the timed steps after the warm-up (their range beside it); `--rounds N` runs the variant
list N times interleaved and reports each ratio's median and range over the rounds; peak memory is torch.cuda.max_memory_allocated over
the timed steps (with cudagraphs over all steps: the graphs' pool is allocated while recording). Ratios
are to BF16 at the same model, length and mode, measured in the same process. `--profile` adds the CUDA
kernel time of one step by category (FP8 and BF16 GEMMs told apart by the cuBLAS kernel name, which a
CUDA graph replay keeps); `--memory` a breakdown of the peak: FP32 parameters, gradients and AdamW states,
and what the step saves for backward by kind (FP8, BF16, FP32, the vocabulary-wide logits); not with
`cudagraphs`, whose replays allocate from the graphs' own pools, outside what the breakdown observes;
`--top-kernels N` the N kernels with the most time, with their launches and time per launch; `--trace DIR`
the profiled step's Chrome trace (chrome://tracing, Perfetto) of each variant, which
`benchmarks/trace_gaps.py` reads for where the GPU idles. `--docs N` packs N documents in each row
(`position_ids` restart at each, as CPT's `document_masking` makes them), `--packed-attention` picks their
attention; `--targets F` leaves only the last share F of each document with a target (SFT's rows: the prompt
labelled -100, the answer trained; the LM head then runs on the rows with a target); `--lora RANK` trains
adapters on the frozen base (the trainer's `model.lora`, as `Trainer.fit` runs it); each is compared with a
BF16 of the same setting.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch

from .fp8.recipe import MODIFIERS, Fp8Recipe, parse_recipe

__all__ = ["BenchCase", "run_case", "parse_variant", "categorize_profile", "kernel_launches", "profile_table",
           "top_kernel_times", "top_kernels_table", "write_trace", "memory_breakdown", "markdown_table", "main"]

VARIANTS = ("bf16", "hybrid", "tensorwise", "torchao-tensorwise", "torchao-rowwise")
MODES = ("eager", "compiled", "cudagraphs")

_KERNEL_CATEGORIES = [  # (category, regex on the CUDA kernel name), first match wins
    ("quantization", r"_act_kernel|_weight_kernel"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    # inductor's fused kernels (named by the ops they fuse: a quantization traced for it, `fuse_row_quantization`,
    # may carry a GEMM's name into them)
    ("norms and elementwise", r"^triton_(poi|per|red)_"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90_"),
    ("communication", r"nccl"),
    ("norms and elementwise", r"."),
]
# cuBLAS names a kernel by its operand types: FP8 ones are nvjet_sm90_qq*/qr* (q: E4M3, r: E5M2; BF16 is
# t: nvjet_sm90_tst_*) or sm90_xmma_gemm_e4m3*; DeepGEMM's are sm90_fp8_gemm_*
_FP8_GEMM = r"nvjet_sm\d+_q|e4m3|e5m2|fp8_gemm"


@dataclass(frozen=True)
class BenchCase:
    """One row of the table."""

    model: str
    """A preset of `fp8train.model.PRESETS`."""
    layers: int | None
    """Decoder layers (None: the preset's)."""
    seq: int
    """Tokens per sequence (batch 1)."""
    variant: str
    """One of VARIANTS."""
    mode: str
    """One of MODES: eager, compiled (torch.compile per decoder layer) or cudagraphs (compiled, and each
    layer's graphs replayed as CUDA graphs)."""
    vocab: int | None = None
    """Embedding rows; None: the preset's (presets sized by a tokenizer get Qwen2.5's 151,936)."""
    loss_impl: str = "chunked"
    """The trainer's `train.loss_impl`: chunked (the default), liger, or hf (full logits)."""
    optim_impl: str = "auto"
    """The trainer's `optim.impl`: auto (fp8train's Triton AdamW on CUDA), triton, fused (torch's) or foreach."""
    docs: int = 1
    """Documents packed in each sequence, of equal length (position_ids restart at each, as CPT's
    `document_masking` and SFT's packing make them): the model attends within each document only."""
    packed_attention: str = "flex"
    """The trainer's `train.packed_attention` (packed rows on CUDA): flex (block mask) or sdpa (dense mask)."""
    targets: float = 1.0
    """Share of each document's tokens with a target, its last ones (SFT: the answer; the prompt before it is
    labelled -100); 1.0: every token, as CPT."""
    lora: int = 0
    """The trainer's `model.lora.rank`: 0 trains every parameter; r > 0 trains rank-r adapters on the seven
    decoder projections of the frozen base (its FP8 weights made once, its own weights in host memory)."""


def _kernel_events(prof):
    """(name, ms, launches) of the CUDA kernels of a torch.profiler run. A CPU op's device time is its kernels'
    time again, and a GPU user annotation (such as torch's `Optimizer.step#AdamW.step`, whose "device time" is
    the span of the kernels inside it) is not a kernel: both are left out."""
    from torch.autograd import DeviceType

    for evt in prof.key_averages():
        t = evt.self_device_time_total / 1e3
        if evt.device_type != DeviceType.CPU and t > 0 and not getattr(evt, "is_user_annotation", False):
            yield evt.key, t, evt.count


def _kernel_category(name: str) -> str:
    """The first of `_KERNEL_CATEGORIES` whose pattern the kernel's name matches."""
    return next(cat for cat, pat in _KERNEL_CATEGORIES if re.search(pat, name.lower()))


_PROFILE_COLUMNS = ("fp8 gemm", "bf16/fp32 gemm", "quantization", "attention", "norms and elementwise", "optimizer",
                    "communication", "total")


def categorize_profile(prof) -> dict[str, float]:
    """CUDA kernel time (ms) of a torch.profiler run by category (`_kernel_events`). FP8 GEMMs are told by
    the kernel's name, not by the op that launched it: a CUDA graph replay records kernels without their ops."""
    out: dict[str, float] = defaultdict(float, {"fp8 gemm": 0.0, "bf16/fp32 gemm": 0.0})
    for key, t, _ in _kernel_events(prof):
        name = key.lower()
        cat = _kernel_category(name)
        if cat == "gemm":
            cat = "fp8 gemm" if re.search(_FP8_GEMM, name) else "bf16/fp32 gemm"
        out[cat] += t
    out["total"] = sum(out.values())
    return dict(out)


def kernel_launches(prof) -> int:
    """CUDA kernel launches in a torch.profiler run (the kernels `categorize_profile` times)."""
    return sum(calls for _, _, calls in _kernel_events(prof))


def _convert_torchao(model, recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda mod, fqn: fqn != "lm_head")


def top_kernel_times(prof, n: int) -> list[tuple[str, str, float, int]]:
    """The n CUDA kernels with the most device time in the profile: (category, name, ms, launches)."""
    rows = [(_kernel_category(name), name[:120], t, calls) for name, t, calls in _kernel_events(prof)]
    return sorted(rows, key=lambda r: -r[2])[:n]


def profile_table(label_columns: list[str],
                  rows: list[tuple[list, dict[str, float], int | None, float | None]]) -> list[str]:
    """`categorize_profile` results as a markdown table under "CUDA kernel time of one step, ms:" (lines, a
    blank one first): each row is its labels (one per label column), its categories' ms, its kernel launches
    (`kernel_launches`) and, where the row's timed steps' median (ms) is given, that minus the profiled step's
    kernel time (the GPU's idle time in a step: launch gaps, host waits)."""
    cols = [*label_columns, *_PROFILE_COLUMNS, "kernel launches", "median step - kernels"]

    def cells(labels: list, ms: dict, launches: int | None, step_ms: float | None) -> list[str]:
        return [*map(str, labels), *(f"{ms.get(c, 0.0):.1f}" for c in _PROFILE_COLUMNS),
                str(launches) if launches is not None else "-",
                f"{step_ms - ms['total']:.1f}" if step_ms is not None else "-"]

    return (["", "CUDA kernel time of one step, ms:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(cells(*row)) + " |" for row in rows])


def top_kernels_table(title: str, rows: list[tuple[str, str, float, int]]) -> list[str]:
    """`top_kernel_times`' rows as a markdown table under "Top kernels, ms: title" (lines, a blank one first),
    with each kernel's launches and mean time per launch."""
    return (["", f"Top kernels, ms: {title}", "", "| category | kernel | ms | launches | us each |",
             "|---|---|---|---|---|"]
            + [f"| {c} | `{k}` | {t:.2f} | {n} | {1e3 * t / n:.1f} |" for c, k, t, n in rows])


def write_trace(prof, trace_dir: str, name: str) -> str:
    """Write a torch.profiler run's Chrome trace (chrome://tracing, Perfetto) to `trace_dir`, gzipped, as
    `name` in letters, digits, '.', '_' and '-' (a variant's '+' becomes '_'); returns its path."""
    path = os.path.join(trace_dir, re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json.gz")
    os.makedirs(trace_dir, exist_ok=True)
    prof.export_chrome_trace(path)
    return path


def memory_breakdown(trainer, batches: list[dict]) -> dict[str, float]:
    """GiB of one training step's peak by kind: the FP32 parameters, gradients and optimizer states, and what
    the forward saves for backward (one count per storage, parameters left out), split into FP8, BF16, FP32
    and the vocabulary-wide tensors of the LM head and loss; `other at peak` is the peak minus parameters,
    optimizer states and saved tensors (the gradients alive at the peak, temporaries, workspaces)."""
    from collections import defaultdict

    model, opt = trainer.model, trainer.optimizer
    vocab = model.config.vocab_size
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            kind = ("saved: logits/loss (vocab-wide)" if t.dim() and t.shape[-1] == vocab else
                    "saved: FP8" if t.element_size() == 1 and t.is_floating_point() else
                    f"saved: {str(t.dtype).removeprefix('torch.')}")
            saved[kind] += storage.nbytes()
        return t

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step(batches)
    torch.cuda.synchronize()
    gib = 2.0 ** 30
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / gib  # noqa: E731
    out = {"FP32 parameters": nbytes(model.parameters()),
           "gradients": nbytes(p.grad for p in model.parameters() if p.grad is not None),
           "optimizer states": nbytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)),
           **{k: v / gib for k, v in sorted(saved.items())}}
    peak = torch.cuda.max_memory_allocated() / gib
    out["other at peak"] = peak - out["FP32 parameters"] - out["optimizer states"] - sum(v / gib for v in saved.values())
    out["peak allocated"] = peak
    out["allocator reserve over peak"] = torch.cuda.max_memory_reserved() / gib - peak
    return out


def _now(cuda: bool):
    """A point in time on the device's clock: a CUDA event recorded on the current stream (the host's elsewhere)."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextlib.contextmanager
def _host_syncs(check: bool):
    """Collects, as file:line, each CUDA operation inside that made the host wait for the GPU (torch's sync
    debug mode)."""
    found: list[str] = []
    if not check:
        yield found
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.cuda.set_sync_debug_mode(0)
    found += [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def _seconds(a, b) -> float:
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3


# `+held`: hold_fp8_weights; `+keep_t`, `+inputs_fp8`: model.lora.keep_weight_t, model.lora.inputs_fp8
_LORA_MODIFIERS = ("keep_t", "inputs_fp8")
_TRAINER_MODIFIERS = ("held", *_LORA_MODIFIERS)


def parse_variant(name: str) -> tuple[str, Fp8Recipe | None, frozenset[str]]:
    """(base variant, Fp8Recipe or None, trainer modifiers) of a variant name with recipe modifiers
    (`hybrid+wgrad_from_fp8`: `fp8train.parse_recipe`'s spelling; None: the trainer builds the base's recipe
    itself) and the trainer's (`_TRAINER_MODIFIERS`: `+held`, `+keep_t`, `+inputs_fp8`)."""
    base, *mods = name.split("+")
    trainer = frozenset(m for m in mods if m in _TRAINER_MODIFIERS)
    mods = [m for m in mods if m not in _TRAINER_MODIFIERS]
    if base not in VARIANTS or ((mods or trainer) and (base.startswith("torchao-") or base == "bf16")) \
            or any(m not in MODIFIERS for m in mods):
        raise ValueError(f"unknown variant {name!r}: one of {list(VARIANTS)}, fp8train's recipes optionally with "
                         f"{['+' + m for m in (*MODIFIERS, *_TRAINER_MODIFIERS)]}")
    return base, parse_recipe("+".join([base, *mods])) if mods else None, trainer


def run_case(case: BenchCase, *, steps: int = 5, warmup: int = 2, device: str = "cuda", profile: bool = False,
             activation_checkpointing: bool = False, memory: bool = False, top_kernels: int = 0,
             trace_dir: str | None = None) -> dict:
    """Build the model, run `warmup + steps` training steps of one sequence, return the measurements. With
    `trace_dir`, the profiled step's Chrome trace is written there (gzipped; `trace` in the result names it)."""
    from .data import CptDataConfig
    from .fp8.convert import convert_to_fp8
    from .train.config import LoopConfig, TrainConfig
    from .train.lora import LoraConfig
    from .train.model import PRESETS, ModelConfig, build_model
    from .train.optim import OptimConfig
    from .train.trainer import Trainer

    import torch._dynamo

    base, custom, trainer_mods = parse_variant(case.variant)
    for mod in trainer_mods & set(_LORA_MODIFIERS):
        if not case.lora:
            raise ValueError(f"variant {case.variant!r}: +{mod} is for a frozen base (--lora)")
    torch._dynamo.reset()  # every case compiles afresh: no recompile limit, no shapes made dynamic by earlier cases
    vocab = case.vocab or (None if PRESETS[case.model]["vocab_size"] else 151936)
    lora = LoraConfig(rank=case.lora, keep_weight_t="keep_t" in trainer_mods,
                      inputs_fp8="inputs_fp8" in trainer_mods)
    mcfg = ModelConfig(source=case.model, num_layers=case.layers, vocab_size=vocab, lora=lora)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(mcfg)
    recipe, fp8_layers = base, None
    if base.startswith("torchao-"):
        _convert_torchao(model, base.split("-", 1)[1])
        recipe = "bf16"
    elif custom is not None:  # the trainer finds the Linears converted already (its log names the base recipe)
        report = convert_to_fp8(model, custom)
        print(report, flush=True)
        fp8_layers = len(report.converted)
    vocab, seq = model.config.vocab_size, case.seq
    g = torch.Generator().manual_seed(1)
    doc_len = -(-seq // case.docs)
    positions = torch.arange(seq) % doc_len
    prompt = positions < round(doc_len * (1.0 - case.targets))  # the first tokens of each document: no target
    rows = [{"input_ids": (ids := torch.randint(0, vocab, (seq,), generator=g)),
             "labels": ids.masked_fill(prompt, -100), "position_ids": positions} for _ in range(steps + warmup)]
    cfg = TrainConfig(stage="cpt", data=CptDataConfig(paths=["(synthetic)"], seq_len=seq),
                      run_dir=tempfile.mkdtemp(prefix=f"fp8train-bench-{case.variant}-"), resume="none",
                      device=device, recipe=recipe, model=mcfg, hold_fp8_weights="held" in trainer_mods,
                      optim=OptimConfig(lr=1e-5, min_lr=1e-6, schedule="constant", impl=case.optim_impl),
                      train=LoopConfig(steps=steps + warmup, global_batch=1, micro_batch=1, compile=case.mode != "eager",
                                       cuda_graphs=case.mode == "cudagraphs", loss_impl=case.loss_impl,
                                       packed_attention=case.packed_attention,
                                       activation_checkpointing=activation_checkpointing))
    trainer = Trainer(cfg, model=model, train_data=rows, val_data=None, progress=False)
    cuda = device == "cuda"
    with trainer.fp8_weights():  # LoRA's frozen base, `hold_fp8_weights`: as `Trainer.fit` runs its steps
        res = _measure(trainer, case, model.config, fp8_layers, steps=steps, warmup=warmup, cuda=cuda,
                       profile=profile, memory=memory, top_kernels=top_kernels, trace_dir=trace_dir)
    del trainer, model, rows
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def _time_steps(trainer, mode: str, steps: int, warmup: int, cuda: bool) -> tuple[list[float], list[float], list[str]]:
    """Run `warmup + steps` steps as the trainer's loop runs them; their times (s), losses, and where an extra
    untimed step made the host wait for the GPU."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # As the trainer's loop runs them: step i + 1 is enqueued before step i is read, so the device does not
    # wait for the host between steps. A step's time is from its start to the next one's, on the device's
    # clock (CUDA events; the host's elsewhere): whatever the device idles between them counts.
    clock, losses, in_flight = [], [], None
    sync()
    for i in range(warmup + steps):
        # CUDA graphs allocate their memory pool while recording, in the warm-up: their peak spans it
        if cuda and i == (0 if mode == "cudagraphs" else warmup):
            torch.cuda.reset_peak_memory_stats()
        batches = trainer.next_micro_batches()
        clock.append(_now(cuda))
        current = trainer.enqueue_step(batches)
        if in_flight is not None:
            losses.append(trainer.finish_step(in_flight)[0])
        in_flight = current
    clock.append(_now(cuda))
    losses.append(trainer.finish_step(in_flight)[0])
    sync()
    # One more step, untimed, under torch's sync debug mode: its warnings cost host time the timed steps
    # must not pay
    batches = trainer.next_micro_batches()
    with _host_syncs(cuda) as host_syncs:
        in_flight = trainer.enqueue_step(batches)
    trainer.finish_step(in_flight)
    times = [_seconds(a, b) for a, b in zip(clock, clock[1:])]
    return times, losses, host_syncs


def _measure(trainer, case: BenchCase, config, fp8_layers: int | None, *, steps: int, warmup: int, cuda: bool,
             profile: bool, memory: bool, top_kernels: int, trace_dir: str | None) -> dict:
    """`run_case`'s measurements of a built trainer (its frozen base made, for LoRA)."""
    from .train.metrics import flops_per_token, peak_tflops

    seq = case.seq
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses, host_syncs = _time_steps(trainer, case.mode, steps, warmup, cuda)
    timed_ms = [t * 1e3 for t in times[warmup:]]
    step_s = statistics.median(timed_ms) / 1e3
    tflops = flops_per_token(config, seq, weight_grads=not case.lora) * seq / step_s / 1e12
    res = {"model": case.model, "layers": config.num_hidden_layers, "seq": seq, "docs": case.docs,
           "targets": case.targets,
           "packed_attention": case.packed_attention, "lora": case.lora,
           "variant": case.variant,
           "loss_impl": case.loss_impl, "optim_impl": case.optim_impl, "mode": case.mode, "step_ms": step_s * 1e3,
           "step_ms_range": [min(timed_ms), max(timed_ms)], "tokens_per_s": seq / step_s, "tflops": tflops,
           # MFU against the BF16 peak for every variant (the FP8 one would halve FP8's figures)
           "mfu_bf16_peak": tflops / (peak_tflops(trainer.device, fp8=False) or float("nan")),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda
           else float("nan"), "loss_first": losses[0], "loss_last": losses[-1],
           "fp8_layers": fp8_layers if fp8_layers is not None else len(trainer.fp8_report.converted),
           "first_step_s": times[0],
           "skipped_steps": trainer.skipped_steps,  # non-finite steps skip the optimizer: not a valid timing
           # where the host waited for the GPU while enqueueing a step (file:line; none expected)
           "host_syncs": sorted(set(host_syncs))}
    if profile or top_kernels or trace_dir:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        batches = trainer.next_micro_batches()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.train_step(batches)
            sync()
        res["profile_ms"], res["kernel_launches"] = categorize_profile(prof), kernel_launches(prof)
        if top_kernels:
            res["top_kernels_ms"] = top_kernel_times(prof, top_kernels)
        if trace_dir:
            name = f"{case.model}-{res['layers']}-{seq}-{case.mode}-{case.variant}"
            name += "".join(f"-{v}" for v, d in ((case.loss_impl, "chunked"), (case.optim_impl, "auto")) if v != d)
            res["trace"] = write_trace(prof, trace_dir, name)
    if memory and cuda and _memory_split_applies(case.mode):
        res["memory_gib"] = memory_breakdown(trainer, trainer.next_micro_batches())
    return res


def _memory_split_applies(mode: str) -> bool:
    """Whether `memory_breakdown` can split a step of `mode`: not under CUDA graphs, whose replays allocate
    from the pools their recordings took, outside what the step observes (the split came out inconsistent
    there: one "peak allocated" for every variant, a negative "other at peak"; an H100, 2026-12-05)."""
    return mode != "cudagraphs"


_CASE_KEYS = ("model", "layers", "seq", "mode")
# a result's BF16 base shares all of these
_SHAPE_KEYS = (*_CASE_KEYS, "loss_impl", "optim_impl", "docs", "targets", "packed_attention", "lora")


def _base(results: list[dict], r: dict) -> dict | None:
    """The BF16 result of r's shape, mode, loss and optimizer, of the same round."""
    return next((b for b in results if b["variant"] == "bf16" and all(b.get(k) == r.get(k) for k in
                 (*_SHAPE_KEYS, "round"))), None)


def _rounds_table(results: list[dict]) -> list[str]:
    """With several rounds: each variant's speed and memory ratio to BF16, median and range over the rounds
    (each round's ratio against that round's BF16)."""
    groups: dict = defaultdict(list)
    for r in results:
        if (b := _base(results, r)) is not None and r["variant"] != "bf16":
            groups[(*(r.get(k) for k in _CASE_KEYS), _label(r))].append(  # _label carries loss and optimizer
                (b["step_ms"] / r["step_ms"], r["peak_mem_gib"] / b["peak_mem_gib"]))
    if not any(len(v) > 1 for v in groups.values()):
        return []
    lines = ["", "Across rounds (each against its round's BF16): median (lowest-highest)", "",
             "| model | layers | seq | mode | variant | rounds | speed x BF16 | memory x BF16 |", "|" + "---|" * 8]
    for (model, layers, seq, mode, variant), ratios in groups.items():
        sp, mem = ([x[i] for x in ratios] for i in (0, 1))
        lines.append(f"| {model} | {layers} | {seq} | {mode} | {variant} | {len(ratios)} | "
                     f"{statistics.median(sp):.3f} ({min(sp):.3f}-{max(sp):.3f}) | "
                     f"{statistics.median(mem):.3f} ({min(mem):.3f}-{max(mem):.3f}) |")
    return lines


def _label(r: dict) -> str:
    """The variant, with the loss and optimizer where they are not the defaults."""
    label = r["variant"] + (f" ({r['loss_impl']} loss)" if r.get("loss_impl", "chunked") != "chunked" else "")
    label += f" ({r['docs']} documents a sequence)" if r.get("docs", 1) != 1 else ""
    label += f" ({r['targets']:.0%} of tokens with a target)" if r.get("targets", 1.0) != 1.0 else ""
    label += f" ({r['packed_attention']} attention)" if r.get("packed_attention", "flex") != "flex" else ""
    label += f" (LoRA r={r['lora']})" if r.get("lora") else ""
    return label + (f" ({r['optim_impl']} AdamW)" if r.get("optim_impl", "auto") != "auto" else "")


def _range(r: dict) -> str:
    """' (lo-hi)': the fastest and slowest timed step, beside the median (the spread a difference must beat)."""
    lo_hi = r.get("step_ms_range")
    return f" ({lo_hi[0]:.1f}-{lo_hi[1]:.1f})" if lo_hi else ""


def markdown_table(results: list[dict]) -> str:
    lines = ["| model | layers | seq | mode | variant | step ms (timed steps' range) | tokens/s | TFLOP/s | MFU (BF16 peak) | peak GiB "
             "| speed x BF16 | memory x BF16 | loss first / last |", "|" + "---|" * 13]
    for r in results:
        b = _base(results, r)
        sp = f"{b['step_ms'] / r['step_ms']:.3f}" if b else "-"
        mem = f"{r['peak_mem_gib'] / b['peak_mem_gib']:.3f}" if b else "-"
        variant = _label(r) + (f" [round {r['round'] + 1}]" if r.get("round") else "")
        lines.append(f"| {r['model']} | {r['layers']} | {r['seq']} | {r['mode']} | "
                     f"{variant} | {r['step_ms']:.1f}{_range(r)} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | "
                     f"{r['mfu_bf16_peak']:.1%} | {r['peak_mem_gib']:.1f} | {sp} | {mem} | "
                     f"{r['loss_first']:.3f} / {r['loss_last']:.3f}"
                     + (f" ({r['skipped_steps']} NON-FINITE steps: invalid)" if r.get("skipped_steps") else "") + " |")
    profiled = [r for r in results if "profile_ms" in r]
    if profiled:
        lines += profile_table(["model", "seq", "mode", "variant"],
                               [([f"{r['model']}/{r['layers']}", r["seq"], r["mode"], _label(r)], r["profile_ms"],
                                 r.get("kernel_launches"), r["step_ms"]) for r in profiled])
    lines += _rounds_table(results)
    for r in (r for r in results if "memory_gib" in r):
        lines += ["", f"Peak memory by kind, GiB: {r['model']}/{r['layers']} {r['seq']} {r['mode']} {_label(r)}", "",
                  "| kind | GiB |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in r["memory_gib"].items()]
    for r in (r for r in results if "top_kernels_ms" in r):
        lines += top_kernels_table(f"{r['model']}/{r['layers']} {r['seq']} {r['mode']} {_label(r)}",
                                   r["top_kernels_ms"])
    return "\n".join(lines)


def _model_spec(spec: str) -> tuple[str, int | None]:
    name, _, layers = spec.partition(":")
    return name, int(layers) if layers else None


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="fp8train bench", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2.5-1.5b"], metavar="PRESET[:LAYERS]",
                   help="model presets, optionally with a layer count (qwen2.5-7b:16)")
    p.add_argument("--seq", type=int, nargs="+", default=[8192])
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default: the preset's)")
    p.add_argument("--docs", type=int, nargs="+", default=[1],
                   help="documents packed in each sequence (position_ids restart at each); several: each count")
    p.add_argument("--targets", type=float, nargs="+", default=[1.0], metavar="SHARE",
                   help="share of each document's tokens with a target (SFT: ~0.5; the rest labelled -100); "
                        "several: each share")
    p.add_argument("--packed-attention", nargs="+", default=["flex"], choices=("flex", "sdpa"),
                   help="the attention of packed rows (train.packed_attention); several: every variant with each")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="LoRA adapters of this rank on the frozen base (model.lora.rank; 0: full training)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), metavar="VARIANT",
                   help=f"{', '.join(VARIANTS)}; modifiers: "
                        f"{', '.join('+' + m for m in (*MODIFIERS, *_TRAINER_MODIFIERS))} (see above)")
    p.add_argument("--modes", nargs="+", default=["compiled"], choices=MODES,
                   help="compiled: torch.compile per layer; cudagraphs: also CUDA graphs (no per-kernel launch cost)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variant list this many times, interleaved; the table adds each ratio's median and "
                        "range over the rounds (profile, memory, top kernels: first round only)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing (every variant)")
    p.add_argument("--loss-impl", nargs="+", default=["chunked"], choices=("chunked", "liger", "hf"),
                   help="the LM head + loss (train.loss_impl); several: every variant with each, BF16 first")
    p.add_argument("--optim-impl", nargs="+", default=["auto"], choices=("auto", "triton", "fused", "foreach"),
                   help="the AdamW step (optim.impl); several: every variant with each, BF16 first")
    p.add_argument("--profile", action="store_true", help="kernel time by category of one more step")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N", help="also list the N slowest kernels")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the profiled step's Chrome trace (.json.gz, first round) of each variant to DIR")
    p.add_argument("--memory", action="store_true", help="peak memory by kind, one more step (GPU; not with cudagraphs)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the harness")
    p.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    return p


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        args = build_parser().parse_args(args)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {gpu}  torch {torch.__version__}", flush=True)
    results = []
    for spec in args.models:
        name, layers = _model_spec(spec)
        for seq in args.seq:
            for mode in args.modes:
                # rounds interleave the variants (A B C A B C): a drift of the machine or of the process
                # shows as spread across rounds instead of as a difference between variants
                for rnd, variant, loss, opt, docs, share, attn in (
                        (i, v, loss, o, d, t, a) for i in range(args.rounds) for d in args.docs for t in args.targets
                        for a in args.packed_attention for loss in args.loss_impl for o in args.optim_impl
                        for v in args.variants):
                    case = BenchCase(name, layers, seq, variant, mode, args.vocab, loss, opt, docs, attn,
                                     targets=share, lora=args.lora)
                    try:
                        r = run_case(case, steps=args.steps, warmup=args.warmup, device=args.device,
                                     profile=args.profile and rnd == 0, activation_checkpointing=args.ac,
                                     memory=args.memory and rnd == 0, top_kernels=args.top_kernels if rnd == 0 else 0,
                                     trace_dir=args.trace if rnd == 0 else None)
                        r["round"] = rnd
                    except Exception as e:  # a peer that fails to import or run (OOM) is reported, not fatal
                        print(f"{case}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        gc.collect()
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    results.append(r)
                    print(json.dumps(r), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
    print("\n" + markdown_table(results), flush=True)
    if args.memory and not all(_memory_split_applies(m) for m in args.modes):
        print("\n--memory: no breakdown for the cudagraphs rows (the graphs' pools lie outside what it observes); "
              "peaks only. --modes compiled gives the split.", flush=True)
    return 0 if results else 1
