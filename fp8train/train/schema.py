"""Strict reading of nested dataclass configs: every field typed and documented, nothing unknown let through.

`from_dict(cls, raw)` builds dataclass `cls` from a dict read from YAML: an unknown key at any depth is an
error naming the full dotted key and the closest valid one (`ConfigError.keys` holds it), a value of the
wrong type names its key, and YAML's loose scalars are converted where that is safe (an int for a float, a
string such as `1e-4`). Around it: dotted `key=value` overrides (`parse_overrides`, `merge`), where a bad
value came from (`key_lines`, `locate`: the file and line, or the override as typed), the YAML-safe dict of
a config (`to_plain`) and the help text of every key from the fields' attribute docstrings (`help_lines`).
config.py holds the configs themselves.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = ["ConfigError", "from_dict", "coerce", "field_hints", "field_docs", "type_name", "parse_overrides", "merge",
           "key_lines", "flatten", "locate", "to_plain", "default_text", "help_lines"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the dotted key, `keys` holds it (and any
    other key the error is about), so that `load_config` can say where the value came from."""

    def __init__(self, message: str, key: str | tuple[str, ...] = ()):
        super().__init__(message)
        self.keys: tuple[str, ...] = (key,) if isinstance(key, str) else tuple(key)


def field_docs(cls: type) -> dict[str, str]:
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


def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type annotation of every field of `cls`."""
    return typing.get_type_hints(cls)


def type_name(tp: Any) -> str:
    """An annotation as the help text and error messages spell it (`int | null`)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if isinstance(tp, type) and not args:
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "null")


def _suggest(key: str, cls: type, prefix: str) -> str:
    """A key of that name one section down (`lr` -> `optim.lr`), else the closest key of `cls`."""
    hints = field_hints(cls)
    for f in fields(cls):
        sections = [a for a in (hints[f.name], *typing.get_args(hints[f.name])) if is_dataclass(a)]
        if any(key in {g.name for g in fields(section) if g.init} for section in sections):
            return f" (did you mean {_join(prefix, f'{f.name}.{key}')!r}?)"
    close = difflib.get_close_matches(key, [f.name for f in fields(cls) if f.init], n=1, cutoff=0.5)
    return f" (did you mean {_join(prefix, close[0])!r}?)" if close else ""


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert where YAML is loose (ints for floats, etc.)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"config key {key!r} must not be null", key=key)
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"config key {key!r} must be {type_name(tp)}, got {value!r}", key=key)
    if value is None:
        raise ConfigError(f"config key {key!r} must not be null (expected {type_name(tp)})", key=key)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"config key {key!r} must be one of {list(args)}, got {value!r}", key=key)
    if is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} is a section: expected a mapping, got {value!r}", key=key)
        return from_dict(tp, value, key)
    if origin is list and isinstance(value, str):
        value = [value]  # `data.paths=corpus.txt`: one item
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} must be a list ({type_name(tp)}), got {value!r}", key=key)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"config key {key!r} must have {len(args)} items, got {len(value)}", key=key)
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping, got {value!r}", key=key)
        vt = args[1] if args else Any
        return {k: coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}", key=key)
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}", key=key)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"config key {key!r} must be a number, got {value!r}", key=key) from None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}", key=key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key {key!r} must be a string, got {value!r}", key=key)
    if isinstance(tp, type) and issubclass(tp, Path):
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(f"config key {key!r} must be a path string, got {value!r}", key=key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"config key {key!r} must be one of {[e.value for e in tp]}, got {value!r}", key=key) from None
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"config key {key!r} must be {type_name(tp)}, got {value!r}", key=key)


