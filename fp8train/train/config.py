"""The run configuration: a `TrainConfig` of small dataclasses, read from YAML plus dotted overrides.

    fp8train train configs/tiny_cpt.yaml optim.lr=3e-4 recipe=bf16 train.steps=20

Every field carries a one-line attribute docstring (`fp8train train --help-config` prints them). Parsing
is strict (schema.py): an unknown key at any depth is an error naming the full dotted key and the closest
valid one, and a value of the wrong type names its key. The `data` section is a `CptDataConfig` or an
`SftDataConfig`, chosen by `stage`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from ..data import CptDataConfig, SftDataConfig
from ..fp8.recipe import Fp8Recipe, make_recipe
from .distributed import DistributedConfig
from .metrics import resolve_report_to
from .model import PRESETS, ModelConfig
from .optim import OptimConfig, lr_lambda
from .schema import (ConfigError, coerce, default_text, field_docs, field_hints, flatten, from_dict, help_lines,
                     key_lines, locate, merge, parse_overrides, to_plain, type_name)

# ConfigError is schema's: exported here too, as the error of loading a config
__all__ = ["ConfigError", "LoopConfig", "TrainConfig", "load_config", "config_to_dict", "format_config_help",
           "resolve_paths"]


@dataclass
class LoopConfig:
    """The training loop (the `train` section)."""

    steps: int | None = None
    """Optimizer steps to run; when set it takes precedence over `epochs`."""
    epochs: float | None = None
    """Passes over the training set, used when `steps` is null (steps = epochs x samples // global_batch)."""
    global_batch: int = 8
    """Sequences per optimizer step over all ranks; must equal micro_batch x accumulation x world size."""
    micro_batch: int = 1
    """Sequences per forward/backward pass on one rank; gradients accumulate up to the global batch."""
    eval_every: int = 0
    """Validation loss every this many steps (and always at the end); 0 = only at the end."""
    eval_batches: int | None = None
    """Cap on validation micro-batches per evaluation (its first eval_batches x micro_batch rows, whatever the
    number of ranks); null = the whole validation split."""
    save_every: int = 0
    """Checkpoint every this many steps (and always at the end); 0 = only at the end."""
    keep_last: int | None = 2
    """Checkpoints kept in run_dir/checkpoints (older ones are deleted); null keeps all."""
    log_every: int = 1
    """Write metrics.jsonl / TensorBoard every this many steps."""
    health_every: int = 0
    """FP8 health (underflow, saturation, scale range per converted layer) every this many steps; 0 = never."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (HF gradient checkpointing, non-reentrant)."""
    compile: bool = False
    """torch.compile each decoder layer; its FP8 Linears trace into the layer's graph (no graph break).
    The fastest setting on a GPU (docs/benchmarks.md); the first steps pay for compilation."""
    cuda_graphs: bool = False
    """With compile, on CUDA: replay each compiled layer as CUDA graphs (inductor's cudagraphs, as in
    mode="reduce-overhead"), so the host no longer launches every kernel: FP8 layers launch about three
    times BF16's kernels, which bounds short sequences by the CPU. Needs fixed shapes (packed CPT data)."""
    max_nonfinite_steps: int = 3
    """Stop with an error after this many NaN/Inf steps in a row (each is skipped: no optimizer update)."""
    loss_impl: Literal["chunked", "liger", "hf"] = "chunked"
    """LM head + loss (training and validation): `chunked` computes the BF16 head GEMM, FP32 cross-entropy
    and both gradients chunk by chunk of tokens, never holding [tokens, vocabulary] logits (~10 GB at 8192
    tokens x 151,936), with its softmax/gradient arithmetic compiled when `train.compile` is on; `liger`
    uses Liger's fused linear cross-entropy (CUDA, `pip install fp8train[liger]`); `hf` the plain
    Hugging Face forward (full FP32 logits). All three compute the same loss (fp8train/train/loss.py)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of `loss_impl: chunked`; null = enough for 2**28 logits per chunk (1 GiB as FP32)."""
    packed_attention: Literal["flex", "sdpa"] = "flex"
    """Attention of rows packed from several documents (CPT's `document_masking`, SFT's packing), on CUDA:
    `flex` flex_attention over a block mask of the documents, which skips every block outside them
    (fp8train/train/attention.py; a 1.5B step of 8 documents a row 0.60x the time of `sdpa`'s on an H100);
    `sdpa` Hugging Face's SDPA with a dense [S, S] mask, ~3.5x a causal row's attention time at 8,192 tokens.
    Rows of one document run SDPA's causal kernel either way; on a CPU, always `sdpa` (flex has no CPU
    backward)."""
    report_to: list[str] | None = None
    """Experiment trackers for the metrics and FP8 health, as transformers spells them: some of tensorboard,
    wandb, mlflow; `all` (those installed) or `none`. null = TensorBoard when installed."""


@dataclass
class TrainConfig:
    """One training run: `stage`, the model, data, optimizer and loop sections, and run-level options."""

    stage: Literal["cpt", "sft"] = "cpt"
    """`cpt` (continual pretraining on raw text) or `sft` (chat data, loss on assistant tokens)."""
    run_dir: str = "runs/default"
    """Output directory: config.yaml, metrics.jsonl, fp8_health.jsonl, checkpoints/, final/."""
    resume: str = "auto"
    """`auto` (continue from the newest complete checkpoint in run_dir, if any; refused when the config
    differs from the run's in what shapes its trajectory), `force` (`auto`, accepting such changes),
    `none` (a new run; refused if run_dir holds one), or a checkpoint path."""
    seed: int = 0
    """Seed for model init and data order; the same seed gives the same run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses CUDA when available, else the CPU."""
    cpu_threads: int = 1
    """torch threads while training on the CPU; 0 = torch's default (one per core). One is fastest for small
    models and on a busy machine (docs/training.md)."""
    recipe: Literal["hybrid", "tensorwise", "rowwise", "bf16"] = "hybrid"
    """FP8 recipe of the decoder Linears: `hybrid` (InfiR2: 1x128 activations, 128x128 weights), or `bf16`."""
    pow2_scale: bool = True
    """Round FP8 scales to powers of two (exact in binary; the paper's default). false: exact scales, which cut
    the FP8 loss gap by 40-48% on SmolLM2-135M (docs/fidelity.md) at no measurable step time at Qwen2.5-7B."""
    swiglu_inputs_fp8: bool = False
    """Save the MLP's SwiGLU inputs (gate and up outputs) for backward as FP8 1x128 tiles instead of BF16:
    less activation memory, the backward's SwiGLU derivative from FP8-rounded values (docs/fidelity.md)."""
    fuse_swiglu: bool | None = None
    """Run each SwiGLU MLP as one piece: the down projection's FP8 input made in the kernel that computes
    silu(gate) * up, the gate and up projections' FP8 output gradients in the ones that compute its derivatives
    (neither written in BF16 and read again). The same BF16 arithmetic, 0.9% less kernel time at Qwen2.5-7B on
    the H200 (docs/benchmarks.md). null: the recipe's default (on for hybrid); false: three FP8 Linears."""
    input_t_in_backward: bool | None = None
    """Make each FP8 Linear's grad_weight input operand (its input, tiled along the tokens) in the backward
    instead of saving it from the forward: the fused MLP's down projection from the gate and up outputs saved
    anyway; compiled, the other Linears from their input, which the compiler recomputes where that is cheap (the
    attention output). Less activation memory for more backward work, the same arithmetic (docs/benchmarks.md).
    null: the recipe's default (off)."""
    fuse_row_quantization: bool | None = None
    """Compiled on CUDA, quantize an activation that needs only its 1x128 rows (no token-tiled copy: a frozen
    LoRA base's input and output gradient) in the kernel inductor makes for its producer (the SwiGLU and its
    derivative with the adapters' adds, RoPE's backward) rather than in a kernel of its own that reads it again:
    ~2% of a Qwen2.5-7B LoRA step (docs/benchmarks.md). The same numbers (the fused code rounds the activation to
    BF16 first, as the kernel reads it). Needs `pow2_scale: true`. null: the recipe's default (off)."""
    wgrad_blocks: bool = False
    """Quantize each FP8 Linear's grad_weight input (its input, transposed) in 128x128 blocks of features and tokens
    instead of 1x128 token tiles, so grad_weight runs on cuBLAS's faster tile x block kernel: +0.03x BF16's
    tokens/s at Qwen2.5-1.5B and 7B on an H100 (docs/benchmarks.md, twenty-ninth session). A value differs only
    where it lies 2^15 below its block's largest, which a block flushes to zero and a tile keeps (hybrid recipe
    only; docs/fidelity.md). Off by default: the paper's recipe tiles this operand per token."""
    deep_gemm: bool = False
    """Run the hybrid recipe's output and grad_input GEMMs on DeepGEMM's SM90 kernel instead of cuBLAS's: the
    same numbers, 2% faster steps at Qwen2.5-7B, 5% for LoRA (docs/benchmarks.md section 0a;
    benchmarks/build_deep_gemm.sh builds DeepGEMM). Ignored on the CPU."""
    hold_fp8_weights: bool = False
    """Keep each FP8 Linear weight's FP8 copy (E4M3, 128x128 blocks) between steps, written by the optimizer's
    step as it updates the weight (`fp8train.hold_fp8_weights`): no forward or backward quantizes a weight (the
    backward transposes the copy), for 1 byte more per decoder parameter all run long. The same numbers. Needs
    fp8train's Triton AdamW (`optim.impl` auto or triton on CUDA) and a recipe with 128x128 weight blocks
    (hybrid); not under FSDP, whose ranks step shards. Where it cannot apply the log says why and the step
    quantizes as before."""
    bf16_layers: list[int] = field(default_factory=list)
    """Decoder layers kept entirely in BF16 (indices; -1 is the last), e.g. [0, 1, -2, -1]: the first and last
    two, where the FP8 forward error concentrates on small models (docs/fidelity.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and tokenizer (section)."""
    data: CptDataConfig | SftDataConfig | None = None
    """The dataset (section): a CptDataConfig for stage cpt, an SftDataConfig for stage sft."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule (section)."""
    train: LoopConfig = field(default_factory=LoopConfig)
    """The training loop (section)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """torchrun + FSDP2 options (section); ignored in a single process."""

    def fp8_recipe(self) -> Fp8Recipe:
        """The frozen recipe that `recipe` and its knobs name; ConfigError naming the key where they do not
        combine (`wgrad_blocks` on a recipe other than hybrid, `fuse_row_quantization` with exact scales) or the
        name is unknown."""
        keys = (("fuse_row_quantization", "pow2_scale") if self.fuse_row_quantization and not self.pow2_scale
                else ("wgrad_blocks", "recipe") if self.wgrad_blocks else ("recipe",))
        try:
            return make_recipe(self.recipe, pow2_scale=self.pow2_scale, swiglu_inputs_fp8=self.swiglu_inputs_fp8,
                               deep_gemm=self.deep_gemm, fuse_swiglu=self.fuse_swiglu,
                               input_t_in_backward=self.input_t_in_backward,
                               fuse_row_quantization=self.fuse_row_quantization, wgrad_blocks=self.wgrad_blocks or None)
        except ValueError as e:
            raise ConfigError(f"config key '{keys[0]}': {e}", keys) from None

    def validate(self, world_size: int = 1) -> None:
        """Cross-field checks; the trainer calls it again with the real world size."""
        t = self.train
        for key in ("global_batch", "micro_batch", "log_every", "max_nonfinite_steps"):
            if getattr(t, key) < 1:
                raise ConfigError(f"config key 'train.{key}' must be >= 1, got {getattr(t, key)}", f"train.{key}")
        if self.cpu_threads < 0:
            raise ConfigError(f"config key 'cpu_threads' must be >= 0 (0 = torch's default), got {self.cpu_threads}",
                              "cpu_threads")
        for key in ("eval_every", "save_every", "health_every"):
            if getattr(t, key) < 0:
                raise ConfigError(f"config key 'train.{key}' must be >= 0, got {getattr(t, key)}", f"train.{key}")
        if t.steps is None and t.epochs is None:
            raise ConfigError("set one of the config keys 'train.steps' or 'train.epochs'", ("train.steps", "train.epochs"))
        if t.steps is not None and t.steps < 1:
            raise ConfigError(f"config key 'train.steps' must be >= 1, got {t.steps}", "train.steps")
        if t.steps is None and not t.epochs > 0:
            raise ConfigError(f"config key 'train.epochs' must be > 0, got {t.epochs}", "train.epochs")
        if t.keep_last is not None and t.keep_last < 1:
            raise ConfigError(f"config key 'train.keep_last' must be >= 1 or null, got {t.keep_last}", "train.keep_last")
        if t.loss_chunk_tokens is not None and t.loss_chunk_tokens < 1:
            raise ConfigError(f"config key 'train.loss_chunk_tokens' must be >= 1 or null, got {t.loss_chunk_tokens}",
                              "train.loss_chunk_tokens")
        try:
            resolve_report_to(t.report_to)
        except ValueError as e:
            raise ConfigError(str(e), "train.report_to") from None
        if t.cuda_graphs and not t.compile:
            raise ConfigError("config key 'train.cuda_graphs' needs 'train.compile': true (it graphs the compiled layers)",
                              ("train.cuda_graphs", "train.compile"))
        self.fp8_recipe()  # the recipe keys combine (make_recipe's rules)
        per_step = t.micro_batch * world_size
        if t.global_batch % per_step:
            raise ConfigError(
                f"config key 'train.global_batch' ({t.global_batch}) must be a multiple of 'train.micro_batch' "
                f"({t.micro_batch}) x world size ({world_size}) = {per_step}", ("train.global_batch", "train.micro_batch"))
        if t.steps is not None:  # the schedule fits the steps: checked now, not after tokenizing
            try:
                lr_lambda(self.optim, t.steps)
            except ValueError as e:
                raise ConfigError(str(e), ("train.steps", "optim.warmup_steps", "optim.warmup_ratio",
                                           "optim.decay_steps", "optim.decay_ratio")) from None
        if self.data is None:
            raise ConfigError("missing required config section 'data'", "data")
        want = CptDataConfig if self.stage == "cpt" else SftDataConfig
        if not isinstance(self.data, want):
            raise ConfigError(f"config key 'data' must be a {want.__name__} for stage {self.stage!r}", "data")
        if self.model.source in PRESETS and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"config key 'data.seq_len' ({self.data.seq_len}) is above the model's "
                              f"max_position_embeddings ('model.max_seq_len' = {self.model.max_seq_len}); lower "
                              "data.seq_len or raise model.max_seq_len", ("data.seq_len", "model.max_seq_len"))


# ------------------------------------------------------------------------------------------- parsing


def config_from_dict(raw: dict, world_size: int = 1) -> TrainConfig:
    """Build and validate a `TrainConfig` from a nested dict (YAML already merged with overrides)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(raw).__name__}")
    stage = coerce(raw.get("stage", "cpt"), field_hints(TrainConfig)["stage"], "stage")
    data_raw = raw.get("data")
    if data_raw is None:
        raise ConfigError("missing required config section 'data'", "data")
    data = coerce(data_raw, CptDataConfig if stage == "cpt" else SftDataConfig, "data")
    cfg = from_dict(TrainConfig, raw, overrides={"data": data})
    cfg.validate(world_size)
    return cfg


