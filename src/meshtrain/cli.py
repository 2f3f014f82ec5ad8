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
    """Usage errors as one `error:` line, like every other mistake. No abbreviations: `--gpus` is not
    `--gpus-per-node`, and a flag that is not spelled out is refused."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = " (a value that starts with '-' is written --key=VALUE)" if "expected one argument" in message else ""
        raise MeshtrainError(f"{self.prog}: {message}{hint}; see {self.prog} --help")


def _number(kind, low, high=None, what=""):
    """An argparse type: `kind` within [low, high]; 0 is refused like a negative where low > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value != value or value < low or (high is not None and value > high):  # NaN too
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{text} must be {what or bound}")
        return value

    return parse


COUNT = _number(int, 1)  # processes, nodes, GPUs, tokens, iterations: at least 1
INDEX = _number(int, 0)  # ranks, restarts, GPUs per CPU node: 0 allowed
POSITIVE = _number(float, 1e-12, what="positive")
PORT = _number(int, 1, 65535)


def _size(text: str) -> int:
    from meshtrain.config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshtrain",
        description="Train Llama-style language models on any launcher and layout, plan layouts before "
        "spending GPU hours, export to Hugging Face and serve. Flags that set a config key are spelled "
        "like the key (--training.seq_len); sizes are written 64M, 5G or 5GB (binary units).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="train a model (any launcher, any layout)",
        usage="meshtrain train [--config FILE] [--nproc N] [launcher options] [--section.key VALUE ...]",
        epilog="Config keys as --section.key VALUE (or --section.key=VALUE) override the file. The "
        "launcher options (--nnodes, --node-rank, --master-addr, --master-port, --max-restarts) "
        "need --nproc.",
    )
    t.add_argument("--config", help="TOML config file (default: built-in defaults = configs/tiny.toml)")
    t.add_argument("--nproc", type=COUNT, help="start this many local worker processes (torch elastic)")
    t.add_argument("--max-restarts", type=INDEX, help="restart failed workers up to this many times (default 0)")
    t.add_argument(
        "--nnodes",
        type=COUNT,
        help="nodes, each running one `meshtrain train --nproc G` (default: "
        "the Slurm allocation's when run as one srun task per node, else 1)",
    )
    t.add_argument("--node-rank", type=INDEX, help="this node's index (static rendezvous at --master-addr)")
    t.add_argument("--master-addr", help="the first node's address (default: the first Slurm host)")
    t.add_argument("--master-port", type=PORT, help="rendezvous port (default: derived from the job id)")
    t.add_argument(
        "--dry-run",
        type=COUNT,
        metavar="WORLD",
        help="build the job for WORLD ranks in this process on a fake process group (nothing allocated) and "
        "print its busiest ranks' memory beside the planner's; nothing is trained",
    )
    t.add_argument(
        "--dry-run-rank", type=INDEX, action="append", metavar="R", help="with --dry-run: this rank (repeatable)"
    )
    t.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    _add_config_keys(t)

    d = sub.add_parser("data", help="prepare training data")
    dsub = d.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    prep = dsub.add_parser(
        "prepare",
        help="tokenize text/jsonl/parquet into token shards + manifest (streamed, on every core; each rank of "
        "srun/mpirun/torchrun takes a share)",
    )
    prep.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, directories or globs (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet) or a Hugging Face "
        "datasets save_to_disk directory",
    )
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument("--text-field", help='the JSON field or column holding text (default "text")')
    prep.add_argument(
        "--format",
        choices=("text", "chat"),
        default="text",
        help='chat: rows of "messages" (or "prompt"/"completion"), rendered with the chat template, with a loss mask',
    )
    prep.add_argument(
        "--chat-template",
        help="chat: a Jinja chat template file (default: the tokenizer's own, beside its tokenizer.json, else "
        "meshtrain's)",
    )
    prep.add_argument(
        "--chat-targets",
        choices=("assistant", "all"),
        help="chat: the tokens the loss learns, the assistant's answers (default) or every token",
    )
    prep.add_argument(
        "--max-tokens",
        type=_number(int, 1),
        help="chat: leave out (and count) conversations longer than this many tokens",
    )
    prep.add_argument("--workers", type=COUNT, help="tokenizing processes on this machine (default: every core)")
    prep.add_argument(
        "--tokenizer-sample",
        type=_size,
        help="text read to train the BPE, spread over the input (default 64M; not with --tokenizer)",
    )
    group = prep.add_mutually_exclusive_group()
    group.add_argument("--tokenizer", help="a Hugging Face tokenizer.json to use")
    group.add_argument(
        "--vocab-size", type=_number(int, 256), help="train a byte-level BPE of this size (default 8192)"
    )
    prep.add_argument(
        "--val-fraction",
        type=_number(float, 0.0, 0.5),
        default=0.01,
        help="share of documents held out for validation, 0 to 0.5 (default 0.01)",
    )
    prep.add_argument(
        "--token-dtype",
        choices=["auto", "uint16", "uint32"],
        default="auto",
        help="width of the stored token ids (auto: uint16 when the vocabulary fits)",
    )

    x = sub.add_parser("export", help="write a Hugging Face Llama directory from a run or checkpoint")
    x.add_argument("source", help="a run directory (its latest checkpoint, else model.safetensors) or a checkpoint")
    x.add_argument("--out", required=True, help="output directory")
    x.add_argument(
        "--max-shard-size", type=_size, default="5G", help="split the safetensors above this size (default 5G)"
    )

    j = sub.add_parser(
        "jobscript",
        help="write a ready-to-submit job script (slurm, sge, pbs, mpirun, torchrun, pcluster)",
        epilog="Arguments after -- go to `meshtrain train`, e.g. -- --training.steps 5",
    )
    j.add_argument("kind", choices=list(GENERATORS), help=", ".join(GENERATORS))
    j.add_argument("--config", required=True, help="the training config the job runs")
    j.add_argument("--nodes", type=COUNT, default=1, help="nodes (default 1)")
    j.add_argument("--gpus-per-node", type=INDEX, default=0, help="GPUs per node (0: CPU nodes, see --procs-per-node)")
    j.add_argument("--procs-per-node", type=COUNT, default=1, help="ranks per node on CPU nodes")
    j.add_argument("--time", default="01:00:00", help="wall-clock limit HH:MM:SS")
    j.add_argument("--partition", default="", help="Slurm partition / PBS queue")
    j.add_argument("--account", default="", help="Slurm account / PBS project / ABCI group")
    j.add_argument("--job-name", default="meshtrain")
    j.add_argument(
        "--mode",
        choices=["task-per-rank", "agent-per-node"],
        default="task-per-rank",
        help="slurm: one srun task per rank, or one torch elastic agent per node",
    )
    j.add_argument("--pe", default="", help="sge: parallel environment to request (default: ABCI's -l rt_F)")
    j.add_argument("--container-image", default="", help="pyxis/enroot image for srun")
    j.add_argument("--container-mounts", default="")
    j.add_argument("--container-workdir", default="")
    j.add_argument("--module", action="append", default=[], help="environment module to load (repeatable)")
    j.add_argument("--instance-type", default="p5.48xlarge", help="pcluster: compute instance type")
    j.add_argument("--venv", default=".venv", help="where meshtrain is installed on the cluster")
    j.add_argument("--out", help="write to this file (pcluster also writes FILE.sbatch) instead of stdout")

    b = sub.add_parser("bench", help="measure the interconnect: collective bandwidth (nccl-tests style)")
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    comm = bsub.add_parser(
        "comm", help="all-reduce, all-gather, reduce-scatter, broadcast from --min-bytes to --max-bytes"
    )
    comm.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    comm.add_argument("--min-bytes", type=_size, default="1K", help="smallest message (default 1K)")
    comm.add_argument("--max-bytes", type=_size, default="1G", help="largest message (default 1G)")
    comm.add_argument("--iters", type=COUNT, default=20)
    comm.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    comm.add_argument("--out", help="also write the rows as JSON to this file (what `plan --comm` reads)")
    comm.add_argument("--nproc", type=COUNT, help="start this many local processes (torch elastic)")

    pl = sub.add_parser(
        "plan",
        help="predict per-GPU memory and throughput of layouts on a cluster, and recommend one",
        epilog="Any of the [parallel]/[training] layout flags fixes that knob; with all fixed (or "
        "--config) one layout is explained. Each flag that sets a config key is spelled like the "
        "key; the short forms are aliases.",
    )
    source = pl.add_mutually_exclusive_group()
    source.add_argument("--model.preset", "--model", dest="model", help="a preset: " + ", ".join(_presets()))
    source.add_argument("--config", help="explain the layout of this training config (model, batch, [parallel])")
    pl.add_argument("--gpu", required=True, help="device kind: " + ", ".join(_plan_kinds()))
    pl.add_argument("--gpus", type=COUNT, help="GPUs (processes) in all (default: the config's tp x pp, else 8)")
    pl.add_argument("--gpus-per-node", type=COUNT, help="default: 8 (cpu: the --gpus processes on this machine)")
    pl.add_argument(
        "--arch",
        choices=["llama", "gpt"],
        default="llama",
        help="gpt: LayerNorm, GELU MLP of 4h, learned positions, tied embeddings (Megatron GPT)",
    )
    for keys, dest, what in (
        (("--model.n_layers", "--layers"), "layers", "blocks"),
        (("--model.dim", "--hidden"), "hidden", "hidden size"),
        (("--model.n_heads", "--heads"), "heads", "attention heads"),
        (("--model.n_kv_heads", "--kv-heads"), "kv_heads", "key/value heads"),
        (("--model.ffn_dim", "--ffn"), "ffn", "MLP hidden size"),
        (("--model.vocab_size", "--vocab"), "vocab", "vocabulary"),
    ):
        pl.add_argument(*keys, dest=dest, type=COUNT, help=f"{what} (default: the preset's)")
    pl.add_argument(
        "--training.seq_len",
        "--seq-len",
        dest="seq_len",
        type=COUNT,
        help="tokens per sequence (default: the config's, else 2048 or the model's limit)",
    )
    pl.add_argument(
        "--training.global_batch_size",
        "--global-batch",
        dest="global_batch",
        type=COUNT,
        help="sequences per step (default: the config's, else 4 per GPU)",
    )
    pl.add_argument(
        "--training.dtype",
        "--dtype",
        dest="dtype",
        choices=["bf16", "fp16", "fp32"],
        help="training precision (default: bf16; fp16 on a V100)",
    )
    pl.add_argument(
        "--attention",
        choices=["flash", "math"],
        default="flash",
        help="math: the s x s attention scores are saved (GPT runs without flash attention)",
    )
    pl.add_argument(
        "--training.compile",
        "--compile",
        dest="compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the blocks and the loss compiled with torch.compile (training.compile; default: the config's, else off)",
    )
    pl.add_argument("--parallel.tp", "--tp", dest="tp", type=COUNT)
    pl.add_argument("--parallel.pp", "--pp", dest="pp", type=COUNT)
    pl.add_argument("--parallel.zero", "--zero", dest="zero", type=int, choices=[0, 1, 2, 3])
    pl.add_argument("--parallel.dp_replicate", "--dp-replicate", dest="dp_replicate", type=COUNT)
    pl.add_argument("--training.micro_batch_size", "--micro-batch", dest="micro_batch", type=COUNT)
    pl.add_argument("--training.activation_checkpointing", "--ac", dest="ac", choices=["none", "selective", "full"])
    pl.add_argument(
        "--parallel.pp_schedule",
        "--pp-schedule",
        dest="pp_schedule",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"],
    )
    pl.add_argument("--parallel.pp_virtual_stages", "--virtual-stages", dest="virtual_stages", type=COUNT)
    pl.add_argument(
        "--parallel.sequence_parallel",
        "--sequence-parallel",
        dest="sequence_parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TP with sequence parallelism (default: on; --no-sequence-parallel for Megatron runs before 2022)",
    )
    pl.add_argument(
        "--network",
        help="inter-node fabric: ib-edr, ib-hdr, ib-ndr, efa-p4d, efa-p5, roce-100g, "
        "ethernet-10g (default: the GPU's usual one)",
    )
    pl.add_argument("--inter-node-gbps", type=POSITIVE, help="inter-node bus bandwidth per GPU, GB/s (bytes)")
    pl.add_argument("--intra-node-gbps", type=POSITIVE, help="intra-node bus bandwidth, GB/s (bytes)")
    pl.add_argument(
        "--comm",
        action="append",
        default=[],
        help="a `meshtrain bench comm --out FILE` file measured "
        "on your cluster (one node: intra-node; several: inter-node); repeatable",
    )
    pl.add_argument("--memory-gib", type=POSITIVE, help="override the device memory")
    pl.add_argument(
        "--training.peak_tflops",
        "--peak-tflops",
        dest="peak_tflops",
        type=POSITIVE,
        help="override the device's dense peak",
    )
    pl.add_argument(
        "--efficiency",
        type=_number(float, 0.01, 1.0),
        help="sustained fraction of the peak in training matmuls (0.01 to 1)",
    )
    pl.add_argument("--top", type=COUNT, default=10, help="layouts in the table")
    pl.add_argument("--json", action="store_true", help="print JSON (a list `layouts`, best first)")
    pl.add_argument("--write-config", help="write the best layout as a training config to this TOML file")
    pl.add_argument(
        "--verify",
        nargs="?",
        const=1,
        type=COUNT,
        metavar="N",
        help="dry-run the best N layouts (default 1) at their world size (`train --dry-run`) and add what the "
        "built job holds on its busiest rank (`built`)",
    )

    s = sub.add_parser("serve", help="serve a run, checkpoint or Hugging Face directory (OpenAI-compatible API)")
    s.add_argument("model", help="a run directory, a checkpoint, or a directory `meshtrain export` wrote")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=PORT, default=8000)
    s.add_argument("--api-key", help="require Authorization: Bearer KEY")
    s.add_argument("--max-batch", type=COUNT, default=16, help="requests decoded together (KV-cache slots)")
    s.add_argument("--max-context", type=COUNT, help="prompt + completion tokens (default: the model's max_seq_len)")
    _add_device(s)
    s.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="serving precision (auto: bf16 on a GPU, else fp32)",
    )

    g = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    g.add_argument("model", help="a run directory, a checkpoint, or a directory `meshtrain export` wrote")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=COUNT, default=64)
    g.add_argument("--temperature", type=_number(float, 0.0, 2.0), default=0.8, help="0 to 2; 0: greedy")
    g.add_argument("--top-p", type=_number(float, 1e-6, 1.0), default=1.0, help="nucleus sampling, (0, 1]")
    g.add_argument("--top-k", type=INDEX, default=50, help="0: off")
    g.add_argument("--seed", type=_number(int, 0, 2**63 - 1), help="seed of the sampling (0 to 2**63-1)")
    _add_device(g)

    e = sub.add_parser("env", help="print the launch environment this process detects")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--all-ranks", action="store_true", help="print on every rank, not only rank 0")
    e.add_argument(
        "--launch.env",
        "--launcher",
        dest="launcher",
        default="auto",
        help="force an environment: " + ", ".join(_launchers()),
    )
    return p


