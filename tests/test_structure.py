"""The package's shape, held: no import cycle (the planner is an estimator below the trainer, the
job's resolution below both), no function over 100 lines or module over 600 (a guard well above what a
module of one responsibility needs), one layout whose fields are config keys, one resolution of a job
that every entry point runs, each derived object made in one place, config errors refused only where
a config is declared or resolved, and command modules that are glue."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import meshtrain
from meshtrain.config import Config, config_keys
from meshtrain.job.layout import layout_of
from meshtrain.layout import Layout
from meshtrain.model.args import LoraSpec

SRC = Path(meshtrain.__file__).parent
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 100, 600


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text())
    return out


def imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The meshtrain modules a module imports, at the top or inside functions; not those imported
    for annotations only (under `if TYPE_CHECKING:`)."""
    found = set()
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshtrain"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("meshtrain")}
    return found


def graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imports(tree, set(trees)) & set(trees) for name, tree in trees.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules_or_parts():
    edges = graph()
    assert cycles(edges) == []
    parts: dict[str, set[str]] = {}
    for a, targets in edges.items():
        parts.setdefault(package(a), set()).update(package(b) for b in targets if package(b) != package(a))
    assert cycles(parts) == []
    assert "meshtrain.train" not in parts["meshtrain.plan"] and "meshtrain.cli" not in parts["meshtrain.plan"]
    assert not parts["meshtrain.job"] & {"meshtrain.plan", "meshtrain.train", "meshtrain.cli", "meshtrain.serve"}
    assert not any("meshtrain.cli" in targets for part, targets in parts.items() if part != "meshtrain.__main__")


def test_functions_and_modules_stay_small():
    too_long = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append((str(path.relative_to(SRC)), len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append((f"{path.relative_to(SRC)}:{node.name}", lines))
    assert too_long == []


def test_the_layout_speaks_config_keys():
    keys = {key.partition(".")[2] for key in config_keys()}
    assert {f.name for f in dataclasses.fields(Layout)} <= keys
    from meshtrain.config import load_config

    cfg = load_config(
        None,
        ["--parallel.pp", "2", "--training.micro_batch_size", "2", "--parallel.pp_schedule", "interleaved_1f1b"]
        + ["--parallel.pp_virtual_stages", "2", "--training.activation_checkpointing", "selective"],
    )
    layout = layout_of(cfg, 4)
    assert (layout.dp_shard, layout.dp, layout.micro_batches) == (2, 2, 4)
    again = layout_of(layout.apply_to(load_config(None)), 4)
    assert again == layout


def calls(tree: ast.Module) -> set[str]:
    """The functions a module calls, by name (`f(...)`, `x.f(...)` -> "f"; `Shape.from_args` whole)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute):
                found.add(f"{fn.value.id}.{fn.attr}" if isinstance(fn.value, ast.Name) else fn.attr)
                found.add(fn.attr)
            elif isinstance(fn, ast.Name):
                found.add(fn.id)
    return found


def test_every_entry_point_resolves_the_one_job():
    """train's launcher, each worker's build, the dry run (so plan --verify) and jobscript resolve
    the job with `meshtrain.job.resolve` (or resolve_prepared); the data's tokenizer check runs nowhere else."""
    trees = modules()
    resolving = {
        name
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "meshtrain.job"
        and {"resolve", "resolve_prepared"} & {a.name for a in node.names}
    }
    assert resolving == {
        "meshtrain.cli.train",
        "meshtrain.job.launch",
        "meshtrain.train.build",
        "meshtrain.train.dry_run",
    }
    assert {name for name, tree in trees.items() if "check_init_tokenizer" in calls(tree)} == {"meshtrain.job"}


def test_each_derived_object_is_constructed_in_one_place():
    """The model's shape (ModelArgs), its Shape, the adapters' spec and the Layout are made from a
    config by job/ alone; the planner calls the same functions for the jobs it searches. (interop
    shapes a Hugging Face directory's own weights, which no config describes.)"""
    constructors = {
        "model_args": {"meshtrain.job.model"},
        "resolve_model": {"meshtrain.job", "meshtrain.plan.request"},
        "adapters_of": {"meshtrain.job", "meshtrain.plan.request"},
        "layout_of": {"meshtrain.job", "meshtrain.plan.search"},
        "Shape.from_args": {"meshtrain.job.model", "meshtrain.interop.hf_import"},
        "LoraSpec": {"meshtrain.job.model", "meshtrain.interop.weights", "meshtrain.serve.loading"},
    }
    trees = modules()
    for constructor, allowed in constructors.items():
        callers = {name for name, tree in trees.items() if constructor in calls(tree)}
        assert callers <= allowed, (constructor, callers - allowed)
    assert not any(hasattr(cls, "from_config") for cls in (Layout, LoraSpec))
    assert not hasattr(Config, "model_args")


# Where a config error may be refused: the declarations and checks across keys (config/), the job's
# resolution (job/), a plan request's resolution (plan/request.py, plan/checks.py), and the device a
# started process finds (launch/distributed.py).
REFUSING = (
    "meshtrain.config",
    "meshtrain.job",
    "meshtrain.plan.request",
    "meshtrain.plan.checks",
    "meshtrain.launch.distributed",
)


def test_config_refusals_live_with_the_declarations_or_the_resolution():
    """ConfigError is raised only where a config is declared or resolved, and cli/ (parsing and
    printing) refuses nothing that names a config key."""
    keys = set(config_keys())
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if getattr(raised, "id", "") == "ConfigError":
                assert name.startswith(REFUSING), f"{name}:{node.lineno} raises ConfigError"
            if name.startswith("meshtrain.cli"):
                text = " ".join(
                    c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
                named = [key for key in keys if key in text]
                assert not named, f"{name}:{node.lineno} refuses {named[0]}: a check for job/ or the declaration"


def test_the_command_modules_hold_glue_and_load_no_torch():
    """cli/ imports no torch (nor the parts that load it) at module load: `meshtrain --help`, a bad
    flag, plan and jobscript answer without it."""
    import subprocess
    import sys

    code = "import sys, meshtrain.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
