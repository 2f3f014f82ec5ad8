"""Checkpoints: exact resume, resharding, crash and preemption recovery, corrupt checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    ATOL,
    RTOL,
    a_train_state,
    alive,
    assert_same_run,
    assert_user_error,
    children,
    faulty,
    rank_of,
    read_metrics,
    run_cli,
    train_args,
    train_together,
)
from meshtrain.checkpoint import MARKER, find_resume, verify
from meshtrain.errors import CheckpointError

SCHEDULE = ["--model.n_layers", "4", "--training.micro_batch_size", "2", "--training.steps", "12"]
LAYOUTS = {
    "ddp2": ["--nproc", "2"],
    "zero1-2": ["--nproc", "2", "--parallel.zero", "1"],
    "zero2-2": ["--nproc", "2", "--parallel.zero", "2"],
    "zero3-2": ["--nproc", "2", "--parallel.zero", "3"],
    "hsdp-2x2": ["--nproc", "4", "--parallel.zero", "3", "--parallel.dp_replicate", "2"],
    "tp2": ["--nproc", "2", "--parallel.tp", "2"],
    "pp2": ["--nproc", "2", "--parallel.pp", "2"],
}


def train(corpus, cli_env, run_dir, *extra, env=None, check=True):
    result = run_cli(train_args(corpus, run_dir, *SCHEDULE, *extra), env or cli_env)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def assert_same_weights(a, b, exact=True):
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        if exact:
            assert torch.equal(wa[key], wb[key]), key
        else:
            torch.testing.assert_close(wa[key], wb[key], rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def straight(corpus, cli_env, tmp_path_factory):
    """Uninterrupted 12-step runs, per layout (and one process); the 2-process ones in one launch
    (conftest.train_together: one start-up of the processes for the six)."""
    env, runs, two_process = faulty(cli_env, MESHTRAIN_RNG_PROBE="1"), {}, []
    for name, extra in {"single": [], **LAYOUTS}.items():
        runs[name] = tmp_path_factory.mktemp(f"straight-{name}")
        if extra[:2] == ["--nproc", "2"]:
            two_process.append(train_args(corpus, runs[name], *SCHEDULE, *extra[2:]))
        else:
            train(corpus, cli_env, runs[name], *extra, env=env)
    train_together(two_process, 2, env)
    return runs


@pytest.fixture(scope="module")
def stopped_and_resumed(corpus, cli_env, tmp_path_factory):
    """Each layout's run stopped at step 6, then started again to step 12: {name: (run dir, the
    step logged last and whether weights were saved when it stopped, the resume's output)}. The
    2-process ones in two launches, one per phase (conftest.train_together)."""
    env, stops, outputs = faulty(cli_env, MESHTRAIN_RNG_PROBE="1"), {}, {}
    runs = {name: tmp_path_factory.mktemp(f"resumed-{name}") for name in LAYOUTS}
    two_process = [name for name, extra in LAYOUTS.items() if extra[:2] == ["--nproc", "2"]]
    for phase in (["--training.stop_at_step", "6"], []):
        together = [train_args(corpus, runs[name], *SCHEDULE, *LAYOUTS[name][2:], *phase) for name in two_process]
        result = train_together(together, 2, env)
        outputs.update({name: result.stdout for name in two_process})
        for name in LAYOUTS.keys() - two_process:
            outputs[name] = train(corpus, cli_env, runs[name], *LAYOUTS[name], *phase, env=env).stdout
        if phase:
            stops = {name: (max(losses(d)), (d / "model.safetensors").exists()) for name, d in runs.items()}
    return {name: (runs[name], stops[name], outputs[name]) for name in LAYOUTS}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stop_and_resume_is_exact(name, straight, stopped_and_resumed):
    """Losses, weights and each rank's random generator (drawn from differently on each rank, as
    dropout would) as if the run had never stopped."""
    run_dir, (last_step, saved_weights), output = stopped_and_resumed[name]
    assert last_step == 6 and not saved_weights
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000006'} (step 6" in output
    assert_same_run(run_dir, straight[name], exact=True)  # identical, not just close
    rng = {p.name: p.read_text() for p in straight[name].glob("rng-rank*.txt")}
    assert len(rng) > 1 and len(set(rng.values())) > 1  # the ranks' generators differ
    assert {p.name: p.read_text() for p in run_dir.glob("rng-rank*.txt")} == rng


@pytest.fixture(scope="module")
def zero3_stopped(corpus, cli_env, tmp_path_factory):
    """A ZeRO-3 2-process run stopped at step 6, trained once: every reshard target resumes from its
    checkpoint (read-only: each target writes into its own run dir)."""
    source = tmp_path_factory.mktemp("zero3-source")
    train(corpus, cli_env, source, *LAYOUTS["zero3-2"], "--training.stop_at_step", "6")
    return source


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "target",
    [[], ["--nproc", "2", "--parallel.tp", "2"], ["--nproc", "2", "--parallel.pp", "2"], ["--nproc", "4"]],
    ids=["single", "tp2", "pp2", "dp4"],
)
def test_reshard_zero3_checkpoint_onto_other_layouts(target, straight, zero3_stopped, corpus, cli_env, tmp_path):
    run_dir = tmp_path / "resharded"
    ckpt = zero3_stopped / "checkpoints" / "step_00000006"
    result = train(corpus, cli_env, run_dir, *target, "--checkpoint.resume", str(ckpt))
    assert "'zero': 3" in result.stdout  # it says which layout saved it
    expected, got = losses(straight["single"]), losses(run_dir)
    assert sorted(got) == list(range(7, 13))
    for step, loss in got.items():
        assert abs(loss - expected[step]) <= RTOL * abs(expected[step]), (step, loss, expected[step])
    assert_same_weights(run_dir, straight["single"], exact=False)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "fault, use_async", [("MESHTRAIN_FAIL_AT_STEP", "false"), ("MESHTRAIN_FAIL_IN_SAVE_AT_STEP", "true")]
)
def test_crash_recovery_with_elastic_restart(fault, use_async, straight, corpus, cli_env, tmp_path):
    """Rank 1 dies at step 7, or while committing the (async) save of step 10; checkpoints every 5
    steps; the restarted workers resume from the last committed checkpoint and end identical."""
    env = faulty(cli_env, **{fault: "7" if fault == "MESHTRAIN_FAIL_AT_STEP" else "10", "MESHTRAIN_FAIL_RANK": "1"})
    result = train(
        corpus,
        cli_env,
        tmp_path,
        *LAYOUTS["ddp2"],
        "--max-restarts",
        "1",
        "--checkpoint.every",
        "5",
        "--checkpoint.async",
        use_async,
        env=env,
    )
    assert "[fault injection]" in result.stdout
    assert "resumed from" in result.stdout and "step_00000005" in result.stdout
    if fault == "MESHTRAIN_FAIL_IN_SAVE_AT_STEP":
        assert "skipping uncommitted checkpoint" in result.stdout
    assert_same_weights(tmp_path, straight["ddp2"], exact=True)
    logged = [m["step"] for m in read_metrics(tmp_path)]
    assert logged == list(range(1, 13))  # the steps redone after the restart are logged once
    steps = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").iterdir())
    assert steps == [5, 10, 12]  # keep = 3, all committed
    assert all((tmp_path / "checkpoints" / f"step_{s:08d}" / MARKER).is_file() for s in steps)


def start_slow_run(corpus, cli_env, run_dir, steps_logged: int = 3) -> subprocess.Popen:
    """`meshtrain train --nproc 2` with 0.5 s steps, once it has logged `steps_logged` steps."""
    args = [sys.executable, "-m", "meshtrain", *train_args(corpus, run_dir, *SCHEDULE, *LAYOUTS["ddp2"])]
    proc = subprocess.Popen(
        args, env=faulty(cli_env, MESHTRAIN_STEP_SLEEP="0.5"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= steps_logged):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the run logged no {steps_logged} steps within 120 s:\n" + proc.communicate()[1][-3000:])
        time.sleep(0.2)
    return proc


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "sig, code", [(signal.SIGUSR1, 75), (signal.SIGTERM, 75), (signal.SIGINT, 130)], ids=["usr1", "term", "int"]
)
def test_a_signal_to_the_launcher_checkpoints_and_the_next_run_continues(
    sig, code, straight, corpus, cli_env, tmp_path
):
    """What Slurm does at preemption (SIGTERM or --signal=USR1 to the launcher) and Ctrl-C (SIGINT):
    the workers finish their step, checkpoint and stop; one line, no traceback; the rerun continues
    exactly."""
    proc = start_slow_run(corpus, cli_env, tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, out[-2000:] + err[-3000:]
    assert "checkpoint of step" in out and "Traceback" not in out + err, out[-2000:] + err[-3000:]
    stopped = max(losses(tmp_path))
    assert 3 <= stopped < 12
    result = train(corpus, cli_env, tmp_path, *LAYOUTS["ddp2"])
    assert f"step {stopped}" in result.stdout
    assert_same_run(tmp_path, straight["ddp2"], exact=True)


@pytest.mark.multiproc
def test_a_signal_during_start_up_ends_the_job_at_once(corpus, cli_env, tmp_path):
    """Preemption while rank 1 is still starting (it has no handlers yet, so the signal kills it) and
    rank 0 already waits for it in the rendezvous: rank 0 must not wait there for the process group's
    timeout (10 minutes) with the launcher waiting on it; nothing was trained, nothing is saved."""
    env = faulty(cli_env, MESHTRAIN_SLOW_START="1:120")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain", *train_args(corpus, tmp_path, *LAYOUTS["ddp2"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while "0" not in [rank_of(w) for w in children(proc.pid)]:
        assert time.monotonic() < deadline, "no rank 0 worker started"
        time.sleep(0.2)
    time.sleep(8)  # rank 0: imported, past its handlers' old place, waiting for rank 1
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()  # its workers die with it
        raise
    assert proc.returncode == 75, out[-2000:] + err[-3000:]
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.multiproc
def test_workers_die_with_a_killed_launcher(corpus, cli_env, tmp_path):
    proc = start_slow_run(corpus, cli_env, tmp_path, steps_logged=1)
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their launcher"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def saved(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved")
    train(corpus, cli_env, run_dir, "--checkpoint.every", "4", "--training.steps", "8", *LAYOUTS["ddp2"])
    return run_dir / "checkpoints"


def test_corrupt_checkpoints_are_named(saved, tmp_path):
    import shutil

    good = saved / "step_00000008"
    assert verify(good)["step"] == 8
    for damage, fragment in [
        ("truncate", "__1_0.distcp is"),
        ("remove", "missing __0_0.distcp"),
        ("metadata", ".metadata does not match"),
        ("flip", "__1_0.distcp does not match"),
        ("marker", "never committed"),
    ]:
        bad = tmp_path / damage / "step_00000008"
        shutil.copytree(good, bad)
        if damage == "truncate":
            (bad / "__1_0.distcp").write_bytes((bad / "__1_0.distcp").read_bytes()[:100])
        elif damage == "remove":
            (bad / "__0_0.distcp").unlink()
        elif damage == "flip":  # random bytes inside a shard, same size
            data = bytearray((bad / "__1_0.distcp").read_bytes())
            data[len(data) // 2 : len(data) // 2 + 8] = bytes(range(8))
            (bad / "__1_0.distcp").write_bytes(bytes(data))
        elif damage == "metadata":
            data = bytearray((bad / ".metadata").read_bytes())
            data[-1] ^= 0xFF
            (bad / ".metadata").write_bytes(bytes(data))
        else:
            (bad / MARKER).unlink()
        with pytest.raises(CheckpointError, match=fragment.replace(".", r"\.")):
            verify(bad)


def test_auto_resume_skips_uncommitted_and_picks_the_newest(saved, tmp_path):
    import json
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    shutil.copytree(root / "step_00000008", root / "step_00000012")
    (root / "step_00000012" / MARKER).unlink()
    warnings = []
    assert find_resume("auto", root, warnings.append) == root / "step_00000008"
    assert "step_00000012" in warnings[0]
    assert find_resume("none", root, warnings.append) is None
    assert find_resume(str(root), root, warnings.append) == root / "step_00000008"
    shard = root / "step_00000008" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    assert find_resume("auto", root, warnings.append) == root / "step_00000004"  # falls back past the damage
    assert "damaged" in warnings[-1] and "__0_0.distcp" in warnings[-1]
    with pytest.raises(CheckpointError, match="__0_0.distcp does not match its checksum"):
        find_resume(str(root / "step_00000008"), root, warnings.append)
    marker = json.loads((root / "step_00000004" / MARKER).read_text())
    for broken in ({**marker, "files": list(marker["files"])}, {k: v for k, v in marker.items() if k != "step"}):
        (root / "step_00000008" / MARKER).write_text(json.dumps(broken))  # a hand-edited marker: one line, no traceback
        with pytest.raises(CheckpointError, match="COMMITTED.json is corrupt"):
            find_resume(str(root / "step_00000008"), root, warnings.append)
    # every checkpoint unusable beside the run's trained weights: a fresh start would replace them
    (root / "step_00000004" / MARKER).unlink()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"trained")
    with pytest.raises(CheckpointError, match="model.safetensors holds the run's trained weights"):
        find_resume("auto", root, warnings.append, retire_skipped=True, results=weights)
    assert (root / "step_00000008").is_dir() and (root / "step_00000004").is_dir()  # nothing retired
    assert find_resume("auto", root, warnings.append, results=tmp_path / "none.safetensors") is None


def test_a_job_that_comes_back_continues_from_its_newest_checkpoint_not_the_named_one(saved, corpus, cli_env, tmp_path):
    """checkpoint.resume = PATH names where a job starts. Restarted by --max-restarts or requeued by
    Slurm, the same command used to take PATH again: redo every step since (the launcher's lock
    skipped the check), or, requeued, be refused for the newer checkpoints it had itself saved. Only
    the job's own checkpoints are continued: another job's keep their refusal."""
    import json
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(saved.parent, run_dir)
    marker = run_dir / "checkpoints" / "step_00000008" / MARKER
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"job": "SLURM_JOB_ID=77"}))  # job 77 saved it
    start = ["--checkpoint.resume", str(run_dir / "checkpoints" / "step_00000004"), "--training.steps", "10"]
    fresh = train(corpus, cli_env, run_dir, *start, check=False)  # a new job: the newer step 8 is not replaced
    assert fresh.returncode != 0 and "holds newer checkpoints (step_00000008)" in fresh.stderr
    other = cli_env | {"SLURM_JOB_ID": "78", "SLURM_RESTART_COUNT": "1"}  # another job come back: not its own
    refused = train(corpus, cli_env, run_dir, *start, env=other, check=False)
    assert refused.returncode != 0 and "holds newer checkpoints (step_00000008)" in refused.stderr
    requeued = train(corpus, cli_env, run_dir, *start, env=other | {"SLURM_JOB_ID": "77"})
    out = requeued.stdout + requeued.stderr
    assert "continuing from the newest checkpoint it committed (step_00000008" in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'}" in out
    assert sorted(losses(run_dir))[-2:] == [9, 10]


def test_resume_into_a_different_model_is_a_clear_error(saved, corpus, cli_env, tmp_path):
    result = train(
        corpus,
        cli_env,
        tmp_path,
        "--checkpoint.resume",
        str(saved / "step_00000008"),
        "--model.n_layers",
        "3",
        check=False,
    )
    assert_user_error(result, "different model", "n_layers 4 -> 3")
    # the run's record (config, tokenizer) is written only once the start goes ahead
    assert not (tmp_path / "config.toml").exists() and not (tmp_path / "tokenizer.json").exists()


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_nonfinite_loss_is_skipped_or_stops(mode, corpus, cli_env, tmp_path):
    result = train(
        corpus,
        cli_env,
        tmp_path,
        "--training.lr",
        "1e30",
        "--training.warmup_steps",
        "0",
        "--training.grad_clip",
        "0",
        "--training.on_nonfinite",
        mode,
        check=False,
    )
    if mode == "stop":
        assert_user_error(result, "not finite", "training.on_nonfinite")
    else:  # the first step's update broke the weights: every later step is skipped, and the run fails
        assert_user_error(result, "training stopped learning at step 1", "each of the 11 steps after it", "training.lr")
        assert not (tmp_path / "model.safetensors").exists()
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # strict JSON: no NaN
        assert metrics[-1]["skipped_steps"] == 11 and metrics[-1]["grad_norm"] is None


def test_a_run_whose_every_step_is_skipped_fails_and_saves_no_weights(corpus, cli_env, tmp_path):
    """fp16 with a loss scale that overflows every step of the run: no update was applied."""
    overflow = ("--training.dtype", "fp16", "--training.initial_loss_scale", str(2.0**100))
    result = train(corpus, cli_env, tmp_path, *overflow, check=False)
    assert_user_error(result, "no step of this run was applied", "each of its 12 steps", "initial_loss_scale")
    assert not (tmp_path / "model.safetensors").exists()
    assert all(m["grad_norm"] is None for m in read_metrics(tmp_path))


@pytest.mark.multiproc
def test_time_limit_checkpoints_before_the_budget_runs_out(straight, corpus, cli_env, tmp_path):
    env = faulty(cli_env, MESHTRAIN_STEP_SLEEP="0.5")
    result = train(
        corpus, cli_env, tmp_path, *LAYOUTS["ddp2"], "--training.time_limit", "00:00:06", env=env, check=False
    )
    assert result.returncode == 75 and "time limit reached" in result.stdout  # stopped early: run it again
    assert max(losses(tmp_path)) < 12 and not (tmp_path / "model.safetensors").exists()
    train(corpus, cli_env, tmp_path, *LAYOUTS["ddp2"])
    assert losses(tmp_path) == losses(straight["ddp2"])


@pytest.mark.multiproc
def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous(corpus, cli_env, tmp_path):
    result = train(
        corpus,
        cli_env,
        tmp_path,
        *LAYOUTS["ddp2"],
        "--checkpoint.every",
        "4",
        env=faulty(cli_env, MESHTRAIN_ENOSPC_AT_STEP="8"),
        check=False,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all("No space left on device" in e and "step 8" in e for e in errors), result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert verify(tmp_path / "checkpoints" / "step_00000004")["step"] == 4
    assert not (tmp_path / "model.safetensors").exists()


def test_no_room_for_a_checkpoint_is_refused_before_writing(corpus, cli_env, tmp_path):
    if os.geteuid() != 0:  # as local_cluster: CI runs as root, elsewhere a skip with the reason
        if os.environ.get("CI"):
            pytest.fail("mounting a small tmpfs needs root on CI")
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        result = train(
            corpus,
            cli_env,
            tmp_path / "run",
            "--checkpoint.every",
            "4",
            "--checkpoint.dir",
            str(small / "ckpt"),
            check=False,
        )
        assert_user_error(result, "no room for the checkpoint of step 4", "GB are free")
        assert not (small / "ckpt").exists()  # nothing written, not even the directory
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_an_unwritable_run_dir_is_one_line(corpus, cli_env, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = train(corpus, cli_env, tmp_path / "file" / "run", check=False)
    assert_user_error(result, "cannot write", str(tmp_path / "file"))


def test_a_skipped_checkpoint_leaves_the_lineage_so_no_logged_step_is_lost(corpus, cli_env, tmp_path):
    """The interleaving that lost metrics records: a start skips a damaged checkpoint, resumes from
    an older one (metrics cut back to it) and dies before logging; the damaged checkpoint is then
    repaired (the chaos test's second flip of the same byte; a file restored from a copy). Resuming
    from it would leave the steps between the two checkpoints unlogged. The skipped checkpoint is
    set aside instead (damaged_step_N), and the next start resumes where the metrics are."""
    run = ["--checkpoint.every", "2", "--training.steps", "6"]
    train(corpus, cli_env, tmp_path, *run, "--training.stop_at_step", "4")
    shard = tmp_path / "checkpoints" / "step_00000004" / "__0_0.distcp"
    flip = len(shard.read_bytes()) // 2

    def flip_byte(path):
        data = bytearray(path.read_bytes())
        data[flip] ^= 0x5A
        path.write_bytes(bytes(data))

    flip_byte(shard)
    died = train(corpus, cli_env, tmp_path, *run, env=faulty(cli_env, MESHTRAIN_FAIL_AT_STEP="3"), check=False)
    assert died.returncode != 0 and "skipping damaged checkpoint" in died.stdout + died.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    if shard.exists():  # repaired where it was
        flip_byte(shard)
    train(corpus, cli_env, tmp_path, *run)
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
    assert (tmp_path / "checkpoints" / "damaged_step_00000004").is_dir()  # kept to inspect


def test_a_start_over_without_a_checkpoint_keeps_the_earlier_record(corpus, cli_env, tmp_path):
    """A run that died before any checkpoint starts again at step 1: it says so, and the first
    start's metrics are moved aside (metrics.1.jsonl), never truncated."""
    died = train(corpus, cli_env, tmp_path, env=faulty(cli_env, MESHTRAIN_FAIL_AT_STEP="5"), check=False)
    assert died.returncode != 0
    first = (tmp_path / "metrics.jsonl").read_text()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    again = train(corpus, cli_env, tmp_path)
    assert "no checkpoint to continue from: this start begins at step 1" in again.stdout + again.stderr
    assert str(tmp_path / "metrics.1.jsonl") in again.stdout + again.stderr
    assert (tmp_path / "metrics.1.jsonl").read_text() == first
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, 13))


