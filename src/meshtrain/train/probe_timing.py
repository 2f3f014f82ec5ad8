"""How the CPU probes time their candidates (train/arithmetic.py, train/attention_backward.py): one
thread by its CPU time, and whether other processes kept the machine busy meanwhile."""

from __future__ import annotations

import os
import time
import types

import torch

# Other processes used more of the CPUs than this while the probe measured: the record is not reused,
# and a multi-threaded probe is taken again on one thread, by CPU time (bench/README.md 1b: ten starts)
BUSY = 0.25


class OtherLoad:
    """The share of the machine's CPU time that other processes used while this one measured, from
    /proc/stat's busy time less this process's CPU time and its finished children's (the compiler
    that inductor runs for a compiled probe) (0 where /proc/stat is missing)."""

    share = 0.0

    def __enter__(self):
        self._start = (_cpu_ticks(), _own_cpu_seconds())
        return self

    def __exit__(self, *exc) -> None:
        (start, ours), end = self._start, _cpu_ticks()
        if start is not None and end is not None and end[1] > start[1]:
            ours_ticks = (_own_cpu_seconds() - ours) * os.sysconf("SC_CLK_TCK")
            self.share = round(max(0.0, (end[0] - start[0] - ours_ticks) / (end[1] - start[1])), 3)


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat's first line."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


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
