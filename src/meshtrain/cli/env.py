"""`meshtrain env`: the launch environment this process detects (rank, world, launcher, hosts)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Literal

from meshtrain.cli.options import add_options, options_of
from meshtrain.config import LAUNCHERS, option


@dataclass
class EnvOptions:
    json: bool = False
    """Print JSON instead of a table."""
    all_ranks: bool = False
    """Print on every rank, not only rank 0."""
    launcher: Literal[LAUNCHERS] = option("auto", flags=("--launch.env", "--launcher"))
    """Force an environment (launch.env)."""


def add_parser(sub) -> None:
    e = sub.add_parser("env", help="print the launch environment this process detects")
    add_options(e, EnvOptions)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtrain.launch import detect
    from meshtrain.logs import write_line

    o: EnvOptions = options_of(args, EnvOptions)
    env = detect(launcher=o.launcher).as_dict()
    if o.all_ranks or env["rank"] == 0:
        write_line(json.dumps(env) if o.json else "\n".join(f"{k:18} {v}" for k, v in env.items()))
    return 0