def test_a_resume_keeps_the_schedules_position_and_takes_the_configs_peak_lr():
    """After a divergence the advice is to lower training.lr and resume: the schedule goes on from
    the checkpoint's step at this run's peak, not the checkpoint's."""
    from meshtrain.config import load_config
    from meshtrain.optim import build_optimizer, lr_factor, restore_schedule

    def schedule(lr):
        t = load_config(None, {"training.lr": lr, "training.warmup_steps": 2}).training
        return build_optimizer([torch.nn.Parameter(torch.ones(2, 2))], t), t

    (optimizer, scheduler), _ = schedule(1e-3)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    (optimizer, resumed), t = schedule(5e-4)
    restore_schedule(resumed, scheduler.state_dict())
    assert resumed.last_epoch == 5 and resumed.base_lrs == [5e-4, 5e-4]
    assert resumed.get_last_lr() == [5e-4 * lr_factor(5, t)] * 2
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4 * lr_factor(5, t)] * 2
    resumed.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 * lr_factor(6, t))


def test_a_resume_with_nothing_left_to_train_is_refused_unless_it_is_the_finished_run():
    """Resuming step 12 with training.steps = 10, or step 6 with stop_at_step still 6, would exit 0
    having done nothing; the finished run itself (step 10 of 10) comes to its end again."""
    from types import SimpleNamespace

    from meshtrain.config.checks import check_steps_ahead
    from meshtrain.errors import ConfigError

    for start, steps, stop in [(10, 10, 0), (10, 10, 10), (4, 10, 6), (0, 10, 0)]:
        check_steps_ahead(start, SimpleNamespace(steps=steps, stop_at_step=stop))
    for start, steps, stop, key in [(12, 10, 0, "steps = 10"), (6, 10, 6, "stop_at_step = 6"), (8, 10, 6, "stop")]:
        with pytest.raises(ConfigError, match=f"checkpoint is at step {start}, but training.{key}"):
            check_steps_ahead(start, SimpleNamespace(steps=steps, stop_at_step=stop))


