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
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import nn

from ..data import GlobalBatchSampler, build_cpt_datasets, build_sft_datasets, collate, rank_slice
from ..fp8.convert import cache_fp8_weights, convert_to_fp8
from ..fp8.health import track_fp8_health
from ..fp8.recipe import make_recipe
from .checkpoint import export_hf, find_latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig, config_to_dict
from .metrics import MetricsLogger, Throughput, flops_per_token, peak_memory_gib, peak_tflops
from .lora import apply_lora
from .model import build_model, load_model_tokenizer, parallelize_model
from .optim import build_optimizer, build_scheduler, clip_grad_norm

log = logging.getLogger(__name__)

__all__ = ["NonFiniteLossError", "World", "TrainResult", "Trainer", "train"]


class NonFiniteLossError(RuntimeError):
    """Too many NaN/Inf steps in a row; the run stopped and its last good checkpoint is kept."""


@dataclass
class World:
    """What the loop needs to know about the process group. The default is a single process.

    The distributed launcher (torchrun + FSDP2) fills in rank and world size, a `shard` hook that
    `parallelize_model` calls last, and an `all_reduce_sum` for the loss token counts and loss sums.
    """

    rank: int = 0
    world_size: int = 1
    shard: Callable[[nn.Module], None] | None = None
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """FSDP2 shards the model (any world size, 1 included): sharded checkpoints, gathered export."""
        return self.shard is not None


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


