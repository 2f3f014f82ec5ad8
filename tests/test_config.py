import re

import pytest

from meshtrain.config import config_keys, load_config, parse_overrides, resolved, to_toml
from meshtrain.errors import ConfigError
from meshtrain.job import resolve
from meshtrain.job.layout import layout_of
from meshtrain.job.model import check_model_args, model_args


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nsteps = 7\nlr = 1\n[model]\npreset = "small"\n')
    cfg = load_config(
        path, ["--training.steps", "9", "--run.dir=x/y", "--model.tie_embeddings", "true", "--model.dim", "none"]
    )
    assert cfg.training.steps == 9 and cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.run.dir == "x/y" and cfg.model.tie_embeddings is True and cfg.model.preset == "small"
    assert model_args(cfg).dim == 640  # "none" keeps the preset's value


def test_model_args_merge_preset_overrides_and_data_vocab():
    cfg = load_config(None, ["--model.n_layers", "3"])
    args = model_args(cfg, 1000)
    assert (args.n_layers, args.dim, args.vocab_size) == (3, 256, 1000)
    cfg = load_config(None, ["--model.vocab_size", "2048"])
    assert model_args(cfg, 1000).vocab_size == 2048


@pytest.mark.parametrize(
    "toml, overrides, fragments",
    [
        ("[training]\nstepz = 3\n", [], ["training.stepz", "steps"]),
        ("[trainin]\nsteps = 3\n", [], ["trainin", "training"]),
        ("[training]\nsteps = 'ten'\n", [], ["training.steps", "integer"]),
        ("[training]\nsteps = true\n", [], ["training.steps", "integer"]),
        ("", ["--training.steps", "ten"], ["training.steps", "integer"]),
        ("", ["--training.dtype", "fp64"], ["training.dtype", "'fp32', 'bf16', 'fp16'"]),
        ("", ["--model.preset", "gpt5"], ["model.preset", "llama3-8b"]),
        ("", ["--training.seq_len", "4096"], ["training.seq_len", "max_seq_len"]),
        ("", ["--training.bogus", "1"], ["training.bogus"]),
        ("", ["--model.n_heads", "7"], ["model.dim", "model.n_heads"]),
        ("", ["--model.n_kv_heads", "3"], ["model.n_kv_heads"]),
        ("", ["--training.steps", "0"], ["training.steps", "positive"]),
        ("", ["training.steps", "3"], ["unexpected argument"]),
        ("", ["--training.steps"], ["needs a value"]),
        ("[training\n", [], ["not valid TOML"]),
        ("", ["--run.sample_tokens", "1024"], ["run.sample_tokens = 1024 would not fit", "max_seq_len = 1024"]),
        ("", ["--run.dir", "data/stdlib"], ["run.dir = 'data/stdlib' is the data.path directory"]),
        ("", ["--run.dir", "a", "--data.path", "a/:1,b:1"], ["run.dir = 'a' is the data.path directory"]),
    ],
)
def test_invalid_values_are_named(tmp_path, toml, overrides, fragments):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        resolve(load_config(path, overrides), 1)  # read, or resolved (the model's shape)
    for fragment in fragments:
        assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_batch_must_divide_over_data_parallel_ranks():
    cfg = load_config(None, ["--training.global_batch_size", "16", "--training.micro_batch_size", "8"])
    resolve(cfg, 2)
    with pytest.raises(ConfigError, match=r"global_batch_size \(16\).*micro_batch_size \(8\).*\(3\) = 24"):
        resolve(cfg, 3)


def test_compile_with_tensor_parallel_and_fsdp_is_accepted():
    cfg = load_config(None, ["--training.compile", "true", "--parallel.tp", "2", "--parallel.zero", "3"])
    resolve(cfg, 2)  # TP alone: the whole model compiled
    resolve(cfg, 4)  # TP x FSDP: each block (tests/test_compile_tp_fsdp.py)


def test_a_zero_stage_with_one_data_parallel_rank_is_named_idle_at_the_start():
    """A config kept across world sizes (torchtitan's FSDP degree -1): ZeRO over one rank shards
    nothing, and the start line says so instead of dropping it."""
    from meshtrain.parallel.mesh import ParallelDims

    cfg = load_config(None, ["--parallel.tp", "2", "--parallel.zero", "3"])
    assert ParallelDims(layout_of(cfg, 4)).describe() == "FSDP 2 x TP 2, ZeRO-3"
    idle = ParallelDims(layout_of(cfg, 2)).describe()
    assert idle == "TP 2 (ZeRO-3 idle: one data-parallel rank, nothing to shard)"
    assert ParallelDims(layout_of(load_config(None, []), 1)).describe() == "single process"


