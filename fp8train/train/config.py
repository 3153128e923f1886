"""The run configuration: a `TrainConfig` of small dataclasses, read from YAML plus dotted overrides.

    fp8train train configs/tiny_cpt.yaml optim.lr=3e-4 recipe=bf16 train.steps=20

Every field carries a one-line attribute docstring (`fp8train train --help-config` prints them). Parsing
is strict: an unknown key at any depth is an error naming the full dotted key and the closest valid one,
and a value of the wrong type names its key. The `data` section is a `CptDataConfig` or an
`SftDataConfig`, chosen by `stage`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from ..data import CptDataConfig, SftDataConfig
from .distributed import DistributedConfig
from .metrics import resolve_report_to
from .model import ModelConfig
from .optim import OptimConfig

__all__ = ["ConfigError", "LoopConfig", "TrainConfig", "load_config", "config_to_dict", "format_config_help",
           "parse_overrides"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the dotted key."""


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
    """Cap on validation micro-batches per evaluation; null = the whole validation split."""
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
    """`auto` (continue from the newest complete checkpoint in run_dir, if any), `none`, or a checkpoint path."""
    seed: int = 0
    """Seed for model init and data order; the same seed gives the same run."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses CUDA when available, else the CPU."""
    recipe: Literal["hybrid", "tensorwise", "rowwise", "bf16"] = "hybrid"
    """FP8 recipe of the decoder Linears: `hybrid` (InfiR2: 1x128 activations, 128x128 weights), or `bf16`."""
    pow2_scale: bool = True
    """Round FP8 scales to powers of two (exact in binary; the paper's default)."""
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

    def validate(self, world_size: int = 1) -> None:
        """Cross-field checks; the trainer calls it again with the real world size."""
        t = self.train
        for key in ("global_batch", "micro_batch", "log_every", "max_nonfinite_steps"):
            if getattr(t, key) < 1:
                raise ConfigError(f"config key 'train.{key}' must be >= 1, got {getattr(t, key)}")
        for key in ("eval_every", "save_every", "health_every"):
            if getattr(t, key) < 0:
                raise ConfigError(f"config key 'train.{key}' must be >= 0, got {getattr(t, key)}")
        if t.steps is None and t.epochs is None:
            raise ConfigError("set one of the config keys 'train.steps' or 'train.epochs'")
        if t.steps is not None and t.steps < 1:
            raise ConfigError(f"config key 'train.steps' must be >= 1, got {t.steps}")
        if t.steps is None and not t.epochs > 0:
            raise ConfigError(f"config key 'train.epochs' must be > 0, got {t.epochs}")
        if t.keep_last is not None and t.keep_last < 1:
            raise ConfigError(f"config key 'train.keep_last' must be >= 1 or null, got {t.keep_last}")
        try:
            resolve_report_to(t.report_to)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if t.cuda_graphs and not t.compile:
            raise ConfigError("config key 'train.cuda_graphs' needs 'train.compile': true (it graphs the compiled layers)")
        per_step = t.micro_batch * world_size
        if t.global_batch % per_step:
            raise ConfigError(
                f"config key 'train.global_batch' ({t.global_batch}) must be a multiple of 'train.micro_batch' "
                f"({t.micro_batch}) x world size ({world_size}) = {per_step}")
        if self.data is None:
            raise ConfigError("missing required config section 'data'")
        want = CptDataConfig if self.stage == "cpt" else SftDataConfig
        if not isinstance(self.data, want):
            raise ConfigError(f"config key 'data' must be a {want.__name__} for stage {self.stage!r}")


# ------------------------------------------------------------------------------------------- parsing


def _field_doc(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal on the line after each annotated field, MRO included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if isinstance(tp, type) and not args:
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "null")


def _suggest(key: str, valid: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean {_join(prefix, close[0])!r}?)" if close else ""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert where YAML is loose (ints for floats, etc.)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"config key {key!r} must not be null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"config key {key!r} must be {_type_name(tp)}, got {value!r}")
    if value is None:
        raise ConfigError(f"config key {key!r} must not be null (expected {_type_name(tp)})")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"config key {key!r} must be one of {list(args)}, got {value!r}")
    if is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} is a section: expected a mapping, got {value!r}")
        return _from_dict(tp, value, key)
    if origin is list and isinstance(value, str):
        value = [value]  # `data.paths=corpus.txt`: one item
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} must be a list ({_type_name(tp)}), got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"config key {key!r} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}")
        vt = args[1] if args else Any
        return {k: _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, Path):
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"config key {key!r} must be a path string, got {value!r}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"config key {key!r} must be one of {[e.value for e in tp]}, got {value!r}") from None
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"config key {key!r} must be {_type_name(tp)}, got {value!r}")