def test_moving_checkpoint_dir_never_starts_the_run_afresh_over_its_checkpoints(tmp_path):
    """The run saved to <run.dir>/checkpoints; a start with another checkpoint.dir (empty) would
    begin at step 0 and rewrite the run's metrics: refused, naming how to continue."""
    from meshtrain.checkpoint import MARKER, refuse_overwriting_results

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000400").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000400" / MARKER).write_text('{"step": 400}')
    moved = tmp_path / "scratch"
    with pytest.raises(CheckpointError, match=r"holds this run.dir's checkpoints \(newest step_00000400\)"):
        refuse_overwriting_results("auto", moved, run_dir)
    refuse_overwriting_results(str(run_dir / "checkpoints" / "step_00000400"), moved, run_dir)  # continued
    refuse_overwriting_results("auto", run_dir / "checkpoints", run_dir)


def test_another_runs_checkpoint_never_starts_in_a_root_holding_checkpoints(tmp_path):
    """Resuming run A's later checkpoint into run B's checkpoint root would mix B's saves with A's
    steps and prune B's own checkpoints as the oldest: refused; into an empty root it is a new run."""
    from meshtrain.checkpoint import MARKER, refuse_overwriting_results

    for run, step in (("a", 5000), ("b", 800)):
        saved = tmp_path / run / "checkpoints" / f"step_{step:08d}"
        saved.mkdir(parents=True)
        (saved / MARKER).write_text(f'{{"step": {step}}}')
    other = str(tmp_path / "a" / "checkpoints" / "step_00005000")
    b = tmp_path / "b"
    with pytest.raises(CheckpointError, match=r"hold an earlier run \(newest step_00000800\).*pruning would delete"):
        refuse_overwriting_results(other, b / "checkpoints", b)
    refuse_overwriting_results(other, tmp_path / "c" / "checkpoints", tmp_path / "c")


