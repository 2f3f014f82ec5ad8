"""Shared fixtures: a small prepared corpus and a way to run the real CLI in subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.data import prepare, stdlib_sources

# A model small enough that a 2-process run takes seconds on 2 cores.
SMALL_MODEL = [
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.ffn_dim",
    "128",
    "--model.max_seq_len",
    "64",
]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """60 standard-library files, BPE vocabulary 512."""

    def make(directory: Path) -> None:
        prepare(stdlib_sources()[:60], directory / "data", vocab_size=512, val_fraction=0.05, progress=False)

    return made_once(tmp_path_factory, "corpus", make) / "data"


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The directory `name`, filled by make(directory) once per test session and shared by the xdist
    workers of `make test` (the first to ask makes it under a lock; the others wait, then read it)."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "made-once"
    shared.mkdir(exist_ok=True)
    directory, made = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            made.touch()
    return directory


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))  # CPU peak probe cache
    for inherited in ("RANK", "WORLD_SIZE", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "RESTARTED"):
        env.pop(inherited, None)  # a suite run inside a job: its tests start jobs of their own
    if env.get("MESHTRAIN_JITTER"):  # `make stress`: seeded pauses at every run-file write in every process
        env["PYTHONPATH"] = os.pathsep.join(p for p in (FAULTS, env.get("PYTHONPATH")) if p)
    return env


# `make test` runs `pytest -n 2 --dist loadgroup`: each case goes to whichever xdist worker is free,
# except those that share something made once per module (a module-scoped fixture: runs trained for
# the module's tests) or per machine (a scheduler started for the module): a module's such cases run
# on one worker, so that what they share is made once.
SERIAL_FILES = {"test_slurm.py": "scheduler", "test_sge.py": "scheduler"}


# Each xdist worker's share of the cores: the torch threads of its own process and of the runs it
# starts. More threads than cores make OpenMP's workers spin against each other (a 2-thread run beside
# another worker's is several times slower than a 1-thread one).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)


def pytest_configure(config):
    if WORKERS > 1:  # this worker's torch, and every process a test starts (else a launcher splits the cores)
        import torch

        torch.set_num_threads(THREADS)
        os.environ["OMP_NUM_THREADS"] = str(THREADS)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        group = SERIAL_FILES.get(item.path.name)
        fixtures = getattr(item, "_fixtureinfo", None)
        if group is None and fixtures is not None:
            scopes = {d.scope for defs in fixtures.name2fixturedefs.values() for d in defs}
            group = item.path.name if scopes & {"module", "class", "package"} else None
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


def local_cluster(script: str, timeout: int = 600):
    """Start one of scripts/local-*.sh for a test module, stop it afterwards. Needs root; on CI a
    missing root is a failure, elsewhere a skip with the reason."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"{script} needs root on CI to install and start the scheduler")
        pytest.skip(f"starting a local scheduler needs root (scripts/{script} start)")
    path = Path(__file__).parents[1] / "scripts" / script
    result = subprocess.run(["bash", str(path), "start"], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    yield
    subprocess.run(["bash", str(path), "stop"], capture_output=True, timeout=120)


def run_cli(args: list[str], env: dict, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtrain", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def run_cli_here(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`meshtrain ARGS` in this process (the CLI's main(argv)), for a refusal made before any work:
    what a subprocess prints, without its seconds of importing torch first."""
    from meshtrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, exit_info.value.code, out.out, out.err)


def train_args(corpus: Path, run_dir: Path, *extra: str, model: list[str] | tuple = tuple(SMALL_MODEL)) -> list[str]:
    """A short run on the test corpus; `model`: the shape flags (none with model.init_from)."""
    return [
        "train",
        "--data.path",
        str(corpus),
        "--data.corpus",
        "",
        "--run.dir",
        str(run_dir),
        *model,
        "--training.seq_len",
        "32",
        "--training.global_batch_size",
        "8",
        "--training.micro_batch_size",
        "4",
        "--training.steps",
        "10",
        "--training.warmup_steps",
        "2",
        "--run.log_every",
        "1",
        "--run.sample_prompt",
        "",
        "--run.tensorboard",
        "false",
        "--training.dtype",  # the numbers tests compare, whatever the CPU (auto may pick bf16 on one)
        "fp32",
        *extra,
    ]


# One tolerance policy. The same layout stopped and resumed, or restarted after a crash, is bitwise
# equal to the uninterrupted run (exact=True). Different layouts, launchers or world sizes sum in
# another order: per-step loss, gradient norm and validation loss within RTOL relative, weights
# within RTOL relative + ATOL absolute (fp32).
RTOL, ATOL = 1e-4, 1e-5


def assert_same_run(run_dir: Path, reference: Path, exact: bool = False) -> None:
    """Every logged step, the validation loss and the final weights of run_dir against reference."""
    import torch
    from safetensors.torch import load_file

    got, want = read_metrics(run_dir), read_metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in w:
                close = g[key] == w[key] if exact else abs(g[key] - w[key]) <= RTOL * abs(w[key])
                assert close, (key, g["step"], w[key], g[key])
    if (reference / "model.safetensors").exists():
        a, b = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
        assert a.keys() == b.keys()
        for key in b:
            if exact:
                assert torch.equal(a[key], b[key]), key
            else:
                torch.testing.assert_close(a[key], b[key], rtol=RTOL, atol=ATOL, msg=key)


@pytest.fixture(scope="session")
def reference_run(corpus, cli_env, tmp_path_factory):
    """`reference_run(*train_overrides, nproc=None)`: the run dir of that run, trained once per session
    (by one xdist worker) and shared by every test file that compares with it. Each rank draws from
    its own generator every step (MESHTRAIN_RNG_PROBE) so that resumed runs can be checked to restore
    each rank's."""
    runs: dict[tuple, Path] = {}

    def get(*extra: str, nproc: int | None = None) -> Path:
        key = (nproc, *extra)
        if key not in runs:

            def make(run_dir: Path) -> None:
                args = train_args(corpus, run_dir, *extra, *(["--nproc", str(nproc)] if nproc else []))
                result = run_cli(args, faulty(cli_env, MESHTRAIN_RNG_PROBE="1"))
                assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]

            name = "reference-" + hashlib.sha1(json.dumps(key).encode()).hexdigest()[:12]
            runs[key] = made_once(tmp_path_factory, name, make)
        return runs[key]

    return get


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: non-zero exit, one line on stderr naming the problem, no traceback."""
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


FAULTS = str(Path(__file__).parent / "faults")  # sitecustomize.py: fault injection in every process


def faulty(cli_env: dict, **faults: str) -> dict:
    """The environment of a run with the faults of tests/faults/sitecustomize.py switched on."""
    path = os.pathsep.join(p for p in (FAULTS, cli_env.get("PYTHONPATH")) if p)
    return {**cli_env, "PYTHONPATH": path, **faults}


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, ValueError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


def rank_of(pid: int) -> str | None:
    """The RANK a launcher gave that process, or None (no such process or no RANK)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), None)


