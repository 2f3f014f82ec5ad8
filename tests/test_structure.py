"""The package's shape, held: no import cycle (the planner is an estimator below the trainer), no
function over 100 lines or module over 500, one layout whose fields are config keys, and one
preflight that every entry point runs."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import meshtrain
from meshtrain.config import config_keys
from meshtrain.layout import Layout

SRC = Path(meshtrain.__file__).parent
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 100, 500


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
    layout = Layout.from_config(cfg, 4)
    assert (layout.dp_shard, layout.dp, layout.micro_batches) == (2, 2, 4)
    again = Layout.from_config(layout.apply_to(load_config(None)), 4)
    assert again == layout


def test_every_entry_point_runs_the_one_preflight():
    """train's launcher, each worker's build, the dry run and jobscript call `preflight`; the data's
    tokenizer check runs nowhere else."""
    calls: dict[str, set[str]] = {"preflight": set(), "check_init_tokenizer": set()}
    for name, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                calls.get(fn, set()).add(name)
    entry_points = {
        "meshtrain.cli.train",
        "meshtrain.cli.jobscript",
        "meshtrain.train.build",
        "meshtrain.train.dry_run",
    }
    assert calls == {"preflight": entry_points, "check_init_tokenizer": {"meshtrain.train.preflight"}}
