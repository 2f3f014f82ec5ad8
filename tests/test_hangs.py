"""A stuck or slow rank found and named (train/watchdog.py, train/stragglers.py): real 2-process
gloo jobs with a rank frozen by SIGSTOP, a data read or a checkpoint save that never returns, or a
rank slowed by SIGSTOP/SIGCONT."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import alive, children, faulty, rank_of, read_metrics, run_cli, train_args

HANG_TIMEOUT = 10
STEPS = 16
RUN = ["--nproc", "2", "--training.hang_timeout", str(HANG_TIMEOUT), "--checkpoint.every", "3"]
RUN += ["--training.steps", str(STEPS)]


def start(corpus, env, run_dir, *extra, preexec_fn=None) -> subprocess.Popen:
    args = [sys.executable, "-m", "meshtrain", *train_args(corpus, run_dir, *RUN, *extra)]
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn
    )


def on_one_core() -> None:
    """Run the job (its launcher and every rank, which inherit it) on this process's first core. On a
    machine shared with other tests' jobs, each core's load differs and the scheduler rarely moves a
    process, so one rank of a job spread over the cores can run 1.5x slower than the other for tens of
    seconds: a straggler indeed, but not what a test of a clean run means. On one core both ranks
    take the same share of whatever else runs there."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def wait_for_steps(proc, run_dir, steps: int) -> None:
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= steps):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("the run logged too few steps:\n" + proc.communicate()[1][-3000:])
        time.sleep(0.1)


