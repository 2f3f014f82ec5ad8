"""A slow rank named while the job goes on.

A rank's own compute time is the time it spends in the units it computes with no collective inside
them: its transformer blocks (DDP, ZeRO: FSDP's gathers run in the block's own hooks, before the
timed span starts), its linear layers under tensor parallelism (whose gathers and reductions run in
the layers' hooks, outside the span) and under expert parallelism (whose all-to-alls run inside an
MoE layer, between its router and the experts' matmuls, which are thus left out), its model
parts under `training.compile` (the blocks are compiled whole; the parts' span includes FSDP's
gathers), and its wait for the next batch. The
blocks' backward is timed too where no collective runs inside it and autograd runs it whole (no
FSDP, tensor or context parallelism, pipeline or compile): FSDP's gathers and reductions of the
backward run in autograd hooks whose order against a module's own is not fixed, and the zero-bubble
pipeline schedules split a block's backward in two, which a module's backward hooks do not
survive. A whole-model compile (tensor parallelism alone) has nothing to hook and is not timed. On
a GPU the spans are CUDA events, read when the log interval syncs anyway; on a CPU the clock.
Waiting for a slower peer is thus left out, and a rank that is slow itself (throttled, on a noisy
host, frozen now and then) stands out.

At each log interval the ranks gather their times since the last one: the slowest rank and the
spread (its time over the median of the others') go into the metrics. A rank is named a straggler
(a warning, and `straggler` in the metrics) from its share of the slowness over the intervals of
the last WINDOW_S seconds: its summed time there, less its longest interval, over the median of the
others' sums (each less its longest) above SLOW_RATIO; or, over at least MOSTLY_INTERVALS intervals,
the slowest in MOSTLY of them by SLIGHTLY_SLOW in sum. Once named, a rank stays named while it is
SLIGHTLY_SLOW in sum (a rate near the bar does not name it again and again). A rank stopped now and then is slow by a
different amount in every interval (in many not at all), which no rule that reads intervals one by
one sees; one long pause of one rank is dropped with its longest interval; the noise of a busy
machine moves from rank to rank, and sums over a window even it out.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.logs import log
from meshtrain.model.llama import TransformerBlock

SLOW_RATIO = 1.5  # a straggler's compute time over the window, over the median of the others'
WINDOW_S = 20.0  # seconds of log intervals a straggler's share is read over
FIRST_JUDGED = 3  # intervals in the window before anyone is named
MOSTLY, MOSTLY_INTERVALS, SLIGHTLY_SLOW = 0.9, 20, 1.25  # slowest nearly always: a lower bar


class ComputeTimer:
    """Sums the forward time (and where `backward`, the backward time) of the given modules on this
    rank, and the spans the loop adds (its wait for data)."""

    def __init__(self, modules: list[nn.Module], device: torch.device, backward: bool = False):
        self.cuda, self.timed = device.type == "cuda", bool(modules)
        self.seconds, self.events, self.started = 0.0, [], []
        self.backward_started: dict[int, object] = {}  # by module: a hook that never ends is overwritten
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._stop, prepend=True))  # before TP's collective
            if backward:  # a block whose input needs no gradient (frozen embeddings) ends at its output's
                warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed")
                self.handles.append(module.register_full_backward_pre_hook(self._start_backward))
                self.handles.append(module.register_full_backward_hook(self._stop_backward))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add_span(self, start) -> None:
        if self.cuda:
            self.events.append((start, self._now()))
        else:
            self.seconds += time.perf_counter() - start

    def _start(self, module, args) -> None:
        self.started.append(self._now())

    def _stop(self, module, args, output) -> None:
        self._add_span(self.started.pop())

    def _start_backward(self, module, grad_output) -> None:
        self.backward_started[id(module)] = self._now()

    def _stop_backward(self, module, grad_input, grad_output) -> None:
        start = self.backward_started.pop(id(module), None)
        if start is not None:
            self._add_span(start)

    def add(self, seconds: float) -> None:
        """A span the caller timed on the host (the wait for a batch)."""
        self.seconds += seconds

    def take(self) -> float:
        """Seconds since the last call (on a GPU, the events recorded so far must have completed)."""
        seconds = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return seconds


def compute_timer(parts: list[nn.Module], device: torch.device, layout, compiled: bool, world: int) -> ComputeTimer:
    """A timer of the units whose forward (and backward, where no collective runs inside it) is this
    rank's compute (see the module docstring)."""
    if world == 1 or (compiled and layout.tp > 1):
        return ComputeTimer([], device)
    if layout.tp > 1 or layout.ep > 1:
        return ComputeTimer([m for part in parts for m in part.modules() if isinstance(m, nn.Linear)], device)
    if compiled:
        return ComputeTimer(list(parts), device)
    blocks = [m for part in parts for m in part.modules() if isinstance(m, TransformerBlock)]
    return ComputeTimer(blocks, device, backward=not layout.fsdp and layout.cp == 1 and layout.pp == 1)


