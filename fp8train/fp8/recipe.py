"""FP8 recipes: which format and which scaling granularity each GEMM operand gets.

A converted Linear runs three GEMMs, each `a @ b.T` with both operands stored row-major with the
contraction dimension last (the "operand layout"):

    output      = input       [tokens, in ] @ weight      [out, in   ].T
    grad_input  = grad_output [tokens, out] @ weight.T    [in,  out  ].T
    grad_weight = grad_output.T [out, tokens] @ input.T   [in,  tokens].T

A `Block` is the (rows, cols) tile of the operand that shares one scale: (1, 128) is one scale per row
per 128 contraction elements, (128, 128) a square block, (1, -1) a whole row (row-wise), and `None`
one scale for the whole tensor. Because every block is given in operand layout, the token-dim tiles of
the recipe's Wgrad are simply (1, 128) blocks of the transposed operands.

One frozen `Fp8Recipe` is made from a name; nothing else in the package decides numerics. Custom recipes
(ablations) are `dataclasses.replace`s of a named one: an operand may get another format or block, or
`fmt=None` to stay in high precision (BF16 under autocast), and `emulate=True` runs every GEMM as
dequantize + FP32 matmul even where cuBLAS could, so that variants differ only in their numerics.

`TILE`, `BLOCK` and `ROW` name the three blocks the named recipes use; nothing else in fp8train spells them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

__all__ = ["Fp8Format", "RecipeName", "OperandConfig", "GemmConfig", "Fp8Recipe", "make_recipe", "parse_recipe", "MODIFIERS",
           "TILE", "BLOCK", "ROW"]

Block = tuple[int, int] | None


class Fp8Format(enum.Enum):
    """The two OCP FP8 formats: E4M3 (more precision) and E5M2 (more range)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Fp8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        """Largest finite magnitude: 448 for E4M3, 57344 for E5M2."""
        return float(torch.finfo(self.dtype).max)

    @classmethod
    def parse(cls, value: "Fp8Format | str") -> "Fp8Format":
        if isinstance(value, Fp8Format):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown FP8 format {value!r}; expected one of {[f.value for f in cls]}") from None


class RecipeName(enum.Enum):
    HYBRID = "hybrid"          # InfiR2 / DeepSeek-V3: 1x128 activations, 128x128 weights, E4M3 everywhere
    TENSORWISE = "tensorwise"  # one scale per tensor, E4M3 forward and E5M2 gradients
    ROWWISE = "rowwise"        # one scale per row of each operand, E4M3
    BF16 = "bf16"              # nothing converted: the baseline


@dataclass(frozen=True)
class OperandConfig:
    fmt: Fp8Format | None
    """None: not quantized (the operand's BF16 value; block is then ignored)."""
    block: Block


@dataclass(frozen=True)
class GemmConfig:
    a: OperandConfig
    b: OperandConfig


