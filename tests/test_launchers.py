"""The same `meshtrain train` under real launchers: Open MPI, MPICH, two simulated nodes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import assert_same_run, faulty, train_args

ROOT_FLAGS = ["--allow-run-as-root", "--oversubscribe"] if os.geteuid() == 0 else ["--oversubscribe"]
LAUNCHERS = {
    "openmpi": ["mpirun.openmpi", "-np", "2", *ROOT_FLAGS],
    "mpich": ["mpiexec.mpich", "-np", "2", "-iface", "lo"],
}
MPI_ENV = {"OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo"}


def need(binary: str) -> None:
    if shutil.which(binary) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is missing on CI: `make test` installs it (scripts/install-cluster-deps.sh)")
        pytest.skip(f"{binary} not installed (scripts/install-cluster-deps.sh installs it as root)")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_mpi_launchers_train_like_one_process(name, reference_run, corpus, cli_env, tmp_path):
    need(LAUNCHERS[name][0])
    env = {**cli_env, **MPI_ENV}
    cmd = [*LAUNCHERS[name], sys.executable, "-m", "meshtrain"]
    # Each write to stdout is followed by a pause, so the other rank's output lands between two
    # writes of one rank: a line must go out in one write to arrive whole.
    out = subprocess.run(
        [*cmd, "env", "--json", "--all-ranks"],
        env=faulty(env, MESHTRAIN_STDOUT_PAUSE="0.3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    ranks = sorted(json.loads(line)["rank"] for line in out.stdout.splitlines() if line.startswith("{"))
    assert ranks == [0, 1], out.stdout + out.stderr
    assert all(json.loads(line)["launcher"] == name for line in out.stdout.splitlines() if line.startswith("{"))
    result = subprocess.run([*cmd, *train_args(corpus, tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "world 2" in result.stdout
    assert_same_run(tmp_path, reference_run())


@pytest.mark.multiproc
def test_two_nodes_simulated_with_two_agents(reference_run, corpus, cli_env, tmp_path):
    """Two `meshtrain train --nnodes 2 --node-rank K` agents on 127.0.0.1, 2 workers each: world 4."""
    port = "29611"
    args = [
        sys.executable,
        "-m",
        "meshtrain",
        *train_args(corpus, tmp_path),
        "--training.micro_batch_size",
        "2",
        "--nproc",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    procs = [
        subprocess.Popen(
            [*args, "--node-rank", str(k)], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert "world 4" in outs[0][0]
    assert_same_run(tmp_path, reference_run())
