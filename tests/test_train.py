"""End-to-end training through the real CLI: single process vs DDP over 2 gloo processes."""

import json
import math

import pytest
from safetensors.torch import load_file

from conftest import assert_same_run, assert_user_error, read_metrics, run_cli, train_args
from meshtrain.config import load_config
from meshtrain.job import arithmetic

FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "elapsed_s")


@pytest.fixture(scope="module")
def single_run(corpus, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single")
    result = run_cli(
        train_args(
            corpus, run_dir, "--run.tensorboard", "true", "--run.sample_prompt", "def", "--run.sample_tokens", "8"
        ),
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_single_process_run_writes_metrics_config_tensorboard_weights(single_run):
    run_dir, result = single_run
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 11))
    for m in metrics:
        for field in FIELDS:
            assert math.isfinite(m[field]), (field, m)
        assert m["tokens_per_s"] > 0 and 0 < m["mfu"] <= 1.0  # a window faster than the probed peak raises it
    assert "val_loss" in metrics[-1]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.1
    assert (run_dir / "config.toml").read_text().count("n_layers = 2") == 1
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert set(load_file(run_dir / "model.safetensors")) >= {"tok_embeddings.weight", "layers.1.attention.wq.weight"}
    assert "sample:\ndef" in result.stdout


@pytest.mark.multiproc
def test_ddp_matches_single_process_loss_grad_norm_and_weights(single_run, corpus, cli_env, tmp_path):
    """1 process with 2 accumulation steps vs 2 DDP ranks with 1: same global batch of 8."""
    result = run_cli([*train_args(corpus, tmp_path), "--nproc", "2", "--run.plan_check", "true"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 2" in result.stdout
    import re  # run.plan_check: the planner's model-state MiB next to the measured ones, per rank

    checks = re.findall(
        r"rank (\d) planner/measured MiB: params ([\d.]+)/([\d.]+) \| grads ([\d.]+)/([\d.]+)", result.stdout
    )
    assert [c[0] for c in checks] == ["0", "1"]
    assert all(c[1] == c[2] and c[3] == c[4] for c in checks), checks
    assert_same_run(tmp_path, single_run[0])


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--training.stepz", "3"], ["training.stepz"]),
        (["--training.steps", "many"], ["training.steps", "integer"]),
        (["--training.seq_len", "128"], ["training.seq_len (128)", "max_seq_len = 64"]),
        (["--nproc", "3"], ["global_batch_size (8)", "(3) = 12"]),
        (["--data.path", "/nonexistent/data"], ["/nonexistent/data", "meshtrain data prepare"]),
    ],
)
def test_bad_config_fails_before_any_work(corpus, cli_env, tmp_path, extra, fragments):
    result = run_cli([*train_args(corpus, tmp_path / "run"), *extra], cli_env)
    assert_user_error(result, *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.multiproc
def test_default_job_prepares_its_corpus_and_learns(cli_env, tmp_path):
    """`make train`'s job as shipped (configs/tiny.toml, 2 processes), with its data and run in tmp,
    cut to 40 of its 100 steps (its full length is 7 minutes of CI on 2 slow cores)."""
    from pathlib import Path

    config = Path(__file__).parents[1] / "configs" / "tiny.toml"
    result = run_cli(
        [
            "train",
            "--config",
            str(config),
            "--nproc",
            "2",
            "--data.path",
            str(tmp_path / "stdlib"),
            "--run.dir",
            str(tmp_path / "run"),
            "--training.steps",
            "40",
        ],
        cli_env,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preparing the default corpus" in result.stdout
    metrics = read_metrics(tmp_path / "run")
    assert metrics[0]["step"] == 1 and metrics[-1]["step"] == 40
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 1.5
    assert metrics[-1]["val_loss"] < metrics[0]["loss"] - 1.5
    assert all(math.isfinite(m[f]) for m in metrics for f in FIELDS)
    assert "sample:\ndef " in result.stdout
    # dtype = "auto": the arithmetic measured (or read from the cache) at start, logged, recorded, run;
    # "busy" where the suite's other worker kept the CPUs busy meanwhile (measured all the same).
    choice = json.loads((tmp_path / "run" / "arithmetic.json").read_text())
    compute = choice["bf16_compute"]
    label = "fp32" if choice["dtype"] == "fp32" else "bf16" if compute == "bf16" else f"bf16/{compute}"
    assert choice["how"] in ("measured", "cached", "busy") and "fp32" in choice["step_ms"]
    assert len(choice["step_ms"]) == (3 if choice["bf16_gemm_slowdown"] > arithmetic.DISTANT else 5)
    assert all(m["arithmetic"] == label for m in metrics if "arithmetic" in m)
    assert "arithmetic: " in result.stdout and "ms per micro-batch" in result.stdout
    # the run records its config as given (dtype auto, the model's shape spelled out), beside the choice
    recorded = load_config(tmp_path / "run" / "config.toml")
    assert recorded.training.dtype == "auto" == load_config(None).training.dtype
    assert recorded.model.dim == 256 and recorded.model.vocab_size == 8192


@pytest.mark.multiproc
def test_external_torchrun_runs_the_same_training(single_run, corpus, cli_env, tmp_path):
    import sys

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "meshtrain",
        *train_args(corpus, tmp_path),
    ]
    import subprocess

    result = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, single_run[0])


