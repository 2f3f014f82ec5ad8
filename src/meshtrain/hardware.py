"""Facts about the machine a process runs on, read by the trainer's metrics and by the planner:
the dense peak of each GPU (data sheets), and the CPU's matmul peak measured on the spot, cached per
CPU model and thread count (job/arithmetic.py keeps its own probe in the same cache directory)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from meshtrain.datasheets import GPU_PEAK_TFLOPS
from meshtrain.errors import MeshtrainError
from meshtrain.files import write_json


def keep_freed_memory() -> bool:
    """Keep the memory a CPU training process frees for its next allocations (glibc's mallopt: no
    mmap for large blocks, no trimming of the heap's top), so that each step's activations reuse the
    pages the previous step touched instead of faulting fresh zeroed ones in from the kernel. glibc
    serves a block over its mmap threshold (at most 32 MiB) with mmap and unmaps it when freed, and
    `small`'s 8 x 256 tokens hold fp32 logits of 64 MiB. Measured on a 2-core Xeon (torch 2.13):
    `small`'s eager bf16 step 1,001 -> 936 ms; its compiled one, whose graphs reuse their buffers,
    unchanged. The heap keeps its high-water mark, which a training step reaches every step anyway.
    False where the C library has no mallopt (musl, macOS)."""
    import ctypes

    m_trim_threshold, m_mmap_max = -1, -4
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**30))


# Quiet probes of the CPU's matmul peak after which it is read, not measured, at a start.
SETTLED_PROBES = 3


def _probe_generator() -> torch.Generator:
    """Probes draw from their own generator: one run measures, another reads the cache, and the
    training's random state (restored from a checkpoint on resume) must not depend on which."""
    return torch.Generator().manual_seed(0)


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


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshtrain" / "cpu_peak.json"


def measure_cpu_peak_tflops(dtype: torch.dtype, n: int = 2048, repeats: int = 3, budget_s: float = 0.15) -> float:
    """The best square-matmul throughput at this process's thread count over the sizes 256, 512, ...
    up to n, each the best of `repeats`. No one size is the peak everywhere: on a 2-core Zen 3 at 2
    threads fp32 read 0.165 TFLOP/s at 512, 0.143 at 1024 and 0.167 at 2048, and a probe that stopped
    at 1024 put a compiled `small` step (its GEMMs at 0.16-0.17) at 96% MFU. A size is taken only while
    one matmul of it is expected (8x the last size's) to take under `budget_s`: every start probes until
    the peak settles, so an emulated dtype (fp16 or bf16 without the instructions, up to 80x slower
    than fp32) stops at 256, and the whole probe stays well under a second."""
    size, best = 256, 0.0
    while True:
        a, b = (torch.randn(size, size, dtype=dtype, generator=_probe_generator()) for _ in range(2))
        start = time.perf_counter()
        torch.matmul(a, b)  # warm up, and see how long one takes
        first = time.perf_counter() - start
        fastest = math.inf
        for _ in range(repeats):
            t = time.perf_counter()
            torch.matmul(a, b)
            fastest = min(fastest, time.perf_counter() - t)
        best = max(best, 2 * size**3 / fastest / 1e12)
        if size >= n or 8 * min(first, fastest) > budget_s:
            return best
        size *= 2


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_key(dtype: torch.dtype) -> str:
    """A peak holds for one CPU model, core count, thread count and dtype."""
    # "squares to 2048": the probe's sizes; a peak of the earlier probe (one size, read low) is measured again
    return f"{cpu_model()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}|squares to 2048"


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def _locked_cache(file: str):
    """The records of ~/.cache/meshtrain/<file> (a dict to change in place, written back after), under
    an exclusive lock on the file: the ranks of a job (and jobs side by side) take turns. None where
    the cache cannot be opened (a read-only home only loses the record)."""
    path = _cache_file().with_name(file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield None
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = _read_cache(path)
        before = dict(cache)
        yield cache
        if cache != before:
            try:
                write_json(path, cache)
            except (OSError, MeshtrainError):
                pass


def cached_measurement(key: str, measure, keep_max: bool, file: str = "cpu_peak.json", valid=None):
    """A machine measurement kept in ~/.cache/meshtrain/<file>. keep_max False: measured once and then
    read (any JSON value; a record that `valid` refuses, another version's or one edited by hand, is
    measured again). keep_max True (a number): measured at each start, keeping the largest, until
    SETTLED_PROBES of them were taken on a quiet machine, and read after that. Measured under the
    cache's lock: ranks measure one at a time, not against each other, and a measure-once value is
    measured by whoever comes first and read by the rest."""
    with _locked_cache(file) as cache:
        if cache is None:
            return measure()
        record = cache.get(key)
        if not keep_max:
            if key in cache and (valid is None or valid(record)):
                return record
            cache[key] = measure()
            return cache[key]
        best, quiet = _max_record(record)
        if quiet >= SETTLED_PROBES:
            return best
        with OtherLoad() as load:
            measured = measure()
        cache[key] = {"best": max(best, measured), "quiet_probes": quiet + (load.share <= BUSY)}
        return cache[key]["best"]


def raise_cpu_peak(dtype: torch.dtype, achieved_tflops: float) -> float:
    """The CPU peak of `dtype`, raised to `achieved_tflops` where a run's steps went faster than it: a
    step's whole-model rate is a lower bound on the matmul peak, so the probe read low (a shared VM's
    speed moves by 20% between seconds) and MFU would read above 100%. Kept for later runs."""
    key = cpu_peak_key(dtype)
    with _locked_cache("cpu_peak.json") as cache:
        if cache is None:
            return achieved_tflops
        best, quiet = _max_record(cache.get(key))
        if achieved_tflops > best:
            cache[key] = {"best": achieved_tflops, "quiet_probes": quiet}
        return max(best, achieved_tflops)


def _max_record(record) -> tuple[float, int]:
    """(best, quiet probes) of a keep_max record; (0, 0) for anything else (measured again)."""
    if isinstance(record, dict) and set(record) == {"best", "quiet_probes"}:
        best, quiet = record["best"], record["quiet_probes"]
        if isinstance(best, (int, float)) and best > 0 and isinstance(quiet, int) and quiet >= 0:
            return float(best), quiet
    return 0.0, 0


def cpu_peak_tflops(dtype: torch.dtype) -> float:
    """The best matmul throughput measured on this (CPU, thread count, dtype). A probe (well under a
    second) at each start, keeping the maximum, until SETTLED_PROBES were taken on a quiet machine:
    a probe taken while the machine was busy reads low and would inflate MFU (once 119%), but it can
    never read high, and it does not count toward the settled ones."""
    return cached_measurement(cpu_peak_key(dtype), lambda: measure_cpu_peak_tflops(dtype), keep_max=True)


def mfu_peak_tflops(device: torch.device, training_dtype: str, override: float = 0.0, fp8: str = "off") -> float:
    """What MFU divides by: the best dense peak the device has for the training's arithmetic, whatever
    the step picked (bf16/fp16 training on a CPU: the larger of its half-precision and fp32 matmul
    peaks, measured; on a GPU the data sheet's tensor-core peak, and with training.fp8 its FP8 peak).
    A slow choice then shows as a low MFU, never a high one."""
    if override > 0:
        return override
    dtype = _half_dtype(training_dtype)
    if device.type == "cpu":
        return max(cpu_peak_tflops(d) for d in {dtype, torch.float32})
    peak = device_peak_tflops(device, dtype)
    return max(peak, device_peak_tflops(device, torch.float8_e4m3fn)) if fp8 != "off" else peak


def _half_dtype(training_dtype: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(training_dtype, torch.float32)


def mfu_peak_floor(device: torch.device, training_dtype: str, override: float = 0.0):
    """Where MFU's peak was measured (a CPU without training.peak_tflops): the function that raises
    it to a rate a run reached (raise_cpu_peak, for the dtype whose peak MFU divides by); else None."""
    if device.type != "cpu" or override > 0:
        return None

    def raise_peak(achieved_tflops: float) -> float:  # which dtype's: looked up only when a window beats it
        dtype = max({_half_dtype(training_dtype), torch.float32}, key=cpu_peak_tflops)
        return raise_cpu_peak(dtype, achieved_tflops)

    return raise_peak


def device_peak_tflops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float:
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for pattern, half, fp32, fp8 in GPU_PEAK_TFLOPS:
            if pattern in name:
                return {torch.bfloat16: half, torch.float16: half, torch.float8_e4m3fn: fp8}.get(dtype, fp32)
        return 0.0  # unknown GPU: MFU is reported as 0 unless training.peak_tflops is set
    return cpu_peak_tflops(dtype)
