"""The `meshtrain` command. Subcommands parse arguments and call into the parts; nothing else."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.launch.jobscript import GENERATORS


class _Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` line, like every other mistake."""

    def error(self, message: str):
        hint = " (a value that starts with '-' is written --key=VALUE)" if "expected one argument" in message else ""
        raise MeshtrainError(f"{self.prog}: {message}{hint}; see {self.prog} --help")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="meshtrain", allow_abbrev=False,
                                description="Train Llama-style language models on any launcher and layout; export "
                                "them to Hugging Face and serve them.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", allow_abbrev=False, help="train a model (any launcher, any layout)",
                       usage="meshtrain train [--config FILE] [--nproc N] [launcher options] [--section.key VALUE ...]",
                       epilog="Config keys as --section.key VALUE (or --section.key=VALUE) override the file.")
    t.add_argument("--config", help="TOML config file (default: built-in defaults = configs/tiny.toml)")
    t.add_argument("--nproc", type=int, help="start this many local worker processes (torch elastic)")
    t.add_argument("--max-restarts", type=int, default=0, help="restart failed workers up to this many times")
    t.add_argument("--nnodes", type=int, help="nodes, each running one `meshtrain train --nproc G` (default: "
                   "the Slurm allocation's when run as one srun task per node, else 1)")
    t.add_argument("--node-rank", type=int, help="this node's index (static rendezvous at --master-addr)")
    t.add_argument("--master-addr", help="the first node's address (default: the first Slurm host)")
    t.add_argument("--master-port", type=int, help="rendezvous port (default: derived from the job id)")
    _add_config_keys(t)

    d = sub.add_parser("data", help="prepare training data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", allow_abbrev=False, help="tokenize text/jsonl/parquet into a token file")
    prep.add_argument("--input", nargs="+", required=True, help="files or directories (.txt, .jsonl, .parquet)")
    prep.add_argument("--out", required=True, help="output directory")
    group = prep.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", help="a Hugging Face tokenizer.json to use")
    group.add_argument("--vocab-size", type=int, help="train a byte-level BPE of this size (default 8192)")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out")
    prep.add_argument("--dtype", default="auto", help="token dtype: auto, uint16 or uint32")

    x = sub.add_parser("export", help="write a Hugging Face Llama directory from a run or checkpoint")
    x.add_argument("source", help="a run directory (its latest checkpoint, else model.safetensors) or a checkpoint")
    x.add_argument("--out", required=True, help="output directory")
    x.add_argument("--max-shard-size", default="5GB", help="split the safetensors above this size")

    j = sub.add_parser("jobscript", help="write a ready-to-submit job script (slurm, sge, pbs, mpirun, torchrun, pcluster)",
                       epilog="Arguments after -- go to `meshtrain train`, e.g. -- --training.steps 5")
    j.add_argument("kind", help=", ".join(GENERATORS))
    j.add_argument("--config", required=True, help="the training config the job runs")
    j.add_argument("--nodes", type=int, default=1)
    j.add_argument("--gpus-per-node", type=int, default=0)
    j.add_argument("--procs-per-node", type=int, default=1, help="ranks per node on CPU nodes")
    j.add_argument("--time", default="01:00:00", help="wall-clock limit HH:MM:SS")
    j.add_argument("--partition", default="", help="Slurm partition / PBS queue")
    j.add_argument("--account", default="", help="Slurm account / PBS project / ABCI group")
    j.add_argument("--job-name", default="meshtrain")
    j.add_argument("--mode", default="task-per-rank", help="slurm: task-per-rank or agent-per-node")
    j.add_argument("--pe", default="", help="sge: parallel environment to request (default: ABCI's -l rt_F)")
    j.add_argument("--container-image", default="", help="pyxis/enroot image for srun")
    j.add_argument("--container-mounts", default="")
    j.add_argument("--container-workdir", default="")
    j.add_argument("--module", action="append", default=[], help="environment module to load (repeatable)")
    j.add_argument("--instance-type", default="p5.48xlarge", help="pcluster: compute instance type")
    j.add_argument("--venv", default=".venv", help="where meshtrain is installed on the cluster")
    j.add_argument("--out", help="write to this file (pcluster also writes FILE.sbatch) instead of stdout")

    b = sub.add_parser("bench", help="measure the interconnect: collective bandwidth (nccl-tests style)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    comm = bsub.add_parser("comm", help="all-reduce, all-gather, reduce-scatter, broadcast from --min to --max bytes")
    comm.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    comm.add_argument("--min-bytes", default="1K", help="smallest message (e.g. 1K)")
    comm.add_argument("--max-bytes", default="1G", help="largest message (e.g. 1G)")
    comm.add_argument("--iters", type=int, default=20)
    comm.add_argument("--json", help="also write the rows to this JSON file")
    comm.add_argument("--nproc", type=int, help="start this many local processes (torch elastic)")

    pl = sub.add_parser("plan", allow_abbrev=False,
                        help="predict per-GPU memory and throughput of layouts on a cluster, and recommend one",
                        epilog="Any of --tp --pp --zero --dp-replicate --micro-batch --ac --pp-schedule "
                        "--virtual-stages fixes that knob; with all fixed (or --config) one layout is explained.")
    pl.add_argument("--model", help="a preset (tiny, small, gpt2-124m, ..., llama3-405b) or a TOML config's model")
    pl.add_argument("--config", help="explain the layout of this training config (model, batch, [parallel])")
    pl.add_argument("--gpu", required=True, help="device kind: " + ", ".join(_plan_kinds()))
    pl.add_argument("--gpus", type=int, help="GPUs (processes) in all (default: the config's tp x pp, else 8)")
    pl.add_argument("--gpus-per-node", type=int, help="default: 8 (cpu: the --gpus processes on this machine)")
    pl.add_argument("--arch", choices=["llama", "gpt"], default="llama",
                    help="gpt: LayerNorm, GELU MLP of 4h, learned positions, tied embeddings (Megatron GPT)")
    for flag, what in (("--layers", "blocks"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads"), ("--ffn", "MLP hidden size"), ("--vocab", "vocabulary")):
        pl.add_argument(flag, type=int, help=f"{what} (default: the preset's)")
    pl.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's, else 2048 or the "
                    "model's limit)")
    pl.add_argument("--global-batch", type=int, help="sequences per step (default: the config's, else 4 per GPU)")
    pl.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 (fp16 on a V100)")
    pl.add_argument("--attention", choices=["flash", "math"], default="flash",
                    help="math: the s x s attention scores are saved (GPT runs without flash attention)")
    pl.add_argument("--tp", type=int)
    pl.add_argument("--pp", type=int)
    pl.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    pl.add_argument("--dp-replicate", type=int)
    pl.add_argument("--micro-batch", type=int)
    pl.add_argument("--ac", choices=["none", "selective", "full"])
    pl.add_argument("--pp-schedule", choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"])
    pl.add_argument("--virtual-stages", type=int)
    pl.add_argument("--network", help="inter-node fabric: ib-edr, ib-hdr, ib-ndr, efa-p4d, efa-p5, roce-100g, "
                    "ethernet-10g (default: the GPU's usual one)")
    pl.add_argument("--inter-node-gbps", type=float, help="inter-node bus bandwidth per GPU, GB/s (bytes)")
    pl.add_argument("--intra-node-gbps", type=float, help="intra-node bus bandwidth, GB/s (bytes)")
    pl.add_argument("--comm", action="append", default=[], help="a `meshtrain bench comm --json` file measured on "
                    "your cluster (one node: intra-node; several: inter-node); repeatable")
    pl.add_argument("--memory-gib", type=float, help="override the device memory")
    pl.add_argument("--peak-tflops", type=float, help="override the device's dense peak")
    pl.add_argument("--efficiency", type=float, help="sustained fraction of the peak in training matmuls")
    pl.add_argument("--top", type=int, default=10, help="layouts in the table")
    pl.add_argument("--json", action="store_true", help="print JSON (a list `layouts`, best first)")
    pl.add_argument("--write-config", help="write the best layout as a training config to this TOML file")

    s = sub.add_parser("serve", help="serve a run, checkpoint or Hugging Face directory (OpenAI-compatible API)")
    s.add_argument("model", help="a run directory, a checkpoint, or a directory `meshtrain export` wrote")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", help="require Authorization: Bearer KEY")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoded together (KV-cache slots)")
    s.add_argument("--max-context", type=int, help="prompt + completion tokens (default: the model's max_seq_len)")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on a GPU, else fp32")

    g = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    g.add_argument("model", help="a run directory, a checkpoint, or a directory `meshtrain export` wrote")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])

    e = sub.add_parser("env", help="print the launch environment this process detects")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--all-ranks", action="store_true", help="print on every rank, not only rank 0")
    e.add_argument("--launcher", default="auto", help="force an environment (torchrun, slurm, openmpi, ...)")
    return p


