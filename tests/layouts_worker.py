"""Run under torchrun: several training runs of the same world size, one after the other, in one
launch (one start-up of the processes and of the process group instead of one per run).

argv: SPEC.json, a list of runs, each its `meshtrain train` overrides ([--section.key, value, ...],
run.dir among them). Each run is the trainer's own
`train(load_config(None, overrides))`, what `meshtrain train` runs in each worker, with its own
mesh, model, data and run directory; every rank writes <run dir>/.done-rank<R> after it. A run
that fails ends the launch (its error on stderr): the runs after it are not started."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

from meshtrain.config import load_config
from meshtrain.train.loop import train


def main() -> int:
    rank = os.environ.get("RANK", "0")
    for overrides in json.loads(Path(sys.argv[1]).read_text()):
        cfg = load_config(None, overrides)
        run_dir = cfg.run.dir
        print(f"=== layouts_worker: {run_dir}", flush=True)
        result = train(cfg)
        if result["exit_code"] != 0:
            print(f"layouts_worker: {run_dir} ended with exit code {result['exit_code']}", file=sys.stderr)
            return result["exit_code"]
        Path(run_dir, f".done-rank{rank}").write_text("")
    gc.freeze()  # as the meshtrain command does: no exit-time collection over torch's objects
    return 0


if __name__ == "__main__":
    sys.exit(main())