def test_model_vocab_smaller_than_data_is_rejected():
    cfg = load_config(None, ["--model.vocab_size", "100"])
    with pytest.raises(ConfigError, match=r"model's vocabulary \(100\) is smaller than the data's \(512\)"):
        check_model_args(model_args(cfg, 512), cfg, 512)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["--model.n_layers", "3", "--training.lr", "0.01"])
    args = model_args(cfg, 777)
    (tmp_path / "config.toml").write_text(to_toml(resolved(cfg, args)))
    again = load_config(tmp_path / "config.toml")
    assert model_args(again) == args and again.training == cfg.training


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.toml")


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=2"]) == [("a.b", "1"), ("c.d", "2")]


def test_every_key_is_documented_and_listed_in_train_help():
    import subprocess
    import sys

    keys = config_keys()
    assert len(keys) > 50 and all(d.doc for d in keys.values()), [k for k, d in keys.items() if not d.doc]
    help_text = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for key in keys:
        assert f"--{key} " in help_text, key
    assert "Optimizer steps of the schedule. (default: 100)" in " ".join(help_text.split())


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["--training.lr", "nan"], "finite"),
        (["--training.beta1", "1.5"], "training.beta1"),
        (["--training.beta2", "-0.1"], "training.beta2"),
        (["--training.peak_tflops", "-1"], "training.peak_tflops"),
    ],
)
def test_out_of_range_values_are_named(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, override)


def test_a_pretrained_directory_is_the_shape_and_a_preset_beside_it_is_refused(tmp_path):
    import json

    from meshtrain.interop.families import args_to_config

    small = model_args(load_config(None, {"model.preset": "small"}))
    (tmp_path / "config.json").write_text(json.dumps(args_to_config(small, "float32", None, [])))
    pretrained = load_config(None, {"model.init_from": f"hf:{tmp_path}"})
    assert (model_args(pretrained).dim, model_args(pretrained).n_layers) == (small.dim, small.n_layers)
    assert pretrained.model.source() == f"hf:{tmp_path}" and load_config().model.source() == "tiny"
    for preset in ("small", "tiny"):  # ignored either way: the weights fix the shape
        cfg = load_config(None, {"model.init_from": f"hf:{tmp_path}", "model.preset": preset})
        with pytest.raises(ConfigError, match=rf"model.preset = '{preset}' but model.init_from's config.json"):
            model_args(cfg)


PIPELINE = {"parallel.pp": 2, "model.n_layers": 4, "training.global_batch_size": 8, "training.micro_batch_size": 1}


@pytest.mark.parametrize(
    "given, fragment, with_the_other",
    [
        ({"parallel.pp_schedule": "gpipe"}, "parallel.pp_schedule = 'gpipe' shapes the pipeline", PIPELINE),
        (
            {"parallel.pp_virtual_stages": 2},
            "parallel.pp_virtual_stages = 2 shapes the pipeline",
            {**PIPELINE, "parallel.pp_schedule": "interleaved_1f1b"},
        ),
        (
            {"training.ac_every": 3},
            "training.ac_every = 3 picks the blocks",
            {"training.activation_checkpointing": "selective"},
        ),
        ({"checkpoint.async": True}, "checkpoint.async overlaps the periodic checkpoints", {"checkpoint.every": 5}),
        (
            {"parallel.sequence_parallel": False},
            "parallel.sequence_parallel = false shapes tensor parallelism",
            {"parallel.tp": 2},
        ),
        (
            {"parallel.loss_parallel": False},
            "parallel.loss_parallel = false shapes tensor parallelism",
            {"parallel.tp": 2},
        ),
        (
            {"run.sample_prompt": "", "run.sample_tokens": 8},
            "run.sample_tokens = 8 sets the length of the final sample",
            {"run.sample_prompt": "def"},
        ),
        (
            {"run.save_model": False, "run.sample_prompt": "", "run.save_model_max_gb": 2},
            "run.save_model_max_gb = 2.0 bounds the model gathered at the end",
            {"run.save_model": True},
        ),
        (
            {"run.log_level": "warning", "run.plan_check": True},
            "run.plan_check is printed at the info level, but run.log_level = 'warning' hides it",
            {"run.log_level": "info"},
        ),
        (
            {"run.log_level": "error", "run.sample_prompt": "class "},
            "run.sample_prompt is printed at the info level",
            {"run.log_level": "info"},
        ),
        (
            {"training.hang_timeout": 0, "training.first_step_timeout": 600},
            "training.first_step_timeout = 600 is the watchdog's budget for the first step",
            {"training.hang_timeout": 60},
        ),
    ],
)
def test_a_key_without_the_key_it_acts_beside_is_refused_at_the_start(given, fragment, with_the_other):
    cfg = load_config(None, given)  # read as given: `meshtrain plan` may search the other key
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        resolve(cfg, 1)
    cfg = load_config(None, {**given, **with_the_other})
    resolve(cfg, cfg.parallel.pp * cfg.parallel.tp)