def _from_dict(cls: type, raw: dict, prefix: str = "", overrides: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from `raw`, strictly: unknown keys and wrong types name their dotted key."""
    hints = _hints(cls)
    init_fields = {f.name: f for f in fields(cls) if f.init}
    for key in raw:
        if key not in init_fields:
            raise ConfigError(f"unknown config key {_join(prefix, str(key))!r}"
                              f"{_suggest(str(key), list(init_fields), prefix)}")
    kwargs = {}
    for name, f in init_fields.items():
        key = _join(prefix, name)
        if overrides and name in overrides:
            kwargs[name] = overrides[name]
        elif name in raw:
            kwargs[name] = _coerce(raw[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key {key!r} ({_field_doc(cls).get(name, _type_name(hints[name]))})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a component's own __post_init__ check
        msg = str(e)
        raise ConfigError(msg if prefix and prefix in msg else f"config section {prefix or 'top level'!r}: {msg}") from e


def parse_overrides(items: list[str]) -> dict:
    """`["optim.lr=3e-4", "recipe=bf16"]` -> nested dict; values are YAML scalars (`null`, `true`, `[1, 2]`)."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e})") from None
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])!r} is set to a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def config_from_dict(raw: dict, world_size: int = 1) -> TrainConfig:
    """Build and validate a `TrainConfig` from a nested dict (YAML already merged with overrides)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(raw).__name__}")
    stage = _coerce(raw.get("stage", "cpt"), _hints(TrainConfig)["stage"], "stage")
    data_raw = raw.get("data")
    if data_raw is None:
        raise ConfigError("missing required config section 'data'")
    data = _coerce(data_raw, CptDataConfig if stage == "cpt" else SftDataConfig, "data")
    cfg = _from_dict(TrainConfig, raw, overrides={"data": data})
    cfg.validate(world_size)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                world_size: int = 1) -> TrainConfig:
    """Read a YAML config (or none: all defaults) and apply dotted `key=value` overrides on top."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config must be a mapping at the top level")
    if overrides:
        raw = _merge(raw, overrides if isinstance(overrides, dict) else parse_overrides(list(overrides)))
    try:
        return config_from_dict(raw, world_size)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def config_to_dict(cfg: Any) -> dict:
    """A YAML-safe nested dict that `load_config` reads back into an equal config."""
    return _plain(cfg)


def _help_lines(cls: type, prefix: str, out: list[str]) -> None:
    docs, hints = _field_doc(cls), _hints(cls)
    for f in fields(cls):
        if not f.init:
            continue
        key, tp = _join(prefix, f.name), hints[f.name]
        if is_dataclass(tp):
            out.append(f"\n[{key}]  {docs.get(f.name, '')}")
            _help_lines(tp, key, out)
            continue
        if f.default is not dataclasses.MISSING:
            default = yaml.safe_dump(_plain(f.default), default_flow_style=True).strip().removesuffix("...").strip()
        elif f.default_factory is not dataclasses.MISSING:
            default = yaml.safe_dump(_plain(f.default_factory()), default_flow_style=True).strip()
        else:
            default = "(required)"
        out.append(f"  {key}: {_type_name(tp)} = {default}\n      {docs.get(f.name, '')}")


def format_config_help() -> str:
    """Every config key with its type, default and docstring (what `--help-config` prints)."""
    out = ["fp8train training config. Keys are set in the YAML file or as dotted overrides (key=value)."]
    top = [f for f in fields(TrainConfig) if f.name != "data"]
    docs, hints = _field_doc(TrainConfig), _hints(TrainConfig)
    for f in top:
        tp = hints[f.name]
        if is_dataclass(tp):
            continue
        default = yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
        out.append(f"  {f.name}: {_type_name(tp)} = {default}\n      {docs.get(f.name, '')}")
    for f in top:
        if is_dataclass(hints[f.name]):
            out.append(f"\n[{f.name}]  {docs.get(f.name, '')}")
            _help_lines(hints[f.name], f.name, out)
    for stage, cls in (("cpt", CptDataConfig), ("sft", SftDataConfig)):
        out.append(f"\n[data]  (stage: {stage}) {cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ''}")
        _help_lines(cls, "data", out)
    return "\n".join(out)
