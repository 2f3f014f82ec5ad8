"""Layout parity: the same model, seed and global batch trained under every layout gives the
single-process per-step loss and gradient norm (fp32, rel. diff <= 1e-4) and the same final weights."""

import pytest
from safetensors.torch import load_file

from conftest import assert_same_run, read_metrics, run_cli, train_args, train_together
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.job import resolve
from meshtrain.job.layout import layout_of
from meshtrain.job.model import model_args

# 4 layers so that 2 pipeline ranks x 2 virtual stages each get one; micro-batch 2 so every
# layout has enough micro-batches for its schedule.
LAYOUT_MODEL = ["--model.n_layers", "4", "--training.micro_batch_size", "2"]

AC_FULL = ["--training.activation_checkpointing", "full"]
LAYOUTS = {
    "ddp2": (2, []),
    "ddp2-ac": (2, AC_FULL),
    "zero1-2": (2, ["--parallel.zero", "1"]),
    "zero2-2-ac-selective": (2, ["--parallel.zero", "2", "--training.activation_checkpointing", "selective"]),
    "zero3-2": (2, ["--parallel.zero", "3"]),
    "zero3-2-ac": (2, ["--parallel.zero", "3", *AC_FULL]),
    "zero3-4": (4, ["--parallel.zero", "3"]),
    "hsdp-2x2": (4, ["--parallel.zero", "3", "--parallel.dp_replicate", "2"]),
    "tp2-sp-lp": (2, ["--parallel.tp", "2"]),
    "tp2-plain": (
        2,
        ["--parallel.tp", "2", "--parallel.sequence_parallel", "false", "--parallel.loss_parallel", "false"],
    ),
    "tp2-sp-ac": (2, ["--parallel.tp", "2", "--parallel.loss_parallel", "false", *AC_FULL]),
    "pp2-gpipe": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "gpipe"]),
    "pp2-1f1b-ac": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b", *AC_FULL]),
    "pp2-interleaved": (
        2,
        ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_virtual_stages", "2"],
    ),
    "pp2-zero-bubble": (
        2,
        ["--parallel.pp", "2", "--parallel.pp_schedule", "zero_bubble", "--parallel.pp_virtual_stages", "2"],
    ),
    "pp2-zbv": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.pp_virtual_stages", "2"]),
    "fsdp2-tp2": (4, ["--parallel.zero", "3", "--parallel.tp", "2"]),
    "pp2-fsdp2": (4, ["--parallel.pp", "2", "--parallel.zero", "3"]),
    "pp2-zero1-dp2": (4, ["--parallel.pp", "2", "--parallel.zero", "1"]),
    "pp2-tp2": (4, ["--parallel.pp", "2", "--parallel.tp", "2"]),
    "pp2-fsdp2-tp2": (8, ["--parallel.pp", "2", "--parallel.zero", "3", "--parallel.tp", "2"]),
    # torch.compile'd model and loss: the same numbers as eager, alone (one graph for the whole
    # model, with checkpointed blocks inside it) and composed (a graph per block).
    "compiled": (None, ["--training.compile", "true", "--training.activation_checkpointing", "selective"]),
    "compiled-zero3-2-ac": (2, ["--training.compile", "true", "--parallel.zero", "3", *AC_FULL]),
    "compiled-pp2-1f1b": (2, ["--training.compile", "true", "--parallel.pp", "2"]),
    "compiled-pp2-tp2": (4, ["--training.compile", "true", "--parallel.pp", "2", "--parallel.tp", "2"]),
}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def launch(corpus, cli_env, run_dir, nproc, extra):
    args = [*train_args(corpus, run_dir, *LAYOUT_MODEL, *extra)]
    if nproc:
        args += ["--nproc", str(nproc)]
    result = run_cli(args, cli_env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run(*LAYOUT_MODEL)


def together(name: str) -> bool:
    """Trained in one launch with the other layouts of its world size (conftest.train_together: the
    trainer's train() of each config in turn, one start-up of the processes for them all). Each
    through `meshtrain train --nproc` instead: fsdp2-tp2 (its launcher's output is read below), the
    8-process layout (alone in its size) and the compiled ones (each its own compile caches)."""
    nproc, extra = LAYOUTS[name]
    return nproc in (2, 4) and "--training.compile" not in extra and name != "fsdp2-tp2"


@pytest.fixture(scope="module")
def layout_run(corpus, cli_env, tmp_path_factory):
    """(run dir, result) of a layout, launched on first use (with the others of its world size, see
    together()) and shared by the tests that read it."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, extra = LAYOUTS[name]
            if together(name):
                names = [n for n in LAYOUTS if together(n) and LAYOUTS[n][0] == nproc]
                dirs = {n: tmp_path_factory.mktemp(n) for n in names}
                args = [train_args(corpus, dirs[n], *LAYOUT_MODEL, *LAYOUTS[n][1]) for n in names]
                result = train_together(args, nproc, cli_env)
                runs.update({n: (dirs[n], result) for n in names})
            else:
                run_dir = tmp_path_factory.mktemp(name)
                runs[name] = (run_dir, launch(corpus, cli_env, run_dir, nproc, extra))
        return runs[name]

    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, layout_run):
    run_dir, _ = layout_run(name)
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 11))
    assert_same_run(run_dir, reference)


@pytest.mark.multiproc
def test_startup_prints_the_mesh(layout_run):
    out = layout_run("fsdp2-tp2")[1].stdout
    assert "dp_shard groups: [0, 2] [1, 3]" in out and "tp groups: [0, 1] [2, 3]" in out
    assert out.count("optimizer") >= 4  # one memory line per rank


@pytest.mark.multiproc
def test_model_state_bytes_follow_the_zero_formulas(reference, layout_run):
    """Per rank: ZeRO-1 shards optimizer states (O/N); ZeRO-2 also gradients; ZeRO-3 also parameters.
    (FSDP2 keeps ZeRO-2's gathered parameters only between forward and backward; at rest, when
    this is measured, they are sharded too.)"""
    import json

    params = sum(t.numel() * 4 for t in load_file(reference / "model.safetensors").values())
    full = {"params": params, "grads": params, "optimizer": 2 * params}  # AdamW: exp_avg, exp_avg_sq
    sharded = {
        "ddp2": (),
        "zero1-2": ("optimizer",),
        "zero2-2-ac-selective": ("optimizer", "grads", "params"),
        "zero3-2": ("optimizer", "grads", "params"),
    }
    for name, keys in sharded.items():
        ranks = json.loads((layout_run(name)[0] / "memory.json").read_text())
        assert len(ranks) == 2
        for key, total in full.items():
            expected = total / 2 if key in keys else total
            for rank in ranks:
                assert abs(rank[key] - expected) <= 0.05 * expected, (name, key, rank[key], expected)
            if key in keys:
                assert sum(r[key] for r in ranks) == pytest.approx(total, rel=0.01)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "nproc, extra",
    [
        (None, ["--training.bf16_compute", "bf16"]),
        (None, ["--training.bf16_compute", "bf16-gemm"]),
        (None, ["--training.bf16_compute", "fp32", "--training.compile", "true"]),
        (2, ["--parallel.zero", "3", "--training.bf16_compute", "bf16"]),
        (2, ["--parallel.zero", "3", "--training.bf16_compute", "bf16-attention"]),
        (2, ["--parallel.tp", "2", "--training.bf16_compute", "fp32"]),
    ],
    ids=[
        "autocast",
        "autocast-bf16-gemms-fp32-attention",
        "compiled-fp32-arithmetic",
        "fsdp-mixed",
        "fsdp-mixed-fp32-gemms-bf16-attention",
        "tp2-fp32-arithmetic",
    ],
)
def test_bf16_converges_like_fp32(nproc, extra, reference, corpus, cli_env, tmp_path):
    """bf16 with bf16 kernels, with fp32 arithmetic (what "auto" picks on a CPU where bf16 kernels
    are slow), and with one class of work in each."""
    result = launch(corpus, cli_env, tmp_path, nproc, ["--training.dtype", "bf16", *extra])
    compute = extra[extra.index("--training.bf16_compute") + 1]
    label = "bf16" if compute == "bf16" else f"bf16/{compute}"
    assert f"cpu {label} |" in result.stdout
    assert all(m["arithmetic"] == label for m in read_metrics(tmp_path) if "arithmetic" in m)
    for r, b in zip(read_metrics(reference), read_metrics(tmp_path), strict=True):
        assert rel(b["loss"], r["loss"]) <= 0.02, (r["step"], r["loss"], b["loss"])


@pytest.mark.parametrize(
    "world, overrides, fragment",
    [
        (6, ["--parallel.tp", "4"], "world size 6 is not divisible by parallel.tp (4) x parallel.pp (1)"),
        (4, ["--parallel.tp", "4", "--parallel.zero", "3", "--model.n_kv_heads", "2"], "divisible by parallel.tp (4)"),
        (4, ["--parallel.pp", "4", "--model.n_layers", "3"], "model.n_layers (3) must be at least"),
        (4, ["--parallel.tp", "2"], "cannot replicate tensor-parallel"),
        (4, ["--parallel.dp_replicate", "2"], "needs parallel.zero = 2 or 3"),
        (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved_1f1b"], "pp_virtual_stages >= 2"),
        (
            2,
            ["--parallel.pp", "2", "--parallel.pp_microbatches", "3", "--training.micro_batch_size", "4"],
            "does not match the local batch",
        ),
        (
            2,
            ["--parallel.pp", "2", "--training.micro_batch_size", "16"],
            "needs at least parallel.pp (2) micro-batches",
        ),
        (2, ["--parallel.zero", "5"], "parallel.zero = 5"),
        (2, ["--parallel.tp", "2", "--parallel.zero", "3", "--model.vocab_multiple", "3"], "vocab_multiple (3)"),
    ],
)
def test_layout_errors_name_the_numbers(world, overrides, fragment):
    with pytest.raises(ConfigError) as e:
        resolve(load_config(None, overrides), world)
    assert fragment in str(e.value)


@pytest.mark.multiproc
def test_planner_predicts_the_model_state_bytes_of_every_layout(reference, layout_run):
    """The planner's parameter, gradient and optimizer bytes for each rank of every parity layout
    (and the single process) against what the run measured on its tensors (memory.json), within 2%."""
    import json

    from meshtrain.model.shapes import Shape
    from meshtrain.plan import model_state_bytes

    for name in [None, *LAYOUTS]:
        run_dir = reference if name is None else layout_run(name)[0]
        ranks = json.loads((run_dir / "memory.json").read_text())
        cfg = load_config(run_dir / "config.toml")
        shape, layout = Shape.from_args(model_args(cfg)), layout_of(cfg, len(ranks))
        for rank, measured in enumerate(ranks):
            predicted = model_state_bytes(shape, layout, rank)
            for key, value in predicted.items():
                assert value == pytest.approx(measured[key], rel=0.02), (name, rank, key, value, measured[key])


DRY_RUN_LAYOUTS = ["ddp2", "zero1-2", "zero3-2", "hsdp-2x2", "tp2-sp-lp", "pp2-1f1b-ac", "fsdp2-tp2", "pp2-zero1-dp2"]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", DRY_RUN_LAYOUTS)
def test_dry_run_states_equal_what_each_rank_of_the_real_run_held(name, layout_run):
    """`train --dry-run WORLD` of the run's own config, rank by rank, against its memory.json: the
    same parameter, gradient and optimizer bytes, to the byte."""
    import json

    from meshtrain.train.dry_run import dry_run

    run_dir = layout_run(name)[0]
    ranks = json.loads((run_dir / "memory.json").read_text())
    cfg = load_config(run_dir / "config.toml")
    for report in dry_run(cfg, len(ranks), list(range(len(ranks)))):
        measured = ranks[report.rank]
        for key in ("params", "grads", "optimizer"):
            assert report.built[key] == measured[key], (name, report.rank, key, report.built[key], measured[key])


TIED = ["--model.tie_embeddings", "true"]
TIED_LAYOUTS = {
    "pp2-1f1b": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "1f1b"]),  # the pair of ranks sums
    "pp2-zbv": (2, ["--parallel.pp", "2", "--parallel.pp_schedule", "zbv", "--parallel.pp_virtual_stages", "2"]),
    "pp2-tp2": (4, ["--parallel.pp", "2", "--parallel.tp", "2"]),  # row shards of both copies line up
}


@pytest.fixture(scope="module")
def tied_run(corpus, cli_env, tmp_path_factory):
    """The run dir of a layout of TIED_LAYOUTS, the 2-process ones trained in one launch (conftest.train_together)."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, extra = TIED_LAYOUTS[name]
            names = [n for n in TIED_LAYOUTS if TIED_LAYOUTS[n][0] == 2] if nproc == 2 else [name]
            dirs = {n: tmp_path_factory.mktemp(f"tied-{n}") for n in names}
            if nproc == 2:
                args = [train_args(corpus, dirs[n], *LAYOUT_MODEL, *TIED, *TIED_LAYOUTS[n][1]) for n in names]
                train_together(args, 2, cli_env)
            else:
                launch(corpus, cli_env, dirs[name], nproc, [*TIED, *extra])
            runs.update(dirs)
        return runs[name]

    return get


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(TIED_LAYOUTS))
def test_tied_embeddings_across_pipeline_stages_match_one_process(name, reference_run, tied_run):
    """Llama 3.2's and the small Qwens' tied embeddings under a pipeline: the last stage's copy gets
    the summed gradient, the norm counts the matrix once, and the run is the single process's."""
    assert_same_run(tied_run(name), reference_run(*LAYOUT_MODEL, *TIED))


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "first, then",
    [((None, []), TIED_LAYOUTS["pp2-1f1b"]), (TIED_LAYOUTS["pp2-zbv"], (None, []))],
    ids=["single-to-pp2", "pp2-zbv-to-single"],
)
def test_tied_embeddings_reshard_between_pipeline_and_none(first, then, reference_run, corpus, cli_env, tmp_path):
    """A checkpoint without a pipeline holds one optimizer state for the tied matrix; a pipeline's
    last stage loads its copy's from it (and a pipeline's checkpoint loads without one): resumed
    runs equal the uninterrupted single process."""
    stop = ["--checkpoint.every", "5"]
    launch(corpus, cli_env, tmp_path, first[0], [*TIED, *first[1], *stop, "--training.stop_at_step", "5"])
    launch(corpus, cli_env, tmp_path, then[0], [*TIED, *then[1], *stop])
    assert_same_run(tmp_path, reference_run(*LAYOUT_MODEL, *TIED))
