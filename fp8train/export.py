"""Serving exports of a trained model: plain BF16 (`hf`) and FP8 128x128-block (`fp8-block`).

`fp8-block` is the DeepSeek-V3 style checkpoint that transformers (`FineGrainedFP8Config`), vLLM and
SGLang load: every converted Linear stores `<module>.weight` in float8_e4m3fn plus an FP32
`<module>.weight_scale_inv` of shape [ceil(out/128), ceil(in/128)], the *dequantize* multiplier
(w ~ weight * weight_scale_inv, block by block), and config.json carries

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...], ...}

Only the decoder's projection Linears are converted (q/k/v/o_proj, gate/up/down_proj, found by name
and 2-D shape); embeddings, the LM head, norms and biases stay BF16. A projection whose shape is not a
multiple of 128 stays BF16 together with the projections a server fuses with it (q/k/v, gate/up):
transformers' dequantizing loader assumes whole blocks, and vLLM needs every fused part block-aligned.
Everything that stays BF16 and is a Linear is listed in `modules_to_not_convert` (and `ignored_layers`,
vLLM's name for it); `lm_head` is always listed because transformers converts every unlisted Linear.

A training checkpoint is verified against its manifest before anything in it is read (a flipped byte
is refused, and nothing is written). The export is written to a temporary sibling directory, fsynced and
renamed into place at the end, so a crash never leaves a directory at the output path that looks
loadable; files get the process umask's permissions.

`export_hf` writes an in-memory model (plain or FSDP2-sharded) as a Hugging Face directory: the final
export of a training run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .data.tokenizer import TOKENIZER_FILES
from .fp8.quant import quantize
from .train import files as fs
from .train.checkpoint import hf_model_dir, save_model_dir
from .train.lora import is_lora, merge_saved_adapter, merged_model
from .train.model import weight_files

__all__ = ["EXPORT_FORMATS", "FP8_BLOCK", "export_checkpoint", "export_hf", "add_cli"]

EXPORT_FORMATS = ("hf", "fp8-block")
FP8_BLOCK = (128, 128)
_PROJ_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
_PROJ_NAMES = {name: group for group in _PROJ_GROUPS for name in group}
_COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
_SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's decimal units


def _resolve_model_dir(src: Path) -> Path:
    """A Hugging Face model directory, or the `model/` directory of a verified training checkpoint."""
    model_dir = hf_model_dir(src)
    if (model_dir / "config.json").is_file():
        return model_dir
    raise FileNotFoundError(
        f"export: {src} is neither a Hugging Face model directory (config.json + *.safetensors) "
        f"nor a training checkpoint with one under model/"
    )


def _shard_size(value: str | int) -> int:
    """`--max-shard-size` in bytes: digits alone are bytes. huggingface_hub refuses digits alone and 0 only
    after the whole conversion ran, so the value is checked (and converted) before any work."""
    text = str(value).strip().upper()
    size = 0
    if re.fullmatch(r"\d+|\d+(\.\d+)?\s*[KMGT]B", text):
        number = re.match(r"[\d.]+", text)[0]
        whole, _, frac = number.partition(".")  # integer arithmetic: exact for any number of digits
        size = int(whole + frac) * _SIZE_UNITS[text[len(number):].strip()] // 10 ** len(frac)
    if size < 1:
        raise ValueError(f"export: --max-shard-size {value!r}: expected a positive size such as 5GB, 500MB or a "
                         "number of bytes (units KB, MB, GB, TB)")
    return size


def _read_config(model_dir: Path) -> dict:
    """config.json of `model_dir` as a dict; anything else is an error naming the file."""
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"export: {path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"export: {path} holds a JSON {type(cfg).__name__}, not an object (a model config)")
    return cfg


def _weight_files(model_dir: Path) -> list[Path]:
    return weight_files(model_dir, "export")  # complete files only: a truncated one is named, not exported


def _read_tensors(model_dir: Path):
    """Yield (name, tensor) for every tensor of the checkpoint, one at a time (low peak memory)."""
    seen: set[str] = set()
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"export: tensor {name!r} appears in more than one shard ({path})")
                seen.add(name)
                yield name, f.get_tensor(name)


def _proj_module(name: str, t: torch.Tensor) -> str | None:
    """The module name if `name` is a decoder projection's 2-D floating-point weight, else None."""
    if not name.endswith(".weight") or t.dim() != 2 or not t.is_floating_point():
        return None
    module = name[: -len(".weight")]
    return module if module.rsplit(".", 1)[-1] in _PROJ_NAMES else None


