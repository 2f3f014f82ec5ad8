"""Enumerate the layouts a cluster allows, estimate each, keep what fits, best first."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config
from meshtrain.errors import ConfigError
from meshtrain.job.layout import check_layout, check_schedule, layout_of
from meshtrain.layout import AC_MODES, Layout
from meshtrain.plan.hardware import Device
from meshtrain.plan.memory import estimate_memory
from meshtrain.plan.speed import step_time
from meshtrain.plan.states import host_state_bytes
from meshtrain.plan.workload import Workload, workload_refusal

GIB = 2**30


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes: params, grads, optimizer, activations, other, total
    speed: dict
    fits: bool
    params: int
    why_not: str = ""
    first_step_peak: float = 0.0  # bytes: the first step's peak, before AdamW's moments exist
    host_per_node: float = 0.0  # bytes of host memory a node's ranks fill (CPU offload's model states)

    def as_dict(self) -> dict:
        return {
            **asdict(self.layout),
            "dp": self.layout.dp,
            "fits": self.fits,
            "params": self.params,
            "memory_gib": {k: round(v / GIB, 3) for k, v in self.memory.items()},
            "peak_gib": {
                "first_step": round(self.first_step_peak / GIB, 3),
                "steady": round(self.memory["total"] / GIB, 3),
            },
            "tokens_per_s_per_gpu": round(self.speed["tokens_per_s_per_gpu"], 2),
            "tflops_per_gpu": round(self.speed["tflops_per_gpu"], 3),
            "mfu": round(self.speed["mfu"], 4),
            "host_gib_per_node": round(self.host_per_node / GIB, 3),
            "step_time_s": round(self.speed["step_time_s"], 5),
            "seconds": {k: round(v, 5) for k, v in self.speed["seconds"].items()},
            **({"why_not": self.why_not} if self.why_not else {}),
            "layout": asdict(self.layout),
        }


def evaluate(w: Workload, layout: Layout, dev: Device, inter_gbps: float) -> Estimate:
    """A layout's memory, host memory per node (its ranks' offloaded states) and speed; it fits when
    both peaks fit the GPU and the node's ranks fit its host memory."""
    fragmentation = 0.0 if dev.name == "cpu" else 0.05
    memory = estimate_memory(w, layout, dev.runtime_gib, fragmentation)
    first = estimate_memory(w, layout, dev.runtime_gib, fragmentation, first_step=True)["total"]
    host = host_state_bytes(w, layout) * min(dev.gpus_per_node, layout.world)
    why = ""
    if max(memory["total"], first) > dev.memory_gib * GIB:
        why = f"needs {max(memory['total'], first) / GIB:.1f} GiB of {dev.memory_gib:.1f}"
    elif host > dev.host_memory_gib * GIB:
        why = f"needs {host / GIB:.0f} GiB of host memory per node of {dev.host_memory_gib:.0f}"
    speed = step_time(w, layout, dev, inter_gbps)
    return Estimate(layout, memory, speed, not why, w.shape.n_params(), why, first, host)