def test_a_resume_under_another_init_from_is_refused(tmp_path):
    """A full-weight checkpoint's weights are what a resumed run trains on: a model.init_from other
    than the one the run started from would be ignored without a word, so it is refused (and a
    checkpoint saved before the record existed is resumed as before); a full-weight DPO run's reference,
    reloaded from model.init_from, must be the model it started from."""
    import json
    from types import SimpleNamespace

    from meshtrain.checkpoint import TRAIN_STATE
    from meshtrain.config import load_config
    from meshtrain.errors import MeshtrainError
    from meshtrain.interop.base import base_identity
    from meshtrain.train.base import check_same_base

    base, other = tmp_path / "base", tmp_path / "other"
    for directory in (base, other):  # what model.init_from's check looks for
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(b"")

    def run(init_from: str, dpo: bool = False):
        cfg = load_config(None, {"model.init_from": init_from} if init_from else {})
        model = SimpleNamespace(reference=object() if dpo else None)  # DPO's frozen copy of the base
        return SimpleNamespace(cfg=cfg, lora=None, base=base_identity(cfg), model=model)  # TrainState's fields

    def checkpoint(**record):
        (tmp_path / TRAIN_STATE).write_text(json.dumps(a_train_state(**record)))
        return tmp_path

    started = checkpoint(init_from=base_identity(run(f"hf:{base}").cfg)["init_from"])
    check_same_base(run(f"hf:{base}"), started)
    check_same_base(run(f"hf:{tmp_path}/other/../base"), started)  # the same directory, another spelling
    for init_from in (f"hf:{other}", ""):
        with pytest.raises(
            MeshtrainError, match=f"continues a run started from {base}, but this run's model.init_from"
        ):
            check_same_base(run(init_from), started)
    with pytest.raises(MeshtrainError, match="started from a random initialisation, but this run's model.init_from"):
        check_same_base(run(f"hf:{base}"), checkpoint(init_from=None))
    check_same_base(run(f"hf:{other}"), checkpoint())  # saved before init_from was recorded
    # full-weight DPO: the reference is reloaded from model.init_from, which must hold the model it was
    dpo = checkpoint(init_from=str(base.resolve()), reference=base_identity(run(f"hf:{base}").cfg))
    check_same_base(run(f"hf:{base}", dpo=True), dpo)
    for changed, key in (("config.json", "config_sha256"), ("model.safetensors", "weights_sha256")):
        (base / changed).write_text('{"changed": 1}')
        with pytest.raises(MeshtrainError, match=f"is a DPO run whose reference model .* but its {key} changed"):
            check_same_base(run(f"hf:{base}", dpo=True), dpo)
        dpo = checkpoint(init_from=str(base.resolve()), reference=base_identity(run(f"hf:{base}").cfg))


