"""A slow rank named while the job goes on.

A rank's own compute time is the forward time of the units it computes with no collective inside
them: its transformer blocks (DDP, ZeRO: FSDP's gathers run in the block's own hooks, before the
timed span starts), its linear layers under tensor parallelism (whose gathers and reductions run in
the layers' hooks, outside the span), its model parts under `training.compile` (the blocks are
compiled whole; the parts' span includes FSDP's gathers). A whole-model compile (tensor
parallelism alone) has nothing to hook and is not timed. On a GPU the spans are CUDA events, read
when the log interval syncs anyway; on a CPU the clock. Waiting for a slower peer is thus left out,
and a rank that is slow itself (throttled, on a noisy host, frozen now and then) stands out.

At each log interval the ranks gather their times since the last one: the slowest rank and the
spread (its time over the median of the others') go into the metrics, and a rank that is the
slowest by more than SLOW_RATIO for SLOW_INTERVALS intervals in a row is named in a warning and as
`straggler`. The noise of a busy machine moves from rank to rank and is not named.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.logs import log
from meshtrain.model.llama import TransformerBlock

SLOW_RATIO = 1.5  # the slowest rank's compute time over the median of the others'
SLOW_INTERVALS = 3  # log intervals in a row


class ComputeTimer:
    """Sums the forward time of the given modules on this rank."""

    def __init__(self, modules: list[nn.Module], device: torch.device):
        self.cuda, self.timed = device.type == "cuda", bool(modules)
        self.seconds, self.events, self.started = 0.0, [], []
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._stop, prepend=True))  # before TP's collective

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, module, args) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.started.append(event)
        else:
            self.started.append(time.perf_counter())

    def _stop(self, module, args, output) -> None:
        start = self.started.pop()
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((start, end))
        else:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        """Seconds since the last call (on a GPU, the events recorded so far must have completed)."""
        seconds = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return seconds


def timed_modules(parts: list[nn.Module], compiled: bool, tp: int, world: int) -> list[nn.Module]:
    """The units whose forward is this rank's compute (see the module docstring)."""
    if world == 1 or (compiled and tp > 1):
        return []
    if tp > 1:
        return [m for part in parts for m in part.modules() if isinstance(m, nn.Linear)]
    if compiled:
        return list(parts)
    return [m for part in parts for m in part.modules() if isinstance(m, TransformerBlock)]


class StragglerDetector:
    def __init__(self, timer: ComputeTimer, device: torch.device, world: int):
        self.timer, self.device, self.world = timer, device, world
        self.streak: dict[int, int] = {}

    def report(self) -> dict:
        """Every rank calls this at a log interval: {slowest_rank, compute_spread, compute_s} (with
        one rank: {}); a persistent straggler is warned about."""
        if not self.timer.timed or not dist.is_initialized():
            return {}
        mine = torch.tensor([self.timer.take()], dtype=torch.float64, device=self.device)
        times = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(times, mine)
        seconds = [t.item() for t in times]
        slowest = max(range(self.world), key=seconds.__getitem__)
        median = statistics.median(s for r, s in enumerate(seconds) if r != slowest)
        spread = seconds[slowest] / median if median > 0 else 1.0
        self.streak = {slowest: self.streak.get(slowest, 0) + 1} if spread > SLOW_RATIO else {}
        if self.streak.get(slowest) == SLOW_INTERVALS:
            log.warning(
                f"rank {slowest} is a straggler: its compute took {spread:.2f}x the other ranks' median for "
                f"{SLOW_INTERVALS} log intervals in a row ({seconds[slowest]:.3f} s vs {median:.3f} s); the "
                "job waits for it at every collective (a throttled or shared device, a noisy host?)"
            )
        record = {"slowest_rank": slowest, "compute_spread": round(spread, 3), "compute_s": round(seconds[slowest], 4)}
        return record | ({"straggler": slowest} if self.streak.get(slowest, 0) >= SLOW_INTERVALS else {})