def worker_of_rank(proc, rank: str) -> int:
    return next(pid for pid in children(proc.pid) if rank_of(pid) == rank)


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", ["sigstop", "data", "save"])
def test_a_hung_rank_is_named_with_every_stack_and_the_next_start_resumes(fault, corpus, cli_env, tmp_path):
    """Rank 1 frozen (SIGSTOP), stuck reading a batch, or stuck saving a checkpoint: the job ends
    within the timeout and the reports' wait, exit 124, with the stacks of the live ranks on disk and
    rank 1 named in one line; no worker is left. The next start continues from the checkpoint: the
    same command again (sigstop), or the launcher's own restart (data, under --max-restarts 1)."""
    run_dir = tmp_path / "run"
    env = faulty(cli_env, MESHTRAIN_STEP_SLEEP="0.2", MESHTRAIN_FAIL_RANK="1")
    restarts = ["--max-restarts", "1"] if fault == "data" else []
    if fault == "sigstop":  # a frozen rank never reports: the others need not wait the full 10 s for it
        env["MESHTRAIN_REPORT_WAIT_S"] = "3"
    elif fault == "data":
        env["MESHTRAIN_HANG_IN_DATA_AT_STEP"] = "5"
    elif fault == "save":
        env["MESHTRAIN_HANG_IN_SAVE_AT_STEP"] = "6"
    proc = start(corpus, env, run_dir, *restarts)
    wait_for_steps(proc, run_dir, 2)
    workers = children(proc.pid)
    if fault == "sigstop":
        wait_for_steps(proc, run_dir, 4)
        os.kill(worker_of_rank(proc, "1"), signal.SIGSTOP)
    stuck = time.monotonic()
    out, err = proc.communicate(timeout=HANG_TIMEOUT + 300)
    if restarts:  # the hung attempt ended, the second resumed and finished
        assert proc.returncode == 0, err[-3000:]
        assert "resumed from" in out + err and read_metrics(run_dir)[-1]["step"] == STEPS
    else:
        assert proc.returncode == 124, err[-3000:]
        assert time.monotonic() - stuck < HANG_TIMEOUT + 60, "the job took too long to give up"
    assert not any(alive(w) for w in workers), "a worker outlived the job"
    (report,) = [p for p in (run_dir / "hangs").iterdir() if not p.name.startswith(".")]
    summary = (report / "summary.txt").read_text()
    assert summary.count("\n") == 1 and summary.startswith("hang: ") and summary.strip() in out + err, summary
    ranks = sorted(p.name for p in report.glob("rank*.txt"))
    if fault == "sigstop":
        assert ranks == ["rank0.txt"] and "rank 1 sent no report (frozen or dead)" in summary, summary
        assert re.search(r"exiting 124: a rerun continues from \S+/checkpoints/step_000000(03|06)\n", summary), summary
    else:
        assert ranks == ["rank0.txt", "rank1.txt"], ranks
        stuck_in = "did not finish data of step 5" if fault == "data" else "did not arrive at all_reduce, held at"
        assert "rank 1 did not" in summary and stuck_in in summary, summary
        status = json.loads((report / "rank1.txt").read_text().split("\n", 1)[0])
        assert status["phase"] == ("data" if fault == "data" else "save") and "sitecustomize" in status["at"]
    for path in report.glob("rank*.txt"):
        text = path.read_text()
        assert "Thread" in text and "File " in text and "meshtrain-watchdog" not in text.split("\n", 1)[0]
    if fault == "sigstop":
        again = run_cli(train_args(corpus, run_dir, *RUN), cli_env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from" in again.stdout + again.stderr
        assert read_metrics(run_dir)[-1]["step"] == STEPS


@pytest.mark.multiproc
def test_a_slow_save_that_progresses_is_waited_for_and_a_frozen_one_is_a_hang(corpus, cli_env, tmp_path):
    """Rank 1's save of step 6 writes for 3x the hang timeout, every item flushed then a pause (a slow
    file system): the job waits for it and finishes, with no hang report. The same save frozen
    (SIGSTOP) half-way: the job is hung within the timeout of its last byte, rank 1 named."""
    timeout = 5
    run = ["--nproc", "2", "--training.hang_timeout", str(timeout), "--checkpoint.every", "3"]
    run += ["--training.steps", "8"]
    env = faulty(cli_env, MESHTRAIN_FAIL_RANK="1", MESHTRAIN_SLOW_SAVE=f"6:{3 * timeout + 3}")
    env["MESHTRAIN_REPORT_WAIT_S"] = "3"

    slow = run_cli(train_args(corpus, tmp_path / "slow", *run), env)
    assert slow.returncode == 0, slow.stderr[-3000:]
    assert "rank 1 saves slowly" in slow.stdout + slow.stderr
    elapsed = {r["step"]: r["elapsed_s"] for r in read_metrics(tmp_path / "slow")}
    assert elapsed[7] - elapsed[6] > 3 * timeout, elapsed  # the save of step 6 took that long
    assert not [p for p in (tmp_path / "slow" / "hangs").iterdir() if not p.name.startswith(".")]
    assert (tmp_path / "slow" / "checkpoints" / "step_00000006" / "COMMITTED.json").is_file()

    run_dir = tmp_path / "frozen"
    proc = start(corpus, env, run_dir, *run[2:])
    wait_for_steps(proc, run_dir, 6)
    time.sleep(timeout / 2)  # inside the slow save
    os.kill(worker_of_rank(proc, "1"), signal.SIGSTOP)
    stuck = time.monotonic()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 124, err[-3000:]
    assert time.monotonic() - stuck < 2 * timeout + 30, "the job took too long to give up"
    (report,) = [p for p in (run_dir / "hangs").iterdir() if not p.name.startswith(".")]
    summary = (report / "summary.txt").read_text()
    assert "rank 1 sent no report (frozen or dead)" in summary and "in save of step 6" in summary, summary


def test_the_first_step_has_a_budget_of_its_own(corpus, cli_env, tmp_path):
    """training.first_step_timeout (the loader's start-up, compilation) replaces the first step's 5x the
    hang timeout: a first batch that never comes is a hang after it, not after 5x 30 s."""
    env = faulty(cli_env, MESHTRAIN_HANG_IN_DATA_AT_STEP="1", MESHTRAIN_REPORT_WAIT_S="1")
    run = ["--training.hang_timeout", "30", "--training.first_step_timeout", "6"]
    began = time.monotonic()
    result = run_cli(train_args(corpus, tmp_path / "run", *run), env)
    assert result.returncode == 124, result.stderr[-3000:]
    assert "waited over 6 s in data of step 1" in result.stdout + result.stderr
    assert time.monotonic() - began < 60


@pytest.mark.multiproc
def test_a_slowed_rank_is_named_a_straggler_and_a_clean_run_names_none(corpus, cli_env, tmp_path):
    """Rank 1 stopped for 0.3 s of every 0.6 s (the job at about half speed, and the stops falling
    in any part of a step, so that the spread of one interval ranges from none to tenfold) is named
    within 60 s (warning and metrics) while the job goes on; the same run without it names no one."""
    extra = ["--training.steps", "600", "--run.log_every", "5", "--checkpoint.every", "0"]  # ~0.2 s intervals
    args = [sys.executable, "-m", "meshtrain", *train_args(corpus, tmp_path / "clean", *RUN, *extra)]
    clean = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=600, preexec_fn=on_one_core)
    assert clean.returncode == 0, clean.stderr[-3000:]
    records = [r for r in read_metrics(tmp_path / "clean") if "compute_spread" in r]
    assert len(records) >= 100 and not any("straggler" in r for r in records)
    assert "straggler" not in clean.stdout + clean.stderr

    run_dir = tmp_path / "slowed"
    proc = start(corpus, cli_env, run_dir, *extra, preexec_fn=on_one_core)
    wait_for_steps(proc, run_dir, 2)
    pid, done, named_after = worker_of_rank(proc, "1"), threading.Event(), []

    def slow_down():
        # The rank exits at the end of the run, between two signals: then there is nothing to slow.
        began = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.3)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.3)
                if not named_after and '"straggler": 1' in (run_dir / "metrics.jsonl").read_text():
                    named_after.append(time.monotonic() - began)

    slower = threading.Thread(target=slow_down, daemon=True)
    slower.start()
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        done.set()
        slower.join()
    assert proc.returncode == 0, err[-3000:]
    assert "rank 1 is a straggler" in out + err
    assert named_after and named_after[0] < 60, named_after
    named = [r for r in read_metrics(run_dir) if r.get("straggler") == 1]
    assert named and not any(r.get("straggler") == 0 for r in read_metrics(run_dir))


