"""Options declared once: a field's annotation is its type (a Literal: its choices), `option(...)`
adds its bounds and grammar, and the string under it is its documentation. Every reader checks a
value against that one declaration: the config loader (TOML, `--section.key VALUE`, dicts from code),
the flags of every command (cli/options.py generates them from the same dataclasses) and jobscript.
A value that does not fit is refused in one line naming the option, the value and what is allowed."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from meshtrain.errors import ConfigError

MISSING = dataclasses.MISSING


def option(
    default: Any = MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    parse: Callable[[str], Any] | None = None,
    check: Callable[[Any], Any] | None = None,
    default_factory: Callable[[], Any] | None = None,
    flags: tuple[str, ...] = (),
    positional: bool = False,
    nargs: str | None = None,
    const: Any = None,
    exclusive: str | None = None,
    verbatim: bool = False,
) -> Any:
    """A dataclass field with bounds (ge/gt/le/lt), a text grammar (`parse`: text -> value, such as
    a size "64M" -> bytes) and a check of the typed value (`check`: raises ValueError with the reason).
    `flags`: a command option's spellings (default --field-name), or a config key's short spellings,
    which every command that reads config keys takes beside --section.key. For a command's own
    options: a positional; `nargs` "+" (a list in one flag) or "?" with `const` (the value of the bare
    flag); `exclusive`: a group of options of which one at most may be given; `verbatim`: the text as
    given, "none" and "null" included (a secret, which must not silently read as unset)."""
    given = {"ge": ge, "gt": gt, "le": le, "lt": lt, "parse": parse, "check": check, "flags": flags}
    given |= {"positional": positional, "nargs": nargs, "const": const, "exclusive": exclusive, "verbatim": verbatim}
    meta = {k: v for k, v in given.items() if v is not None and v is not False and v != ()}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Declared:
    """One option as declared: its name (a config key, or a flag's name), type, default, bounds and doc."""

    name: str
    hint: Any
    default: Any
    meta: dict
    doc: str

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.hint)

    @property
    def base(self) -> Any:
        """The type without None (`int | None` -> int)."""
        if typing.get_origin(self.hint) in (typing.Union, types.UnionType):
            return next(a for a in typing.get_args(self.hint) if a is not type(None))
        return self.hint

    @property
    def choices(self) -> tuple | None:
        return typing.get_args(self.base) if typing.get_origin(self.base) is Literal else None

    @property
    def is_list(self) -> bool:
        return typing.get_origin(self.base) is list

    @property
    def item(self) -> Declared:
        """A list option's element, with the same bounds and grammar."""
        return dataclasses.replace(self, hint=typing.get_args(self.base)[0])

    def describe(self) -> str:
        """What is allowed, in words: "an integer at least 1", "one of 'fp32', 'bf16'"."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        base = typing.get_args(self.base)[0] if self.is_list else self.base
        words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(base, str(base))
        return ", ".join(filter(None, [words, self.bounds()]))

    def bounds(self) -> str:
        """The declared range in words: "positive", "between 1 and 65535", "at least 0 and below 1"."""
        m = self.meta
        if m.get("gt") == 0 and len({"ge", "le", "lt"} & m.keys()) == 0:
            return "positive"
        if "ge" in m and "le" in m:
            return f"between {m['ge']} and {m['le']}"
        return " and ".join(f"{w} {m[k]}" for k, w in BOUND_WORDS.items() if k in m)

    def check(self, value: Any) -> Any:
        """A typed value (TOML, code or parsed text) against the declaration: the value, or ConfigError."""
        if value is None and self.optional:
            return None
        if self.is_list:
            if not isinstance(value, list):
                raise ConfigError(f"{self.name} = {value!r} must be a list")
            return [self.item.check(v) for v in value]
        value = _check_type(self.name, value, self.base)
        if self.choices is None and isinstance(value, (int, float)) and not isinstance(value, bool):
            for key, fails in BOUND_TESTS.items():
                if key in self.meta and fails(value, self.meta[key]):
                    raise ConfigError(f"{self.name} = {value} must be {self.bounds()}")
        if "check" in self.meta:
            try:
                self.meta["check"](value)
            except ValueError as e:
                raise ConfigError(f"{self.name} = {value!r}: {e}") from None
        return value

    def from_text(self, text: str) -> Any:
        """Command-line text, parsed by the declared grammar or type, then checked."""
        if self.optional and not self.meta.get("verbatim") and text.lower() in ("none", "null"):
            return None
        base = typing.get_args(self.base)[0] if self.is_list else self.base
        if "parse" in self.meta:
            try:
                value = self.meta["parse"](text)
            except ValueError as e:
                raise ConfigError(f"{self.name}: {e}") from None
        elif base is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"{self.name} {text!r} has the wrong type: it must be true or false")
            value = text.lower() in ("true", "1", "yes")
        elif self.choices is not None and isinstance(self.choices[0], int):
            value = int(text) if text.strip().lstrip("-").isdigit() else text
        elif base in (int, float):
            try:
                value = base(text)
            except ValueError:
                raise ConfigError(f"{self.name} {text!r} has the wrong type: it must be {self.describe()}") from None
        else:
            value = text
        return self.check([value] if self.is_list else value)


BOUND_WORDS = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
BOUND_TESTS = {
    "ge": lambda v, b: v < b,
    "gt": lambda v, b: v <= b,
    "le": lambda v, b: v > b,
    "lt": lambda v, b: v >= b,
}


def _check_type(name: str, value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            allowed = ", ".join(repr(a) for a in choices)
            raise ConfigError(f"{name} = {value!r} is not allowed: use one of {allowed}")
        return value
    ok = (
        (hint is bool and isinstance(value, bool))
        or (hint is int and isinstance(value, int) and not isinstance(value, bool))
        or (hint is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (hint is str and isinstance(value, str))
    )
    if not ok:
        words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))
        raise ConfigError(f"{name} = {value!r} has the wrong type: it must be {words}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"{name} = {value!r} must be a finite number")
    return float(value) if hint is float else value


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


@functools.cache
def declared(cls: type, prefix: str = "") -> dict[str, Declared]:
    """Every field of an options dataclass, by field name, as declared (names shown as prefix + name)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        name = prefix + f.name.rstrip("_")  # a Python keyword as a key: checkpoint.async is field async_
        out[f.name] = Declared(name, hints[f.name], default, dict(f.metadata), docs.get(f.name, ""))
    return out


def check_declared(obj: Any) -> None:
    """Every field of an options dataclass instance against its declaration (for values set in code)."""
    for name, d in declared(type(obj)).items():
        d.check(getattr(obj, name))
