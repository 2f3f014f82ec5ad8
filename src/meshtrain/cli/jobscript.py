"""`meshtrain jobscript KIND`: a ready-to-submit script, after the job's own preflight at its world size."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtrain.cli.options import add_options, options_of
from meshtrain.errors import MeshtrainError
from meshtrain.launch.jobscript import KINDS, JobSpec


def add_parser(sub) -> None:
    j = sub.add_parser(
        "jobscript",
        help="write a ready-to-submit job script (slurm, sge, pbs, mpirun, torchrun, pcluster on GPUs or Trainium)",
        epilog="Arguments after -- go to `meshtrain train`, e.g. -- --training.steps 5",
    )
    j.add_argument("kind", choices=list(KINDS), help=", ".join(KINDS))
    add_options(j, JobSpec, skip=("train_args",))
    j.add_argument(
        "--out",
        help="write to this file (pcluster also writes FILE.sbatch, and with --accelerator trainium "
        "FILE.neuron-setup.sh) instead of stdout",
    )


def run(args: argparse.Namespace, train_args: list[str]) -> int:
    from meshtrain.config import load_config
    from meshtrain.launch.jobs import EARLIER_HEADERS, MARKER, prepare, render

    spec: JobSpec = prepare(args.kind, options_of(args, JobSpec, train_args=train_args))
    files = render(args.kind, spec)
    cfg = load_config(spec.config, train_args)
    _check_device(cfg.launch.device, spec.gpus_per_node, args.kind)
    _check_launcher(cfg.launch.env, args.kind, spec.mode)
    if args.kind in ("slurm", "sge", "pbs") and cfg.launch.device != "neuron":  # what the nodes reserved offer
        import torch

        from meshtrain.train.preflight import check_device

        check_device(cfg, torch.device("cuda" if spec.gpus_per_node else "cpu"), launcher=True)
    _check_job(cfg, spec.world)
    if spec.accelerator == "trainium":
        from meshtrain.launch.pcluster import NEURON_TRIAL

        what = "ahead-of-time compile trial (10 steps in a run directory of its own) of the job"
        try:  # its arguments in the script's order
            trial = load_config(spec.config, ["--launch.device", "neuron", *train_args, *NEURON_TRIAL])
        except MeshtrainError as e:
            raise MeshtrainError(f"the {what} could not start with this config: {e}") from None
        _check_job(trial, spec.world, what)
    if not args.out and len(files) > 1:  # on standard output they would run together as one file
        names = ", ".join(f"PREFIX{suffix}" for suffix in files)
        raise MeshtrainError(f"jobscript {args.kind} writes {len(files)} files ({names}): name them with --out PREFIX")
    if args.out:
        from meshtrain.files import check_output

        for suffix in files:
            signatures = (MARKER, *EARLIER_HEADERS)
            check_output(args.out + suffix, "--out", {"--config": spec.config}, signatures, "meshtrain jobscript")
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


def _check_device(device: str, gpus_per_node: int, kind: str) -> None:
    """GPUs reserved for a job that trains on the CPU would sit idle for its whole run, and a job
    pinned to CUDA without them fails only after waiting in the queue: both refused here."""
    if gpus_per_node and device == "cpu":
        raise MeshtrainError(
            f"--gpus-per-node {gpus_per_node} reserves GPUs, but launch.device = cpu trains on the CPU: drop "
            "--gpus-per-node, or train on them (launch.device = auto or cuda)"
        )
    if not gpus_per_node and device == "cuda" and kind in ("slurm", "sge", "pbs"):
        raise MeshtrainError(
            "launch.device = cuda, but the script reserves no GPUs: give --gpus-per-node (or launch.device = auto)"
        )


# The launchers that start a script's processes, by kind (Slurm's by mode): what launch.env may name.
SCRIPT_LAUNCHERS = {
    "slurm": {"task-per-rank": ("slurm",), "agent-per-node": ("torchrun",)},
    "pcluster": {"task-per-rank": ("slurm",), "agent-per-node": ("torchrun",)},
    "sge": ("openmpi", "mpich"),
    "pbs": ("openmpi", "mpich"),
    "mpirun": ("openmpi", "mpich"),
    "torchrun": ("torchrun",),
}


def _check_launcher(launcher: str, kind: str, mode: str) -> None:
    """A launch.env other than the script's launcher would read variables the job never sets (or, with
    single, train one whole job per process): refused before the job waits in the queue."""
    started_by = SCRIPT_LAUNCHERS[kind]
    started_by = started_by[mode] if isinstance(started_by, dict) else started_by
    if launcher not in ("auto", *started_by):
        how = f" --mode {mode}" if kind in ("slurm", "pcluster") else ""
        raise MeshtrainError(
            f"launch.env = {launcher!r}, but the {kind}{how} script starts its processes with "
            f"{' or '.join(started_by)}: drop launch.env (auto finds it), or set it to {started_by[0]}"
        )


def _check_job(cfg, world: int, what: str = "job") -> None:
    """The preflight the job will run, at the job's world size (batch and layout divisibility, the
    model's shape; the data's vocabulary and tokenizer where the data is here too), so that a script
    that cannot train is never submitted to wait in the queue."""
    from meshtrain.errors import DataError
    from meshtrain.train.preflight import preflight, prepared_dataset

    try:
        dataset = prepared_dataset(cfg)
    except DataError:
        dataset = None  # prepared on the cluster, or by the job itself
    try:
        preflight(cfg, world, dataset)
    except MeshtrainError as e:
        raise MeshtrainError(f"the {what}'s {world} ranks could not train this config: {e}") from None
