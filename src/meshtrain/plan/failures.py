"""Effective training time under failures, by simulation (`meshtrain plan --failures`).

A failure process (Poisson in wall-clock time, at a rate per GPU) is replayed against a job of G
replica groups, each failure striking one group:

- checkpoint-restart is one group (the whole job): every failure throws away the work since the last
  checkpoint, then the job restarts and reloads it;
- replica groups (torchft): the struck group leaves, the others lose only the step in flight and train
  on at their share, and the group rejoins from a live peer's state. Only when every group is down at
  once does the job fall back to its checkpoint.

Both write checkpoints at the Young/Daly interval for the rate at which the *whole job* is lost. The
effective training time is the work kept (GPU-seconds of steps that count) over the GPU-seconds spent.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

# Llama 3 pre-training: 466 job interruptions in a 54-day snapshot on 16,384 H100s
# (The Llama 3 Herd of Models, section 3.3.4), which reached > 90% effective training time.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16_384
LLAMA3_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS / 1000)  # per 1,000 GPUs per day
DAY = 86_400.0


@dataclass(frozen=True)
class JobTimes:
    """What a failure costs this job, in seconds: a training step, a blocking checkpoint save, a whole-job
    restart (relaunch, rendezvous, reload of the checkpoint, recompile) and a replica group's rejoin
    (relaunch of its processes and the transfer of a live peer's state)."""

    step: float
    checkpoint: float
    restart: float
    rejoin: float


def job_rate(per_1000_gpu_days: float, gpus: int) -> float:
    """Failures of the job per second."""
    return per_1000_gpu_days * gpus / 1000 / DAY


def all_down_rate(rate: float, groups: int, away: float) -> float:
    """The rate (per second) at which every group is down at once: a failure strikes the last group up
    while the other G-1 are each away (probability q, the steady-state share of time a group is out)."""
    if groups == 1:
        return rate
    per_group = rate / groups
    q = per_group * away / (1 + per_group * away)
    return rate * q ** (groups - 1)


def young_daly(checkpoint: float, mtbf: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work between saves) for a save of `checkpoint`
    seconds and a mean time between whole-job losses `mtbf`; it is Young's sqrt(2 C M) to first order."""
    if checkpoint >= 2 * mtbf:
        return mtbf
    x = checkpoint / (2 * mtbf)
    return math.sqrt(2 * checkpoint * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint


def simulate(rate: float, groups: int, times: JobTimes, interval: float, horizon: float, rng: random.Random) -> float:
    """One replay of `horizon` seconds; the share of the GPU-time that trained. Between failures the
    groups up train at their share, less the saves (C every `interval` of wall time since the last
    start); a failure of a group that is up costs the others the step in flight; a failure of the last
    group up (or of the only one) loses the work since the last save and restarts the job."""
    period = interval + times.checkpoint
    useful_share = interval / period
    back = [0.0] * groups  # when each group is up again
    start = 0.0  # the job's last start: saves fall at start + k * period
    done = saved = 0.0  # job-seconds of work, and what the last save holds
    t = 0.0

    def train_until(end: float) -> None:
        nonlocal t, done, saved
        while t < end:
            up = sum(b <= t for b in back)
            nxt = min([b for b in back if t < b < end], default=end)
            if up:
                rate_now = up / groups * useful_share
                last_save = start + math.floor((nxt - start) / period) * period
                if last_save > t:
                    saved = done + rate_now * (last_save - t)
                done += rate_now * (nxt - t)
            t = nxt

    while True:
        at = t + rng.expovariate(rate)
        if at >= horizon:
            train_until(horizon)
            return done / horizon
        train_until(at)
        struck = rng.randrange(groups)
        up = [g for g in range(groups) if back[g] <= at]
        if not up or up == [struck]:  # the job is lost (or its restart struck): it starts again from its save
            done = saved
            start = at + times.restart
            back = [start] * groups
        elif struck in up:
            done = max(saved, done - (len(up) / groups) * times.step)
            back[struck] = at + times.rejoin
        else:  # struck while it was rejoining: the rejoin begins again
            back[struck] = at + times.rejoin


@dataclass(frozen=True)
class Outcome:
    mode: str
    groups: int
    mtbf_s: float  # between losses of the whole job
    interval_s: float  # Young/Daly, capped at the horizon
    effective: float  # mean over the replays
    spread: float  # their standard deviation

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "groups": self.groups,
            "job_mtbf_h": round(self.mtbf_s / 3600, 3) if self.mtbf_s < 1e12 else None,  # None: never
            "checkpoint_interval_s": round(self.interval_s, 1),
            "effective_training_time": round(self.effective, 4),
            "spread": round(self.spread, 4),
        }


def outcome(
    mode: str, rate: float, groups: int, times: JobTimes, horizon: float, replays: int = 8, seed: int = 0
) -> Outcome:
    """Replay the failure process `replays` times at the Young/Daly interval for this mode's job losses."""
    away = times.restart if groups == 1 else times.rejoin
    losses = all_down_rate(rate, groups, away)
    mtbf = 1 / losses if losses > 0 else math.inf  # below a float's range: never
    interval = min(young_daly(times.checkpoint, mtbf), horizon)
    runs = [simulate(rate, groups, times, interval, horizon, random.Random(seed + i)) for i in range(replays)]
    return Outcome(mode, groups, mtbf, interval, statistics.fmean(runs), statistics.pstdev(runs))


def compare(per_1000_gpu_days: float, gpus: int, groups: int, times: JobTimes, days: float) -> list[Outcome]:
    """Checkpoint-restart against `groups` replica groups, for the same failures and job."""
    rate, horizon = job_rate(per_1000_gpu_days, gpus), days * DAY
    return [
        outcome("checkpoint-restart", rate, 1, times, horizon),
        outcome("replica groups", rate, groups, times, horizon),
    ]
