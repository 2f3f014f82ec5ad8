"""Never destroy what the user has: outputs that would replace inputs or foreign files are refused,
a fresh start never mixes with another run's checkpoints, one job per run directory, and files get
the permissions of the user's umask."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_user_error, children, faulty, read_metrics, run_cli, run_cli_here, train_args
from meshtrain.files import UMASK
from meshtrain.lock import LOCK_NAME


@pytest.fixture(scope="module")
def run(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("safety-run")
    result = run_cli(train_args(corpus, run_dir, "--checkpoint.every", "5"), cli_env)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def snapshot(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_export_never_deletes_what_it_did_not_write(run, cli_env, tmp_path, capsys):
    before = snapshot(run)
    assert_user_error(run_cli_here(["export", str(run), "--out", str(run)], capsys), "is the input")
    assert_user_error(
        run_cli_here(["export", str(run / "checkpoints"), "--out", str(run)], capsys), "contains the input"
    )
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert_user_error(run_cli_here(["export", str(run), "--out", str(foreign)], capsys), "did not write")
    afile = tmp_path / "a-file"
    afile.write_text("keep me too")
    assert_user_error(run_cli_here(["export", str(run), "--out", str(afile)], capsys), "is a file")
    assert snapshot(run) == before and (foreign / "notes.txt").read_text() == "keep me"
    assert afile.read_text() == "keep me too"

    out = tmp_path / "hf"
    for _ in range(2):  # its own earlier output is replaced
        result = run_cli(["export", str(run), "--out", str(out)], cli_env)
        assert result.returncode == 0, result.stderr
    (out / "README.md").write_text("model card")
    assert_user_error(run_cli_here(["export", str(run), "--out", str(out)], capsys), "holds README.md, which")
    (out / "README.md").unlink()
    for path in [out / "model.safetensors", out / "config.json", run / "model.safetensors"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~UMASK, path  # readable by a server of another user


def test_prepare_never_deletes_what_it_did_not_write(cli_env, tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("def f(x):\n    return x\n" * 50)
    args = ["data", "prepare", "--vocab-size", "300"]
    assert_user_error(run_cli_here([*args, "--input", str(texts), "--out", str(texts)], capsys), "is the input")
    assert_user_error(
        run_cli_here([*args, "--input", str(texts / "a.txt"), "--out", str(tmp_path)], capsys), "contains the input"
    )
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.bin").write_bytes(b"1234")
    assert_user_error(run_cli_here([*args, "--input", str(texts), "--out", str(other)], capsys), "did not write")
    assert (texts / "a.txt").is_file() and (other / "x.bin").read_bytes() == b"1234"
    (other / "manifest.json").write_text('{"name": "my web app"}')  # someone else's manifest
    assert_user_error(run_cli_here([*args, "--input", str(texts), "--out", str(other)], capsys), "did not write")
    assert (other / "x.bin").read_bytes() == b"1234"
    out = tmp_path / "data"
    for _ in range(2):
        result = run_cli([*args, "--input", str(texts), "--out", str(out)], cli_env)
        assert result.returncode == 0, result.stderr
    assert (out / "manifest.json").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "files"}))
    result = run_cli([*args, "--input", str(texts), "--out", str(out)], cli_env)  # an earlier meshtrain's output
    assert result.returncode == 0, result.stderr
    (out / "notes.txt").write_text("my notes on this data")  # put beside an earlier output: not replaced with it
    result = run_cli_here([*args, "--input", str(texts), "--out", str(out)], capsys)
    assert_user_error(result, "holds notes.txt, which `meshtrain data prepare` did not write")
    assert (out / "notes.txt").read_text() == "my notes on this data"


def test_a_fresh_start_never_mixes_with_another_runs_checkpoints(run, corpus, cli_env, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    for launcher in ([], ["--nproc", "2"]):
        result = run_cli(
            [
                *train_args(
                    corpus, run_dir, "--training.steps", "4", "--checkpoint.resume", "none", "--checkpoint.every", "2"
                ),
                *launcher,
            ],
            cli_env,
        )
        assert_user_error(result, "checkpoint.resume = none", "step_00000010")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_a_fresh_start_never_replaces_an_earlier_runs_results(run, corpus, cli_env, tmp_path):
    """A run without checkpoints (checkpoint.every = 0) leaves its weights and metrics; a second start
    in that run.dir has nothing to continue and would replace them: refused before anything is written,
    by either launcher. With the run's checkpoints there it continues (tests/test_checkpoint.py)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    for launcher in ([], ["--nproc", "2"]):
        result = run_cli([*train_args(corpus, run_dir, "--training.steps", "4"), *launcher], cli_env)
        assert_user_error(result, f"run.dir {run_dir} holds an earlier run's trained weights (model.safetensors)")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