def _plan_kinds() -> tuple[str, ...]:
    from meshtrain.plan.hardware import KINDS

    return KINDS


class _ConfigKey(argparse.Action):
    """`--section.key VALUE`: collected in order, parsed and checked by config.load_config."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.overrides = [*(getattr(namespace, "overrides", None) or []), option_string, value]


def _add_config_keys(parser: argparse.ArgumentParser) -> None:
    """Every config key, with its type, default and docstring, in `meshtrain train --help`."""
    import typing

    from meshtrain.config import config_keys

    def metavar(hint) -> str:
        if typing.get_origin(hint) is typing.Literal:
            return "{" + ",".join(repr(a) if a == "" else a for a in typing.get_args(hint)) + "}"
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        return {int: "INT", float: "FLOAT", bool: "BOOL"}.get(args[0], "STR")

    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, hint, default, doc in config_keys():
        section = key.split(".")[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}] config keys")
        groups[section].add_argument(f"--{key}", action=_ConfigKey, metavar=metavar(hint), default=argparse.SUPPRESS,
                                     help=f"{doc} (default: {default!r})".replace("%", "%%"))


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshtrain.config import load_config
    from meshtrain.logs import setup_logging

    cfg = load_config(args.config, overrides)
    in_worker = "RANK" in os.environ  # a worker started by torch elastic (ours or torchrun)
    if args.nproc is not None and not in_worker:
        if args.nproc < 1 or args.max_restarts < 0 or (args.nnodes is not None and args.nnodes < 1):
            raise MeshtrainError(f"--nproc ({args.nproc}) and --nnodes must be at least 1, --max-restarts "
                                 f"({args.max_restarts}) at least 0")
        from meshtrain.launch.local import launch_workers
        from meshtrain.train import check_training, ensure_dataset

        setup_logging(0, cfg.run.log_level)
        dataset = ensure_dataset(cfg)  # once, before any worker starts; also surfaces data errors here
        check_training(cfg, args.nproc * (args.nnodes or int(os.environ.get("SLURM_STEP_NUM_NODES", 1))),
                       dataset.vocab_size)
        worker_argv = ["train", *(["--config", args.config] if args.config else []), *overrides]
        return launch_workers(args.nproc, worker_argv, args.max_restarts, args.nnodes, args.node_rank,
                              args.master_addr, args.master_port)

    from meshtrain.train import train

    return train(cfg)["exit_code"]


def _jobscript(args: argparse.Namespace, train_args: list[str]) -> int:
    from meshtrain.config import load_config, parse_duration
    from meshtrain.launch.jobscript import JobSpec, render

    spec = JobSpec(config=args.config, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   procs_per_node=args.procs_per_node, time=args.time, partition=args.partition, account=args.account,
                   job_name=args.job_name, container_image=args.container_image,
                   container_mounts=args.container_mounts, container_workdir=args.container_workdir, mode=args.mode, sge_pe=args.pe,
                   modules=args.module, instance_type=args.instance_type, venv=args.venv, train_args=train_args)
    files = render(args.kind, spec)
    load_config(args.config, train_args)  # the job must not fail later on its own config
    parse_duration(args.time, "--time")
    for suffix, text in files.items():
        if args.out:
            from meshtrain.files import write_text

            path = write_text(args.out + suffix, text)
            if text.startswith("#!"):
                path.chmod(0o755)
            print(f"wrote {path}")
            if "logs/" in text:  # Slurm and SGE open the log before the script runs: a missing logs/ kills the job
                for logs in {Path("logs").resolve(), path.parent.resolve() / "logs"}:
                    logs.mkdir(parents=True, exist_ok=True)
                print("made logs/ here and beside the script: submit from one of these directories")
        else:
            print(text, end="")
    return 0


def _bench_comm(args: argparse.Namespace, argv: list[str]) -> int:
    from meshtrain.commbench import BUS_FACTOR, format_table, parse_size, run_comm_bench

    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in BUS_FACTOR]
    if unknown:
        raise MeshtrainError(f"--ops {','.join(unknown)} unknown: use {', '.join(BUS_FACTOR)}")
    try:
        low, high = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except (ValueError, IndexError):
        raise MeshtrainError(f"--min-bytes {args.min_bytes} / --max-bytes {args.max_bytes}: use sizes such as "
                             "1K, 64M, 1G") from None
    if not 4 <= low <= high or args.iters < 1:
        raise MeshtrainError(f"--min-bytes {args.min_bytes} must be at least 4 bytes and at most --max-bytes "
                             f"{args.max_bytes}, and --iters ({args.iters}) at least 1")
    if args.nproc and "RANK" not in os.environ:
        from meshtrain.launch.local import launch_workers

        forwarded = [a for i, a in enumerate(argv) if a != "--nproc" and (i == 0 or argv[i - 1] != "--nproc")]
        return launch_workers(args.nproc, forwarded)
    rows = run_comm_bench(ops, low, high, args.iters)
    if rows:
        print(format_table(rows), flush=True)
        if args.json:
            from meshtrain.files import write_json

            write_json(args.json, rows)
    return 0


def _sampling(args: argparse.Namespace):
    from meshtrain.serve import SamplingParams

    if args.max_tokens < 1 or not 0 <= args.temperature <= 2 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise MeshtrainError("--max-tokens must be >= 1, --temperature in [0, 2], --top-p in (0, 1], --top-k >= 0")
    return SamplingParams(args.max_tokens, args.temperature, args.top_p, args.top_k, [], args.seed)


def _finish(code: int) -> None:
    """Leave a distributed worker in order: barrier, destroy the process group, flush, os._exit.
    Letting the interpreter tear down live gloo objects aborts ~1 run in 10 (pytorch#179291)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    try:
        args, extra = _parser().parse_known_args(argv)
        if args.command == "jobscript":
            if extra:
                raise MeshtrainError(f"unexpected arguments: {' '.join(extra)} (put training overrides after --)")
            extra = passthrough
        elif passthrough:
            extra += passthrough
        if args.command == "train":
            code = _train(args, [*(getattr(args, "overrides", None) or []), *extra])
        elif args.command == "jobscript":
            code = _jobscript(args, extra)
        else:
            if extra:
                raise MeshtrainError(f"unexpected arguments: {' '.join(extra)}")
            if args.command == "data":
                from meshtrain.data import prepare

                manifest = prepare(args.input, args.out, args.tokenizer, args.vocab_size, args.val_fraction,
                                   args.dtype, progress=sys.stderr.isatty())
                print(f"wrote {args.out}: {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} "
                      f"validation tokens, vocabulary {manifest['vocab_size']} ({manifest['dtype']})")
                code = 0
            elif args.command == "serve":
                from meshtrain.serve import serve

                code = serve(args.model, args.host, args.port, args.api_key, args.max_batch, args.max_context,
                             args.device, args.dtype)
            elif args.command == "generate":
                from meshtrain.serve import generate_to_terminal

                code = generate_to_terminal(args.model, args.prompt, _sampling(args), args.device)
            elif args.command == "plan":
                from meshtrain.plan.command import run_plan

                code = run_plan(args)
            elif args.command == "bench":
                code = _bench_comm(args, argv)
            elif args.command == "export":
                import re

                from meshtrain.interop import export_hf

                if not re.fullmatch(r"\d+(\.\d+)?\s*[KMGT]?B", args.max_shard_size.strip(), re.IGNORECASE):
                    raise MeshtrainError(f"--max-shard-size {args.max_shard_size!r}: use a size such as 500MB or 5GB")

                print(f"wrote {export_hf(args.source, args.out, args.max_shard_size)}")
                code = 0
            else:
                from meshtrain.launch import detect
                from meshtrain.logs import write_line

                env = detect(launcher=args.launcher).as_dict()
                if args.all_ranks or env["rank"] == 0:
                    write_line(json.dumps(env) if args.json else "\n".join(f"{k:18} {v}" for k, v in env.items()))
                code = 0
    except MeshtrainError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    _finish(code)
