"""`meshtrain bench comm`: collective bandwidth of the interconnect (nccl-tests style).
`meshtrain bench serve`: a model's servers under the same streamed load (serve/loadtest.py)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Literal

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


def _check_servers(text: str) -> None:
    from meshtrain.serve.loadtest import SERVERS

    names = text.split(",")
    if unknown := [name for name in names if name not in SERVERS]:
        raise ValueError(f"{','.join(unknown)} unknown: use {', '.join(SERVERS)}")
    if len(set(names)) < len(names):
        raise ValueError("names a server twice")


def _check_concurrency(text: str) -> None:
    parts = text.split(",")
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError("is not a comma-separated list of positive client counts (e.g. 1,8,32)")
    if len({int(part) for part in parts}) < len(parts):
        raise ValueError("names a client count twice")


@dataclass
class ServeBenchOptions:
    model: str = option(positional=True)
    """A Hugging Face directory (`meshtrain export` writes one) every server loads."""
    servers: str = option("meshtrain,transformers", check=_check_servers)
    """Servers to measure, each started alone in turn: meshtrain, meshtrain-no-prefix-caching, transformers
    (`transformers serve --continuous-batching`)."""
    concurrency: str = option("1,8,32", check=_check_concurrency)
    """Concurrent streaming clients of each row, comma-separated."""
    system_tokens: int = option(2000, ge=0)
    """Tokens of the system prompt every request of the second scenario shares (0: short prompts only)."""
    max_tokens: int = option(64, ge=1)
    """New tokens per request (greedy)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """The precision every server runs in (auto: bf16 on a GPU, else fp32)."""
    out: str | None = None
    """Also write the rows as JSON to this file (rewritten after each server)."""


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure the interconnect (collective bandwidth) or a model's servers")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    comm = bsub.add_parser(
        "comm", help="all-reduce, all-gather, reduce-scatter, broadcast from --min-bytes to --max-bytes"
    )
    add_options(comm, CommOptions)
    serve = bsub.add_parser(
        "serve", help="throughput, time to first token and inter-token latency of servers of one model"
    )
    add_options(serve, ServeBenchOptions)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    return run_serve_bench(args) if args.bench_command == "serve" else run_comm(args, argv)


def run_serve_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from meshtrain.files import write_json
    from meshtrain.logs import write_line
    from meshtrain.serve.loadtest import benchmark, table

    o: ServeBenchOptions = options_of(args, ServeBenchOptions)
    if o.out:
        check_output(o.out, "--out", {"MODEL": o.model}, '"ttft_p50_s"', "meshtrain bench serve")
        folder = Path(o.out).resolve().parent
        if not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise MeshtrainError(f"--out {o.out}: {folder} is not a folder this user can write: give another path")
    concurrency = [int(c) for c in o.concurrency.split(",")]
    save = (lambda rows: write_json(o.out, rows)) if o.out else (lambda rows: None)
    rows = benchmark(
        Path(o.model), o.servers.split(","), concurrency, o.system_tokens, o.max_tokens, o.dtype, write_line, save
    )
    write_line(table(rows))
    return 0


def run_comm(args: argparse.Namespace, argv: list[str]) -> int:
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
