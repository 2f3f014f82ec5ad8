"""`meshtrain bench comm`: collective bandwidth of the interconnect (nccl-tests style)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from meshtrain.cli.options import add_options, options_of
from meshtrain.config import option, parse_size
from meshtrain.errors import MeshtrainError
from meshtrain.files import check_output


def _check_ops(text: str) -> None:
    from meshtrain.commbench import BUS_FACTOR

    unknown = [op for op in text.split(",") if op not in BUS_FACTOR]
    if unknown:
        raise ValueError(f"{','.join(unknown)} unknown: use {', '.join(BUS_FACTOR)}")


@dataclass
class CommOptions:
    ops: str = option("all_reduce,all_gather,reduce_scatter,broadcast", check=_check_ops)
    """Collectives to measure, comma-separated."""
    min_bytes: int = option(1 << 10, parse=parse_size, ge=4)
    """Smallest message (default 1K)."""
    max_bytes: int = option(1 << 30, parse=parse_size, ge=4)
    """Largest message (default 1G)."""
    iters: int = option(20, ge=1)
    """Timed iterations per size, at most 64 MiB / size (at least 1): large messages run fewer (the table's iters)."""
    json: bool = False
    """Print JSON rows instead of a table."""
    out: str | None = None
    """Also write the rows as JSON to this file (what `plan --comm` reads)."""
    nproc: int | None = option(None, ge=1)
    """Start this many local processes (torch elastic)."""


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure the interconnect: collective bandwidth (nccl-tests style)")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    comm = bsub.add_parser(
        "comm", help="all-reduce, all-gather, reduce-scatter, broadcast from --min-bytes to --max-bytes"
    )
    add_options(comm, CommOptions)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from meshtrain.commbench import format_table, run_comm_bench

    o: CommOptions = options_of(args, CommOptions)
    if o.min_bytes > o.max_bytes:
        raise MeshtrainError(f"--min-bytes ({o.min_bytes} bytes) must be at most --max-bytes ({o.max_bytes} bytes)")
    if o.out:
        check_output(o.out, "--out", {}, '"busbw_GBps"', "meshtrain bench comm")  # before the measurement
    if o.nproc:
        from meshtrain.launch.local import launch_workers, refuse_inside_a_launcher

        refuse_inside_a_launcher()

        forwarded = [
            a
            for i, a in enumerate(argv)
            if a != "--nproc" and not a.startswith("--nproc=") and (i == 0 or argv[i - 1] != "--nproc")
        ]
        return launch_workers(o.nproc, forwarded)
    rows = run_comm_bench(o.ops.split(","), o.min_bytes, o.max_bytes, o.iters)
    if rows:
        from meshtrain.logs import write_line

        write_line(json.dumps(rows) if o.json else format_table(rows))
        if o.out:
            from meshtrain.files import write_json

            write_json(o.out, rows)
    return 0