def test_a_straggler_is_named_from_its_share_of_the_window_not_from_one_interval():
    """The rule alone, on made-up interval times of 2 ranks: a rank stopped now and then (slow by
    nothing or by tenfold, never three intervals in a row) is named; so is one nearly always slowest
    by 30%; one long pause, or noise that moves between ranks, names no one; once named, a rank
    stays so while it is still 30% slower in sum."""
    from meshtrain.train.stragglers import StragglerDetector

    def named(intervals, detector=None):  # intervals of 0.2 s
        detector = detector or StragglerDetector(timer=None, device=None, world=2)
        start = detector.window[-1][0] if detector.window else 0.0
        return [detector.observe(start + 0.2 * (i + 1), list(seconds)) for i, seconds in enumerate(intervals)][-1]

    stopped_now_and_then = [(1.0, [1.0, 11.7, 1.0, 1.4, 1.0, 1.0, 3.0][i % 7]) for i in range(40)]
    assert named(stopped_now_and_then) == 1
    assert named([(1.0, 1.4 if i % 12 else 0.95) for i in range(40)]) == 1
    assert named([(1.0, 1.0)] * 10 + [(1.0, 30.0)] + [(1.0, 1.0)] * 10) is None
    noise = [(1.0 + 0.4 * (i % 3 == 0), 1.0 + 0.4 * (i % 3 == 1)) for i in range(60)]
    assert named(noise) is None
    detector = StragglerDetector(timer=None, device=None, world=2)
    assert named([(1.0, 2.0)] * 5, detector) == 1
    assert named([(1.0, 1.35)] * 100, detector) == 1  # the window holds 20 s: only these
    assert named([(1.0, 1.1)] * 100, detector) is None
    assert named([(1.0, 1.35)] * 10) is None
