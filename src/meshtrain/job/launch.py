"""What a job's launcher must provide, checked before anything starts. The local launcher (`train
--nproc`): torch elastic's variables and restarts. A job script, before it is written: the device its
nodes reserve, the launcher that starts its processes, and the job itself at the script's world size
(also the ahead-of-time compile trial of a Trainium cluster), so that a script that cannot train is
never submitted to wait in the queue."""

from __future__ import annotations

from meshtrain.config import Config, load_config
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.job import resolve_prepared
from meshtrain.launch.jobscript import JobSpec


def check_local_launch(cfg: Config, max_restarts: int | None) -> None:
    """`train --nproc` starts torch elastic's workers: launch.env must read torchrun's variables, and
    its restarts must not restart training.time_limit's clock."""
    from meshtrain.launch.env import chosen_launcher

    launcher = chosen_launcher(cfg.launch.env)
    if launcher not in ("auto", "torchrun"):
        raise ConfigError(
            f"launch.env = {launcher} (MESHTRAIN_LAUNCHER or the config), but --nproc starts torch elastic's "
            "workers (torchrun's variables): set launch.env to auto or torchrun, or leave out --nproc and start the "
            "job with that launcher"
        )
    if max_restarts and cfg.training.time_limit:
        raise ConfigError(
            f"training.time_limit with --nproc's --max-restarts {max_restarts}: each restart would start the "
            "limit's clock again, and the stop at the limit (exit 75) would count as a failure to restart; leave "
            "restarts to the scheduler's requeue (docs/launching.md), or drop one of them"
        )


def check_script_job(kind: str, spec: JobSpec, cfg: Config, train_args: list[str]) -> None:
    """Everything `jobscript KIND` checks of the job `spec` will run with `cfg` (the config and
    `train_args`, the training overrides after --)."""
    check_device_reserved(cfg.launch.device, spec.gpus_per_node, kind)
    check_launcher(cfg.launch.env, kind, spec.mode)
    if kind in ("slurm", "sge", "pbs") and cfg.launch.device != "neuron":  # what the nodes reserved offer
        import torch

        from meshtrain.job.device import check_device

        check_device(cfg, torch.device("cuda" if spec.gpus_per_node else "cpu"), launcher=True)
    check_job_at(cfg, spec.world)
    if spec.accelerator == "trainium":
        from meshtrain.launch.pcluster import NEURON_TRIAL

        what = "ahead-of-time compile trial (10 steps in a run directory of its own) of the job"
        try:  # its arguments in the script's order
            trial = load_config(spec.config, ["--launch.device", "neuron", *train_args, *NEURON_TRIAL])
        except MeshtrainError as e:
            raise MeshtrainError(f"the {what} could not start with this config: {e}") from None
        check_job_at(trial, spec.world, what)


def check_device_reserved(device: str, gpus_per_node: int, kind: str) -> None:
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


def check_launcher(launcher: str, kind: str, mode: str) -> None:
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


def check_job_at(cfg, world: int, what: str = "job") -> None:
    """The job resolved as it will be, at the job's world size (batch and layout divisibility, the
    model's shape; the data's vocabulary and tokenizer where the data is here too), so that a script
    that cannot train is never submitted to wait in the queue."""
    try:
        resolve_prepared(cfg, world, missing_ok=True)  # data not here: prepared on the cluster, or by the job
    except MeshtrainError as e:
        raise MeshtrainError(f"the {what}'s {world} ranks could not train this config: {e}") from None
