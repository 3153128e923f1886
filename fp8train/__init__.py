"""fp8train: end-to-end FP8 training of Hugging Face causal LMs (InfiR2 hybrid-granularity recipe).

The numerics (recipes, quantization, FP8Linear, conversion) import eagerly and need only torch; the
training, data, export and evaluation layers load on first use, so `import fp8train` stays light.
"""

import importlib

from .convert import ConversionReport, cache_fp8_weights, compile_options, convert_to_fp8, summarize_fp8_health, track_fp8_health
from .linear import FP8Linear
from .quant import Fp8Tensor, dequantize, quantize
from .recipe import Fp8Format, Fp8Recipe, RecipeName, make_recipe

_LAZY = {
    # training
    "TrainConfig": "config", "load_config": "config", "Trainer": "trainer", "train": "trainer",
    "ModelConfig": "model", "build_model": "model",
    "OptimConfig": "optim", "build_optimizer": "optim", "build_scheduler": "optim",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "find_latest_checkpoint": "checkpoint",
    "export_hf": "checkpoint", "CorruptCheckpointError": "checkpoint",
    # data
    "load_tokenizer": "data", "CptDataConfig": "data", "SftDataConfig": "data",
    "build_cpt_datasets": "data", "build_sft_datasets": "data",
    # distributed
    "DistributedConfig": "distributed", "init_distributed": "distributed", "apply_fsdp": "distributed",
    # export / eval
    "export_checkpoint": "export", "EvalConfig": "eval", "run_eval": "eval",
}

__all__ = [
    "ConversionReport", "FP8Linear", "Fp8Format", "Fp8Recipe", "Fp8Tensor", "RecipeName",
    "cache_fp8_weights", "compile_options", "convert_to_fp8", "dequantize", "make_recipe", "quantize", "summarize_fp8_health", "track_fp8_health",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8train' has no attribute {name!r}")