def greedy_by_recomputation(model, prompt: list[int], n: int) -> list[int]:
    """The test oracle for every cached decoder: n greedy tokens, each from a full forward over the
    whole sequence (no KV cache, no stop token)."""
    import torch

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens]))[0, -1, : model.args.vocab_size]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def train_together(runs: list[list[str]], nproc: int, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    """Several `meshtrain train` runs of one world size (each its train_args, without --nproc) in one
    torchrun launch of tests/layouts_worker.py: one start-up of the processes for all of them (about
    10 s of a 2-process launch on 2 cores, most of its time). Each run is the trainer's own train()
    of its config, in its own run dir; the cores are split as `meshtrain train --nproc` splits them.
    Asserts that every run finished on every rank."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "runs.json"
        spec.write_text(json.dumps([args[1:] if args[0] == "train" else args for args in runs]))
        worker = Path(__file__).parent / "layouts_worker.py"
        env = {**env, "OMP_NUM_THREADS": str(max(1, THREADS // nproc))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        cmd += [str(worker), str(spec)]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for args in runs:
        run_dir = Path(args[args.index("--run.dir") + 1])
        assert all((run_dir / f".done-rank{r}").exists() for r in range(nproc)), (run_dir, result.stdout[-3000:])
    return result


def pretend_other_load(monkeypatch, share: float) -> None:
    """Every look of the CPU probes reads `share` of the machine used by others, whatever /proc/stat
    says (a clock tick inside a look would otherwise replace a patched class default with the
    machine's real reading)."""
    from meshtrain.job.probe_timing import OtherLoad

    monkeypatch.setattr(OtherLoad, "__exit__", lambda self, *exc: setattr(self, "share", share))


def field_paths(value, prefix: tuple = ()):
    """Every field of a JSON value as a path of keys (of a list, its first two items), outermost
    first: what the property tests over files edit one at a time."""
    if prefix:
        yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value[:2]) if isinstance(value, list) else ()
    for key, inner in items:
        yield from field_paths(inner, (*prefix, key))


def with_field(value, path: tuple, new):
    """A deep copy of the JSON value `value` whose field at `path` is `new`."""
    edited = json.loads(json.dumps(value))
    inner = edited
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = new
    return edited


def a_train_state(**record) -> dict:
    """A train_state.json of a 1-process run at step 5 with `record` (the fields a test is about)."""
    state = {"step": 5, "peft": None, "scheduler": {}, "loader": {"consumed": 0, "seed": 0, "seq_len": 8}}
    state["loader"]["n_windows"] = [4]
    state["layout"] = {"world_size": 1, "tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1, "dp_shard": 1, "zero": 0}
    state["model"] = {"dim": 8, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1, "ffn_dim": 8, "vocab_size": 8}
    return state | record
