"""How the CPU probes time their candidates (job/arithmetic.py, job/attention_backward.py): one
thread by its CPU time, and whether other processes kept the machine busy meanwhile."""

from __future__ import annotations

import time
import types

import torch

from meshtrain.hardware import BUSY, OtherLoad  # noqa: F401  (the probes read them here)


def timed_ms(fn) -> float:
    """Wall-clock ms; with one thread CPU ms (the same when the machine is quiet, and unstretched
    when other processes take turns on the core: ten starts of `tiny` under two busy processes kept
    their pick by CPU time and not by the clock)."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn()
    return (clock() - start) * 1e3


def own_code(fn):
    """`fn` with a code object of its own, for a probe to compile: dynamo keeps the graphs it
    compiles per code object, up to its recompile_limit (8), beyond which a function runs eagerly;
    the probes' candidates, each another module or shape, would fill one code object's entries."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def quiet_record(record, field: str, names) -> bool:
    """Whether a cached probe record is `{field: {name: ms} for exactly `names`, "busy": share}`,
    measured on a machine that others did not keep busy (a busy one's is measured again at the next
    start)."""
    return (
        isinstance(record, dict)
        and set(record) == {field, "busy"}
        and isinstance(record["busy"], float)
        and 0 <= record["busy"] <= BUSY
        and isinstance(record[field], dict)
        and set(record[field]) == set(names)
        and all(isinstance(ms, (int, float)) and ms > 0 for ms in record[field].values())
    )
