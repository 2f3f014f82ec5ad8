"""Generated job scripts: pinned text (golden files), valid bash, clean under shellcheck.
Regenerate the golden files after an intended change with MESHTRAIN_UPDATE_GOLDEN=1."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import assert_user_error, run_cli

GOLDEN = Path(__file__).parent / "golden"
FITS = ["--training.micro_batch_size", "1"]  # tiny.toml's batch of 16 on the 16 ranks of 2 x 8 GPUs
COMMON = ["--config", "configs/tiny.toml", "--nodes", "2", "--time", "02:00:00", "--account", "proj42"]
CASES = {
    "slurm": ["slurm", *COMMON, "--gpus-per-node", "8", "--partition", "gpu", "--module", "cuda/12.4"],
    "slurm-agent-container": [
        "slurm",
        *COMMON,
        "--gpus-per-node",
        "8",
        "--mode",
        "agent-per-node",
        "--container-image",
        "nvcr.io#nvidia/pytorch:25.01-py3",
        "--container-mounts",
        "/fsx:/fsx",
        "--container-workdir",
        "/fsx/meshtrain",
    ],
    "slurm-cpu": ["slurm", *COMMON, "--procs-per-node", "2"],
    "sge": ["sge", *COMMON, "--gpus-per-node", "4", "--module", "cuda/12.4", "--module", "nccl/2.21"],
    "pbs": ["pbs", *COMMON, "--gpus-per-node", "4", "--partition", "workq"],
    "mpirun": ["mpirun", *COMMON, "--procs-per-node", "4"],
    "torchrun": ["torchrun", *COMMON, "--gpus-per-node", "8"],
    "pcluster": ["pcluster", *COMMON, "--gpus-per-node", "8", "--instance-type", "p5.48xlarge"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_jobscript_matches_golden_and_lints(case, cli_env, tmp_path):
    out = tmp_path / "job"
    result = run_cli(
        [
            "jobscript",
            *CASES[case],
            "--out",
            str(out),
            "--",
            "--training.steps",
            "5",
            "--training.micro_batch_size",
            "1",
        ],
        cli_env,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr
    files = {p.name.removeprefix("job"): p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    # Slurm and SGE open the log before the script runs: the directory must exist already.
    assert (tmp_path / "logs").is_dir() == any("logs/" in text for text in files.values())
    for suffix, text in files.items():
        golden = GOLDEN / f"{case}{suffix}.txt"
        if os.environ.get("MESHTRAIN_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert text == golden.read_text(), f"{golden} differs; regenerate with MESHTRAIN_UPDATE_GOLDEN=1 if intended"
        if text.startswith("#!/bin/bash"):
            assert "--training.steps 5" in text
            assert subprocess.run(["bash", "-n", str(tmp_path / f"job{suffix}")]).returncode == 0
            if shutil.which("shellcheck") is None:
                if os.environ.get("CI"):
                    pytest.fail("shellcheck is missing on CI: `make test` installs it")
                continue
            lint = subprocess.run(
                ["shellcheck", "-s", "bash", str(tmp_path / f"job{suffix}")], capture_output=True, text=True
            )
            assert lint.returncode == 0, lint.stdout


def test_slurm_script_has_the_preemption_and_rank_settings(cli_env):
    text = run_cli(["jobscript", *CASES["slurm"], "--", *FITS], cli_env).stdout
    for line in (
        "#SBATCH --signal=USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --output=logs/%x.%j.log",
        "srun --kill-on-bad-exit=1",
    ):
        assert line in text
    agent = run_cli(["jobscript", *CASES["slurm-agent-container"], "--", *FITS], cli_env).stdout
    assert "--ntasks-per-node=1" in agent and "--nproc 8" in agent and "--container-image=" in agent


def test_bad_jobscript_requests(cli_env):
    assert_user_error(run_cli(["jobscript", "lsf", "--config", "c.toml"], cli_env), "lsf", "slurm")
    assert_user_error(run_cli(["jobscript", "slurm", "--config", "c.toml", "--nodes", "0"], cli_env), "--nodes")
