"""The checks of values read back from files: a data manifest (data/format.py), a checkpoint's train
state (checkpoint/commit.py), a model record (model/args.py). One definition, so that every reader
agrees on what a count is (an int, never a bool) and what a number is (never NaN, inf or huge)."""

from __future__ import annotations

import math
from collections.abc import Callable

LARGEST_COUNT = 2**63 - 1  # an int64: more tokens, steps or bytes than any run has (and any training.seed)
LARGEST_SIZE = 2**31 - 1  # a width, depth, head count or vocabulary past this fits no device's memory
LARGEST_NUMBER = 1e12  # a learning rate, a RoPE base, a loss scale factor: never more


def whole(value, low: int = 0, high: int = LARGEST_COUNT) -> bool:
    return type(value) is int and low <= value <= high


def number(value, low: float = 0.0, high: float = LARGEST_NUMBER, *, above: bool = False) -> bool:
    """A finite int or float in [low, high] (`above`: in (low, high])."""
    if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)):
        return False  # an int is compared exactly (math.isfinite of 10**400 would raise)
    return (value > low if above else value >= low) and value <= high


def numbers(value, low: float = 0.0) -> bool:
    return isinstance(value, list) and all(number(v, low) for v in value)


def first_problem(fields: dict[str, Callable], record: dict, prefix: str = "", others: bool = False) -> str | None:
    """The first field of `record` its check in `fields` refuses ("loader.seed is -1"), or that
    `fields` does not know ("unknown field loader.x"; `others`: fields not listed are someone else's
    to read), or None."""
    for key, value in record.items():
        if key in fields and not fields[key](value):
            return f"{prefix}{key} is {value!r}"
        if key not in fields and not others:
            return f"unknown field {prefix}{key}"
    return None