def test_lora_adapters_on_a_base_stored_otherwise_name_what_auto_chose(tmp_path):
    """LoRA adapters trained on an fp32 base, resumed where training.dtype = auto picks bf16 (another CPU,
    thread count, a busy probe): the refusal names auto's choice and the setting that resumes them; a
    dtype set by hand gets the refusal of any other setting."""
    import json
    from types import SimpleNamespace

    from meshtrain.checkpoint import TRAIN_STATE
    from meshtrain.config import load_config
    from meshtrain.errors import MeshtrainError
    from meshtrain.train.base import check_same_base

    cfg = load_config(None, {"training.dtype": "bf16"})
    base = {"seed": cfg.training.seed}
    settings = {"method": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q"]}
    adapters = SimpleNamespace(to_dict=lambda: settings)
    peft = {**settings, "base": base, "base_storage": "fp32"}
    (tmp_path / TRAIN_STATE).write_text(json.dumps(a_train_state(peft=peft)))
    for how, message in (
        (
            "measured",
            r"trained on a fp32 base, but this start stores it in bf16 \(bf16 \(measured\)\): set training.dtype = fp3",
        ),
        ("given", r"another setting or base \(base_storage fp32 -> bf16\)"),
    ):
        chosen = SimpleNamespace(how=how, describe=lambda: "bf16 (measured)")
        job = SimpleNamespace(arithmetic=chosen)
        s = SimpleNamespace(cfg=cfg, lora=adapters, base=base, job=job, model=SimpleNamespace(reference=None))
        with pytest.raises(MeshtrainError, match=message):
            check_same_base(s, tmp_path)


def test_a_run_directory_resumes_its_newest_checkpoint_wherever_its_checkpoint_dir_is(tmp_path):
    """checkpoint.resume = RUN takes that run's newest committed checkpoint (as documented): in
    <run>/checkpoints, or in the checkpoint.dir its config.toml records (absolute, or relative to where
    training ran, which its relative run.dir tells). It was looked for in RUN itself and refused as
    "never committed"; a run directory without a checkpoint is refused naming where it looked."""
    import json

    from meshtrain.checkpoint import refuse_overwriting_results

    def run(name: str, checkpoint_dir: str = "", run_dir: str | None = None):
        directory = tmp_path / name
        directory.mkdir(parents=True)
        (directory / "config.toml").write_text(
            f'[checkpoint]\ndir = "{checkpoint_dir}"\n\n[run]\ndir = "{run_dir or directory}"\n'
        )
        return directory

    def commit(root, *steps):
        for step in steps:
            (root / f"step_{step:08d}").mkdir(parents=True)
            (root / f"step_{step:08d}" / MARKER).write_text(json.dumps({"step": step, "files": {}}))
        return root / f"step_{steps[-1]:08d}"

    new = tmp_path / "new"
    for source, newest in [
        (run("plain"), commit(tmp_path / "plain" / "checkpoints", 2, 4)),
        (run("absolute", str(tmp_path / "scratch")), commit(tmp_path / "scratch", 6)),
        (run("runs/relative", "ck/relative", "runs/relative"), commit(tmp_path / "ck" / "relative", 8)),
    ]:
        assert find_resume(str(source), new / "checkpoints", print) == newest
        refuse_overwriting_results(str(source), new / "checkpoints", new)  # another run's: a new run from it
    with pytest.raises(
        CheckpointError, match=r"run directory has no committed checkpoint \(none in .*empty/checkpoints"
    ):
        find_resume(str(run("empty")), new / "checkpoints", print)
    with pytest.raises(CheckpointError, match="relative to the directory training ran in"):
        find_resume(str(run("unknown", "ck/unknown", "/elsewhere/unknown")), new / "checkpoints", print)


def test_every_field_of_train_state_past_its_bounds_is_refused_in_one_line(saved, tmp_path, capsys):
    """Each field of a checkpoint's train_state.json (the loader's, the schedule's and the fp16 loss
    scale's too), given a value of the wrong type, NaN, infinite, negative or huge, is refused in one
    line naming the file: the marker's checksum catches damage, this a writer that was wrong. The
    export of such a checkpoint, its checksum made to match, stops in one line before writing."""
    import math
    import shutil

    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    from conftest import run_cli_here, with_field
    from meshtrain.checkpoint import TRAIN_STATE, crc32, read_train_state

    source = saved / "step_00000008"
    state = json.loads((source / TRAIN_STATE).read_text())
    state["loss_scale"] = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
    state["loss_scale"]["_growth_tracker"] = 3
    checked = {"step", "skipped_steps", "layout", "model", "peft", "init_from", "reference", "run_dir"}
    paths = [(key,) for key in state if key in checked]
    paths += [(key, inner) for key in ("loader", "loss_scale") for inner in state[key]]
    paths += [("scheduler", key) for key in ("base_lrs", "_last_lr", "last_epoch", "_step_count", "schedule")]
    paths += [("layout", "tp"), ("model", "dim"), ("model", "norm_eps"), ("loader", "weights", 0)]
    bad = st.sampled_from([math.nan, math.inf, -math.inf, -1, -0.5, 1e300, 2**200, [1, "x"], {"a": "b"}, "x"])
    copy = tmp_path / "ckpt"
    copy.mkdir()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(paths), bad)
    def refused(path, value):
        assume(not (value == "x" and path in (("init_from",), ("run_dir",))))  # a name: resume compares it
        (copy / TRAIN_STATE).write_text(json.dumps(with_field(state, path, value)))
        with pytest.raises(CheckpointError) as refusal:
            read_train_state(copy)
        assert "\n" not in str(refusal.value) and TRAIN_STATE in str(refusal.value), (path, value)

    refused()
    (copy / TRAIN_STATE).write_text(json.dumps(state))
    assert read_train_state(copy) == state  # the unedited state reads

    shutil.copytree(saved.parent, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000008"
    (checkpoint / TRAIN_STATE).write_text(json.dumps(with_field(state, ("loader", "weights"), [math.nan])))
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["files"][TRAIN_STATE] = {
        "bytes": (checkpoint / TRAIN_STATE).stat().st_size,
        "crc32": crc32(checkpoint / TRAIN_STATE),
    }
    (checkpoint / MARKER).write_text(json.dumps(marker))
    result = run_cli_here(["export", str(checkpoint), "--out", str(tmp_path / "hf")], capsys)
    assert_user_error(result, "train_state.json is corrupt (loader.weights is [nan])")
    assert not (tmp_path / "hf").exists()
