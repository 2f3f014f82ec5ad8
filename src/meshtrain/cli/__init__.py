"""The `meshtrain` command: one module per subcommand, each a parser built from declared options
(cli/options.py) and a `run` that calls into the parts; nothing else."""

from __future__ import annotations

import argparse
import gc
import os
import sys

from meshtrain.cli import bench, data, env, export, jobscript, plan, serve, train
from meshtrain.cli.options import Parser
from meshtrain.errors import MeshtrainError

# subcommand -> its run(args, extra arguments)
COMMANDS = {
    "train": train.run,
    "data": data.run,
    "export": export.run,
    "jobscript": jobscript.run,
    "bench": bench.run,
    "plan": plan.run,
    "serve": serve.run_serve,
    "generate": serve.run_generate,
    "env": env.run,
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="meshtrain",
        description="Train Llama-style language models on any launcher and layout, plan layouts before "
        "spending GPU hours, export to Hugging Face and serve. Flags that set a config key are spelled "
        "like the key (--training.seq_len); sizes are written 64M, 5G or 5GB (binary units).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train, data, export, jobscript, bench, plan):
        module.add_parser(sub)
    serve.add_parsers(sub)
    env.add_parser(sub)
    return p


def _finish(code: int, whole_process: bool) -> None:
    """Leave a distributed worker in order: barrier, destroy the process group, flush, os._exit.
    Letting the interpreter tear down live gloo objects aborts ~1 run in 10 (pytorch#179291).
    `whole_process` (the command, not a caller's main(argv)): what is left is frozen out of the
    interpreter's exit-time garbage collection, which walks every object torch and dynamo made
    (0.5 to 1 s of each command on 2 cores); the commands close their files themselves."""
    dist = sys.modules.get("torch.distributed")  # not imported (plan, jobscript, a bad flag): no group to leave
    if dist is not None and dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if whole_process:
        gc.freeze()
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    whole_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    try:
        args, extra = build_parser().parse_known_args(argv)
        if args.command == "jobscript":
            if extra:
                raise MeshtrainError(f"unexpected arguments: {' '.join(extra)} (put training overrides after --)")
            extra = passthrough
        else:
            extra += passthrough
            if args.command == "train":
                extra = [*(getattr(args, "overrides", None) or []), *extra]
            elif extra:
                raise MeshtrainError(f"unexpected arguments: {' '.join(extra)}")
        code = COMMANDS[args.command](args, argv if args.command == "bench" else extra)
    except MeshtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except BrokenPipeError:  # `meshtrain plan --json | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        code = 0
    _finish(code, whole_process)
