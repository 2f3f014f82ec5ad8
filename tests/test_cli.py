"""One grammar for every subcommand: no abbreviations, one meaning per flag name, config keys spelled
as keys, one size grammar, counts that refuse 0, inputs that would be ignored refused; each mistake
is one `error:` line. Parsed in this process (main() exits before any work on a usage error)."""

import argparse

import pytest

from meshtrain.cli import build_parser, main
from meshtrain.config import Config, load_config, parse_size
from meshtrain.errors import ConfigError

# Each subcommand with the arguments it requires, so that only the flag under test can be wrong.
SUBCOMMANDS = {
    "train": ["train"],
    "data prepare": ["data", "prepare", "--input", "x.txt", "--out", "out"],
    "export": ["export", "runs/x", "--out", "out"],
    "jobscript": ["jobscript", "slurm", "--config", "configs/tiny.toml"],
    "bench comm": ["bench", "comm"],
    "plan": ["plan", "--gpu", "h100-80gb"],
    "serve": ["serve", "runs/x"],
    "generate": ["generate", "runs/x", "--prompt", "x"],
    "env": ["env"],
}


def subparser(path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path.split():
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def test_every_command_prints_its_help():
    """--help of every command and subcommand (argparse refuses to print a usage line with an empty
    mutually exclusive group, so a flag table that made one would break it)."""

    def commands(parser, path=()):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, (*path, name))

    found = dict(commands(build_parser()))
    assert {("data", "prepare"), ("bench", "comm"), ("train",), ("serve",), ("jobscript",)} <= set(found)
    for path, parser in found.items():
        assert parser.format_help().startswith("usage: "), path


def one_line_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_nproc_inside_another_launcher_is_refused(capsys, monkeypatch):
    """Under torchrun (RANK set) --nproc and its options would be dropped: meshtrain's own workers
    never get --nproc, so a process that has both was started by someone else's launcher."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for argv in (["train", "--nproc", "4", "--max-restarts", "3"], ["bench", "comm", "--nproc", "2"]):
        assert "this process was started by one (RANK=0)" in one_line_error(argv, capsys)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_abbreviated_flag_is_refused(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = [
        s
        for a in subparser(name)._actions
        for s in a.option_strings
        if s.startswith("--") and len(s) > 4 and s != "--help"
    ]
    assert flags
    for flag in flags:
        abbreviated = flag[:-1]
        if abbreviated in flags:
            continue
        err = one_line_error([*SUBCOMMANDS[name], abbreviated, "1"], capsys)
        assert abbreviated.lstrip("-") in err, (flag, err)


def test_flags_with_one_meaning_everywhere():
    """--json is a switch and --out a path wherever they appear; --dtype is a model's precision
    (data prepare's token width is --token-dtype); flags that set config keys are the keys."""
    for name in SUBCOMMANDS:
        for action in subparser(name)._actions:
            if "--json" in action.option_strings:
                assert isinstance(action, argparse._StoreTrueAction), name
            if "--dtype" in action.option_strings:
                assert set(action.choices) <= {"auto", "bf16", "fp16", "fp32"}, name
            if "--device" in action.option_strings:
                assert "--launch.device" in action.option_strings, name
    plan = {s for a in subparser("plan")._actions for s in a.option_strings}
    assert {
        "--training.micro_batch_size",
        "--training.activation_checkpointing",
        "--model.n_layers",
        "--model.dim",
        "--parallel.tp",
        "--parallel.pp_virtual_stages",
        "--training.seq_len",
    } <= plan
    assert "--launch.env" in {s for a in subparser("env")._actions for s in a.option_strings}


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["jobscript", "slurm", "--config", "configs/tiny.toml", "--gpus", "16", "--nodes", "2"], "--gpus"),
        (["plan", "--gpu", "h100-80gb", "--model", "tiny", "--gpus", "0"], "--gpus: 0 must be at least 1"),
        (["plan", "--gpu", "h100-80gb", "--model", "tiny", "--seq-len", "0"], "training.seq_len = 0 must be positive"),
        (["plan", "--gpu", "h100-80gb", "--model", "tiny", "--config", "configs/tiny.toml"], "not allowed with"),
        (["plan", "--gpu", "h100-80gb", "--model", "tiny", "--efficiency", "0"], "--efficiency"),
        (["train", "--nnodes", "2"], "--nnodes"),
        (["train", "--max-restarts", "3"], "add --nproc"),
        (["train", "--nproc", "0"], "--nproc: 0 must be at least 1"),
        (["train", "--nproc", "2", "--nnodes", "2", "--node-rank", "2"], "below --nnodes"),
        (["jobscript", "slurm", "--config", "configs/tiny.toml", "--nodes", "0"], "--nodes: 0"),
        (["jobscript", "slurm", "--config", "configs/tiny.toml", "--nodes", "3"], "the job's 3 ranks could not train"),
        (["export", "runs/x", "--out", "o", "--max-shard-size", "5XB"], "is not a size"),
        (["bench", "comm", "--max-bytes", "0"], "must be positive"),
        (["serve", "runs/x", "--port", "99999"], "--port: 99999 must be between 1 and 65535"),
        (["serve", "runs/x", "--max-batch", "0"], "--max-batch"),
        (["generate", "runs/x", "--prompt", "x", "--seed", str(2**64)], "--seed"),
        (["generate", "runs/x", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
        (["data", "prepare", "--input", "x", "--out", "o", "--dtype", "uint16"], "--dtype"),
    ],
)
def test_refused_in_one_line(argv, fragment, capsys):
    assert fragment in one_line_error(argv, capsys)


def test_one_size_grammar():
    assert [parse_size(s) for s in ("4096", "1K", "64M", "64MB", "64MiB", "1.5G", "5GB")] == [
        4096,
        1024,
        64 * 2**20,
        64 * 2**20,
        64 * 2**20,
        3 * 2**29,
        5 * 2**30,
    ]
    for bad in ("0", "-1", "5XB", "lots", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_configs_are_built_in_code_without_strings():
    cfg = load_config(overrides={"training.steps": 50, "parallel.tp": 2, "model.dim": None, "checkpoint.async": True})
    assert (cfg.training.steps, cfg.parallel.tp, cfg.model.dim, cfg.checkpoint.async_) == (50, 2, None, True)
    assert cfg == load_config(None, ["--training.steps", "50", "--parallel.tp", "2", "--checkpoint.async", "true"])
    with pytest.raises(ConfigError, match="training.steps = '50' has the wrong type"):
        load_config(overrides={"training.steps": "50"})
    with pytest.raises(ConfigError, match="unknown config key 'training.stepz'"):
        load_config(overrides={"training.stepz": 5})
    cfg = Config()
    cfg.training.steps = 0
    with pytest.raises(ConfigError, match="training.steps = 0 must be positive"):
        cfg.validate()


def test_the_built_in_defaults_are_what_help_says():
    """`meshtrain train --help` says the built-in defaults are configs/tiny.toml: every key's default
    in the help is the value a config without that key reads, and the file sets nothing else."""
    from pathlib import Path

    from meshtrain.cli.options import add_config_keys
    from meshtrain.config import load_config

    built_in = load_config(None)
    assert load_config(Path(__file__).parents[1] / "configs" / "tiny.toml") == built_in
    parser = argparse.ArgumentParser()
    add_config_keys(parser)
    for action in parser._actions:
        if (d := getattr(action, "declared", None)) is not None and action.option_strings[0] == f"--{d.name}":
            section, _, name = d.name.partition(".")
            assert f"(default: {getattr(getattr(built_in, section), name.replace('async', 'async_'))!r})" in action.help
    assert built_in.training.dtype == "auto"