class StragglerDetector:
    def __init__(self, timer: ComputeTimer, device: torch.device, world: int):
        self.timer, self.device, self.world = timer, device, world
        self.started = time.monotonic()
        self.window: deque[tuple[float, list[float]]] = deque()  # (when, each rank's seconds)
        self.named: int | None = None

    def report(self) -> dict:
        """Every rank calls this at a log interval: {slowest_rank, compute_spread, compute_s}, and
        `straggler` while one is named (with one rank: {}). Every rank reads the same gathered times
        and clock (the latest rank's), so all agree on whom they name."""
        if not self.timer.timed or not dist.is_initialized():
            return {}
        clock = time.monotonic() - self.started
        mine = torch.tensor([self.timer.take(), clock], dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        seconds, now = [t[0].item() for t in gathered], max(t[1].item() for t in gathered)
        slowest, spread = _slowest(seconds)
        record = {"slowest_rank": slowest, "compute_spread": round(spread, 3), "compute_s": round(seconds[slowest], 4)}
        straggler = self.observe(now, seconds)
        return record | ({"straggler": straggler} if straggler is not None else {})

    def observe(self, now: float, seconds: list[float]) -> int | None:
        """The straggler after an interval that ended `now` (seconds since the start) in which the
        ranks computed `seconds`; warned about when it is named."""
        self.window.append((now, seconds))
        while now - self.window[0][0] > WINDOW_S:
            self.window.popleft()
        straggler, ratio = self._straggler()
        if straggler is not None and straggler != self.named:
            log.warning(
                f"rank {straggler} is a straggler: over the last {len(self.window)} log intervals its compute took "
                f"{ratio:.2f}x the other ranks' median (without each one's longest interval), the slowest in "
                f"{self._times_slowest(straggler)} of them; the job waits for it at every collective (a throttled "
                "or shared device, a noisy host?)"
            )
        self.named = straggler
        return straggler

    def _times_slowest(self, rank: int) -> int:
        return sum(_slowest(seconds)[0] == rank for _, seconds in self.window)

    def _straggler(self) -> tuple[int | None, float]:
        """(the straggler or None, its trimmed sum over the others' median): see the module docstring."""
        if len(self.window) < FIRST_JUDGED:
            return None, 1.0
        by_rank = [[seconds[r] for _, seconds in self.window] for r in range(self.world)]
        rank, ratio = _slowest([sum(times) - max(times) for times in by_rank])
        mostly = len(self.window) >= MOSTLY_INTERVALS and self._times_slowest(rank) >= MOSTLY * len(self.window)
        stays = rank == self.named or mostly  # named, it stays so until it is barely slower
        return (rank if ratio > SLOW_RATIO or (stays and ratio > SLIGHTLY_SLOW) else None), ratio


def _slowest(seconds: list[float]) -> tuple[int, float]:
    """(the slowest rank, its time over the median of the others')."""
    slowest = max(range(len(seconds)), key=seconds.__getitem__)
    median = statistics.median(s for r, s in enumerate(seconds) if r != slowest)
    return slowest, seconds[slowest] / median if median > 0 else 1.0