@dataclass(frozen=True)
class Fp8Recipe:
    """Numerics of every converted Linear. Build it with `make_recipe(name)`.

    pow2_scale: round each scale up to a power of two, so that scaling is exact in binary (the default,
    as in the paper); False keeps the exact FP32 value amax / fmt.max.
    emulate: run the GEMMs as dequantize + FP32 matmul on every device (same numbers as cuBLAS up to FP32
    summation order; for ablations and debugging, much slower).
    """

    name: RecipeName
    output: GemmConfig | None
    grad_input: GemmConfig | None
    grad_weight: GemmConfig | None
    pow2_scale: bool = True
    emulate: bool = False
    wgrad_input_from_fp8: bool = False
    """grad_weight's input operand (input.T, token-tiled) is quantized from the FP8 row copy of the input that
    the forward made (dequantize, transpose, re-quantize, as DeepSeek-V3 does), so one FP8 copy is made in the
    forward and saved for backward; False (the paper's recipe) quantizes it from the high-precision input."""
    swiglu_inputs_fp8: bool = False
    """The SwiGLU's inputs (the gate and up projections' outputs, the largest activations a decoder layer
    saves) are saved for backward as E4M3 1x128 tiles instead of BF16 (COAT's trick), halving their memory;
    the backward's SiLU and product derivatives then read their dequantized values. The forward is unchanged.
    Off in the paper's recipe (docs/fidelity.md has its gradient error)."""
    fuse_swiglu: bool = False
    """A SwiGLU MLP of converted projections runs as one piece (fp8train.fp8.swiglu): the down projection's
    input quantized in the kernel that computes silu(g) * u, and the gate and up projections' output gradients
    in the kernels that compute the SwiGLU's derivatives, so neither activation is written in BF16 and read
    again. The same BF16 arithmetic (bit for bit on the CPU; on CUDA the sigmoid as inductor computes it).
    On by default in the hybrid recipe, whose 1x128 tile kernels the producers are: on the H200 the kernels
    are 1.18-1.37x faster than what they replace, a Qwen2.5-7B step's kernel time 0.9% shorter and its step
    0.4% (docs/benchmarks.md section 0); off elsewhere (no producer kernels: the fused structure would run the
    same ops unfused)."""
    input_t_in_backward: bool = False
    """grad_weight's input operand (input.T, token-tiled) is made in the backward from high-precision values
    instead of in the forward and saved in FP8, so the forward saves nothing for it: the fused MLP's down
    projection makes h.T from the g and u its SwiGLU keeps anyway (~3.3 GiB less at Qwen2.5-7B/22 and 8192
    tokens, for one more launch in the backward); under torch.compile every other Linear saves its input by
    reference and the compiler's partitioner decides: it recomputes the input where that is cheap (o_proj's, a
    copy of the attention output) and otherwise quantizes it in the forward as before (the norm outputs: it
    does not recompute reductions). Eagerly those Linears keep their 1-byte FP8 copy (the input itself would
    hold 2-4 bytes per element). The same arithmetic: bit for bit on the CPU, eagerly and compiled;
    compiled on CUDA inductor may fuse the FP32 norms around a Linear differently once their outputs are saved by
    reference (last-bit differences, docs/benchmarks.md). Not with `swiglu_inputs_fp8` for h (its saved g and u
    are no longer the forward's) nor with `wgrad_input_from_fp8`."""
    deep_gemm: bool = False
    """The tile x block GEMMs (output and grad_input, BF16 out) run on DeepGEMM's SM90 kernel instead of
    cuBLAS's where they run on cuBLAS: the same products (bit-identical on the H200), up to 21% faster per GEMM
    at the 7B projection shapes, 2% per training step (docs/benchmarks.md section 0a). grad_weight (tile x
    tile) stays on cuBLAS, which is faster there.
    Needs DeepGEMM installed; no effect where the GEMMs are emulated."""
    fuse_row_quantization: bool = False
    """Under torch.compile on CUDA, an activation quantized into its 1x128 rows alone (no token-tiled copy: a
    frozen base's input and grad_output, LoRA's) is traced from the reference's torch ops instead of launching
    the tile kernel, so inductor fuses it into the kernel that produces the activation (the SwiGLU and its
    derivatives with LoRA's adds, the residual adds, RoPE's backward): the activation is not read again. The
    same numbers: the fused code rounds the producer's value to the activation's dtype first, as the tile kernel
    reads it (`ops._as_written`), and a power-of-two scale and its reciprocal are integer arithmetic on bit
    patterns (`quant._pow2_scale`). Power-of-two scales only (ValueError otherwise): an exact scale is a division,
    which inductor's Triton code makes approximately. Token-tiled copies stay on the kernel (inductor's code for
    them is slow)."""

    def __post_init__(self) -> None:
        if self.fuse_row_quantization and not self.pow2_scale:
            raise ValueError("fuse_row_quantization needs power-of-two scales (pow2_scale): an exact scale is a "
                             "division, which inductor's generated code makes approximately")

    @property
    def enabled(self) -> bool:
        return self.name is not RecipeName.BF16

    @property
    def spec(self) -> str:
        """`name[+modifier...]`, what `parse_recipe` reads back: the name and each of `MODIFIERS` that changes
        the named recipe (a field no modifier spells, such as `emulate`, is not shown)."""
        base = make_recipe(self.name)
        mods = [m for m, (field, value) in MODIFIERS.items()
                if getattr(self, field) == value != getattr(base, field)]
        return "+".join([self.name.value, *mods])


def _gemm(fa: Fp8Format, ba: Block, fb: Fp8Format, bb: Block) -> GemmConfig:
    return GemmConfig(OperandConfig(fa, ba), OperandConfig(fb, bb))


TILE: Block = (1, 128)     # one scale per row and 128 contraction elements (per token, for activations)
BLOCK: Block = (128, 128)  # one scale per 128x128 block (weights)
ROW: Block = (1, -1)       # one scale per row
_E4, _E5 = Fp8Format.E4M3, Fp8Format.E5M2