# Input paths (not outputs: run_dir and data.cache_dir stay relative to the working directory). A relative
# one in a config file is relative to that file; on the command line, to the working directory.
_SPECIAL_NAMES = {"model.tokenizer": ("qwen2.5", "qwen2"), "resume": ("auto", "none", "force")}


def _resolve(value: Any, base: Path, key: str) -> Any:
    if not isinstance(value, str) or not value or value.startswith("~") or os.path.isabs(value):
        return value
    if value.lower() in _SPECIAL_NAMES.get(key, ()) or (key == "model.source" and value in PRESETS):
        return value
    resolved = os.path.normpath(base / value)
    if key in ("model.source", "data.hf_dataset.name") and not os.path.exists(resolved) and "/" not in value \
            and not value.endswith(".gguf"):
        return value  # a name (a preset, a dataset on the Hub), not a path
    if key == "data.hf_dataset.name" and not os.path.exists(resolved):
        return value
    return resolved


def resolve_paths(raw: dict, base: str | os.PathLike) -> dict:
    """A copy of the config dict `raw` with its relative input paths (model.source, model.tokenizer,
    data.paths, data.hf_dataset.name, resume) made absolute against the folder `base`; names (presets,
    `qwen2.5`, `auto`, a Hub dataset) are kept."""
    raw, base = copy.deepcopy(raw), Path(base).resolve()
    for section, key in (("model", "source"), ("model", "tokenizer"), ("data", "paths"), ("", "resume")):
        node = raw.get(section) if section else raw
        if not isinstance(node, dict) or key not in node:
            continue
        dotted = f"{section}.{key}" if section else key
        value = node[key]
        if isinstance(value, list):
            node[key] = [_resolve(v, base, dotted) for v in value]
        else:
            node[key] = _resolve(value, base, dotted)
    hf = raw.get("data", {}).get("hf_dataset") if isinstance(raw.get("data"), dict) else None
    if isinstance(hf, dict) and "name" in hf:
        hf["name"] = _resolve(hf["name"], base, "data.hf_dataset.name")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                world_size: int = 1) -> TrainConfig:
    """Read a YAML config (or none: all defaults) and apply dotted `key=value` overrides on top.

    Relative input paths resolve against the config file's folder, those of overrides against the working
    directory (`resolve_paths`). An error names the override as typed, or the file and line of the key.
    """
    raw: dict = {}
    lines: dict[str, int] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist" if not path.exists()
                              else f"config file {path} is not a file")
        text = path.read_text(encoding="utf-8")
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            if mark is not None:  # file:line, then what PyYAML found there
                problem = " ".join(f"{getattr(e, 'problem', None) or e}".split())
                raise ConfigError(f"{path}:{mark.line + 1}: not valid YAML ({problem}, column {mark.column + 1})") \
                    from None
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config must be a mapping at the top level")
        lines = key_lines(text)
        raw = resolve_paths(raw, path.parent)
    typed: dict[str, str] = {}
    if overrides:
        if isinstance(overrides, dict):
            tree = overrides
            typed = {k: f"{k}={v}" for k, v in flatten(tree).items()}
        else:
            tree = parse_overrides(list(overrides))
            typed = {item.partition("=")[0].strip(): item for item in overrides}
        raw = merge(raw, resolve_paths(tree, Path.cwd()))
    try:
        return config_from_dict(raw, world_size)
    except ConfigError as e:
        raise ConfigError(locate(e, path, lines, typed), e.keys) from None


def config_to_dict(cfg: Any) -> dict:
    """A YAML-safe nested dict that `load_config` reads back into an equal config."""
    return to_plain(cfg)


def format_config_help() -> str:
    """Every config key with its type, default and docstring (what `--help-config` prints)."""
    out = ["fp8train training config. Keys are set in the YAML file or as dotted overrides (key=value)."]
    top = [f for f in fields(TrainConfig) if f.name != "data"]
    docs, hints = field_docs(TrainConfig), field_hints(TrainConfig)
    for f in top:
        tp = hints[f.name]
        if is_dataclass(tp):
            continue
        out.append(f"  {f.name}: {type_name(tp)} = {default_text(f)}\n      {docs.get(f.name, '')}")
    for f in top:
        if is_dataclass(hints[f.name]):
            out.append(f"\n[{f.name}]  {docs.get(f.name, '')}")
            help_lines(hints[f.name], f.name, out)
    for stage, cls in (("cpt", CptDataConfig), ("sft", SftDataConfig)):
        out.append(f"\n[data]  (stage: {stage}) {cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ''}")
        help_lines(cls, "data", out)
    return "\n".join(out)