def _add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launch.device",
        "--device",
        dest="device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: CUDA where there is a GPU, else the CPU",
    )


def _presets() -> tuple[str, ...]:
    from meshtrain.model.presets import PRESETS

    return tuple(PRESETS)


def _launchers() -> tuple[str, ...]:
    from meshtrain.config import LAUNCHERS

    return LAUNCHERS


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
        groups[section].add_argument(
            f"--{key}",
            action=_ConfigKey,
            metavar=metavar(hint),
            default=argparse.SUPPRESS,
            help=f"{doc} (default: {default!r})".replace("%", "%%"),
        )


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshtrain.config import load_config
    from meshtrain.logs import setup_logging

    cfg = load_config(args.config, overrides)
    in_worker = "RANK" in os.environ  # a worker started by torch elastic (ours or torchrun)
    launcher_flags = {
        "--nnodes": args.nnodes,
        "--node-rank": args.node_rank,
        "--master-addr": args.master_addr,
        "--master-port": args.master_port,
        "--max-restarts": args.max_restarts,
    }
    given = [flag for flag, value in launcher_flags.items() if value is not None]
    if given and args.nproc is None:
        raise MeshtrainError(
            f"{', '.join(given)} configure meshtrain's own launcher: add --nproc N (workers per "
            "node), or leave them to your launcher (torchrun, srun, mpirun)"
        )
    if args.node_rank is not None and args.node_rank >= (args.nnodes or 1):
        raise MeshtrainError(f"--node-rank {args.node_rank} must be below --nnodes ({args.nnodes or 1})")
    if args.dry_run is None and (args.dry_run_rank or args.json):
        raise MeshtrainError(f"{'--dry-run-rank' if args.dry_run_rank else '--json'} goes with --dry-run WORLD")
    if args.dry_run is not None:
        if args.nproc is not None or given:
            raise MeshtrainError("--dry-run builds the job in this one process: leave out --nproc and its options")
        return _dry_run(cfg, args)
    if args.nproc is not None and not in_worker:
        from meshtrain.checkpoint import checkpoint_root, refuse_another_lineage
        from meshtrain.launch.local import launch_workers
        from meshtrain.lock import TOKEN_VARIABLE, RunLock
        from meshtrain.train import check_init_tokenizer, check_training, ensure_dataset

        setup_logging(0, cfg.run.log_level)
        refuse_another_lineage(cfg.checkpoint.resume, checkpoint_root(cfg))
        dataset = ensure_dataset(cfg)  # once, before any worker starts; also surfaces data errors here
        check_init_tokenizer(cfg, dataset)
        nodes = args.nnodes or int(os.environ.get("SLURM_STEP_NUM_NODES", 1))
        check_training(cfg, args.nproc * nodes, dataset.vocab_size)
        # The launcher holds the run directory for the whole job, across its workers' restarts (on
        # a multi-node job started by hand: node 0's launcher).
        lock = RunLock(cfg.run.dir)
        if not args.node_rank:
            lock.acquire()
            os.environ[TOKEN_VARIABLE] = lock.token  # the workers it starts belong to this job
        try:
            worker_argv = ["train", *(["--config", args.config] if args.config else []), *overrides]
            return launch_workers(
                args.nproc,
                worker_argv,
                args.max_restarts or 0,
                args.nnodes,
                args.node_rank,
                args.master_addr,
                args.master_port,
            )
        finally:
            lock.release()

    from meshtrain.train import train

    return train(cfg)["exit_code"]


