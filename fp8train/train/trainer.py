"""The training loop: CPT and SFT of an HF causal LM with FP8 decoder Linears.

One optimizer step = one global batch of `train.global_batch` sequences, split over ranks and then into
micro-batches of `train.micro_batch`. The loss is the mean over every target token of the global batch:
each micro-batch's forward gets `num_items_in_batch` = the label tokens of the whole global batch (after
the causal shift), so the gradients of the micro-batches simply add up. FP32 master weights, gradients
and AdamW states; the forward runs under BF16 autocast, the converted Linears in FP8.

Determinism: for a seed the run is a pure function of the config on the CPU, and resuming from a
checkpoint (model, optimizer, scheduler, sampler position, RNG) reproduces it bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import nn

from ..data import GlobalBatchSampler, build_cpt_datasets, build_sft_datasets, collate, host_to_device, rank_slice
from ..data.tokenizer import end_of_turn_ids
from ..fp8.convert import cache_fp8_weights, convert_to_fp8, freeze_fp8_weights, hold_fp8_weights
from ..fp8.health import track_fp8_health
from ..fp8.gemm import load_deep_gemm
from ..fp8.linear import FP8InputLinear
from ..export import export_hf
from ..threads import cpu_threads
from .adamw import read_later
from .attention import document_mask, use_packed_attention
from .checkpoint import find_latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig, config_to_dict
from .distributed import World
from .loss import IGNORE_INDEX, count_targets, target_rows, use_loss
from .metrics import MetricsLogger, Throughput, device_clock, flops_per_token, peak_memory_gib, peak_tflops
from .lora import apply_lora, is_lora
from .model import PRESETS, build_model, check_weights_match, load_model_tokenizer, parallelize_model
from .optim import (build_optimizer, build_scheduler, gradient_norm, optimizer_step, optimizer_step_on_device,
                    restore_step_impl, skips_on_device)
from .resume import plan_resume

__all__ = ["NonFiniteLossError", "StepInFlight", "TrainResult", "Trainer", "train"]


class NonFiniteLossError(RuntimeError):
    """Too many NaN/Inf steps in a row; the run stopped and its last good checkpoint is kept."""


@dataclass
class TrainResult:
    """What `Trainer.fit` returns."""

    run_dir: Path
    step: int
    """The last completed step."""
    losses: dict[int, float] = field(default_factory=dict)
    """Per-step training loss of the steps this process ran (NaN for skipped steps)."""
    val_loss: float | None = None
    """The last validation loss (None without a validation split)."""
    skipped_steps: int = 0
    """Non-finite steps skipped over the whole run, resumed parts included."""
    final_dir: Path | None = None
    """The exported Hugging Face directory (rank 0)."""
    is_main: bool = True
    """Whether this process is rank 0, the one that reports (every rank returns a result under torchrun)."""


@dataclass
class StepInFlight:
    """An optimizer step enqueued by `Trainer.enqueue_step`; `Trainer.finish_step` reads its loss and norm."""

    step: int
    """The step's number (1-based)."""
    lr: float
    """The learning rate it stepped with."""
    tokens: int
    """Tokens it trained on, over all ranks."""
    tokens_seen: int
    """Tokens of the run up to and including it."""
    seq_len: int
    """Tokens per row."""
    health: dict
    """FP8 health stats, where it tracked them."""
    values: Callable[[], torch.Tensor]
    """Waits for this step's [loss, grad norm] on the host and returns them."""
    ended: "float | torch.cuda.Event"
    """When its work is done, on the device's clock (`device_clock`): what its throughput is timed by."""


