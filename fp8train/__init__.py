"""fp8train: end-to-end FP8 training of Hugging Face causal LMs (InfiR2 hybrid-granularity recipe)."""

from .convert import ConversionReport, convert_to_fp8, summarize_fp8_health, track_fp8_health
from .linear import FP8Linear
from .quant import Fp8Tensor, dequantize, quantize
from .recipe import Fp8Format, Fp8Recipe, RecipeName, make_recipe

__all__ = [
    "ConversionReport",
    "FP8Linear",
    "Fp8Format",
    "Fp8Recipe",
    "Fp8Tensor",
    "RecipeName",
    "convert_to_fp8",
    "dequantize",
    "make_recipe",
    "quantize",
    "summarize_fp8_health",
    "track_fp8_health",
]