def _dry_run(cfg, args) -> int:
    from meshtrain.plan.dry_run import KEYS, dry_run

    reports = dry_run(cfg, args.dry_run, args.dry_run_rank)
    if args.json:
        print(json.dumps({"world": args.dry_run, "ranks": [r.as_dict() for r in reports]}, indent=2))
        return 0

    def size(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    print(f"dry run: the job built for {args.dry_run} ranks; per rank, built (measured on fake tensors) / planned")
    for r in reports:
        where = ", ".join(f"{k} {v}" for k, v in r.coordinates.items())
        print(
            f"rank {r.rank} ({where}): "
            + " | ".join(f"{k} {size(r.built.get(k))} / {size(r.planned[k])}" for k in KEYS)
        )
        for note in r.notes:
            print(f"  {note}")
    return 0


def _jobscript(args: argparse.Namespace, train_args: list[str]) -> int:
    from meshtrain.config import load_config, parse_duration
    from meshtrain.launch.jobscript import JobSpec, render

    spec = JobSpec(
        config=args.config,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node,
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        container_image=args.container_image,
        container_mounts=args.container_mounts,
        container_workdir=args.container_workdir,
        mode=args.mode,
        sge_pe=args.pe,
        modules=args.module,
        instance_type=args.instance_type,
        venv=args.venv,
        train_args=train_args,
    )
    files = render(args.kind, spec)
    parse_duration(args.time, "--time")
    _check_job(load_config(args.config, train_args), spec.world)
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


def _prepare(args) -> int:
    """`data prepare`, alone or as one rank of a job (srun, mpirun, torchrun, SGE): the ranks join
    one gloo group (waiting on each other for as long as the slowest share takes) and split the work."""
    from datetime import timedelta

    from meshtrain.data import prepare
    from meshtrain.launch import detect
    from meshtrain.launch.distributed import init_distributed

    if args.tokenizer and args.tokenizer_sample is not None:
        raise MeshtrainError("--tokenizer-sample sizes the text a new BPE is trained on: not with --tokenizer")
    chat = _chat_options(args)
    from meshtrain.logs import setup_logging

    env = detect()
    setup_logging(env.rank)
    if env.distributed:
        init_distributed(env, "cpu", timeout=timedelta(days=7))
    manifest = prepare(
        args.input,
        args.out,
        args.tokenizer,
        args.vocab_size,
        args.val_fraction,
        args.token_dtype,
        progress=sys.stderr.isatty() and env.rank == 0,
        text_field=args.text_field or "text",
        workers=args.workers,
        sample_bytes=args.tokenizer_sample or 64 << 20,
        distributed=env.distributed,
        chat=chat,
    )
    if env.rank == 0:
        print(
            f"wrote {args.out}: {manifest['train_tokens']:,} train and {manifest['val_tokens']:,} validation tokens "
            f"in {len(manifest['shards'])} shards, vocabulary {manifest['vocab_size']} ({manifest['dtype']})"
        )
        if chat:
            docs = manifest["documents"]
            print(
                f"chat: {docs['train']:,} train and {docs['val']:,} validation conversations, "
                f"{manifest['target_tokens']:,} training targets ({chat.targets})"
                + (f"; {manifest['skipped_longer']:,} longer than --max-tokens left out" if chat.max_tokens else "")
            )
    return 0


def _chat_options(args):
    """--format chat's options (each refused without it), with the template resolved: --chat-template,
    else the tokenizer's own (a chat_template.jinja or tokenizer_config.json beside it), else
    meshtrain's default."""
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, template_of
    from meshtrain.data.prepare import ChatOptions

    chat_only = {"--chat-template": args.chat_template, "--chat-targets": args.chat_targets}
    chat_only["--max-tokens"] = args.max_tokens
    if args.format != "chat":
        given = [flag for flag, value in chat_only.items() if value is not None]
        if given:
            raise MeshtrainError(f"{given[0]} is an option of chat data: add --format chat")
        return None
    if args.text_field is not None:
        raise MeshtrainError('--text-field names the text of plain documents; chat rows hold "messages"')
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise MeshtrainError(f"--chat-template {path} does not exist (a Jinja chat template file)")
        template = path.read_text()
    else:
        template = template_of(Path(args.tokenizer).parent) if args.tokenizer else DEFAULT_CHAT_TEMPLATE
    ChatTemplate(template, None)  # a clear error now for one that does not parse
    return ChatOptions(template, args.chat_targets or "assistant", args.max_tokens or 0)


def _check_job(cfg, world: int) -> None:
    """The start-up checks the job will run, at the job's world size (batch and layout divisibility,
    the model's shape; the data's vocabulary where the data is here too), so that a script that
    cannot train is never submitted to wait in the queue."""
    from meshtrain.config import parse_data_path
    from meshtrain.data import read_manifest
    from meshtrain.errors import DataError
    from meshtrain.train import check_training

    try:
        vocab = read_manifest(parse_data_path(cfg.data.path)[0][0])["vocab_size"]
    except DataError:
        vocab = None  # prepared on the cluster, or by the job itself
    try:
        check_training(cfg, world, vocab)
    except MeshtrainError as e:
        raise MeshtrainError(f"the job's {world} ranks could not train this config: {e}") from None


def _bench_comm(args: argparse.Namespace, argv: list[str]) -> int:
    from meshtrain.commbench import BUS_FACTOR, format_table, run_comm_bench

    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in BUS_FACTOR]
    if unknown:
        raise MeshtrainError(f"--ops {','.join(unknown)} unknown: use {', '.join(BUS_FACTOR)}")
    if not 4 <= args.min_bytes <= args.max_bytes:
        raise MeshtrainError(
            f"--min-bytes ({args.min_bytes} bytes) must be at least 4 bytes and at most --max-bytes "
            f"({args.max_bytes} bytes)"
        )
    if args.nproc and "RANK" not in os.environ:
        from meshtrain.launch.local import launch_workers

        forwarded = [
            a
            for i, a in enumerate(argv)
            if a != "--nproc" and not a.startswith("--nproc=") and (i == 0 or argv[i - 1] != "--nproc")
        ]
        return launch_workers(args.nproc, forwarded)
    rows = run_comm_bench(ops, args.min_bytes, args.max_bytes, args.iters)
    if rows:
        from meshtrain.logs import write_line

        write_line(json.dumps(rows) if args.json else format_table(rows))
        if args.out:
            from meshtrain.files import write_json

            write_json(args.out, rows)
    return 0


def _sampling(args: argparse.Namespace):
    from meshtrain.serve import SamplingParams

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
                code = _prepare(args)
            elif args.command == "serve":
                from meshtrain.serve import serve

                code = serve(
                    args.model,
                    args.host,
                    args.port,
                    args.api_key,
                    args.max_batch,
                    args.max_context,
                    args.device,
                    args.dtype,
                )
            elif args.command == "generate":
                from meshtrain.serve import generate_to_terminal

                code = generate_to_terminal(args.model, args.prompt, _sampling(args), args.device)
            elif args.command == "plan":
                from meshtrain.plan.command import run_plan

                code = run_plan(args)
            elif args.command == "bench":
                code = _bench_comm(args, argv)
            elif args.command == "export":
                from meshtrain.interop import export_hf

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
