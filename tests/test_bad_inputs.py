"""A catalogue of what a user can get wrong, across the CLI, the config, the environment and the
job scripts: each case exits with code 2 and one line on stderr naming the problem, no traceback,
before any work starts. Run in-process (meshtrain.cli.main) to stay fast."""

from pathlib import Path

import pytest

from conftest import run_cli_here

ROOT = Path(__file__).parents[1]
CONFIG = str(ROOT / "configs" / "tiny.toml")
TRAIN = ["train", "--data.path", "/nonexistent/meshtrain-data", "--data.corpus", ""]

CASES = {
    # [training]
    "steps zero": (["--training.steps", "0"], "training.steps"),
    "steps negative": (["--training.steps", "-3"], "training.steps"),
    "steps text": (["--training.steps", "many"], "integer"),
    "global batch zero": (["--training.global_batch_size", "0"], "training.global_batch_size"),
    "micro batch zero": (["--training.micro_batch_size", "0"], "training.micro_batch_size"),
    "seq_len zero": (["--training.seq_len", "0"], "training.seq_len"),
    "seq_len too long": (["--training.seq_len", "99999"], "max_seq_len"),
    "lr nan": (["--training.lr", "nan"], "finite"),
    "lr inf": (["--training.lr", "inf"], "finite"),
    "lr negative": (["--training.lr=-1e-3"], "training.lr"),
    "lr negative without =": (["--training.lr", "-1e-3"], "--key=VALUE"),
    "min lr ratio": (["--training.min_lr_ratio", "2"], "training.min_lr_ratio"),
    "warmup negative": (["--training.warmup_steps", "-1"], "training.warmup_steps"),
    "weight decay negative": (["--training.weight_decay", "-0.1"], "training.weight_decay"),
    "beta1 above one": (["--training.beta1", "1.5"], "training.beta1"),
    "beta2 one": (["--training.beta2", "1"], "training.beta2"),
    "grad clip negative": (["--training.grad_clip", "-1"], "training.grad_clip"),
    "dtype fp64": (["--training.dtype", "fp64"], "training.dtype"),
    "bf16 compute": (["--training.bf16_compute", "int8"], "training.bf16_compute"),
    "bf16 compute under fp16": (["--training.dtype", "fp16", "--training.bf16_compute", "bf16"], "is fp16"),
    "loss scale without fp16": (["--training.initial_loss_scale", "1024"], "set training.dtype = fp16"),
    "loss scale below one": (["--training.dtype", "fp16", "--training.initial_loss_scale", "0.5"], "at least 1"),
    "loss scale window zero": (["--training.dtype", "fp16", "--training.loss_scale_window", "0"], "loss_scale_window"),
    "loss scale window without fp16": (["--training.loss_scale_window", "100"], "set training.dtype = fp16"),
    "fp8 recipe": (["--training.fp8", "e5m2"], "training.fp8"),
    "fp8 under fp16": (["--training.dtype", "fp16", "--training.fp8", "tensorwise"], "not fp16"),
    "fp8 with fp32 gemms": (
        ["--training.dtype", "bf16", "--training.bf16_compute", "fp32", "--training.fp8", "rowwise"],
        "computes the GEMMs in fp32",
    ),
    "fp8 with lora": (["--training.fp8", "tensorwise", "--peft.method", "lora"], "freezes them"),
    "cpu offload text": (["--parallel.cpu_offload", "sometimes"], "true or false"),
    "ac mode": (["--training.activation_checkpointing", "some"], "training.activation_checkpointing"),
    "ac every zero": (["--training.ac_every", "0"], "training.ac_every"),
    "compile maybe": (["--training.compile", "maybe"], "true or false"),
    "eval every negative": (["--training.eval_every", "-5"], "training.eval_every"),
    "eval batches zero": (["--training.eval_batches", "0"], "training.eval_batches"),
    "peak tflops negative": (["--training.peak_tflops", "-1"], "training.peak_tflops"),
    "stop after the end": (["--training.stop_at_step", "1000"], "training.stop_at_step"),
    "time limit text": (["--training.time_limit", "tomorrow"], "not a duration"),
    "time limit zero": (["--training.time_limit", "0"], "must be positive"),
    "on nonfinite": (["--training.on_nonfinite", "ignore"], "training.on_nonfinite"),
    "seed text": (["--training.seed", "abc"], "integer"),
    # [parallel]
    "tp zero": (["--parallel.tp", "0"], "parallel.tp"),
    "pp zero": (["--parallel.pp", "0"], "parallel.pp"),
    "cp zero": (["--parallel.cp", "0"], "parallel.cp"),
    "cp text": (["--parallel.cp", "two"], "integer"),
    "dp_replicate zero": (["--parallel.dp_replicate", "0"], "parallel.dp_replicate"),
    "zero stage 4": (["--parallel.zero", "4"], "parallel.zero"),
    "schedule": (["--parallel.pp_schedule", "1f2b"], "parallel.pp_schedule"),
    "virtual stages zero": (["--parallel.pp_virtual_stages", "0"], "parallel.pp_virtual_stages"),
    # [model]
    "preset": (["--model.preset", "gpt5"], "model.preset"),
    "dim negative": (["--model.dim", "-64"], "model.dim"),
    "heads do not divide": (["--model.n_heads", "7"], "model.n_heads"),
    "kv heads do not divide": (["--model.n_kv_heads", "3"], "model.n_kv_heads"),
    "odd head dim": (["--model.dim", "264", "--model.n_heads", "8", "--model.n_kv_heads", "8"], "even"),
    "init_from not hf": (["--model.init_from", "somewhere"], "model.init_from"),
    "vocab zero": (["--model.vocab_size", "0"], "model.vocab_size"),
    "norm eps": (["--model.norm_eps", "0"], "model.norm_eps"),
    # [data], [checkpoint], [launch], [run]
    "corpus": (["--data.corpus", "wikipedia"], "data.corpus"),
    "missing data": ([], "/nonexistent/meshtrain-data"),
    "blend weight zero": (["--data.path", "data/web:0,data/code:1"], "weight of data/web is 0"),
    "blend weight negative": (["--data.path=data/web:0.7,data/code:-0.3"], "weights must be above 0"),
    "blend weight missing": (["--data.path", "data/web:0.7,data/code"], "'data/code' has no weight"),
    "blend source twice": (["--data.path", "data/web:1,data/web:2"], "names a directory twice"),
    "blend of one": (["--data.path", "data/web:0.3"], "one source takes every sample, so its weight does nothing"),
    "blend missing source": (["--data.path", "/nonexistent/web:1,/nonexistent/code:1"], "/nonexistent/web"),
    "checkpoint every negative": (["--checkpoint.every", "-1"], "checkpoint.every"),
    "checkpoint keep zero": (["--checkpoint.keep", "0"], "checkpoint.keep"),
    "resume missing": (["--checkpoint.resume", "/nonexistent/ckpt"], "checkpoint.resume"),
    "launcher": (["--launch.env", "pbs"], "launch.env"),
    "device": (["--launch.device", "tpu"], "launch.device"),
    "log every zero": (["--run.log_every", "0"], "run.log_every"),
    "log level": (["--run.log_level", "verbose"], "run.log_level"),
    "sample tokens zero": (["--run.sample_tokens", "0"], "run.sample_tokens"),
    "save_model_max_gb zero": (["--run.save_model_max_gb", "0"], "run.save_model_max_gb"),
    "cuda graphs without compile": (["--training.cuda_graphs", "true"], "training.compile is false"),
    # syntax
    "unknown key": (["--training.stepz", "3"], "training.stepz"),
    "unknown section": (["--trainer.steps", "3"], "sections are"),
    "missing value": (["--training.steps"], "expected one argument"),
    "no dashes": (["training.steps", "3"], "unexpected argument"),
    "config missing": (["--config", "/nonexistent.toml"], "does not exist"),
    # the launcher
    "nproc zero": (["--nproc", "0"], "--nproc"),
    "max restarts negative": (["--nproc", "2", "--max-restarts", "-1"], "--max-restarts"),
    "nnodes zero": (["--nproc", "2", "--nnodes", "0"], "--nnodes"),
    "batch does not divide over ranks": (["--nproc", "3"], "micro_batch_size (8) x data-parallel degree (3) = 24"),
    "launcher forced under nproc": (
        ["--nproc", "2", "--launch.env", "single"],
        "launch.env = single (MESHTRAIN_LAUNCHER or the config), but --nproc",
    ),
    "time limit with restarts": (
        ["--nproc", "2", "--max-restarts", "1", "--training.time_limit", "01:00:00"],
        "training.time_limit with --nproc's --max-restarts 1",
    ),
}


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    result = run_cli_here(argv, capsys)
    return result.returncode, result.stderr


