"""FP8 training inside transformers' `Trainer` and TRL's `SFTTrainer`: convert the model, add one callback.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)    # FP32 master weights
    print(convert_for_training(model))                   # decoder projections -> FP8Linear (the hybrid recipe)
    trainer = SFTTrainer(model=model, args=SFTConfig(..., bf16=True), train_dataset=ds)
    trainer.add_callback(FP8TrainerCallback(trainer, health_every=50))
    trainer.train()

What the Trainer's options need with converted layers (each tested on a CPU in tests/test_integrations_hf.py):

- `bf16=True`: nothing. The Trainer runs the forward under autocast and an FP8Linear takes its output dtype
  from it. The parameters should stay FP32 master weights (`convert_for_training` warns about BF16 ones).
- gradient accumulation: the callback quantizes each weight once per optimizer step (`cache_fp8_weights`)
  and closes the cache before the optimizer steps. It must: the Trainer's default AdamW is fused, which
  updates weights without bumping their version counter, so an open cache would feed the next step the old
  weights. With one micro-batch per step nothing is cached (nothing to share; the copy would cost memory).
- gradient checkpointing (either `use_reentrant`): nothing; the recompute reuses the step's FP8 weights.
- `torch_compile=True`: the FP8 Linears trace into the Trainer's compiled graph; the callback adds
  `fp8train.compile_options()` to it (on CUDA, one quantization of the input q/k/v or gate/up share).
  Health steps run the FP8 Linears eagerly (the statistics are Python-side), so they compile a second graph.
- PEFT LoRA: convert first, then wrap (`get_peft_model`, or `SFTTrainer(peft_config=...)`): LoRA wraps
  each FP8Linear as its frozen base layer. A model already wrapped by PEFT is refused. While it trains, the
  callback keeps the frozen base's FP8 weights (`freeze_fp8_weights`: made once, not every step; with
  `offload_frozen=True` the base's own weights wait in host memory) and gives them back at the end, before
  anything can merge adapters into them: also when training stops with an exception (a Ctrl-C in a notebook),
  where the Trainer calls no `on_train_end` (the callback wraps `trainer.train`; `release()` does it by hand).
- packed rows (`position_ids` restarting at each document, as `fp8train.build_sft_datasets` makes them):
  transformers derives each document's attention mask from them only when the forward uses no KV cache; the
  Trainer turns the model's cache off itself (`TrainingArguments.use_cache`, False by default): keep it off.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from ..fp8.convert import ConversionReport, cache_fp8_weights, compile_options, convert_to_fp8, freeze_fp8_weights
from ..fp8.health import track_fp8_health
from ..fp8.linear import FP8Linear
from ..fp8.recipe import make_recipe
from ..train.lora import keep_adapter_inputs_fp8
from ..train.metrics import health_scalars

__all__ = ["convert_for_training", "FP8TrainerCallback"]

log = logging.getLogger(__name__)


def convert_for_training(model: nn.Module, recipe: str = "hybrid", *, pow2_scale: bool = True,
                         module_filter_fn=None) -> ConversionReport:
    """Swap the decoder projections of a transformers causal LM for FP8Linear, in place, before the Trainer
    (and PEFT) see it; returns `convert_to_fp8`'s report. Parameters keep their names and objects, so
    `save_pretrained` writes a plain checkpoint."""
    if hasattr(model, "peft_config"):
        raise ValueError("convert_for_training: the model is already wrapped by PEFT; convert it first, then wrap "
                         "it (get_peft_model or SFTTrainer(peft_config=...)), so that LoRA's base layers are FP8")
    report = convert_to_fp8(model, make_recipe(recipe, pow2_scale=pow2_scale), module_filter_fn)
    low = sorted({str(m.weight.dtype) for m in model.modules() if isinstance(m, FP8Linear)} - {"torch.float32"})
    if low:
        log.warning("fp8train: the converted layers' weights are %s, not float32: the optimizer then updates "
                    "low-precision weights (small updates round away); load the model with dtype=torch.float32 "
                    "and train with bf16=True", ", ".join(low))
    return report


class FP8TrainerCallback(TrainerCallback):
    """For a model converted with `convert_for_training`, inside a transformers `Trainer` (or a subclass: TRL's):

    - caches each FP8 weight for the micro-batches of one optimizer step (with gradient accumulation) and
      drops the cache before the optimizer updates the weights;
    - every `health_every` steps (0 = never) records the FP8 health of the step's first micro-batch and
      logs it through `Trainer.log`, so the console, TensorBoard, W&B, MLflow... get it (`health_scalars`);
    - with `torch_compile=True`, adds `fp8train.compile_options()` to the Trainer's compile;
    - while training, keeps frozen weights (a LoRA base) in FP8, made once (`freeze_fp8_weights`), with
      `offload_frozen` their high-precision values in host memory, with `keep_frozen_t` their FP8 transposes
      too (1 more byte a weight; no backward transposes them);
    - with `adapter_inputs_fp8`, has each LoRA adapter keep for backward its FP8 base's copy of their input
      instead of the BF16 input (`fp8train.train.lora.keep_adapter_inputs_fp8`: for good, at construction).

    All of it ends with training, normally or by an exception (it wraps `trainer.train`); `release()` ends it
    by hand (idempotent).
    """

    def __init__(self, trainer: Trainer, *, health_every: int = 0, offload_frozen: bool = False,
                 keep_frozen_t: bool = False, adapter_inputs_fp8: bool = False):
        if isinstance(health_every, bool) or not isinstance(health_every, int) or health_every < 0:
            raise ValueError(f"FP8TrainerCallback: health_every must be an integer >= 0, got {health_every!r}")
        if not any(isinstance(m, FP8Linear) for m in trainer.model.modules()):
            raise ValueError("FP8TrainerCallback: the trainer's model has no FP8 layers; call "
                             "fp8train.integrations.hf.convert_for_training(model) before building the trainer")
        self._trainer = trainer
        if adapter_inputs_fp8 and not keep_adapter_inputs_fp8(trainer.model):
            raise ValueError("FP8TrainerCallback: adapter_inputs_fp8 needs PEFT LoRA adapters without dropout on "
                             "FP8 layers (convert_for_training, then get_peft_model or SFTTrainer(peft_config=...))")
        self.health_every = health_every
        self.offload_frozen, self.keep_frozen_t = offload_frozen, keep_frozen_t
        self._frozen = contextlib.ExitStack()
        self._cache = contextlib.ExitStack()
        self._health = contextlib.ExitStack()
        self._stats: dict | None = None
        _add_compile_options(trainer)
        train = trainer.train

        @functools.wraps(train)
        def train_then_release(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            finally:  # an exception skips on_train_end: a stale FP8 base would outlive a merge of the adapters
                self.release()

        trainer.train = train_then_release

    def on_train_begin(self, args, state, control, **kwargs):
        self._frozen.enter_context(freeze_fp8_weights(self._trainer.model, offload=self.offload_frozen,
                                                      keep_t=self.keep_frozen_t))

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if args.gradient_accumulation_steps > 1:
            self._cache.enter_context(cache_fp8_weights(model))
        if self.health_every and (state.global_step + 1) % self.health_every == 0:
            self._stats = self._health.enter_context(track_fp8_health(model))

    def on_substep_end(self, args, state, control, **kwargs):
        self._health.close()  # the first micro-batch only, as fp8train's own trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._health.close()
        self._cache.close()  # before the optimizer changes the weights

    def on_step_end(self, args, state, control, **kwargs):
        if self._stats:
            # Trainer.log itself: a subclass's override (TRL's) would fold its pending metrics into this record.
            # Logging resets control.should_log, which the Trainer reads next for this step's loss record.
            should_log = control.should_log
            Trainer.log(self._trainer, health_scalars(self._stats))
            control.should_log = should_log
        self._stats = None

    def on_train_end(self, args, state, control, **kwargs):
        self.release()

    def release(self) -> None:
        """End health tracking, the step's weight cache and the frozen FP8 base (its weights back on their device)."""
        self._health.close()
        self._cache.close()
        self._frozen.close()


def _add_compile_options(trainer) -> None:
    """Hand `compile_options()` to accelerate's torch.compile of the model (transformers' `torch_compile=True`).
    torch.compile takes a `mode` or `options`, not both: a mode is folded into the options."""
    plugin = getattr(getattr(trainer.accelerator, "state", None), "dynamo_plugin", None)
    if plugin is None or str(plugin.backend.value).lower() != "inductor":
        return
    mode_options = torch._inductor.list_mode_options(plugin.mode, plugin.dynamic) if plugin.mode not in (
        None, "default") else {}
    plugin.options = {**mode_options, **(plugin.options or {}), **compile_options()}
    plugin.mode = None
