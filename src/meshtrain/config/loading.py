"""Reading a config: TOML file -> dataclasses, `--section.key VALUE` overrides, type checks. Every
failure names the key, the value and what is allowed, as one line (`ConfigError`)."""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from meshtrain.config.checks import validate
from meshtrain.config.schema import ALIASES, SECTIONS, Config
from meshtrain.errors import ConfigError


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Read a TOML file (or start from defaults), apply overrides, check values. Overrides are the
    command line's `["--section.key", "VALUE", ...]` (parsed by each key's type) or, from code, a
    dict of typed values `{"training.steps": 50, "parallel.tp": 2}` (type-checked as TOML values)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (the shipped ones are in configs/)")
        try:
            raw = tomllib.loads(p.read_text())
        except UnicodeDecodeError:
            raise ConfigError(f"config file {p} is not text: pass a TOML file such as configs/tiny.toml") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    cfg = _build(Config, raw, "")
    if isinstance(overrides, dict):
        for key, value in overrides.items():
            set_value(cfg, key, value)
    else:
        for key, text in parse_overrides(overrides or []):
            set_dotted(cfg, key, text)
    validate(cfg)
    return cfg


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """`--training.steps 50` or `--training.steps=50` -> [("training.steps", "50")]."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg} needs a value: {arg} VALUE")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def _field(cfg: Config, key: str) -> tuple[Any, str, Any]:
    """(section object, field name, type) of a dotted key, or a ConfigError naming the known keys."""
    section_name, _, name = key.partition(".")
    name = ALIASES.get(name, name)
    section = getattr(cfg, section_name, None) if section_name in SECTIONS else None
    if section is None or "." in name:
        raise ConfigError(f"unknown config key {key!r}: sections are {', '.join(SECTIONS)}")
    hints = typing.get_type_hints(type(section))
    if name not in hints:
        raise ConfigError(
            f"unknown config key {key!r}: keys of [{section_name}] are {', '.join(_field_names(section))}"
        )
    return section, name, hints[name]


def set_dotted(cfg: Config, key: str, text: str) -> None:
    """Set `section.key` from command-line text, parsed by the field's type."""
    section, name, hint = _field(cfg, key)
    setattr(section, name, _from_text(text, hint, key))


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set `section.key` to a typed value (None clears an optional field), checked like TOML."""
    section, name, hint = _field(cfg, key)
    optional = type(None) in typing.get_args(hint)
    setattr(section, name, None if value is None and optional else _check_type(value, hint, key))


def _field_names(obj: Any) -> list[str]:
    inverse = {v: k for k, v in ALIASES.items()}
    return [inverse.get(f.name, f.name) for f in dataclasses.fields(obj)]


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for toml_key, value in raw.items():
        key = ALIASES.get(toml_key, toml_key)
        dotted = f"{prefix}{toml_key}"
        if key not in hints:
            where = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigError(f"unknown config key {dotted!r}: keys of {where} are {', '.join(_field_names(cls))}")
        if dataclasses.is_dataclass(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {dotted!r} must be a table [{dotted}]")
            kwargs[key] = _build(hints[key], value, f"{dotted}.")
        else:
            kwargs[key] = _check_type(value, hints[key], dotted)
    return cls(**kwargs)


def describe_type(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(hint) if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def _check_type(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_type(value, args[0], key)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key} = {value!r} is not allowed: use {describe_type(hint)}")
        return value
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{key} = {value!r} has the wrong type: it must be {describe_type(hint)}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} must be a finite number")
    return float(value) if hint is float else value


def _from_text(text: str, hint: Any, key: str) -> Any:
    """Parse a command-line string by the field's type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null"):
            return None
        return _from_text(text, next(a for a in typing.get_args(hint) if a is not type(None)), key)
    if origin is Literal or hint is str:
        return _check_type(text, hint, key)
    try:
        if hint is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return _check_type(hint(text), hint, key)
    except ValueError:
        raise ConfigError(f"--{key} {text!r} has the wrong type: it must be {describe_type(hint)}") from None