def _fp8_modules(shapes: dict[str, tuple[int, int]]) -> set[str]:
    """Projections to convert: block-aligned ones whose fused group (same parent) is all block-aligned."""
    aligned = {m: s[0] % FP8_BLOCK[0] == 0 and s[1] % FP8_BLOCK[1] == 0 for m, s in shapes.items()}
    keep = set()
    for module, ok in aligned.items():
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        siblings = [f"{parent}.{n}" if parent else n for n in _PROJ_NAMES[leaf]]
        if ok and all(aligned.get(s, True) for s in siblings):
            keep.add(module)
    return keep


def _convert(model_dir: Path, fmt: str, pow2_scale: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """The output state dict and a summary (converted / kept-BF16 Linear modules)."""
    if fmt == "hf":
        tensors = merge_saved_adapter(model_dir, _read_tensors(model_dir))  # a LoRA checkpoint: adapters merged
        sd = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t) for n, t in tensors}
        return sd, {}
    # Shapes first (metadata only), so the fused-group decision never needs two passes over data.
    shapes = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if name.endswith(".weight") and len(shape) == 2 and name[:-7].rsplit(".", 1)[-1] in _PROJ_NAMES:
                    shapes[name[: -len(".weight")]] = tuple(shape)
    to_fp8 = _fp8_modules(shapes)
    sd: dict[str, torch.Tensor] = {}
    for name, t in merge_saved_adapter(model_dir, _read_tensors(model_dir)):
        module = _proj_module(name, t)
        if module in to_fp8:
            q = quantize(t, block=FP8_BLOCK, fmt="e4m3", pow2_scale=pow2_scale)
            if not torch.isfinite(q.scale).all():
                raise ValueError(f"export: {name} holds NaN or Inf; refusing to export a broken checkpoint")
            sd[name] = q.data
            sd[f"{module}.weight_scale_inv"] = q.scale.float().contiguous()
        else:
            sd[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    kept = sorted(set(shapes) - to_fp8)
    return sd, {"converted": sorted(to_fp8), "kept_bf16": kept}


def _write_config(cfg: dict, out: Path, fmt: str, summary: dict, pow2_scale: bool) -> None:
    """Write the source's config.json `cfg` (modified in place) for the export."""
    cfg["dtype"] = "bfloat16"
    if "torch_dtype" in cfg:  # older transformers / vLLM read this name
        cfg["torch_dtype"] = "bfloat16"
    if fmt == "fp8-block":
        skip = ["lm_head", *summary["kept_bf16"]]
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
            "fmt": "e4m3",
            "modules_to_not_convert": skip,
            "ignored_layers": skip,
            # Informational (loaders ignore it): what fp8train converted and how.
            "fp8train": {
                "converted_projections": sorted({m.rsplit(".", 1)[-1] for m in summary["converted"]}),
                "num_converted": len(summary["converted"]),
                "pow2_scale": pow2_scale,
            },
        }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def export_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    format: str = "hf",
    pow2_scale: bool = False,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Export the model in `src` (HF model dir or training checkpoint dir) to `out_dir`; returns out_dir.

    format: "hf" (BF16 safetensors) or "fp8-block" (E4M3 projections with 128x128 FP32 scale_inv).
    pow2_scale: round each block's scale up to a power of two (exact rescaling, slightly coarser).
    max_shard_size: shards larger than this are split, with a model.safetensors.index.json; bytes, or a
    string with a unit such as "500MB".
    """
    from huggingface_hub import save_torch_state_dict

    if format not in EXPORT_FORMATS:
        raise ValueError(f"export: unknown format {format!r}; expected one of {list(EXPORT_FORMATS)}")
    shard_bytes = _shard_size(max_shard_size)
    src, out = Path(src), Path(out_dir)
    model_dir = _resolve_model_dir(src)
    cfg = _read_config(model_dir)  # once, before the conversion: a bad config.json fails fast
    if "quantization_config" in cfg:
        raise ValueError(f"export: {model_dir} is already quantized (config.json has quantization_config); "
                         f"export from the unquantized checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"export: output {out} already exists and is not empty; remove it or pick another -o")

    sd, summary = _convert(model_dir, format, pow2_scale)
    tmp = fs.new_temp_dir(out)
    try:
        save_torch_state_dict(sd, tmp, max_shard_size=shard_bytes)
        del sd
        _write_config(cfg, tmp, format, summary, pow2_scale)
        for name in _COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)  # contents only: the umask's permissions
        fs.commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_hf(model: nn.Module, out_dir: str | os.PathLike, tokenizer=None, dtype: torch.dtype = torch.bfloat16,
              *, overwrite: bool = False) -> Path | None:
    """Write `model` as a Hugging Face directory in `dtype` (safetensors, config, tokenizer), atomically.

    A model with its Linears swapped for FP8 subclasses exports exactly like the original: only the
    shared parameters are written. An FSDP2-sharded model is gathered to rank 0 first: every rank calls
    this, rank 0 writes and returns the path, the others return None. An existing non-empty `out_dir`
    is replaced only with `overwrite`.
    """
    from .train.distributed import all_ranks_ok, gather_full_state_dict, get_rank, is_sharded_model

    out_dir = Path(out_dir)
    if is_lora(model):
        model = merged_model(model, dtype=dtype)  # adapters merged into the projections
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True to replace it")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if is_sharded_model(model):
        full = gather_full_state_dict(model)  # collective: every rank takes part; CPU tensors on rank 0
        written = []

        def write():
            if get_rank() == 0:
                from transformers import AutoModelForCausalLM

                with torch.device("meta"):
                    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
                plain.load_state_dict(full, assign=True)
                plain.tie_weights()
                written.append(export_hf(plain, out_dir, tokenizer, dtype, overwrite=overwrite))

        all_ranks_ok(write, f"exporting {out_dir}")
        return written[0] if written else None
    tmp = fs.new_temp_dir(out_dir)
    try:
        params = model.state_dict(keep_vars=True)
        cast: dict[int, torch.Tensor] = {}  # cast each tensor once so that tied aliases stay one storage
        for t in params.values():
            if id(t) not in cast:
                cast[id(t)] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        save_model_dir(model, tmp, tokenizer, state_dict={name: cast[id(t)] for name, t in params.items()})
        config = copy.deepcopy(model.config)
        config.dtype = dtype  # save_pretrained records the in-memory (FP32) dtype
        config.use_cache = True  # training turns the KV cache off; generation from the export wants it
        config.save_pretrained(tmp)
        fs.commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _run_cli(args: argparse.Namespace) -> int:
    out = export_checkpoint(
        args.checkpoint, args.output, format=args.format, pow2_scale=args.pow2_scale,
        max_shard_size=args.max_shard_size,
    )
    print(f"exported {args.format} model to {out}")
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `fp8train export CHECKPOINT --format hf|fp8-block -o DIR [--pow2-scale] [--max-shard-size]`."""
    p = subparsers.add_parser(
        "export",
        help="export a trained model as BF16 or FP8-block safetensors for serving",
        description="Export a Hugging Face model directory (or a training checkpoint with one under model/) "
        "as BF16 safetensors (--format hf) or as a 128x128 block-scaled FP8 checkpoint (--format fp8-block) "
        "that transformers, vLLM and SGLang load.",
    )
    p.add_argument("checkpoint", help="HF model directory or training checkpoint directory")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="hf", help="export format (default: hf)")
    p.add_argument("-o", "--output", required=True, help="output directory (must not exist or be empty)")
    p.add_argument(
        "--pow2-scale", action=argparse.BooleanOptionalAction, default=False,
        help="fp8-block: round block scales up to powers of two (default: exact FP32 scales)",
    )
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB, 500MB or a number of bytes")
    p.set_defaults(func=_run_cli)
    return p