_RECIPES = {
    RecipeName.HYBRID: dict(
        output=_gemm(_E4, TILE, _E4, BLOCK),       # input per token tile, weight per 128x128 block
        grad_input=_gemm(_E4, TILE, _E4, BLOCK),   # grad_output per token tile, weight.T per block
        grad_weight=_gemm(_E4, TILE, _E4, TILE),   # both operands tiled along the token dim
        fuse_swiglu=True,                          # its tile kernels have the SwiGLU producers
    ),
    RecipeName.TENSORWISE: dict(
        output=_gemm(_E4, None, _E4, None),
        grad_input=_gemm(_E5, None, _E4, None),
        grad_weight=_gemm(_E5, None, _E4, None),
    ),
    RecipeName.ROWWISE: dict(
        output=_gemm(_E4, ROW, _E4, ROW),
        grad_input=_gemm(_E4, ROW, _E4, ROW),
        grad_weight=_gemm(_E4, ROW, _E4, ROW),
    ),
    RecipeName.BF16: dict(output=None, grad_input=None, grad_weight=None),
}


# `wgrad_blocks`: grad_weight's input.T in 128x128 blocks (features x tokens) instead of 1x128 token tiles, so
# grad_weight runs on cuBLAS's tile x block kernel, as output and grad_input do (faster than tile x tile). With
# power-of-two scales (the default) a value rounds alike under its tile's scale and its block's unless it lies
# below E4M3's normals under the block's (2^-14.8 of the block's amax), which the block flushes where the tile
# would keep it; exact scales round every value a little differently (docs/fidelity.md).
_WGRAD_BLOCKS = _gemm(_E4, TILE, _E4, BLOCK)

MODIFIERS = {  # `+name` in a recipe spec (`hybrid+exact+deep_gemm`): (Fp8Recipe field, value)
    "exact": ("pow2_scale", False),
    "wgrad_from_fp8": ("wgrad_input_from_fp8", True),
    "wgrad_blocks": ("grad_weight", _WGRAD_BLOCKS),
    "swiglu_fp8": ("swiglu_inputs_fp8", True),
    "deep_gemm": ("deep_gemm", True),
    "fused": ("fuse_swiglu", True),
    "unfused": ("fuse_swiglu", False),
    "t_bwd": ("input_t_in_backward", True),
    "t_fwd": ("input_t_in_backward", False),
    "fuse_rows": ("fuse_row_quantization", True),
}


def parse_recipe(spec: str) -> Fp8Recipe:
    """`name[+modifier...]` -> the named recipe with those `MODIFIERS` applied (the spelling of `fp8train bench`
    variants and of the fidelity scripts' arms); ValueError naming the part it cannot read."""
    name, *mods = spec.split("+")
    unknown = [m for m in mods if m not in MODIFIERS]
    if unknown:
        raise ValueError(f"recipe {spec!r}: unknown modifier {unknown[0]!r} (one of {', '.join(MODIFIERS)})")
    return replace(make_recipe(name), **dict(MODIFIERS[m] for m in mods))


def make_recipe(name: "str | RecipeName | Fp8Recipe" = "hybrid", *, pow2_scale: bool | None = None,
                swiglu_inputs_fp8: bool | None = None, deep_gemm: bool | None = None,
                fuse_swiglu: bool | None = None, input_t_in_backward: bool | None = None,
                fuse_row_quantization: bool | None = None, wgrad_blocks: bool | None = None) -> Fp8Recipe:
    """The frozen recipe for `name` ('hybrid', 'tensorwise', 'rowwise' or 'bf16'); a knob given (not None)
    replaces the named recipe's value. `wgrad_blocks` (hybrid; ignored by bf16): grad_weight's input.T in 128x128
    blocks (`MODIFIERS`' `wgrad_blocks`); False: the named recipe's token tiles."""
    knobs = {k: bool(v) for k, v in (("pow2_scale", pow2_scale), ("swiglu_inputs_fp8", swiglu_inputs_fp8),
                                     ("deep_gemm", deep_gemm), ("fuse_swiglu", fuse_swiglu),
                                     ("input_t_in_backward", input_t_in_backward),
                                     ("fuse_row_quantization", fuse_row_quantization)) if v is not None}
    if isinstance(name, Fp8Recipe):
        recipe = replace(name, **knobs) if knobs else name
    else:
        try:
            rname = name if isinstance(name, RecipeName) else RecipeName(str(name).lower())
        except ValueError:
            raise ValueError(
                f"unknown FP8 recipe {name!r}; expected one of {[r.value for r in RecipeName]}"
            ) from None
        recipe = Fp8Recipe(name=rname, **{**_RECIPES[rname], **knobs})
    if wgrad_blocks is None or recipe.name is RecipeName.BF16:  # (BF16: no GEMM in FP8, nothing to change)
        return recipe
    if recipe.name is not RecipeName.HYBRID:
        raise ValueError(f"wgrad_blocks applies to the hybrid recipe, not {recipe.name.value!r}")
    field, blocks = MODIFIERS["wgrad_blocks"]
    return replace(recipe, **{field: blocks if wgrad_blocks else _RECIPES[RecipeName.HYBRID][field]})