def _pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("config key 'device' is 'cuda' but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _build_datasets(cfg: TrainConfig, tokenizer):
    if cfg.stage == "cpt":
        train, val = build_cpt_datasets(cfg.data, tokenizer, cfg.seed)
        return train, val, None
    return build_sft_datasets(cfg.data, tokenizer, cfg.seed)


def _count_targets(batch: dict) -> torch.Tensor:
    # HF shifts labels left by one inside the loss: the first position never counts as a target.
    return (batch["labels"][:, 1:] != -100).sum()


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
        self.dtype = torch.bfloat16
        torch.manual_seed(cfg.seed)

        self.tokenizer = tokenizer if tokenizer is not None or model is not None else load_model_tokenizer(cfg.model)
        data_stats = None
        if train_data is None:
            train_data, val_data, data_stats = _build_datasets(cfg, self.tokenizer)
        if len(train_data) < cfg.train.global_batch:
            raise ValueError(f"the training set has {len(train_data)} sequences, fewer than one global batch "
                             f"(config key 'train.global_batch' = {cfg.train.global_batch})")
        self.train_data, self.val_data = train_data, val_data
        self.total_steps = self._total_steps()

        torch.manual_seed(cfg.seed)  # the model init does not depend on how much data loading drew
        self.model = model if model is not None else build_model(cfg.model, self.tokenizer)
        self.model.to(self.device)
        self.fp8_report = convert_to_fp8(self.model, make_recipe(cfg.recipe, pow2_scale=cfg.pow2_scale))
        self.model = apply_lora(self.model, cfg.model.lora, sharded=self.world.sharded)  # after FP8: base = FP8Linear
        parallelize_model(self.model, activation_checkpointing=cfg.train.activation_checkpointing,
                          compile=cfg.train.compile, cuda_graphs=cfg.train.cuda_graphs, shard=self.world.shard)
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
        mode = self.cfg.resume
        if mode.lower() == "none":
            if find_latest_checkpoint(self.ckpt_root) is not None:
                raise FileExistsError(f"{self.ckpt_root} already holds checkpoints and config key 'resume' is "
                                      "'none'; use resume=auto to continue, or a new run_dir")
            return
        path = find_latest_checkpoint(self.ckpt_root) if mode.lower() == "auto" else Path(mode)
        if path is None:
            return
        from .distributed import is_sharded_checkpoint, load_sharded, load_single_process_checkpoint

        written_sharded = is_sharded_checkpoint(path)
        if written_sharded or self.world.sharded:  # any checkpoint resumes at any world size
            load = load_sharded if written_sharded else load_single_process_checkpoint
            state = load(path, self.model, self.optimizer)
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            state = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.sampler.load_state_dict(state["sampler"])
        self._batches = iter(self.sampler)
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self._nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.tokens_seen = state["tokens_seen"]
        self._resumed_from = path

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
            lines.append(f"LoRA rank {self.cfg.model.lora.rank} on {', '.join(self.cfg.model.lora.target_modules)}: "
                         f"{trainable / 1e6:.2f}M trainable parameters, the base frozen")
        if data_stats is not None:
            lines.append(f"data: {data_stats}")
        if self._resumed_from is not None:
            lines.append(f"resumed from {self._resumed_from} at step {self.step}")
        for line in lines:
            self.logger.write(line)

    # ------------------------------------------------------------------------------------------ steps

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _micro_batches(self, indices: list[int]) -> list[dict]:
        local = rank_slice(indices, self.world.rank, self.world.world_size)
        mb = self.cfg.train.micro_batch
        return [collate([self.train_data[i] for i in local[j:j + mb]]) for j in range(0, len(local), mb)]

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)

    def train_step(self, batches: list[dict], track_health: bool = False) -> tuple[float, float, dict]:
        """Forward/backward every micro-batch, clip, and step unless the loss or grad norm is not finite.

        Returns (loss, grad_norm, fp8 health stats). The loss is the global per-token mean.
        """
        world = self.world
        self._mark_step()
        n_targets = world.all_reduce_sum(sum(_count_targets(b) for b in batches).to(self.device))
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
        loss = float(world.all_reduce_sum(loss_sum))
        grad_norm = clip_grad_norm(self.model, self.cfg.optim.grad_clip)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self._nonfinite_in_a_row = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self._nonfinite_in_a_row += 1
        self.scheduler.step()  # a skipped step keeps its place in the schedule
        return loss, grad_norm, health

    def _mark_step(self) -> None:
        """Tell CUDA graphs a new step begins: its replays may reuse the memory of the last step's outputs."""
        if self.cfg.train.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean per-token loss over the validation split (at most `train.eval_batches` micro-batches)."""
        if self.val_data is None or len(self.val_data) == 0:
            return None
        self.model.eval()
        mb, cap, ws = self.cfg.train.micro_batch, self.cfg.train.eval_batches, self.world.world_size
        # Several ranks drop the remainder, so that each runs the same number of forward passes
        # (sharded models all-gather in every one); a single process evaluates every row.
        usable = len(self.val_data) if ws == 1 else len(self.val_data) - len(self.val_data) % (mb * ws)
        local = list(range(self.world.rank, usable, ws))
        chunks = [local[j:j + mb] for j in range(0, len(local), mb)][:cap]
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = torch.zeros((), device=self.device, dtype=torch.float64)
        for idx in chunks:
            batch = self._to_device(collate([self.val_data[i] for i in idx]))
            n = _count_targets(batch)
            self._mark_step()
            with self._autocast():
                out = self.model(**batch, num_items_in_batch=n)
            total += out.loss.double() * n
            count += n
        self.model.train()
        total, count = self.world.all_reduce_sum(total), self.world.all_reduce_sum(count)
        return float(total / count) if count > 0 else None

    def save(self) -> Path | None:
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "skipped_steps": self.skipped_steps,
                 "nonfinite_in_a_row": self._nonfinite_in_a_row, "tokens_seen": self.tokens_seen}
        if self.world.sharded:  # every rank writes its shards (DCP), resumable at any world size
            from .distributed import save_sharded

            return save_sharded(self.ckpt_root / f"step_{self.step:08d}", self.model, self.optimizer,
                                {**state, "scheduler": self.scheduler.state_dict()})
        return save_checkpoint(self.ckpt_root, self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, train_state=state, tokenizer=self.tokenizer,
                               keep_last=self.cfg.train.keep_last)

    # ------------------------------------------------------------------------------------------- loop

    def fit(self) -> TrainResult:
        """Train to `total_steps`, evaluating, logging and checkpointing on the way; export final/."""
        t = self.cfg.train
        result = TrainResult(self.run_dir, self.step)
        fp8 = make_recipe(self.cfg.recipe).enabled
        throughput = Throughput(self.device, peak_tflops(self.device, fp8), self.world.world_size)
        try:
            while self.step < self.total_steps:
                batches = self._micro_batches(next(self._batches))
                step = self.step + 1
                track = fp8 and t.health_every > 0 and step % t.health_every == 0
                loss, grad_norm, health = self.train_step(batches, track_health=track)
                self.step = step
                result.losses[step] = loss
                tokens = sum(b["input_ids"].numel() for b in batches) * self.world.world_size
                self.tokens_seen += tokens
                throughput.add(tokens)
                if throughput.flops_per_token is None:
                    throughput.flops_per_token = flops_per_token(self.model.config, batches[0]["input_ids"].shape[1])
                if health:
                    self.logger.log_health(step, health)
                if self._nonfinite_in_a_row:
                    self._report_nonfinite(step, loss, grad_norm)
                self._after_step(step, loss, grad_norm, throughput, result)
            if not result.losses:  # resumed a finished run: nothing to train, still report and export
                result.val_loss = self.evaluate()
            result.step, result.skipped_steps = self.step, self.skipped_steps
            result.final_dir = self._export_final()
            if self.world.is_main:
                self.logger.write(f"done: step {self.step}, final model in {result.final_dir}")
        finally:
            self.logger.close()
        return result

    def _export_final(self) -> Path | None:
        """The Hugging Face export of the final model (rank 0 gathers a sharded model first)."""
        out = self.run_dir / "final"
        if not self.world.sharded:
            return export_hf(self.model, out, self.tokenizer, overwrite=True)
        from .distributed import barrier, gather_full_state_dict

        full = gather_full_state_dict(self.model)  # collective: every rank takes part
        path = None
        if self.world.is_main:
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(self.model.config, dtype=torch.float32)
            plain.load_state_dict(full, assign=True)
            plain.tie_weights()
            path = export_hf(plain, out, self.tokenizer, overwrite=True)
        barrier()
        return path

    def _report_nonfinite(self, step: int, loss: float, grad_norm: float) -> None:
        limit = self.cfg.train.max_nonfinite_steps
        self.logger.write(f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; step skipped "
                          f"({self._nonfinite_in_a_row} in a row, {self.skipped_steps} in all)")
        if self._nonfinite_in_a_row >= limit:
            last = find_latest_checkpoint(self.ckpt_root)
            raise NonFiniteLossError(
                f"{self._nonfinite_in_a_row} non-finite steps in a row at step {step} (config key "
                f"'train.max_nonfinite_steps' = {limit}); stopping. Last good checkpoint: {last or 'none saved yet'}")

    def _after_step(self, step: int, loss: float, grad_norm: float, throughput: Throughput,
                    result: TrainResult) -> None:
        t = self.cfg.train
        last = step == self.total_steps
        lr = self.scheduler.get_last_lr()[0]
        record = None
        if step % t.log_every == 0 or last:
            rate = throughput.report()
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, **rate,
                      "peak_mem_gib": peak_memory_gib(self.device), "tokens": self.tokens_seen,
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
    """Build a `Trainer` from `cfg` and run it to the end; under torchrun, on every rank with FSDP2."""
    from . import distributed as dist

    info = dist.init_distributed(cfg.distributed)
    if info.world_size == 1 and cfg.distributed.fsdp == "auto":
        return Trainer(cfg, **kwargs).fit()
    if not torch.distributed.is_initialized():
        raise ValueError("config key 'distributed.fsdp' is 'always' but there is no process group: launch with "
                         "torchrun (torchrun --nproc-per-node 1 -m fp8train.cli train ...)")

    def shard(model: nn.Module) -> None:
        report = dist.apply_fsdp(model, cfg.distributed, info)
        if info.is_main:
            log.info("FSDP2: %d sharded modules, FP8 all-gather for %d weights, BF16 gather for %d",
                     len(report.sharded), len(report.fp8_gather), len(report.bf16_gather))

    world = World(rank=info.rank, world_size=info.world_size, shard=shard, all_reduce_sum=dist.all_reduce_sum)
    try:
        return Trainer(cfg, world=world, **kwargs).fit()
    finally:
        dist.destroy()