def _pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("config key 'device' is 'cuda' but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _build_datasets(cfg: TrainConfig, tokenizer):
    if cfg.stage == "cpt":
        train, val = build_cpt_datasets(cfg.data, tokenizer, cfg.seed)
        return train, val, None
    return build_sft_datasets(cfg.data, tokenizer, cfg.seed)


def _check_run_dir(run_dir: Path) -> None:
    """run_dir (or a folder above it) being a file would fail only at the first write: say so now."""
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if path.is_dir():
                return
            where = "is a file" if path == run_dir else f"cannot be created: {path} is a file"
            raise FileExistsError(f"config key 'run_dir': {run_dir} {where}; run_dir names the folder that receives "
                                  "config.yaml, metrics.jsonl, checkpoints/ and final/, so pick another path")


def _stop_at_end_of_turn(model: nn.Module, tokenizer) -> None:
    """An SFT model ends its answers with the chat template's end-of-turn token (`<|im_end|>`), often not the EOS
    of a base model's config: add it to the generation config its exports carry, so that `generate` and serving
    engines stop there."""
    gen = getattr(model, "generation_config", None)
    if gen is None or tokenizer is None:
        return
    ids = end_of_turn_ids(tokenizer, also=gen.eos_token_id)
    gen.eos_token_id = ids if len(ids) > 1 else next(iter(ids), None)


def _check_seq_len(cfg: TrainConfig, model: nn.Module) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and cfg.data is not None and cfg.data.seq_len > limit:
        raise ValueError(f"config key 'data.seq_len' ({cfg.data.seq_len}) is above the model's "
                         f"max_position_embeddings ({limit}); lower data.seq_len"
                         + (" or raise model.max_seq_len" if cfg.model.source in PRESETS else ""))


class Trainer:
    """Builds everything from a `TrainConfig`, restores a checkpoint if asked, and runs `fit()`.

    `model`, `tokenizer`, `train_data` and `val_data` may be passed in (tests, notebooks); otherwise
    they come from the config. `val_data=None` with `train_data` given means no validation.
    """

    def __init__(self, cfg: TrainConfig, *, model: nn.Module | None = None, tokenizer=None, train_data=None,
                 val_data=None, world: World | None = None, progress: bool = True):
        self.world = world or World()
        cfg.validate(self.world.world_size)
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.device = _pick_device(cfg.device)
        self.recipe = cfg.fp8_recipe()
        if self.recipe.deep_gemm and self.device.type == "cuda":
            load_deep_gemm()  # a missing DeepGEMM fails here, before anything is built or written
        self.dtype = torch.bfloat16
        _check_run_dir(self.run_dir)
        self._resume_plan = plan_resume(cfg)  # refuses, before anything is built or written, the wrong run
        torch.manual_seed(cfg.seed)

        self.tokenizer = tokenizer if tokenizer is not None or model is not None else load_model_tokenizer(cfg.model)
        # The model before the data: a bad source or shape fails before tokenizing, and nothing is written
        # before the config, the model and the data are known good.
        torch.manual_seed(cfg.seed)  # the model init does not depend on what ran before
        self.model = model if model is not None else build_model(cfg.model, self.tokenizer)
        _check_seq_len(cfg, self.model)
        data_stats = None
        if train_data is None:
            train_data, val_data, data_stats = _build_datasets(cfg, self.tokenizer)
        if len(train_data) < cfg.train.global_batch:
            raise ValueError(f"the training set has {len(train_data)} sequences, fewer than one global batch "
                             f"(config key 'train.global_batch' = {cfg.train.global_batch})")
        self.train_data, self.val_data = train_data, val_data
        self.total_steps = self._total_steps()

        if cfg.stage == "sft":
            _stop_at_end_of_turn(self.model, self.tokenizer)
        self.model.to(self.device)
        if cfg.train.packed_attention == "flex" and self.device.type == "cuda":  # flex has no CPU backward
            use_packed_attention(self.model)
        self.fp8_report = convert_to_fp8(self.model, self.recipe, bf16_layers=cfg.bf16_layers)
        self.model = apply_lora(self.model, cfg.model.lora, sharded=self.world.sharded)  # after FP8: base = FP8Linear
        parallelize_model(self.model, activation_checkpointing=cfg.train.activation_checkpointing,
                          compile=cfg.train.compile, cuda_graphs=cfg.train.cuda_graphs,
                          shard=self.world.shard if self.world.sharded else None)
        # The loss runs inside the model's forward call (FSDP2 gathers the head there), chunked by default.
        self._takes_loss_rows = use_loss(self.model, cfg.train.loss_impl, chunk_tokens=cfg.train.loss_chunk_tokens,
                                         compile=cfg.train.compile)
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.sampler = GlobalBatchSampler(len(train_data), cfg.train.global_batch, cfg.seed)
        self._batches = iter(self.sampler)

        self.step = 0
        self.skipped_steps = 0
        self._nonfinite_in_a_row = 0
        self.tokens_seen = 0
        self._resumed_from: Path | None = None
        self._resume()

        self.logger = MetricsLogger(self.run_dir, total_steps=self.total_steps, start_step=self.step,
                                    report_to=cfg.train.report_to, config=config_to_dict(cfg), progress=progress,
                                    enabled=self.world.is_main)
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            self._describe(data_stats)

    # ---------------------------------------------------------------------------------------- setup

    def _total_steps(self) -> int:
        t = self.cfg.train
        if t.steps is not None:
            return t.steps
        return max(1, int(t.epochs * len(self.train_data)) // t.global_batch)

    def _resume(self) -> None:
        ckpt = self._resume_plan.checkpoint
        if ckpt is None:
            return
        if ckpt.kind == "single" and not is_lora(self.model):  # another model's: one line with both shapes
            check_weights_match(self.model, ckpt.path / "model", f"checkpoint {ckpt.path}")
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        state = load_checkpoint(ckpt, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        restore_step_impl(self.optimizer, configured)  # optim.impl is the config's, not the saving run's
        if self._resume_plan.forced:  # force or a branch: the config's optimizer and schedule apply from here on
            sched = self.scheduler
            for group, new in zip(self.optimizer.param_groups, configured):
                group.update(new)
            sched.base_lrs = [g["initial_lr"] for g in self.optimizer.param_groups]
            for group, base, lam in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base * lam(sched.last_epoch)
        self.sampler.load_state_dict(state["sampler"])
        self._batches = iter(self.sampler)
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self._nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.tokens_seen = state["tokens_seen"]
        self._resumed_from = ckpt.path

    def _describe(self, data_stats) -> None:
        n_params = sum(p.numel() for p in self.model.parameters())
        t = self.cfg.train
        accum = t.global_batch // (t.micro_batch * self.world.world_size)
        lines = [f"fp8train: {self.cfg.stage} of {self.cfg.model.source} ({n_params / 1e6:.1f}M params) on "
                 f"{self.device}, {self.total_steps} steps of {t.global_batch} sequences "
                 f"(micro-batch {t.micro_batch} x {accum} accumulation x {self.world.world_size} ranks); "
                 f"{len(self.train_data)} training sequences",
                 str(self.fp8_report)]
        if self.cfg.model.lora.enabled:
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            kept = sum(isinstance(m, FP8InputLinear) for m in self.model.modules())
            lines.append(f"LoRA rank {self.cfg.model.lora.rank} on {', '.join(self.cfg.model.lora.target_modules)}: "
                         f"{trainable / 1e6:.2f}M trainable parameters, the base frozen"
                         + (f"; {kept} adapters keep their input in FP8 (model.lora.inputs_fp8)" if kept else ""))
        if data_stats is not None:
            lines.append(f"data: {data_stats}")
        if self._resumed_from is not None:
            lines.append(f"resumed from {self._resumed_from} at step {self.step}")
        lines += self._resume_plan.notes
        for line in lines:
            self.logger.write(line)

    # ------------------------------------------------------------------------------------------ steps

    def _to_device(self, batch: dict) -> dict:
        """The batch on the device (copied from pinned memory: a copy from pageable memory may wait for the
        device), with what the host knows and the GPU would otherwise be asked for in every forward: the
        attention mask of packed rows, from their `position_ids` (`document_mask`), and the rows with a target
        (`loss_rows`: SFT's prompts and padding skip the LM head)."""
        extra = {}
        if "position_ids" in batch and "attention_mask" not in batch:
            extra["attention_mask"] = document_mask(self.model.config, batch["position_ids"], self.device)
        rows = target_rows(batch["labels"]) if "labels" in batch and self._takes_loss_rows else None
        if rows is not None:
            extra["loss_rows"] = host_to_device(rows, self.device)
        return {k: host_to_device(v, self.device) for k, v in batch.items()} | extra

    def next_micro_batches(self) -> list[dict]:
        """The next global batch of the sampler: this rank's micro-batches, as `train_step` takes them."""
        return self._micro_batches(next(self._batches))

    def _micro_batches(self, indices: list[int]) -> list[dict]:
        local = rank_slice(indices, self.world.rank, self.world.world_size)
        mb = self.cfg.train.micro_batch
        return [collate([self.train_data[i] for i in local[j:j + mb]]) for j in range(0, len(local), mb)]

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, batches: list[dict], track_health: bool = False) -> tuple[float, float, dict]:
        """One optimizer step over `batches`, waited for: `finish_step(enqueue_step(...))`.

        Returns (loss, grad_norm, fp8 health stats). The loss is the global per-token mean.
        """
        return self.finish_step(self.enqueue_step(batches, track_health))

    def enqueue_step(self, batches: list[dict], track_health: bool = False) -> StepInFlight:
        """Forward/backward every micro-batch, clip and step, without waiting for the device.

        The loss and the gradient norm start on their way to the host, and the optimizer skips the update
        on the device where either is not finite (`skips_on_device`: TritonAdamW, the CUDA default, and torch's
        fused AdamW); so the host goes on to the next step while this one runs. Other optimizers (foreach, the
        CPU default) wait for the two values here and skip on the host. `finish_step` reads them.
        """
        world = self.world
        self._mark_step()
        # (a blocking copy to the device would wait for everything already queued on it)
        n_targets = world.all_reduce_sum(host_to_device(sum(count_targets(b["labels"]) for b in batches), self.device))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        health: dict = {}
        # One weight quantization per step across micro-batches, closed before the update. With one
        # micro-batch there is nothing to share: without the cache the forward's FP8 copy of W dies with
        # the forward and only W.T (saved for grad_input) lives on, 1 byte per parameter less.
        caching = cache_fp8_weights(self.model) if len(batches) > 1 else contextlib.nullcontext()
        with caching:
            for i, batch in enumerate(batches):
                batch = self._to_device(batch)
                tracker = track_fp8_health(self.model) if track_health and i == 0 else contextlib.nullcontext({})
                with tracker as stats:
                    with self._autocast():
                        out = self.model(**batch, num_items_in_batch=n_targets)
                    # Each rank's loss is (its target-token loss sum) / (global target count); FSDP averages
                    # gradients over ranks, so scale by world size to get the global per-token mean.
                    (out.loss * world.world_size).backward()
                health.update(stats)
                loss_sum += out.loss.detach().float()
        params = list(self.model.parameters())
        norm = gradient_norm(self.optimizer, params)
        loss_sum = world.all_reduce_sum(loss_sum)
        values = read_later(torch.stack([loss_sum, norm.float().to(loss_sum.device)]))
        # Clip and step (the clip folded into a fused AdamW's step); no update for a non-finite loss or norm.
        clip = self.cfg.optim.grad_clip
        if skips_on_device(self.optimizer):
            finite = torch.isfinite(loss_sum) & torch.isfinite(norm)
            optimizer_step_on_device(self.optimizer, params, clip, norm, found_inf=~finite)
        else:
            loss = float(values()[0])
            optimizer_step(self.optimizer, params, clip, skip=not math.isfinite(loss), norm=norm)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # a skipped step keeps its place in the schedule
        self.step += 1
        tokens = sum(b["input_ids"].numel() for b in batches) * world.world_size
        self.tokens_seen += tokens
        return StepInFlight(self.step, lr, tokens, self.tokens_seen, batches[0]["input_ids"].shape[1], health,
                            values, device_clock(self.device))

    def finish_step(self, step: StepInFlight) -> tuple[float, float, dict]:
        """(loss, grad_norm, fp8 health stats) of an enqueued step, waiting for that step only; a non-finite
        one (its update skipped) is counted. Each step is finished once, in order."""
        loss, grad_norm = step.values().tolist()
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self._nonfinite_in_a_row += 1
        return loss, grad_norm, step.health

    def _mark_step(self) -> None:
        """Tell CUDA graphs a new step begins: its replays may reuse the memory of the last step's outputs."""
        if self.cfg.train.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the validation split, or its first `train.eval_batches` micro-batches' rows:
        the same rows whatever the number of ranks. The rows are dealt out to the ranks in turn; a rank left
        short runs rows without a target in their place (each forward of a sharded model all-gathers, so every
        rank runs as many), which add nothing to the loss."""
        if self.val_data is None or len(self.val_data) == 0:
            return None
        self.model.eval()
        mb, cap, ws = self.cfg.train.micro_batch, self.cfg.train.eval_batches, self.world.world_size
        rows = len(self.val_data) if cap is None else min(len(self.val_data), cap * mb)
        local = list(range(self.world.rank, rows, ws))
        local += [None] * (-(-rows // ws) - len(local))
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        for j in range(0, len(local), mb):
            batch = self._to_device(collate([self._val_row(i) for i in local[j:j + mb]]))
            n = count_targets(batch["labels"])
            self._mark_step()
            with self._autocast():
                out = self.model(**batch, num_items_in_batch=n)
            total += torch.where(n > 0, out.loss.double() * n, 0.0)  # (no target: the loss is 0 / 0)
            count += n
        self.model.train()
        total, count = self.world.all_reduce_sum(total), self.world.all_reduce_sum(count)
        return float(total / count) if count > 0 else None

    def _val_row(self, i: int | None) -> dict:
        """Validation row i, or (None) the first row with no target: a stand-in that adds nothing to the loss."""
        if i is not None:
            return self.val_data[i]
        row = self.val_data[0]
        return {**row, "labels": torch.full_like(row["labels"], IGNORE_INDEX)}

    def save(self) -> Path:
        """Checkpoint the current step (every rank calls it; a sharded model writes its shards)."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "skipped_steps": self.skipped_steps,
                 "nonfinite_in_a_row": self._nonfinite_in_a_row, "tokens_seen": self.tokens_seen}
        return save_checkpoint(self.ckpt_root, self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, train_state=state, tokenizer=self.tokenizer,
                               config=config_to_dict(self.cfg), keep_last=self.cfg.train.keep_last)

    # ------------------------------------------------------------------------------------------- loop

    def fit(self) -> TrainResult:
        """Train to `total_steps`, evaluating, logging and checkpointing on the way; export final/."""
        result = TrainResult(self.run_dir, self.step, is_main=self.world.is_main)
        try:
            with self.fp8_weights():
                self._train_loop(result)
            if not result.losses:  # resumed a finished run: nothing to train, still report and export
                result.val_loss = self.evaluate()
            result.step, result.skipped_steps = self.step, self.skipped_steps
            result.final_dir = self._export_final()
            if self.world.is_main:
                self.logger.write(f"done: step {self.step}, final model in {result.final_dir}")
        finally:
            self.logger.close()
        return result

    @contextlib.contextmanager
    def fp8_weights(self) -> Iterator[None]:
        """The context steps run in: with LoRA, the frozen base's FP8 weights made once, not every step (and
        its high-precision weights in host memory while `offload_base`, its W.T too with `keep_weight_t`); with
        `hold_fp8_weights`, each trained weight's FP8 copy, written by the optimizer's step (or a line in the log
        saying why not)."""
        with contextlib.ExitStack() as stack:
            lora = self.cfg.model.lora
            if lora.enabled:
                offload = lora.offload_base and self.device.type == "cuda"
                stack.enter_context(freeze_fp8_weights(self.model, offload=offload, keep_t=lora.keep_weight_t))
            if self.cfg.hold_fp8_weights:
                try:
                    held = stack.enter_context(hold_fp8_weights(self.model, self.optimizer))
                except TypeError as e:  # the optimizer cannot write FP8 weights (nothing was held)
                    held, why = 0, f"optim.impl {self.cfg.optim.impl} on {self.device.type}: {e}"
                else:
                    why = "no FP8 Linear trains a whole weight in 128x128 blocks" + (
                        ": FSDP's ranks step shards of each weight" if self.world.sharded else "")
                self.logger.write(f"hold_fp8_weights: {held} layers hold their FP8 weights, written by the optimizer"
                                  if held else f"hold_fp8_weights: off ({why})")
            yield

    def _train_loop(self, result: TrainResult) -> None:
        """Steps overlap: step N is read and logged after step N + 1 is enqueued, so the device never waits
        for the host between them. A step that evaluates, saves, tracks FP8 health or ends the run is
        finished before the next begins, so that it sees the model of exactly its step."""
        t = self.cfg.train
        fp8 = self.recipe.enabled
        throughput = Throughput(self.device, peak_tflops(self.device, fp8), self.world.world_size)
        in_flight = None
        while self.step < self.total_steps:
            step = self.step + 1
            track = fp8 and t.health_every > 0 and step % t.health_every == 0
            current = self.enqueue_step(self.next_micro_batches(), track_health=track)
            if in_flight is not None:
                self._finish(in_flight, throughput, result)
            in_flight = current
            if track or step == self.total_steps or (t.eval_every and step % t.eval_every == 0) \
                    or (t.save_every and step % t.save_every == 0):
                self._finish(in_flight, throughput, result)
                in_flight = None

    def _finish(self, step: StepInFlight, throughput: Throughput, result: TrainResult) -> None:
        loss, grad_norm, health = self.finish_step(step)
        result.losses[step.step] = loss
        throughput.add(step.tokens, step.ended)
        if throughput.flops_per_token is None:
            throughput.flops_per_token = flops_per_token(self.model.config, step.seq_len,
                                                         weight_grads=not self.cfg.model.lora.enabled)
        if health:
            self.logger.log_health(step.step, health)
        if self._nonfinite_in_a_row:
            self._report_nonfinite(step.step, loss, grad_norm)
        self._after_step(step, loss, grad_norm, throughput, result)

    def _export_final(self) -> Path | None:
        """The Hugging Face export of the final model (rank 0 gathers a sharded model first)."""
        return export_hf(self.model, self.run_dir / "final", self.tokenizer, overwrite=True)

    def _report_nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        limit = self.cfg.train.max_nonfinite_steps
        self.logger.write(f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; step skipped "
                          f"({self._nonfinite_in_a_row} in a row, {self.skipped_steps} in all)")
        if self._nonfinite_in_a_row >= limit:
            last = find_latest_checkpoint(self.ckpt_root)
            raise NonFiniteLossError(
                f"{self._nonfinite_in_a_row} non-finite steps in a row at step {step} (config key "
                f"'train.max_nonfinite_steps' = {limit}); stopping. Last good checkpoint: {last or 'none saved yet'}")

    def _after_step(self, done: StepInFlight, loss: float, grad_norm: float, throughput: Throughput,
                    result: TrainResult) -> None:
        t = self.cfg.train
        step, lr = done.step, done.lr
        last = step == self.total_steps
        record = None
        if step % t.log_every == 0 or last:
            rate = throughput.report()
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, **rate,
                      "peak_mem_gib": peak_memory_gib(self.device), "tokens": done.tokens_seen,
                      "skipped_steps": self.skipped_steps}
            self.logger.progress(step, loss, lr, rate["tokens_per_s"])
        else:
            self.logger.progress(step, loss, lr, None)
        overhead = False
        if (t.eval_every and step % t.eval_every == 0) or last:
            result.val_loss = self.evaluate()
            overhead = True
            if result.val_loss is not None:
                record = record or {"step": step}
                record["val_loss"] = result.val_loss
                self.logger.write(f"step {step}: loss {loss:.4f}, val_loss {result.val_loss:.4f}")
        if record is not None:
            self.logger.log(record)
        if (t.save_every and step % t.save_every == 0) or last:
            self.save()
            overhead = True
        if overhead:
            throughput.reset()  # evaluation and checkpointing are not training time


def train(cfg: TrainConfig, **kwargs) -> TrainResult:
    """Build a `Trainer` from `cfg` and run it to the end; under torchrun, on every rank with FSDP2.
    On a CPU, torch uses `cfg.cpu_threads` threads meanwhile."""
    with cpu_threads(cfg.cpu_threads if _pick_device(cfg.device).type == "cpu" else None):
        return _train(cfg, **kwargs)


def _train(cfg: TrainConfig, **kwargs) -> TrainResult:
    from . import distributed as dist

    world = dist.init_distributed(cfg.distributed)
    if world.world_size == 1 and cfg.distributed.fsdp == "auto":
        return Trainer(cfg, **kwargs).fit()
    if not torch.distributed.is_initialized():
        raise ValueError("config key 'distributed.fsdp' is 'always' but there is no process group: launch with "
                         "torchrun (torchrun --nproc-per-node 1 -m fp8train.cli train ...)")
    try:
        return Trainer(cfg, world=dataclasses.replace(world, fsdp=cfg.distributed), **kwargs).fit()
    finally:
        dist.destroy()
