"""Every option is declared once (type, bounds, choices, grammar) and every reader refuses what its
declaration refuses: each flag of each command and each config key (on the command line and in a
TOML file), fed malformed and out-of-range values generated from the declaration (hypothesis), gives
one `error:` line and exit 2, never a traceback and never exit 0. Parsed in this process: main()
stops at the refusal, before any work."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import typing

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshtrain.cli import build_parser, main
from meshtrain.config import config_keys, load_config
from meshtrain.config.options import Declared
from meshtrain.errors import ConfigError

# Each subcommand with the arguments it requires, so that only the option under test can be wrong.
COMMANDS = {
    "train": ["train"],
    "data prepare": ["data", "prepare", "--input", "x.txt", "--out", "out"],
    "export": ["export", "runs/x", "--out", "out"],
    "jobscript": ["jobscript", "slurm", "--config", "configs/tiny.toml"],
    "bench comm": ["bench", "comm"],
    "bench serve": ["bench", "serve", "hf/x"],
    "plan": ["plan", "--gpu", "h100-80gb"],
    "serve": ["serve", "runs/x"],
    "generate": ["generate", "runs/x", "--prompt", "x"],
    "env": ["env"],
}
EXAMPLES = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def subparser(path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path.split():
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def flags_with_values() -> list[tuple[str, str, Declared]]:
    """(command, flag, declaration) of every flag that takes a value."""
    out = []
    for command in COMMANDS:
        for action in subparser(command)._actions:
            d = getattr(action, "declared", None)
            if d is None or not action.option_strings or action.nargs == 0:
                continue
            out.append((command, action.option_strings[0], d))
    return out


def rejected(d: Declared, text: str) -> bool:
    try:
        d.from_text(text)
    except ConfigError:
        return True
    return False


def out_of_range(d: Declared) -> st.SearchStrategy:
    """Numbers just outside each declared bound, and far outside it."""
    m, base = d.meta, d.item.base if d.is_list else d.base
    values = []
    for key in ("ge", "gt", "le", "lt"):
        if key in m:
            bound = m[key]
            if base is int:
                near = bound + {"ge": -1, "gt": 0, "le": 1, "lt": 0}[key]
            else:
                eps = 1e-3 * max(1.0, abs(bound))
                near = bound + {"ge": -eps, "gt": 0.0, "le": eps, "lt": 0.0}[key]
            far = bound - 10**6 if key in ("ge", "gt") else bound + 10**6
            values += [base(near), base(far)]
    return st.sampled_from(values) if values else st.nothing()


def malformed_text(d: Declared) -> st.SearchStrategy[str]:
    """Text this declaration must refuse: the wrong type, out of range, not a choice, bad grammar."""
    base = d.item.base if d.is_list else d.base
    garbage = st.text(alphabet="abcxyz:,.%-_ ", min_size=1, max_size=8)
    if d.choices is not None:
        words = {str(c) for c in d.choices}
        return st.one_of(garbage, st.sampled_from(["FP32", "none ", "4", "-1", "true"])).filter(
            lambda t: t not in words and t.strip() not in words
        )
    if base is bool:
        return garbage.filter(lambda t: t.lower() not in ("true", "false", "1", "0", "yes", "no", "none", "null"))
    if "parse" in d.meta or "check" in d.meta:  # a grammar: generated, kept where the grammar refuses it
        samples = ["0", "-5M", "1:2:3:4", "x:0,y", "12Q", ":", "", " ", "\t", "null", " key "]
        refused = st.sampled_from([t for t in samples if rejected(d, t)])
        if any(rejected(d, t) for t in ("abc", "x_y", "a.b", "zz")):
            return st.one_of(garbage, refused)
        blank = st.text(alphabet=" \t", max_size=6).filter(lambda t: rejected(d, t))  # what free text refuses
        return st.one_of(refused, blank)  # free text: a host name, a key
    if base in (int, float):
        not_a_number = garbage.filter(lambda t: not _parses(t, base))
        numbers = out_of_range(d).map(repr)
        specials = st.sampled_from(["nan", "inf", "-inf"] if base is float else ["1.5", "1e3", "0x10"])
        return st.one_of(not_a_number, numbers, specials)
    return st.nothing()  # free text: nothing to refuse


def _parses(text: str, base: type) -> bool:
    try:
        value = base(text)
    except ValueError:
        return False
    return not (base is float and not math.isfinite(value))


def assert_refused_in_one_line(argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
    text = err.getvalue()
    assert exit_.value.code == 2, (argv, exit_.value.code, text)
    assert text.count("\n") == 1 and text.startswith("error: ") and "Traceback" not in text, (argv, text)
    return text


FLAGS = [f for f in flags_with_values() if not malformed_text(f[2]).is_empty]


@pytest.mark.parametrize("command, flag, declared", FLAGS, ids=[f"{c}:{f}" for c, f, _ in FLAGS])
def test_every_flag_refuses_what_its_declaration_refuses(command, flag, declared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a refused command could write lands in the checkout

    @EXAMPLES
    @given(malformed_text(declared))
    def refused(text):
        assume(rejected(declared, text))  # the declaration itself refuses it
        assert_refused_in_one_line([*COMMANDS[command], f"{flag}={text}"])

    refused()


def typed_malformed(d: Declared) -> st.SearchStrategy:
    """TOML values a key must refuse: the wrong type, or out of range."""
    base = d.base
    wrong_type = {
        int: st.one_of(st.text(max_size=4), st.floats(allow_nan=False), st.booleans()),
        float: st.one_of(st.text(max_size=4), st.booleans()),
        bool: st.one_of(st.text(max_size=4), st.integers()),
        str: st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans()),
    }
    if d.choices is not None:
        return st.one_of(st.text(max_size=6), st.integers(-3, 9), st.booleans()).filter(
            lambda v: v not in d.choices or isinstance(v, bool)
        )
    strategies = [wrong_type.get(base, st.nothing())]
    if base in (int, float):
        strategies.append(out_of_range(d))
    return st.one_of(strategies)


KEYS = [(key, d) for key, d in config_keys().items() if not d.is_list]


@pytest.mark.parametrize("key, declared", KEYS, ids=[k for k, _ in KEYS])
def test_every_config_key_refuses_in_toml_and_in_code(key, declared, tmp_path):
    import tomli_w

    section, _, name = key.partition(".")

    @EXAMPLES
    @given(typed_malformed(declared))
    def refused(value):
        try:
            declared.check(value)
        except ConfigError:
            pass
        else:
            assume(False)  # a value the declaration takes (an int where a float is declared)
        with pytest.raises(ConfigError) as e:
            load_config(overrides={key: value})
        assert "\n" not in str(e.value) and key in str(e.value)
        path = tmp_path / "bad.toml"
        path.write_text(tomli_w.dumps({section: {name: value}}))
        assert key in assert_refused_in_one_line(["train", "--config", str(path)])

    refused()


def test_declarations_say_what_they_allow():
    keys = config_keys()
    assert keys["training.steps"].describe() == "an integer, positive"
    assert keys["training.beta1"].describe() == "a number, at least 0 and below 1"
    assert keys["parallel.zero"].choices == (0, 1, 2, 3)
    assert typing.get_origin(keys["training.dtype"].base) is typing.Literal
    with pytest.raises(ConfigError, match=r"parallel.zero = True is not allowed"):
        keys["parallel.zero"].check(True)  # a bool is not the integer 1


def test_every_switch_starts_at_its_declared_default_and_can_be_turned_both_ways():
    """An option declared `bool = True` as a plain store_true flag would start False (argparse's
    default, not the declaration's) and its flag could only set what the declaration meant: each
    boolean option of every command parses to its declared default, and its switches reach both values."""
    checked = 0
    for command, base in COMMANDS.items():
        parser = build_parser()
        for action in subparser(command)._actions:
            d = getattr(action, "declared", None)
            if d is None or not isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
                continue
            assert getattr(parser.parse_args(base), action.dest) is d.default, (command, action.option_strings)
            reached = {getattr(parser.parse_args([*base, flag]), action.dest) for flag in action.option_strings}
            assert reached | {d.default} == {True, False}, (command, action.option_strings)
            checked += 1
    assert checked >= 5


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--servers", "meshtrain,vllm"], "vllm unknown: use meshtrain, meshtrain-no-prefix-caching, transformers"),
        (["--servers", "meshtrain,meshtrain"], "names a server twice"),
        (["--concurrency", "1,8,08"], "names a client count twice"),
        (["--concurrency", "1,0"], "is not a comma-separated list of positive client counts"),
    ],
)
def test_bench_serve_lists_are_refused_in_one_line(extra, message):
    assert message in assert_refused_in_one_line(["bench", "serve", "hf/x", *extra])
