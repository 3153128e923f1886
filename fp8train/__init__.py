"""fp8train: end-to-end FP8 training of Hugging Face causal LMs (InfiR2 hybrid-granularity recipe).

The numerics (recipes, quantization, FP8Linear, conversion) import eagerly and need only torch; the
training, data, export and evaluation layers load on first use, so `import fp8train` stays light.
"""

import importlib

from .fp8 import (ConversionReport, FP8InputLinear, FP8Linear, Fp8Format, Fp8Recipe, Fp8Tensor, RecipeName,
                  cache_fp8_weights, compile_options, convert_to_fp8, dequantize, freeze_fp8_weights, hold_fp8_weights,
                  make_recipe, parse_recipe, quantize, summarize_fp8_health, track_fp8_health)

_LAZY = {
    # training
    "TrainConfig": "train.config", "load_config": "train.config", "Trainer": "train.trainer", "train": "train.trainer",
    "ModelConfig": "train.model", "build_model": "train.model",
    "OptimConfig": "train.optim", "build_optimizer": "train.optim", "build_scheduler": "train.optim",
    "optimizer_step": "train.optim", "optimizer_step_on_device": "train.optim", "skips_on_device": "train.optim",
    "gradient_norm": "train.optim", "StepInFlight": "train.trainer", "linear_cross_entropy": "train.loss",
    "use_loss": "train.loss", "target_rows": "train.loss", "count_targets": "train.loss",
    "save_checkpoint": "train.checkpoint", "load_checkpoint": "train.checkpoint",
    "find_latest_checkpoint": "train.checkpoint", "export_hf": "export",
    "CorruptCheckpointError": "train.checkpoint",
    # data
    "load_tokenizer": "data", "CptDataConfig": "data", "SftDataConfig": "data",
    "build_cpt_datasets": "data", "build_sft_datasets": "data",
    # distributed
    "DistributedConfig": "train.distributed", "init_distributed": "train.distributed",
    "apply_fsdp": "train.distributed",
    # export / eval
    "export_checkpoint": "export", "EvalConfig": "eval", "run_eval": "eval",
}

__all__ = [
    "ConversionReport", "FP8InputLinear", "FP8Linear", "Fp8Format", "Fp8Recipe", "Fp8Tensor", "RecipeName",
    "cache_fp8_weights", "compile_options", "convert_to_fp8", "dequantize", "freeze_fp8_weights", "hold_fp8_weights",
    "make_recipe", "parse_recipe", "quantize", "summarize_fp8_health", "track_fp8_health",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8train' has no attribute {name!r}")