def assert_one_line(code: int, err: str, fragment: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("extra, fragment", CASES.values(), ids=CASES.keys())
def test_train_refuses_bad_input(extra, fragment, capsys):
    assert_one_line(*run_main([*TRAIN, *extra], capsys), fragment)


def dry_run_of(extra: list[str]) -> list[str]:
    """The same job as a dry run: --nproc N becomes --dry-run N (the world size), else 2 ranks."""
    if "--nproc" in extra:
        return [("--dry-run" if a == "--nproc" else a) for a in extra]
    return [*extra, "--dry-run", "2"]


TRAINER_REFUSALS = {name: case for name, case in CASES.items() if "--nproc" not in case[1]}
DRY_RUN_ONLY = {
    "world does not divide": (["--parallel.tp", "2", "--dry-run", "3"], "world size 3 is not divisible"),
    "rank outside the world": (["--dry-run", "2", "--dry-run-rank", "5"], "not a rank of a 2-rank job"),
    "rank without dry run": (["--dry-run-rank", "1"], "--dry-run-rank goes with --dry-run WORLD"),
    "json without dry run": (["--json"], "--json goes with --dry-run WORLD"),
    "dry run and nproc": (["--dry-run", "2", "--nproc", "2"], "leave out --nproc"),
    "dry run world zero": (["--dry-run", "0"], "--dry-run"),
    "dry run compiled": (["--training.compile", "true", "--dry-run", "1"], "a dry run builds the job on fake tensors"),
    "cuda graphs on several ranks": (
        ["--training.compile", "true", "--training.cuda_graphs", "true", "--dry-run", "2"],
        "this layout has 2 ranks",
    ),
}


@pytest.mark.parametrize("extra", [case[0] for case in TRAINER_REFUSALS.values()], ids=TRAINER_REFUSALS.keys())
def test_the_dry_run_refuses_what_train_refuses_word_for_word(extra, capsys):
    assert run_main([*TRAIN, *dry_run_of(extra)], capsys) == run_main([*TRAIN, *extra], capsys)


@pytest.mark.parametrize("extra, fragment", DRY_RUN_ONLY.values(), ids=DRY_RUN_ONLY.keys())
def test_dry_run_options_refuse_bad_input(extra, fragment, tmp_path, capsys):
    data = ["--data.path", str(tmp_path / "data"), "--data.corpus", "stdlib"]  # the default corpus, not built
    assert_one_line(*run_main(["train", *data, *extra], capsys), fragment)


def test_config_file_of_binary_bytes(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_bytes(bytes(range(256)))
    assert_one_line(*run_main(["train", "--config", str(path)], capsys), "not text")


OTHER = {
    "export size": (["export", "/nonexistent/run", "--out", "x", "--max-shard-size", "lots"], "--max-shard-size"),
    "export source": (["export", "/nonexistent/run", "--out", "x"], "/nonexistent/run"),
    "jobscript time": (["jobscript", "slurm", "--config", CONFIG, "--time", "tomorrow"], "--time"),
    "jobscript config": (["jobscript", "slurm", "--config", "/nonexistent.toml"], "does not exist"),
    "jobscript override": (["jobscript", "slurm", "--config", CONFIG, "--", "--training.stepz", "3"], "training.stepz"),
    "jobscript bad value": (["jobscript", "slurm", "--config", CONFIG, "--", "--training.lr", "nan"], "finite"),
    "jobscript kind": (["jobscript", "lsf", "--config", CONFIG], "lsf"),
    "jobscript nodes": (["jobscript", "slurm", "--config", CONFIG, "--nodes", "0"], "--nodes"),
    "jobscript mode": (["jobscript", "slurm", "--config", CONFIG, "--mode", "fast"], "--mode"),
    "jobscript launcher of another script": (
        ["jobscript", "slurm", "--config", CONFIG, "--mode", "agent-per-node", "--", "--launch.env", "slurm"],
        "the slurm --mode agent-per-node script starts its processes with torchrun",
    ),
    "jobscript single under srun": (
        ["jobscript", "slurm", "--config", CONFIG, "--", "--launch.env", "single"],
        "launch.env = 'single', but the slurm --mode task-per-rank script",
    ),
    "jobscript recompute on gpus": (
        [
            "jobscript",
            "slurm",
            "--config",
            CONFIG,
            "--gpus-per-node",
            "2",
            "--",
            "--training.attention_backward",
            "recompute",
        ],
        "this job trains on cuda",
    ),
    "jobscript cuda graphs on cpu nodes": (
        ["jobscript", "sge", "--config", CONFIG, "--", "--training.compile", "true", "--training.cuda_graphs", "true"],
        "this job trains on cpu",
    ),
    "bench min above max": (["bench", "comm", "--min-bytes", "1G", "--max-bytes", "1K"], "--min-bytes"),
    "bench size text": (["bench", "comm", "--max-bytes", "huge"], "--max-bytes"),
    "bench ops": (["bench", "comm", "--ops", "all_to_all"], "all_to_all"),
    "bench iters": (["bench", "comm", "--iters", "0"], "--iters"),
    "prepare input": (["data", "prepare", "--input", "/nonexistent/texts", "--out", "/tmp/x"], "/nonexistent/texts"),
    "prepare glob": (["data", "prepare", "--input", "/nonexistent/*.jsonl", "--out", "/tmp/x"], "matches no files"),
    "prepare workers": (["data", "prepare", "--input", CONFIG, "--out", "/tmp/x", "--workers", "0"], "--workers"),
    "prepare sample with a tokenizer": (
        ["data", "prepare", "--input", CONFIG, "--out", "/tmp/x", "--tokenizer", CONFIG, "--tokenizer-sample", "1M"],
        "--tokenizer-sample",
    ),
    "prepare fraction": (
        ["data", "prepare", "--input", CONFIG, "--out", "/tmp/x", "--val-fraction", "2"],
        "--val-fraction",
    ),
    "plan cuda graphs uncompiled": (
        ["plan", "--model", "small", "--gpu", "h100-80gb", "--gpus", "1", "--cuda-graphs"],
        "training.compile is false",
    ),
    "plan cuda graphs on a cpu": (
        ["plan", "--model", "small", "--gpu", "cpu", "--gpus", "1", "--compile", "--cuda-graphs"],
        "--cuda-graphs replays kernels on a GPU",
    ),
    "plan seq_len beyond the file's model": (
        ["plan", "--config", CONFIG, "--gpu", "h100-80gb", "--gpus", "1", "--seq-len", "99999"],
        "is longer than the model allows",
    ),
    "serve model": (["serve", "/nonexistent/model"], "/nonexistent/model"),
    "serve empty api key": (["serve", "/nonexistent/model", "--api-key", " "], "leave out --api-key"),
    "serve null api key": (["serve", "/nonexistent/model", "--api-key", "null"], "--api-key: 'null': is no key"),
    "serve api key no client sends": (["serve", "/nonexistent/model", "--api-key", "clé"], "no client could send it"),
    "serve api key with a space": (["serve", "/nonexistent/model", "--api-key", "abc "], "no client could send it"),
    "serve empty host": (["serve", "/nonexistent/model", "--host", ""], "--host: '': is empty"),
    "serve context of one token": (["serve", "/nonexistent/model", "--max-context", "1"], "--max-context"),
    "generate temperature": (
        ["generate", "/nonexistent/model", "--prompt", "x", "--temperature", "5"],
        "--temperature",
    ),
}


@pytest.mark.parametrize("argv, fragment", OTHER.values(), ids=OTHER.keys())
def test_other_commands_refuse_bad_input(argv, fragment, capsys):
    assert_one_line(*run_main(argv, capsys), fragment)


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world size 0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "world size 2 with 0"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 is outside"),
        ({"RANK": "0"}, "WORLD_SIZE is missing"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ],
    ids=["world zero", "local world zero", "rank outside", "world missing", "rank text"],
)
def test_bad_launcher_environment(env, fragment, monkeypatch, capsys):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_one_line(*run_main(["env"], capsys), fragment)


@pytest.mark.parametrize(
    "key, gpu, fragment",
    [
        ('attention_backward = "recompute"', "h100-80gb", "whose attention kernels a GPU job keeps"),
        ('dtype = "auto"\nbf16_compute = "fp32"', "v100-32gb", "but the plan trains in fp32 on v100-32gb"),
    ],
)
def test_plan_refuses_config_keys_its_device_would_refuse(key, gpu, fragment, tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(f"[training]\n{key}\n")
    assert_one_line(*run_main(["plan", "--config", str(config), "--gpu", gpu, "--gpus", "1"], capsys), fragment)