def test_resuming_an_older_checkpoint_never_replaces_newer_ones(run, corpus, cli_env, tmp_path):
    """From step 5 with step 10 committed beside it, the run would save over step 10 when it gets
    there: refused before anything is written. Naming the newest explicitly continues the run."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(run, run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    older = run_dir / "checkpoints" / "step_00000005"
    result = run_cli([*train_args(corpus, run_dir, "--checkpoint.resume", str(older)), "--nproc", "2"], cli_env)
    assert_user_error(result, "continues from step 5", "newer checkpoints (step_00000010)")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    newest = run_dir / "checkpoints" / "step_00000010"
    result = run_cli(train_args(corpus, run_dir, "--checkpoint.resume", str(newest)), cli_env)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.multiproc
def test_one_job_per_run_directory(corpus, cli_env, tmp_path):
    args = [sys.executable, "-m", "meshtrain", *train_args(corpus, tmp_path, "--nproc", "2", "--checkpoint.every", "5")]
    first = subprocess.Popen(
        args, env=faulty(cli_env, MESHTRAIN_STEP_SLEEP="0.4"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lock = tmp_path / LOCK_NAME
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.1)
    holder = json.loads(lock.read_text())
    workers = children(first.pid)
    for w in workers:  # the first job holds the directory for as long as the second ones take to start
        os.kill(w, signal.SIGSTOP)
    try:
        for second in (train_args(corpus, tmp_path), [*train_args(corpus, tmp_path), "--nproc", "2"]):
            assert_user_error(run_cli(second, cli_env), "is in use by another job", f"pid {holder['pid']}")
    finally:
        for w in workers:
            os.kill(w, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 11))
    assert not lock.exists()  # released at the end

    # A lock left by a job that died (SIGKILL, a node reboot) is taken over; the run continues.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead.stdout), "started": "1", "job": "old"}))
    result = run_cli([*train_args(corpus, tmp_path), "--training.steps", "12"], cli_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not lock.exists()


def test_a_second_run_in_the_same_allocation_is_refused_and_the_job_itself_comes_back(tmp_path, monkeypatch):
    """Runs in one Slurm allocation share its job id: a live process of it on this host that is not
    this process's launcher holds the directory for another run (refused); the launcher above this
    process, or a holder that died (a requeue), is this job's own lock."""
    from meshtrain.lock import RunDirLocked, RunLock, _start_time

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = tmp_path / LOCK_NAME

    def held_by(pid):
        lock.write_text(
            json.dumps(
                {"host": os.uname().nodename, "pid": pid, "started": _start_time(pid), "job": "SLURM_JOB_ID=4242"}
            )
        )

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        held_by(other.pid)
        with pytest.raises(RunDirLocked, match="in use by another process of this job"):
            RunLock(tmp_path).acquire()
        with pytest.raises(RunDirLocked, match="in use by another process of this job"):
            RunLock(tmp_path).held_by_this_job()
    finally:
        other.kill()
        other.wait()
    held_by(os.getppid())  # the launcher above this process: its lock, kept as it is
    assert RunLock(tmp_path).held_by_this_job()
    RunLock(tmp_path).acquire().release()
    assert json.loads(lock.read_text())["pid"] == os.getppid()
    held_by(other.pid)  # the job's earlier start, dead (a requeue): taken over, so a live process holds it
    assert RunLock(tmp_path).held_by_this_job()
    taken = RunLock(tmp_path).acquire()
    assert taken.held and json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert not lock.exists() and [p.name for p in tmp_path.iterdir()] == []  # no temporary file left


def test_the_lock_is_taken_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    from meshtrain.lock import RunDirLocked, RunLock

    def no_links(*args):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first = RunLock(tmp_path).acquire()
    assert first.held and json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock = json.loads((tmp_path / LOCK_NAME).read_text())
    (tmp_path / LOCK_NAME).write_text(json.dumps({**lock, "job": "another job"}))
    with pytest.raises(RunDirLocked, match="in use by another job"):
        RunLock(tmp_path).acquire()
    first.release()


def test_a_checkpoint_dir_outside_the_run_dir_is_locked_too(tmp_path, monkeypatch):
    """Two runs with their own run.dir but one checkpoint.dir would resume, retire and prune each
    other's checkpoints: the second is refused, naming checkpoint.dir."""
    from meshtrain.checkpoint import job_locks
    from meshtrain.config import load_config
    from meshtrain.lock import RunDirLocked

    shared = str(tmp_path / "shared")
    first = load_config(None, ["--run.dir", str(tmp_path / "a"), "--checkpoint.dir", shared])
    second = load_config(None, ["--run.dir", str(tmp_path / "b"), "--checkpoint.dir", shared])
    inside = load_config(None, ["--run.dir", str(tmp_path / "c"), "--checkpoint.dir", str(tmp_path / "c" / "ckpt")])
    assert len(job_locks(first).locks) == 2 and len(job_locks(inside).locks) == 1
    held = job_locks(first).acquire()
    try:
        monkeypatch.setenv("MESHTRAIN_RUN_LOCK", "another job")  # as a second job would start
        lock = json.loads((tmp_path / "shared" / LOCK_NAME).read_text())
        (tmp_path / "shared" / LOCK_NAME).write_text(json.dumps({**lock, "job": "the first job"}))
        with pytest.raises(RunDirLocked, match="use another checkpoint.dir"):
            job_locks(second).acquire()
        assert not (tmp_path / "b" / LOCK_NAME).exists()  # taken all or none
    finally:
        held.release()
