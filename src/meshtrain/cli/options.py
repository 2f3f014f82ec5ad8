"""Flags generated from declarations: a command's options are a dataclass (config/options.py: type,
bounds, grammar and doc declared once), config keys are the config tree's own declarations. One
grammar everywhere: no abbreviations, config keys spelled as keys, each mistake one `error:` line."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from meshtrain.config import Declared, config_keys, declared
from meshtrain.config.options import MISSING
from meshtrain.errors import ConfigError, MeshtrainError


class Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` line, like every other mistake. No abbreviations: `--gpus` is not
    `--gpus-per-node`, and a flag that is not spelled out is refused."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _get_values(self, action, arg_strings):
        # argparse drops a "--" value (`--nproc=--`) and hands the action nothing: refuse it instead
        if action.option_strings and "--" in arg_strings and action.nargs not in (0, argparse.REMAINDER):
            self.error(f"argument {'/'.join(action.option_strings)}: '--' is not a value")
        return super()._get_values(action, arg_strings)

    def error(self, message: str):
        hint = " (a value that starts with '-' is written --key=VALUE)" if "expected one argument" in message else ""
        raise MeshtrainError(f"{self.prog}: {message}{hint}; see {self.prog} --help")


def text_parser(d: Declared, flag: str):
    """An argparse type: text -> the declared value, or the declaration's reason (without the name,
    which argparse puts in front). A list option's flag parses one element."""
    d = d.item if d.is_list else d

    def parse(text: str):
        try:
            return d.from_text(text)
        except ConfigError as e:
            message = str(e)
            for prefix in (f"{d.name} = ", f"{d.name}: ", f"{d.name} "):
                message = message.removeprefix(prefix)
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = flag  # argparse names a failed type by it
    return parse


def metavar(d: Declared) -> str | None:
    if d.choices is not None:
        return "{" + ",".join(repr(c) if c == "" else str(c) for c in d.choices) + "}"
    base = typing.get_args(d.base)[0] if d.is_list else d.base
    return {int: "INT", float: "FLOAT", bool: "BOOL"}.get(base, "STR")


def add_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """A flag (or positional) for every field of an options dataclass, as declared."""
    groups: dict[str, Any] = {}
    for name, d in declared(cls).items():
        if name in skip:
            continue
        meta = d.meta
        flags = meta.get("flags") or ("--" + name.replace("_", "-"),)
        default = None if d.default is MISSING else d.default
        shown = default not in (None, "", False, []) and "default" not in d.doc
        doc = d.doc + (f" (default: {default})" if shown else "")
        where = parser
        if "exclusive" in meta:
            if meta["exclusive"] not in groups:  # one group each: an empty one breaks argparse's usage line
                groups[meta["exclusive"]] = parser.add_mutually_exclusive_group()
            where = groups[meta["exclusive"]]
        if meta.get("positional"):
            where.add_argument(name, type=text_parser(d, name), help=doc.replace("%", "%%")).declared = d
            continue
        kwargs: dict[str, Any] = {"dest": name, "help": doc.replace("%", "%%")}
        if d.base is bool:  # a switch; one on by default also as --no-<name>, or nothing could turn it off
            on = {"action": argparse.BooleanOptionalAction, "default": True}
            kwargs |= on if default else {"action": "store_true"}
        else:
            kwargs |= {"type": text_parser(d, flags[0]), "metavar": metavar(d), "default": default}
            kwargs |= {"choices": d.choices} if d.choices is not None else {}
            if d.is_list:
                kwargs |= {"nargs": "+"} if meta.get("nargs") == "+" else {"action": "append"}
                kwargs["default"] = None
            elif meta.get("nargs") == "?":
                kwargs |= {"nargs": "?", "const": meta["const"]}
            if d.default is MISSING:
                kwargs |= {"required": True, "default": argparse.SUPPRESS}
        where.add_argument(*flags, **kwargs).declared = d  # what the flag takes, for --help and the tests


def options_of(args: argparse.Namespace, cls: type, **extra) -> Any:
    """The options dataclass from parsed flags (a list flag never given is its declared default)."""
    values = {}
    for name, d in declared(cls).items():
        if name in extra:
            values[name] = extra[name]
        elif hasattr(args, name):
            value = getattr(args, name)
            values[name] = d.default if value is None and d.is_list and d.default is not MISSING else value
    return cls(**values)


class ConfigKey(argparse.Action):
    """`--section.key VALUE`: collected in order as overrides, parsed and checked by the config
    loader (config.load_config), so a key means the same on every command that takes it."""

    def __init__(self, *args, key: str, **kwargs):
        self.key = key
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        if self.nargs == 0:  # --flag / --no-flag of a boolean key
            value = "false" if (option_string or "").startswith("--no-") else "true"
        namespace.overrides = [*(getattr(namespace, "overrides", None) or []), f"--{self.key}", value]


def add_config_keys(parser: argparse.ArgumentParser, keys: list[str] | None = None) -> None:
    """Flags for config keys (all of them, or `keys`), with their declared type, default and doc, in
    sections of --help. A key declared with short spellings (`option(flags=...)`) takes them too on
    every command: a boolean key's as switches (--compile / --no-compile), the others' with a value."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, d in config_keys().items():
        if keys is not None and key not in keys:
            continue
        section = key.split(".")[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}] config keys")
        short = d.meta.get("flags", ())
        help_text = f"{d.doc} (default: {d.default!r})".replace("%", "%%")
        text_choices = d.choices if d.choices is not None and all(isinstance(c, str) for c in d.choices) else None
        groups[section].add_argument(
            f"--{key}",
            *(() if d.base is bool else short),
            action=ConfigKey,
            key=key,
            metavar=metavar(d),
            choices=text_choices,
            default=argparse.SUPPRESS,
            help=help_text,
        ).declared = d
        if d.base is bool and short:
            switches = (*short, *(f"--no-{flag[2:]}" for flag in short))
            groups[section].add_argument(
                *switches, action=ConfigKey, key=key, nargs=0, default=argparse.SUPPRESS, help=f"--{key} as a switch"
            ).declared = d