def check(w: Workload, layout: Layout, base: Config | None, args) -> str:
    """Why meshtrain would refuse this layout ("" if it would not): the trainer's own checks for
    the Llama it trains; the divisibility rules of Megatron for a GPT shape; QLoRA's layouts."""
    refusal = workload_refusal(w, layout)
    if refusal:
        return refusal
    if base is not None:  # a dp_shard the base sets (an explained config's) is kept, for the trainer to check
        cfg = layout.apply_to(base)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=base.parallel.dp_shard))
        try:
            check_layout(layout_of(cfg, layout.world), args, cfg)
        except ConfigError as e:
            return str(e)
        return ""
    s = w.shape
    if layout.cpu_offload and (layout.zero != 3 or layout.shard_ranks == 1):
        return "cpu offload moves ZeRO-3's shards to host memory: it needs zero 3 over more than one shard"
    if s.n_heads % layout.tp or s.ffn_dim % layout.tp or s.vocab_size % layout.tp:
        return f"heads, ffn and vocabulary must be divisible by tp {layout.tp}"
    if layout.cp > 1 and (w.seq_len % layout.cp or s.n_heads // layout.tp % layout.cp):
        return f"the sequence and the heads per TP rank must be divisible by cp {layout.cp}"
    if layout.pp > 1 and (problem := schedule_refusal(layout.pp_schedule, layout.pp_virtual_stages)):
        return problem
    if s.n_layers < layout.pp * layout.stages_per_rank:
        return "fewer layers than pipeline stages"
    if layout.global_batch_size % (layout.micro_batch_size * layout.dp):
        return "global batch not divisible by micro-batch x dp"
    if layout.pp > 1 and layout.micro_batches < layout.pp:
        return "fewer micro-batches than pipeline stages"
    return ""


def schedule_refusal(schedule: str, stages: int) -> str:
    """Why train refuses a pipeline schedule with `stages` per rank ("" if it runs them): Layout's own
    schedule rule, on a probe pipeline of 2 ranks with micro-batches that every schedule takes, so only
    the pair is judged (a GPT shape's micro-batches follow Megatron's rules in `check`; the CLI refuses a
    pinned pair before the search)."""
    probe = Layout(pp=2, pp_schedule=schedule, pp_virtual_stages=stages, global_batch_size=2)
    try:
        check_schedule(probe, 0)  # the rule check_layout applies, without a model or a config
    except ConfigError as e:
        return str(e)
    return ""


def degrees_refusal(gpus: int, fixed: dict) -> str:
    """Why no layout's degrees fit `gpus` ("" if some do), in train's words (layout_of's first
    two rules): pinned tp, pp and cp whose product does not divide the world, or a pinned dp_replicate
    that does not divide the data-parallel degree left. The others are judged at 1, the degree the search
    always tries: if the pins fail there they fail everywhere. Without it the search would have no
    layout to try, and nothing to say why."""
    degrees = {key: fixed.get(key) or 1 for key in ("tp", "pp", "cp", "dp_replicate")}
    if gpus % (degrees["tp"] * degrees["pp"] * degrees["cp"] * degrees["dp_replicate"]) == 0:
        return ""
    probe = Config()
    probe = dataclasses.replace(probe, parallel=dataclasses.replace(probe.parallel, **degrees))
    try:
        layout_of(probe, gpus)
    except ConfigError as e:
        return str(e)
    return ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


VIRTUAL_STAGES = tuple(range(2, 9))  # large runs interleave up to 8 (Llama 3 405B: 126 layers, PP 16)


def schedules(pp: int, n_layers: int, fixed: dict) -> list[tuple[str, int]]:
    """(schedule, stages per rank) to try: 1F1B, and interleaved 1F1B with several stages per
    rank (2 to 8) while every stage keeps a layer; a fixed schedule or stage count narrows that.
    A pinned value is kept, never replaced by one the search likes better: a pinned pair is tried as
    given (`check` refuses a pair train refuses, in its words), and pinned stages alone take the
    searched schedule that runs them (1F1B one, interleaved 1F1B several)."""
    if pp == 1:
        return [("1f1b", 1)]
    name, v = fixed.get("pp_schedule"), fixed.get("pp_virtual_stages")
    if name is not None and v is not None:
        return [(name, v)]
    if v is not None:
        return [("1f1b" if v == 1 else "interleaved_1f1b", v)]
    if name in SINGLE_STAGE_SCHEDULES:
        return [(name, 1)]
    if name == "zbv":
        return [("zbv", 2)]
    stages = [s for s in VIRTUAL_STAGES if pp * s <= n_layers]
    if name is None:
        return [("1f1b", 1), *(("interleaved_1f1b", s) for s in stages)]
    return [(name, s) for s in stages] or [(name, 2)]


# The shortest slice of a sequence the search gives a context-parallel rank (a pinned --cp may go
# lower): shorter sequences fit a GPU without CP, and the planner does not model what small slices
# cost beyond the all-to-alls' bytes (a GEMM's rows per rank, the all-to-alls' latency).
MIN_CP_SLICE = 2048


def cp_degrees(w: Workload, ranks: int) -> list[int]:
    """Context-parallel degrees to try on `ranks` (world / (tp x pp)): 1, and the powers of two
    dividing them, the sequence and the query heads (what Ulysses splits; `check` applies the
    trainer's full rules: per TP rank, key/value heads, sequence parallelism's slice) that leave each
    rank at least MIN_CP_SLICE tokens of a sequence."""
    out, cp = [1], 2
    while ranks % cp == 0 and w.seq_len % cp == 0 and w.shape.n_heads % cp == 0 and w.seq_len // cp >= MIN_CP_SLICE:
        out.append(cp)
        cp *= 2
    return out


def candidates(w: Workload, gpus: int, gpus_per_node: int, global_batch: int, fixed: dict) -> list[Layout]:
    """Every combination of the free knobs; `fixed` pins any of the Layout's fields by its config key
        name (tp, pp, cp, zero, dp_replicate, micro_batch_size, activation_checkpointing, ac_every, pp_schedule,
        pp_virtual_stages, sequence_parallel, loss_parallel, cpu_offload). QLoRA runs on one process or plain
        DDP: only TP 1, PP 1, CP 1 and ZeRO 0/1 are proposed (a pinned other value is refused by `check`). CPU
        offload is never searched: off unless pinned (then every layout is proposed, and `check` keeps the
        ZeRO-3 ones the trainer takes). Context parallelism: the powers of two that fit, down to
    MIN_CP_SLICE tokens a rank (cp_degrees);
        DP = gpus / (tp x pp x cp), and ZeRO shards over dp_shard x cp."""

    def options(name, values):
        return [fixed[name]] if fixed.get(name) is not None else values

    q = w.quantized
    out = []
    for tp in options("tp", [1] if q else [d for d in _divisors(gpus_per_node) if gpus % d == 0]):
        for pp, cp in itertools.product(
            options("pp", [1] if q else [d for d in _divisors(gpus // tp) if d <= w.shape.n_layers]),
            options("cp", [1] if q else cp_degrees(w, gpus // tp)),
        ):
            if gpus % (tp * pp * cp):
                continue
            dp = gpus // (tp * pp * cp)
            zeros = ([0, 1] if q else [0, 1, 2, 3]) if dp * cp > 1 else [0]
            for zero, ac in itertools.product(
                options("zero", zeros), options("activation_checkpointing", list(AC_MODES))
            ):
                replicate = [1] + [
                    r for r in _divisors(dp) if 1 < r < dp and zero >= 2 and dp // r * cp * tp == gpus_per_node
                ]
                # none divides a global batch that dp does not: micro-batch 1 then, which `check` refuses, saying why
                micro = [b for b in (1, 2, 4, 8, 16, 32) if global_batch % (b * dp) == 0] or [1]
                pipelines = schedules(pp, w.shape.n_layers, fixed)
                for r, mb, (schedule, v) in itertools.product(
                    options("dp_replicate", replicate), options("micro_batch_size", micro), pipelines
                ):
                    if dp % r:
                        continue
                    out.append(
                        Layout(
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            dp_replicate=r,
                            dp_shard=dp // r,
                            zero=zero,
                            # both shape tensor parallelism: without it the default (train refuses another)
                            sequence_parallel=tp == 1 or fixed.get("sequence_parallel", True) is not False,
                            loss_parallel=tp == 1 or fixed.get("loss_parallel", True) is not False,
                            cpu_offload=fixed.get("cpu_offload") is True,
                            pp_schedule=schedule,
                            pp_virtual_stages=v,
                            global_batch_size=global_batch,
                            micro_batch_size=mb,
                            activation_checkpointing=ac,
                            ac_every=(fixed.get("ac_every") or 2) if ac == "selective" else 2,  # else unused
                        )
                    )
    return out


def search(
    w: Workload,
    dev: Device,
    inter_gbps: float,
    gpus: int,
    global_batch: int,
    fixed: dict,
    base: Config | None = None,
    args=None,
) -> tuple[list[Estimate], dict[str, int]]:
    """Estimates, those that fit best first (by tokens/s), then those that do not (smallest first);
    and how many layouts were dropped for each reason meshtrain would refuse them (never none with no
    estimate: pinned degrees that leave nothing to try are that reason)."""
    if problem := degrees_refusal(gpus, fixed):
        return [], {problem: 1}
    estimates, refused = [], {}
    for layout in candidates(w, gpus, min(gpus, dev.gpus_per_node), global_batch, fixed):
        reason = check(w, layout, base, args)
        if reason:
            refused[reason] = refused.get(reason, 0) + 1
            continue
        estimates.append(evaluate(w, layout, dev, inter_gbps))
    estimates.sort(key=lambda e: (not e.fits, -e.speed["tokens_per_s_per_gpu"] if e.fits else e.memory["total"]))
    return estimates, refused
