"""`meshtrain jobscript KIND`: a ready-to-submit script, after its job is resolved at its world size."""

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
    from meshtrain.job.launch import check_script_job
    from meshtrain.launch.jobs import EARLIER_HEADERS, MARKER, prepare, render

    spec: JobSpec = prepare(args.kind, options_of(args, JobSpec, train_args=train_args))
    files = render(args.kind, spec)
    check_script_job(args.kind, spec, load_config(spec.config, train_args), train_args)
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
