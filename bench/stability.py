"""Is `training.dtype = "auto"` stable? Fresh starts of its probe (each a new process with an empty
cache, so each measures), on a quiet machine and while busy processes (one per core, each a 1-thread
fp32 matmul loop: other jobs on the same host) compete for every core. A row is a preset at a
thread count as a user runs it: `tiny` at 1 thread, eager (each process of `make train`'s `--nproc
2`), `small` at every core (one process), eager and compiled (whose probe times its attention
backward first, then its contenders compiled). It counts the picks, and gives the spread of the
measured lead of bf16 GEMMs + fp32 attention over all-bf16 (the closest contest on the machines met
so far).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile

from bench.common import markdown, write_results

PROBE = """
import json, sys, torch
from meshtrain.config import load_config
from meshtrain.job.arithmetic import CANDIDATES, cpu_choice
torch.set_num_threads(int(sys.argv[2]))
args = model_args(load_config(overrides={"model.preset": sys.argv[1]}))
compiled = sys.argv[3] == "compiled"  # the attention shape a compiled run probes at: 8 x 256 tokens
shape = (8, args.n_heads, args.n_kv_heads, 256, args.head_size) if compiled else None
choice = cpu_choice(args, 8, 256, [name for name, _, _ in CANDIDATES], shape)
print(json.dumps({"pick": choice.name, "how": choice.how, "busy": choice.busy, "step_ms": choice.step_ms}))
"""
LOAD = """
import sys, time, torch
from meshtrain.job.model import model_args
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = (a @ a).tanh()
"""


def starts(preset: str, threads: int, mode: str, n: int, busy: bool) -> list[dict]:
    load = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(os.cpu_count() or 1)] if busy else []
    out = []
    try:
        for _ in range(n):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, XDG_CACHE_HOME=cache)
                result = subprocess.run(
                    [sys.executable, "-c", PROBE, preset, str(threads), mode], env=env, capture_output=True, text=True
                )
                if result.returncode != 0:
                    raise RuntimeError(result.stderr[-2000:])
                out.append(json.loads(result.stdout.strip().splitlines()[-1]))
    finally:
        for p in load:
            p.kill()
    return out


def main(a) -> list[dict]:
    rows = []
    for preset, threads, mode in a.stability_rows:
        threads = int(threads) if threads != "all" else os.cpu_count() or 1
        for busy in (False, True):
            picked = starts(preset, threads, mode, a.stability_starts, busy)
            leads = [p["step_ms"]["bf16"] / p["step_ms"]["bf16/bf16-gemm"] for p in picked]
            row = {"preset": preset, "threads": threads, "mode": mode}
            row |= {"busy_processes": (os.cpu_count() or 1) if busy else 0}
            row |= {"picks": dict(collections.Counter(p["pick"] for p in picked)), "starts": picked}
            row |= {"others_share": [p["busy"] for p in picked], "gemm_lead": [min(leads), max(leads)]}
            print(f"  {preset} x{threads} {mode} {'busy' if busy else 'quiet'}: {row['picks']}", flush=True)
            rows.append(row)
    lines = [
        [
            r["preset"],
            str(r["threads"]),
            r["mode"],
            f"{r['busy_processes']} busy" if r["busy_processes"] else "quiet",
            f"{min(r['others_share']):.0%}-{max(r['others_share']):.0%}",
            ", ".join(f"{name} {count}" for name, count in sorted(r["picks"].items(), key=lambda kv: -kv[1])),
            f"{r['gemm_lead'][0]:.2f}-{r['gemm_lead'][1]:.2f}",
        ]
        for r in rows
    ]
    header = ["preset", "threads", "probe", "machine", "others' share of the CPUs", "picks", "bf16 / bf16-gemm time"]
    write_results("stability", rows, markdown(header, lines))
    return rows
