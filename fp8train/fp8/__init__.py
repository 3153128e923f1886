"""The FP8 core: recipes, quantization, the FP8 Linear and model conversion (needs only torch).

    recipe.py   which format and scale granularity every GEMM operand gets (`make_recipe`)
    quant.py    the reference block quantization (`quantize`, `dequantize`, `compute_scale`)
    kernels.py  the Triton quantization kernels of the CUDA path (bit-identical to quant.py)
    operands.py a GEMM operand's spec (format, block, padding), a Linear's plan, the operand layout
    gemm.py     the one GEMM and its route table (cuBLAS scaled_mm, DeepGEMM, or emulated)
    ops.py      the three GEMMs of one Linear (`reference_fp8_linear`: what they compute), their
                quantization, the custom ops torch.compile sees
    linear.py   FP8Linear: a layer's state (plans, input and weight caches, frozen and held weights, health);
                FP8InputLinear: a LoRA adapter keeping its frozen FP8 base's copy of their input
    swiglu.py   FP8SwiGLUMLP: the MLP as one piece, its activation quantized inside its producers
    convert.py  convert_to_fp8, cache_fp8_weights, freeze_fp8_weights, hold_fp8_weights
    health.py   FP8 health statistics (underflow, saturation, scale range) observed during a step
    fsdp.py     FSDP2 all-gather of the FP8 weight blocks
    compile.py  compile_options: inductor's pass that shares one input quantization among siblings
"""

from .convert import (ConversionReport, cache_fp8_weights, compile_options, convert_to_fp8, freeze_fp8_weights,
                      hold_fp8_weights)
from .health import summarize_fp8_health, track_fp8_health
from .linear import FP8InputLinear, FP8Linear
from .quant import Fp8Tensor, dequantize, quantize
from .recipe import Fp8Format, Fp8Recipe, RecipeName, make_recipe, parse_recipe

__all__ = ["ConversionReport", "FP8InputLinear", "FP8Linear", "Fp8Format", "Fp8Recipe", "Fp8Tensor", "RecipeName",
           "cache_fp8_weights", "compile_options", "convert_to_fp8", "dequantize", "freeze_fp8_weights",
           "hold_fp8_weights", "make_recipe", "parse_recipe", "quantize", "summarize_fp8_health", "track_fp8_health"]
