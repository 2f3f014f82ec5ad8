"""The generated SGE script on a real single-node Son of Grid Engine (scripts/local-sge.sh)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_same_run, local_cluster, run_cli, train_args

ROOT = Path(__file__).parents[1]
VENV = Path(sys.executable).parent.parent


@pytest.fixture(scope="module")
def sge():
    yield from local_cluster("local-sge.sh")


@pytest.mark.multiproc
def test_qsub_pe_mpi_2_runs_the_generated_script(sge, reference_run, corpus, cli_env, tmp_path):
    script, run_dir = tmp_path / "job.sge", tmp_path / "run"
    args = [
        "jobscript",
        "sge",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--procs-per-node",
        "2",
        "--pe",
        "mpi",
        "--venv",
        str(VENV),
        "--out",
        str(script),
        "--",
        *train_args(corpus, run_dir)[1:],
    ]
    assert run_cli(args, cli_env).returncode == 0
    assert (tmp_path / "logs").is_dir()  # made by jobscript: SGE opens the log before the script runs
    mpi_env = (
        "OMPI_ALLOW_RUN_AS_ROOT=1,OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1,OMPI_MCA_oob_tcp_if_include=lo,"
        "OMPI_MCA_btl_tcp_if_include=lo"
    )
    job = subprocess.run(
        ["qsub", "-terse", "-v", mpi_env, str(script)], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.strip()
    deadline = time.monotonic() + 300
    while job in subprocess.run(["qstat"], capture_output=True, text=True).stdout:
        if time.monotonic() > deadline:
            subprocess.run(["qdel", job], capture_output=True)
            pytest.fail(
                f"SGE job {job} still queued or running after 300 s:\n"
                + subprocess.run(["qstat", "-j", job], capture_output=True, text=True).stdout[-2000:]
            )
        time.sleep(0.5)
    log = (tmp_path / "logs" / "meshtrain.log").read_text()
    assert "world 2" in log, log[-3000:]
    assert_same_run(run_dir, reference_run())