def test_a_blended_run_reports_its_mix_and_each_source_s_validation_loss(corpus, cli_env, tmp_path):
    """data.path = "A:0.75,B:0.25": every record says which share of the tokens came from each
    source (exactly the weights: 12 of 16 sequences a step from A), and the validation loss of each."""
    from meshtrain.data import prepare, stdlib_sources

    other = tmp_path / "other"
    prepare(stdlib_sources()[200:230], other, tokenizer=corpus / "tokenizer.json", val_fraction=0.1, progress=False)
    args = train_args(corpus, tmp_path / "run", "--training.steps", "6", "--training.eval_every", "3")
    args[args.index("--data.path") + 1] = f"{corpus}:0.75,{other}:0.25"
    result = run_cli(args, cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics if "val_loss" in m] == [3, 6]
    for m in metrics:
        assert m["data_mix"] == {str(corpus): 0.75, str(other): 0.25}
        if "val_loss" in m:
            by_source = m["val_loss_by_source"]
            assert by_source.keys() == {str(corpus), str(other)} and by_source[str(corpus)] != by_source[str(other)]
            assert m["val_loss"] == pytest.approx(0.75 * by_source[str(corpus)] + 0.25 * by_source[str(other)])


# --- the LR schedule's keys changed on resume (optim.py's restore_schedule) ---


def test_a_resume_with_another_lr_schedule_says_so_and_follows_it(corpus, cli_env, tmp_path):
    """warmup_steps, min_lr_ratio and steps are read from this run's config: a resume that changes them
    changes the LR from there on, and the start says which changed and what the next step's LR becomes."""
    schedule = ["--training.lr", "1e-3", "--training.steps", "3", "--checkpoint.every", "1"]
    first = train_args(corpus, tmp_path, *schedule, "--training.warmup_steps", "0", "--training.stop_at_step", "2")
    assert run_cli(first, cli_env).returncode == 0
    again = train_args(corpus, tmp_path, *schedule, "--training.warmup_steps", "5", "--training.min_lr_ratio", "0.9")
    result = run_cli(again, cli_env)
    assert result.returncode == 0, result.stderr[-2000:]
    said = " ".join((result.stdout + result.stderr).split())
    assert "training.warmup_steps 0 -> 5, training.min_lr_ratio 0.1 -> 0.9" in said, said
    assert "from step 3, 6.00e-04 where the checkpoint's gives 3.25e-04" in said, said
    assert [m["lr"] for m in read_metrics(tmp_path) if m.get("step") == 3] == [pytest.approx(6e-4)]


def test_a_resume_of_an_unchanged_or_unrecorded_schedule_says_nothing(caplog):
    """The same schedule resumed: no warning; a checkpoint that predates the record (no "schedule"
    in its state): nothing to compare, no warning, and the next save records this run's."""
    import torch

    from meshtrain.config import load_config
    from meshtrain.optim import build_optimizer, restore_schedule

    def scheduler(**training):
        t = load_config(None, {f"training.{k}": v for k, v in training.items()}).training
        return build_optimizer([torch.nn.Parameter(torch.ones(2, 2))], t)[1]

    saved = scheduler(warmup_steps=0)
    for _ in range(2):
        saved.optimizer.step()
        saved.step()
    caplog.set_level("INFO", logger="meshtrain")
    restore_schedule(scheduler(warmup_steps=0), saved.state_dict())
    old = {k: v for k, v in saved.state_dict().items() if k != "schedule"}
    resumed = scheduler(warmup_steps=5)
    restore_schedule(resumed, old)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert resumed.state_dict()["schedule"] == {"warmup_steps": 5, "min_lr_ratio": 0.1, "steps": 100}
    restore_schedule(scheduler(warmup_steps=3), resumed.state_dict())
    assert "training.warmup_steps 5 -> 3 (this run's config" in caplog.text