def test_a_quiet_run_may_turn_the_sample_off():
    resolve(load_config(None, {"run.log_level": "warning", "run.sample_prompt": ""}), 1)


def test_the_config_tree_and_the_command_line_read_without_torch():
    """config/, the model's shapes and the CLI's parsers import no torch: reading and checking a
    config (what every refusal of the CLI does first) and `meshtrain --help` do not load the
    framework (2 s of each call)."""
    import subprocess
    import sys

    code = "import sys, meshtrain.cli, meshtrain.config as c; c.load_config(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "overrides, warned",
    [
        (["--training.steps", "10", "--training.warmup_steps", "12"], ["never reaches training.lr", "min_lr_ratio"]),
        (["--training.steps", "10", "--training.warmup_steps", "9"], ["no step of training.steps (10) to decay"]),
        (["--training.steps", "10", "--training.eval_every", "20"], ["training.eval_every (20) > training.steps"]),
        (["--training.steps", "10", "--run.log_every", "50"], ["run.log_every (50) > training.steps (10)"]),
        (["--training.steps", "10", "--training.warmup_steps", "2"], []),
    ],
)
def test_settings_a_short_schedule_leaves_idle_are_named_at_the_start(overrides, warned, monkeypatch):
    from types import SimpleNamespace

    from meshtrain.train.build import log, warn_pointless_settings

    cfg = load_config(None, ["--training.eval_every", "5", "--run.log_every", "1", *overrides])
    state = SimpleNamespace(cfg=cfg, dataset=SimpleNamespace(names=[], sources=[], weights=[]), val={})
    messages = []
    monkeypatch.setattr(log, "warning", messages.append)
    warn_pointless_settings(state)
    for fragment in warned:
        assert any(fragment in m for m in messages), messages
    assert bool(messages) == bool(warned), messages


def test_a_sample_that_would_not_fit_the_context_is_refused_before_training(corpus):
    """The end-of-run sample is the prompt and run.sample_tokens more in max_seq_len tokens: a given
    length beside the prompt, or a prompt alone, that would not fit is refused at the start (the
    default length is cut to fit the prompt)."""
    from conftest import SMALL_MODEL
    from meshtrain.data import Blend

    def start(*sample):
        cfg = load_config(None, [*SMALL_MODEL, "--data.path", str(corpus), "--training.seq_len", "32", *sample])
        return resolve(cfg, 1, Blend(str(corpus), 32))

    prompt = ["--run.sample_prompt", "import os\nimport sys\n"]
    start(*prompt)  # the default length: cut to fit
    start(*prompt, "--run.sample_tokens", "40")
    with pytest.raises(ConfigError, match=r"run.sample_prompt \(\d+ tokens\) and run.sample_tokens = 60"):
        start(*prompt, "--run.sample_tokens", "60")
    with pytest.raises(ConfigError, match="shorten the prompt"):
        start("--run.sample_prompt", "def f(x):\n    return x\n" * 20)


@pytest.mark.parametrize(
    "name, what",
    [("manifest.json", "prepared data"), ("config.json", "a Hugging Face model"), ("tokenizer.json", "a tokenizer")],
)
def test_a_run_dir_holding_another_directorys_files_is_refused(tmp_path, name, what):
    """A run writes its tokenizer, config and weights into run.dir: a directory of data, a model or a
    tokenizer would have them replaced, whatever data.path and init_from say. A meshtrain run's own
    directory (arithmetic.json) is its to write, and an empty or new one is fine."""
    (tmp_path / "new").mkdir()
    load_config(None, ["--run.dir", str(tmp_path / "new")])
    load_config(None, ["--run.dir", str(tmp_path / "absent")])
    (tmp_path / name).write_text("{}")
    with pytest.raises(ConfigError, match=f"holds {what} \\({name}\\), not a meshtrain run"):
        load_config(None, ["--run.dir", str(tmp_path)])
    (tmp_path / "arithmetic.json").write_text("{}")
    load_config(None, ["--run.dir", str(tmp_path)])


def test_a_keys_short_spelling_reads_as_the_key_everywhere():
    """The short flags declared with a key (--seq-len, --compile) mean the key in every reader: the
    train and plan parsers, and the overrides a jobscript passes on (config.parse_overrides)."""
    pairs = parse_overrides(["--micro-batch", "1", "--seq-len=64", "--compile", "--no-sequence-parallel"])
    assert pairs == [
        ("training.micro_batch_size", "1"),
        ("training.seq_len", "64"),
        ("training.compile", "true"),
        ("parallel.sequence_parallel", "false"),
    ]
    cfg = load_config(None, ["--tp", "2", "--zero", "3"])
    assert (cfg.parallel.tp, cfg.parallel.zero) == (2, 3)
    with pytest.raises(ConfigError, match="--compile is a switch"):
        parse_overrides(["--compile=true"])
