"""python -m bench [throughput|precision|masking|context|arithmetic|stability|profile|scaling|memory|serve|
structured|data|planner|watchdog|moe|plots|all] [options]: see bench/README.md."""

import argparse
import os

from bench import (
    arithmetic,
    context,
    data,
    masking,
    memory,
    moe,
    planner,
    plots,
    precision,
    profile,
    scaling,
    serve,
    serve_structured,
    stability,
    throughput,
    watchdog,
)


def at_least(low: int):
    """An argparse type: an integer of at least `low` (zero rounds or starts would measure nothing)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def stability_rows(text: str) -> list[tuple[str, str, str]]:
    """`preset:threads:eager|compiled,...` (threads: a number or `all`), checked before anything runs."""
    rows = [tuple(spec.split(":")) for spec in text.split(",")]
    for row in rows:
        if len(row) != 3 or not (row[1] == "all" or row[1].isdigit() and int(row[1]) > 0):
            raise argparse.ArgumentTypeError(f"{':'.join(row)!r} is not preset:threads:eager|compiled")
        if row[2] not in ("eager", "compiled"):
            raise argparse.ArgumentTypeError(f"{':'.join(row)!r}: the probe is eager or compiled, not {row[2]!r}")
    return rows


count = at_least(1)
p = argparse.ArgumentParser(prog="python -m bench")
p.add_argument(
    "suite",
    nargs="?",
    default="all",
    choices=(
        "throughput",
        "precision",
        "masking",
        "context",
        "arithmetic",
        "stability",
        "profile",
        "scaling",
        "memory",
        "serve",
        "structured",
        "data",
        "planner",
        "watchdog",
        "moe",
        "plots",
        "all",
    ),
)
p.add_argument("--presets", default="tiny,small", help="throughput, arithmetic: model presets")
p.add_argument("--dtypes", default="fp32,bf16", help="throughput: any of fp32,bf16,fp16,fp8-tensorwise,fp8-rowwise")
p.add_argument("--precision-presets", default="tiny", help="precision: model presets (tiny: ~15 minutes on 2 cores)")
p.add_argument("--precision-dtypes", default="fp32,bf16,fp16,fp8-tensorwise", help="precision: the rows, one per dtype")
p.add_argument("--batch", type=count, default=8, help="throughput: sequences per step")
p.add_argument("--seq-len", type=count, default=256)
p.add_argument("--steps", type=count, default=2, help="throughput, precision: steps per timed round")
p.add_argument("--rounds", type=count, default=6, help="throughput, precision, moe: interleaved timing rounds")
p.add_argument("--masking-preset", default="tiny", help="masking: the model trained")
p.add_argument(
    "--masking-seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048], help="masking"
)
p.add_argument("--masking-tokens", type=count, default=2048, help="masking: tokens per step (batch = this / seq_len)")
p.add_argument("--masking-rounds", type=count, default=3, help="masking: interleaved timing rounds")
p.add_argument("--context-preset", default="tiny", help="context: the model trained")
p.add_argument(
    "--context-lengths",
    type=lambda s: [int(x) for x in s.split(",")],
    default=[1024, 2048, 4096, 8192, 16384, 32768],
    help="context: sequence lengths (global batch 1, causal attention)",
)
p.add_argument(
    "--context-masked",
    type=lambda s: [int(x) for x in s.split(",") if x],
    default=[],
    help="context: lengths also run with training.document_masking (default none)",
)
p.add_argument("--context-dtype", default="fp32", help="context: training.dtype")
p.add_argument("--context-steps", type=count, default=5, help="context: steps per run up to 4k (3 at 8k, 1 from 16k)")
p.add_argument("--context-rounds", type=count, default=2, help="context: rounds at lengths up to 4k (longer: one)")
p.add_argument("--stability-starts", type=count, default=10, help="stability: fresh probes per row")
p.add_argument(
    "--stability-rows",
    type=stability_rows,
    default="tiny:1:eager,small:all:eager,small:all:compiled",
    help="stability: preset:threads:eager|compiled, comma-separated (threads: a number or all)",
)
p.add_argument("--arithmetic-rounds", type=count, default=2, help="arithmetic: rounds of 2-process runs")
p.add_argument(
    "--arithmetic-eager", help="arithmetic: presets also run eagerly, as `make train` runs (default: tiny, if run)"
)
p.add_argument("--profile-steps", type=count, default=3, help="profile: steps profiled per variant")
p.add_argument("--scaling-preset", default="tiny")
p.add_argument("--scaling-rounds", type=count, default=2, help="scaling: rounds over every layout")
p.add_argument("--train-steps", type=at_least(3), default=12, help="scaling, arithmetic: steps a run (2 untimed)")
p.add_argument("--procs", type=at_least(0), default=0, help="scaling: processes (default: one per core)")
p.add_argument("--data-path", default="", help="scaling/memory: a prepared data set (default: the stdlib corpus)")
p.add_argument("--memory-preset", default="small")
p.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
p.add_argument("--serve-preset", default="tiny", help="serve: the model served")
p.add_argument("--serve-tokens", type=count, default=64, help="serve: new tokens per request")
p.add_argument("--system-tokens", type=count, default=2000, help="serve: tokens of the shared system prompt")
p.add_argument(
    "--data-sizes",
    type=lambda s: [int(x) for x in s.split(",")],
    default=[100, 1024],
    help="data: the two input sizes in MiB (default 100,1024)",
)
p.add_argument("--data-workers", type=count, default=os.cpu_count(), help="data: most workers (default: every core)")
p.add_argument("--data-tmp", default="", help="data: where the inputs are written (default: the system's temp)")
a = p.parse_args()
for name, suite in (
    ("throughput", throughput),
    ("precision", precision),
    ("masking", masking),
    ("context", context),
    ("arithmetic", arithmetic),
    ("stability", stability),
    ("profile", profile),
    ("scaling", scaling),
    ("memory", memory),
    ("serve", serve),
    ("structured", serve_structured),
    ("data", data),
    ("planner", planner),
    ("watchdog", watchdog),
    ("moe", moe),
    ("plots", plots),
):
    if a.suite in (name, "all"):
        print(f"== {name}", flush=True)
        suite.main(a)
