"""`meshtrain plan`: the parser, and the glue that plans (plan/request.py), dry-runs the best layouts
(--verify: train/dry_run.py), writes the best as a training config and prints the table or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from meshtrain.cli.options import add_config_keys, add_options, options_of


def add_parser(sub) -> None:
    from meshtrain.plan.request import PLAN_KEYS, PlanOptions

    pl = sub.add_parser(
        "plan",
        help="predict per-GPU memory and throughput of layouts on a cluster, and recommend one",
        epilog="Any of the [parallel]/[training] layout flags fixes that knob; with all fixed (or "
        "--config) one layout is explained. Each flag that sets a config key is spelled like the "
        "key and checked like it; the short forms are the key's own, declared with it.",
    )
    add_options(pl, PlanOptions)
    add_config_keys(pl, list(PLAN_KEYS))


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtrain.files import check_output
    from meshtrain.plan.request import (
        PLAN_HEADER,
        PlanOptions,
        check_failure_options,
        failure_report,
        make_plan,
        write_best,
    )

    o: PlanOptions = options_of(args, PlanOptions)
    check_failure_options(o)
    if o.write_config:
        check_output(
            o.write_config, "--write-config", {"--config": o.config, "--comm": o.comm}, PLAN_HEADER, "meshtrain plan"
        )
    plan = make_plan(o, list(getattr(args, "overrides", None) or []))
    built = {}
    if o.verify:  # its refusals before anything is written
        from meshtrain.train.dry_run import verify

        built = verify(plan, o.arch, o.verify)
    if o.write_config:
        path, layout = write_best(o, plan.estimates, plan.base)
        print(
            f"wrote {path} ({layout.describe()}); run it with `meshtrain train --config {path}` on "
            f"{layout.world} processes, or `meshtrain jobscript slurm --config {path} ...`",
            file=sys.stderr if o.json else sys.stdout,  # --json: stdout is the JSON alone
        )
    failures = failure_report(o, plan) if o.failures is not None else None
    if o.json:
        print(json.dumps(plan.as_dict(o.top, built) | ({"failures": failures} if failures else {}), indent=1))
        return 0
    from rich.console import Console

    from meshtrain.plan.report import render
    from meshtrain.train.dry_run import KEYS

    render(plan.title(), plan.estimates, plan.refused, o.top or 10, Console(width=None if sys.stdout.isatty() else 120))
    for i, gib in built.items():
        cells = ", ".join(f"{k} {gib[k]:.2f}/{gib['planned'][k]:.2f}" for k in KEYS if gib[k] is not None)
        print(
            f"built (dry run) #{i + 1} {plan.estimates[i].layout.describe()}: {cells} GiB built/planned on rank "
            f"{gib['rank']}"
        )
        for note in gib["notes"]:
            print(f"  {note}")
    if failures:
        print_failures(failures)
    return 0


def print_failures(report: dict) -> None:
    s = report["seconds"]
    print(
        f"failures at {report['rate_per_1000_gpu_days']:.3g} per 1,000 GPUs per day over {report['days']:g} days "
        f"(step {s['step']:.3g} s, checkpoint {s['checkpoint']:.3g} s, restart {s['restart']:.4g} s, "
        f"rejoin {s['rejoin']:.4g} s):"
    )
    for m in report["modes"]:
        interval = m["checkpoint_interval_s"]
        mtbf = m["job_mtbf_h"]
        lost = "the job is practically never lost" if mtbf is None else f"the job is lost every {mtbf:.3g} h"
        every = "none needed (beyond the run)" if interval >= report["days"] * 86400 else f"every {interval:,.0f} s"
        print(
            f"  {m['mode']} ({m['groups']} group{'s' if m['groups'] > 1 else ''}): effective training time "
            f"{m['effective_training_time']:.1%} +- {m['spread']:.1%}; {lost}; "
            f"checkpoints (Young/Daly) {every}"
        )
