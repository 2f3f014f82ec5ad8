"""Reading a config: TOML file -> dataclasses, `--section.key VALUE` overrides, each value checked by
its key's declaration (config/options.py). Every failure names the key, the value and what is
allowed, as one line (`ConfigError`)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from meshtrain.config.schema import ALIASES, SECTIONS, Config, config_keys
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
    cfg = _build(raw)
    if isinstance(overrides, dict):
        for key, value in overrides.items():
            set_value(cfg, key, value)
    else:
        for key, text in parse_overrides(overrides or []):
            set_dotted(cfg, key, text)
    return cfg.validate()


def short_flags() -> dict[str, tuple[str, str | None]]:
    """Each key's declared short spelling (`option(flags=...)`) -> (the key, the value of a boolean
    key's switch: --compile "true", --no-compile "false"; None where the flag takes a value)."""
    out: dict[str, tuple[str, str | None]] = {}
    for key, d in config_keys().items():
        for flag in d.meta.get("flags", ()):
            if d.base is bool:
                out |= {flag: (key, "true"), f"--no-{flag[2:]}": (key, "false")}
            else:
                out[flag] = (key, None)
    return out


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """`--training.steps 50` or `--training.steps=50` -> [("training.steps", "50")]; a key's short
    spelling as declared (`--seq-len 50`, `--compile`) reads the same."""
    pairs, i, shorts = [], 0, short_flags()
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in shorts:
            key, switch = shorts[name]
            if switch is not None:
                if "=" in arg:
                    raise ConfigError(
                        f"{name} is a switch and takes no value: {name}, or --{key} {arg.split('=', 1)[1]}"
                    )
                pairs.append((key, switch))
                i += 1
                continue
            arg = f"--{key}{arg[len(name) :]}"
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


def _declared(key: str):
    """The declaration of a dotted key, or a ConfigError naming the known keys."""
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config key {key!r}: sections are {', '.join(SECTIONS)}")
    found = config_keys().get(key)
    if found is None:
        raise ConfigError(f"unknown config key {key!r}: keys of [{section}] are {', '.join(_key_names(section))}")
    return found


def _set(cfg: Config, key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    setattr(getattr(cfg, section), ALIASES.get(name, name), value)


def set_dotted(cfg: Config, key: str, text: str) -> None:
    """Set `section.key` from command-line text, parsed and checked by the key's declaration."""
    _set(cfg, key, _declared(key).from_text(text))


def set_value(cfg: Config, key: str, value: Any) -> None:
    """Set `section.key` to a typed value (None clears an optional key), checked like TOML."""
    _set(cfg, key, _declared(key).check(value))


def _key_names(section: str) -> list[str]:
    return [key.partition(".")[2] for key in config_keys() if key.startswith(section + ".")]


def _build(raw: dict[str, Any]) -> Config:
    """A TOML document -> Config, every value checked by its key's declaration."""
    cfg = Config()
    for section, table in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config key {section!r}: keys of the top level are {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"config key {section!r} must be a table [{section}]")
        for name, value in table.items():
            key = f"{section}.{name}"
            if key not in config_keys():
                raise ConfigError(
                    f"unknown config key {key!r}: keys of [{section}] are {', '.join(_key_names(section))}"
                )
            _set(cfg, key, config_keys()[key].check(value))
    return cfg
