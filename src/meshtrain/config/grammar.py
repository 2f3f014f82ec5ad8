"""The grammars of text values: a data blend, a size, a duration. Config keys (`option(check=...)`),
flags and jobscript parse them with these alone."""

from __future__ import annotations

import math
import re

from meshtrain.errors import ConfigError

SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)


def parse_data_path(text: str) -> list[tuple[str, float]]:
    """data.path: one prepared directory, or a blend "DIR:WEIGHT,DIR:WEIGHT,..." -> [(dir, share)]
    with the shares summing to 1."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigError(f"data.path = {text!r} has an empty entry: use DIR or DIR:WEIGHT,DIR:WEIGHT")
    sources = []
    for item in items:
        path, _, weight = item.rpartition(":")
        try:
            value = float(weight) if path else None
        except ValueError:
            value = None
        if value is None:
            if len(items) > 1:
                raise ConfigError(f"data.path = {text!r}: {item!r} has no weight; give every source one, DIR:WEIGHT")
            return [(item, 1.0)]
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"data.path = {text!r}: the weight of {path} is {weight}; weights must be above 0")
        sources.append((path, value))
    if len(sources) == 1:
        raise ConfigError(
            f"data.path = {text!r}: one source takes every sample, so its weight does nothing: drop "
            f"':{item.rpartition(':')[2]}', or blend it with other sources (DIR:WEIGHT,DIR:WEIGHT)"
        )
    paths = [p for p, _ in sources]
    if len(set(paths)) < len(paths):
        raise ConfigError(f"data.path = {text!r} names a directory twice: give each source once")
    total = sum(w for _, w in sources)
    return [(p, w / total) for p, w in sources]


def parse_size(text: str) -> int:
    """The one size grammar of every flag and key: bytes, or a number with K, M, G or T (binary
    multiples; a trailing B or iB is allowed): "4096", "64M", "1.5G", "5GB", "500MiB"."""
    m = SIZE.fullmatch(str(text).strip())
    if not m:
        raise ValueError(f"{text!r} is not a size: write bytes or a number with K, M, G or T (64M, 5G, 5GB)")
    value = int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2).upper() or "_"))
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def parse_duration(text: str, key: str) -> float:
    """ "HH:MM:SS", "MM:SS", seconds, or with days as Slurm writes them, "D-HH", "D-HH:MM", "D-HH:MM:SS"
    -> seconds; "" -> 0 (no limit)."""
    if not text:
        return 0.0
    try:
        days, _, clock = text.rpartition("-")
        parts = [float(x) for x in clock.split(":")]
        if len(parts) > 3 or not all(math.isfinite(p) and p >= 0 for p in parts):
            raise ValueError
        if days:  # after a day count the first field is hours
            parts += [0.0] * (3 - len(parts))
        seconds = sum(v * 60**i for i, v in enumerate(reversed(parts))) + (86400 * int(days) if days else 0)
    except ValueError:
        raise ConfigError(f'{key} = "{text}" is not a duration: use "HH:MM:SS" or seconds') from None
    if seconds <= 0:
        raise ConfigError(f"{key} = {text!r} must be positive")
    return seconds