def from_dict(cls: type, raw: dict, prefix: str = "", overrides: dict[str, Any] | None = None) -> Any:
    """Build dataclass `cls` from `raw`, strictly: unknown keys and wrong types name their dotted key."""
    hints = field_hints(cls)
    init_fields = {f.name: f for f in fields(cls) if f.init}
    for key in raw:
        if key not in init_fields:
            raise ConfigError(f"unknown config key {_join(prefix, str(key))!r}"
                              f"{_suggest(str(key), cls, prefix)}", _join(prefix, str(key)))
    kwargs = {}
    for name, f in init_fields.items():
        key = _join(prefix, name)
        if overrides and name in overrides:
            kwargs[name] = overrides[name]
        elif name in raw:
            kwargs[name] = coerce(raw[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key {key!r} ({field_docs(cls).get(name, type_name(hints[name]))})", key=key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a component's own __post_init__ check, which names its dotted key
        msg = str(e)
        keys = tuple(k for k in (_join(prefix, name) for name in init_fields) if re.search(rf"\b{re.escape(k)}\b", msg))
        if not keys:
            msg = f"config section {prefix or 'top level'!r}: {msg}"
        raise ConfigError(msg, keys or prefix) from None


def parse_overrides(items: list[str]) -> dict:
    """`["optim.lr=3e-4", "recipe=bf16"]` -> nested dict; values are YAML scalars (`null`, `true`, `[1, 2]`)."""
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        value = _override_value(item, text)
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])!r} is set to a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _override_value(item: str, text: str) -> Any:
    """A YAML scalar or list; a glob such as `*.txt` or `[*.md, *.txt]` (YAML reads `*` as an alias) is
    taken as plain strings, so that `data.include=[*.txt]` needs no inner quotes."""
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        plain = text.strip()
        if "*" in plain and not any(c in plain for c in "{}:#&!|>'\""):
            if plain.startswith("[") and plain.endswith("]"):
                return [part.strip() for part in plain[1:-1].split(",") if part.strip()]
            return plain
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None


def merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in, section by section (`over` wins)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def key_lines(text: str) -> dict[str, int]:
    """The line of every dotted key (and list item, `key[i]`) of a YAML mapping."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = _join(prefix, str(k.value))
                lines[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[f"{prefix}[{i}]"] = item.start_mark.line + 1

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: value}."""
    out = {}
    for k, v in tree.items():
        key = _join(prefix, str(k))
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _related(a: str, b: str) -> bool:
    """Whether the dotted keys `a` and `b` name the same setting, or one holds the other."""
    a, b = re.sub(r"\[\d+\]$", "", a), re.sub(r"\[\d+\]$", "", b)
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def locate(e: ConfigError, path: Path | None, lines: dict[str, int], overrides: dict[str, str]) -> str:
    """The error prefixed by where its value came from: the override as typed, or the file and line."""
    for key in e.keys:
        typed = [text for k, text in overrides.items() if _related(k, key)]
        if typed:
            return f"{typed[0]} (command line): {e}"
    if path is None:
        return str(e)
    for key in e.keys:  # the key's line, else its section's (a missing key)
        key = re.sub(r"\[\d+\]$", "", key) if key not in lines else key
        while key and key not in lines:
            key = key.rpartition(".")[0]
        if key:
            return f"{path}:{lines[key]}: {e}"
    return f"{path}: {e}"


def to_plain(value: Any) -> Any:
    """Dataclasses, paths and enums as the plain (YAML-safe) dicts, lists and scalars they read back from."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def default_text(f: dataclasses.Field) -> str:
    """A field's default as the help text shows it (YAML flow style; `(required)`)."""
    if f.default is not dataclasses.MISSING:
        return yaml.safe_dump(to_plain(f.default), default_flow_style=True).strip().removesuffix("...").strip()
    if f.default_factory is not dataclasses.MISSING:
        return yaml.safe_dump(to_plain(f.default_factory()), default_flow_style=True).strip().removesuffix("...").strip()
    return "(required)"


def help_lines(cls: type, prefix: str, out: list[str]) -> None:
    """Appends a line per field of `cls` (type, default, docstring) to `out`, sections recursively."""
    docs, hints = field_docs(cls), field_hints(cls)
    for f in fields(cls):
        if not f.init:
            continue
        key, tp = _join(prefix, f.name), hints[f.name]
        section = _optional_section(tp)
        if is_dataclass(tp) or section is not None:
            out.append(f"  {key}: section{' = null (optional)' if section else ''}\n      {docs.get(f.name, '')}")
            help_lines(section or tp, key, out)
            continue
        out.append(f"  {key}: {type_name(tp)} = {default_text(f)}\n      {docs.get(f.name, '')}")


def _optional_section(tp: Any) -> type | None:
    """The dataclass of an optional section (`X | None`), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 and is_dataclass(args[0]):
        return args[0]
    return None
