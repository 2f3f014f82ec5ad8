"""Generated Slurm scripts on a real single-node Slurm (scripts/local-slurm.sh brings it up)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import assert_same_run, faulty, local_cluster, run_cli, train_args

ROOT = Path(__file__).parents[1]
VENV = Path(sys.executable).parent.parent


@pytest.fixture(scope="module")
def slurm():
    yield from local_cluster("local-slurm.sh")


def submit(script: Path, workdir: Path, env: dict, timeout: float = 300) -> str:
    """sbatch, then poll squeue until the job has left it (sbatch --wait polls only every 10 s)."""
    (workdir / "logs").mkdir(exist_ok=True)
    job = (
        subprocess.run(
            ["sbatch", "--parsable", f"--chdir={workdir}", str(script)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .split(";")[0]
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job])
        pytest.fail(f"job {job} did not finish in {timeout} s")
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    log = next((workdir / "logs").glob(f"*.{job}.log")).read_text()
    assert "JobState=COMPLETED" in state, log[-3000:]
    return log


def jobscript(cli_env, tmp_path, mode, corpus, run_dir, *extra, limit: str = "00:10:00") -> Path:
    out = tmp_path / "job.sbatch"
    args = [
        "jobscript",
        "slurm",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--procs-per-node",
        "2",
        "--time",
        limit,
        "--venv",
        str(VENV),
        "--mode",
        mode,
        "--out",
        str(out),
        "--",
        *train_args(corpus, run_dir)[1:],
        "--training.dtype",
        "fp32",  # the reference runs' arithmetic; tiny.toml's "auto" may pick bf16 on a busy machine
        *extra,
    ]
    assert run_cli(args, cli_env).returncode == 0
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["task-per-rank", "agent-per-node"])
def test_sbatch_generated_script_trains_like_a_local_run(mode, slurm, reference_run, corpus, cli_env, tmp_path):
    run_dir = tmp_path / "run"
    log = submit(jobscript(cli_env, tmp_path, mode, corpus, run_dir), tmp_path, cli_env)
    assert "world 2" in log
    assert_same_run(run_dir, reference_run())


@pytest.mark.multiproc
def test_mpirun_inside_sbatch_uses_mpi_ranks_not_the_batch_step(slurm, corpus, cli_env, tmp_path):
    if not Path("/usr/bin/mpirun.openmpi").exists():
        pytest.fail("Open MPI missing: `make test` installs it")
    script = tmp_path / "mpi.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --output=logs/%x.%j.log\n"
        "export OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_btl_tcp_if_include=lo\n"
        f"mpirun.openmpi --allow-run-as-root {VENV}/bin/meshtrain env --json --all-ranks\n"
    )
    log = submit(script, tmp_path, cli_env)
    envs = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert sorted(e["rank"] for e in envs) == [0, 1]
    assert {e["launcher"] for e in envs} == {"openmpi+slurm"} and {e["world_size"] for e in envs} == {2}


@pytest.mark.multiproc
def test_env_under_srun_reports_each_task(slurm, cli_env):
    out = subprocess.run(
        ["srun", "-n", "2", str(VENV / "bin" / "meshtrain"), "env", "--json", "--all-ranks"],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    envs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted((e["rank"], e["local_rank"]) for e in envs) == [(0, 0), (1, 1)], out.stderr
    assert {e["launcher"] for e in envs} == {"slurm"} and {e["master_addr"] for e in envs} == {"localhost"}


@pytest.mark.multiproc
def test_prepare_under_srun_splits_the_work_and_writes_what_one_process_writes(slurm, corpus, cli_env, tmp_path):
    """Two srun tasks, each tokenizing its share of the work units (one gloo group between them):
    the same bytes as one process with one worker."""
    from meshtrain.data import stdlib_sources

    with (tmp_path / "docs.jsonl").open("w") as f:
        for source in stdlib_sources()[:400]:
            f.write(json.dumps({"text": source.read_text(errors="replace")}) + "\n")
    args = ["data", "prepare", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(corpus / "tokenizer.json")]
    args += ["--val-fraction", "0.05", "--workers", "1"]
    one = run_cli([*args, "--out", str(tmp_path / "one")], cli_env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        ["srun", "-n", "2", str(VENV / "bin" / "meshtrain"), *args, "--out", str(tmp_path / "two")],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 reports
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert len({s["file"].split("-")[1] for s in manifest["shards"]}) >= 3  # several units: both ranks had work
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


@pytest.mark.multiproc
def test_a_job_that_reaches_its_time_limit_requeues_itself_and_resumes(slurm, reference_run, corpus, cli_env, tmp_path):
    """--time 1 minute, about 70 s of training: USR1 45 s in, a checkpoint and exit 75, the script
    requeues its job, the next run resumes; every step logged once, weights bitwise equal to an
    uninterrupted run of the same layout. (A requeued job starts again once its old credential
    has expired: scripts/local-slurm.sh sets 10 s instead of the default 120.) Only the first run
    is slowed (3 s steps, so that it is still training at the USR1): the requeued one trains its
    remaining steps at full speed instead of 3 s each (and cannot meet the limit a second time)."""
    run_dir, steps = tmp_path / "run", ["--training.steps", "20"]
    out = jobscript(cli_env, tmp_path, "task-per-rank", corpus, run_dir, *steps, limit="00:01:00")
    script = out.read_text()
    assert script.count("\nset -euo pipefail\n") == 1
    first_run_only = '[ "${SLURM_RESTART_COUNT:-0}" = 0 ] || unset MESHTRAIN_STEP_SLEEP  # test: first run slowed\n'
    out.write_text(script.replace("\nset -euo pipefail\n", "\nset -euo pipefail\n" + first_run_only))
    log = submit(out, tmp_path, faulty(cli_env, MESHTRAIN_STEP_SLEEP="3"), timeout=420)
    job = log.split("requeueing job ", 1)[-1].split()[0] if "requeueing job" in log else ""
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=0" not in state, state + log[-3000:]
    assert "requeueing job" in log and "resumed from" in log, log[-3000:]
    assert_same_run(run_dir, reference_run(*steps, nproc=2), exact=True)
