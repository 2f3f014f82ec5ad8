"""fp16 with dynamic loss scaling, FP8 linears (torchao, emulated on the CPU) and CPU offload: each
trains like its reference, on every layout, and is refused in one line where it cannot run."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import SMALL_MODEL, assert_user_error, read_metrics, run_cli, train_args, train_together
from meshtrain.parallel.float8 import apply_fp8

STEPS = ("--training.steps", "30")
LEARN = ("--training.lr", "1e-2")  # where a run must learn visibly in 30 steps
DEFAULT_MODEL = ("--model.preset", "tiny", "--training.global_batch_size", "4", "--training.micro_batch_size", "2")
FP16 = ("--training.dtype", "fp16")
BF16 = ("--training.dtype", "bf16", "--training.bf16_compute", "bf16")  # bf16 kernels, as FP8 is compared with
# A scale small enough that no step of these short runs overflows, and a window short enough that it
# grows during them (so a resume that lost the scaler's state would differ).
QUIET_SCALE = ("--training.initial_loss_scale", "1024", "--training.loss_scale_window", "10")


FP16_LAYOUTS = {
    "zero3": ("--parallel.zero", "3"),
    "tp2": ("--parallel.tp", "2"),
    "pp2": ("--parallel.pp", "2"),
    "zero1": ("--parallel.zero", "1"),
}
FP8_LAYOUTS = {k: FP16_LAYOUTS[k] for k in ("zero3", "tp2", "pp2")}
# The 2-process runs of the layout tests, trained in one launch (conftest.train_together: one start-up
# of the processes for all seven instead of one each).
TWO_PROCESS = {
    **{"fp16-" + "-".join(layout): (*FP16, *QUIET_SCALE, *layout) for layout in FP16_LAYOUTS.values()},
    **{"fp8-" + "-".join(layout): (*BF16, "--training.fp8", "tensorwise", *layout) for layout in FP8_LAYOUTS.values()},
}


@pytest.fixture(scope="module")
def runs(corpus, cli_env, tmp_path_factory):
    """`runs(name, *overrides, nproc=None)`: a 30-step run, trained once per module (the 2-process
    ones of TWO_PROCESS all together, the first time one of them is asked for)."""
    done = {}

    def get(name: str, *extra: str, nproc: int | None = None, model=SMALL_MODEL):
        if name not in done and nproc == 2 and name in TWO_PROCESS and model == SMALL_MODEL:
            assert tuple(extra) == TWO_PROCESS[name], (name, extra)
            dirs = {n: tmp_path_factory.mktemp(n) for n in TWO_PROCESS}
            args = [train_args(corpus, dirs[n], *STEPS, *TWO_PROCESS[n], model=model) for n in TWO_PROCESS]
            train_together(args, 2, cli_env)
            done.update(dirs)
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name)
            procs = ["--nproc", str(nproc)] if nproc else []
            args = train_args(corpus, run_dir, *STEPS, *extra, *procs, model=model)
            result = run_cli(args, cli_env)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            done[name] = run_dir
        return done[name]

    return get


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def assert_close_runs(run_dir, reference, rtol: float, grad_rtol: float, weight_rtol: float) -> None:
    """Every step's loss within rtol and gradient norm within grad_rtol, each final weight tensor
    within weight_rtol in norm. Low precision needs the wider two: under FSDP the gathered
    parameters are fp16, so the residual stream is too (autocast keeps it fp32); an element whose
    gradient is below fp16's resolution in one sum order and not in another takes Adam's full step
    in one run and none in the other; fp8 has 3 bits of mantissa, rounded under per-shard scales."""
    got, want = read_metrics(run_dir), read_metrics(reference)
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], rel=rtol), g["step"]
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=grad_rtol), g["step"]
    a, b = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert a.keys() == b.keys()
    for key in b:
        assert (a[key] - b[key]).norm() <= weight_rtol * b[key].norm(), key


def test_fp16_trains_like_fp32(runs):
    """The default model (the tiny preset), on short sequences."""
    fp32, fp16 = (
        losses(runs(name, *LEARN, *dtype, model=DEFAULT_MODEL)) for name, dtype in (("fp32", ()), ("fp16", FP16))
    )
    assert fp32[-1] < fp32[0] - 0.5  # it learned something
    for a, b in zip(fp16, fp32, strict=True):
        assert abs(a - b) <= 0.03 * b
    last = read_metrics(runs("fp16"))[-1]
    assert last["arithmetic"] == "fp16" and last["loss_scale"] == 2.0**16 and last["skipped_steps"] == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(FP16_LAYOUTS.values()), ids=list(FP16_LAYOUTS))
def test_fp16_is_the_same_on_every_layout(runs, layout):
    one = runs("fp16-quiet", *FP16, *QUIET_SCALE)
    two = runs("fp16-" + "-".join(layout), *FP16, *QUIET_SCALE, *layout, nproc=2)
    assert_close_runs(two, one, rtol=1e-2, grad_rtol=5e-2, weight_rtol=1e-2)
    scales = [m["loss_scale"] for m in read_metrics(two)]
    assert scales == [m["loss_scale"] for m in read_metrics(one)] and scales[-1] > 1024  # grown alike, no skips


def test_fp16_resumes_bitwise_with_its_loss_scale(runs, corpus, cli_env, tmp_path):
    whole = runs("fp16-quiet", *FP16, *QUIET_SCALE)
    run_dir = tmp_path / "resumed"
    first = train_args(corpus, run_dir, *STEPS, *FP16, *QUIET_SCALE, "--training.stop_at_step", "13")
    assert run_cli(first, cli_env).returncode == 0
    assert run_cli(train_args(corpus, run_dir, *STEPS, *FP16, *QUIET_SCALE), cli_env).returncode == 0
    state = json.loads(next((run_dir / "checkpoints").glob("step_*13/train_state.json")).read_text())
    assert state["loss_scale"]["scale"] == 2048 and state["loss_scale"]["_growth_tracker"] == 3
    resumed = {m["step"]: m for m in read_metrics(run_dir)}
    for m in read_metrics(whole):
        if m["step"] > 13:
            assert (resumed[m["step"]]["loss"], resumed[m["step"]]["loss_scale"]) == (m["loss"], m["loss_scale"])
    a, b = load_file(run_dir / "model.safetensors"), load_file(whole / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_an_overflow_skips_the_step_and_lowers_the_scale(runs):
    """A first scale of 2^40 overflows fp16's gradients: those steps are skipped (the weights keep
    their values), the scale halves each time, then training goes on from finite weights."""
    run_dir = runs("fp16-overflow", *LEARN, *FP16, "--training.initial_loss_scale", str(2.0**40))
    metrics = read_metrics(run_dir)
    skipped = metrics[-1]["skipped_steps"]
    assert 3 <= skipped < 25
    assert metrics[0]["loss_scale"] == 2.0**39 and metrics[0]["grad_norm"] is None  # inf, written as null
    assert metrics[-1]["loss_scale"] == 2.0 ** (40 - skipped) and math.isfinite(metrics[-1]["grad_norm"])
    assert metrics[-1]["loss"] < metrics[skipped]["loss"]  # learning once the scale fits
    assert all(torch.isfinite(w).all() for w in load_file(run_dir / "model.safetensors").values())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_within_5_percent_of_bf16(runs, recipe):
    bf16 = losses(runs("bf16", *LEARN, *BF16))
    fp8 = losses(runs(f"fp8-{recipe}", *LEARN, *BF16, "--training.fp8", recipe))
    assert fp8[-1] < fp8[0] - 0.5
    for a, b in zip(fp8, bf16, strict=True):
        assert abs(a - b) <= 0.05 * b
    assert read_metrics(runs(f"fp8-{recipe}"))[-1]["arithmetic"] == f"bf16+fp8-{recipe}"


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(FP8_LAYOUTS.values()), ids=list(FP8_LAYOUTS))
def test_fp8_is_the_same_on_every_layout(runs, layout):
    """ZeRO-3 gathers the fp8 weights (tensorwise), TP and PP convert their shards and stages."""
    one = runs("fp8-quiet", *BF16, "--training.fp8", "tensorwise")
    two = runs("fp8-" + "-".join(layout), *BF16, "--training.fp8", "tensorwise", *layout, nproc=2)
    assert_close_runs(two, one, rtol=1e-2, grad_rtol=0.5, weight_rtol=5e-2)


def test_a_converted_linear_equals_torchaos_fp8_gemm():
    """The blocks' linears (not the embedding or the output) become Float8Linear; emulated, one gives
    the numbers of torchao's real fp8 kernel (torch._scaled_mm) to fp8's rounding."""
    from torchao.float8.float8_linear import Float8Linear

    from meshtrain.model import Llama
    from meshtrain.model.llama import ModelArgs

    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=256))
    model.init_weights(0)
    real = copy.deepcopy(model)
    apply_fp8(model, "tensorwise", emulate=True, fp8_all_gather=False)
    apply_fp8(real, "tensorwise", emulate=False, fp8_all_gather=False)
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.0.{n}" for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo")} | {
        f"layers.0.feed_forward.{n}" for n in ("w1", "w2", "w3")
    }
    x = torch.randn(2, 32, 64)
    outs = []
    for m in (model, real):
        linear = m.layers["0"].feed_forward.w1
        xi = x.clone().requires_grad_()
        out = linear(xi)
        out.square().sum().backward()
        outs.append((out, xi.grad, linear.weight.grad))
    reference = torch.nn.functional.linear(x, real.layers["0"].feed_forward.w1.weight)
    assert (outs[0][0] - reference).abs().max() > 0  # fp8 rounding, not the fp32 product
    for ours, theirs in zip(outs[0], outs[1]):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--parallel.zero", "3", "--parallel.cpu_offload", "true"), "this job trains on the CPU"),
        (("--parallel.zero", "2", "--parallel.cpu_offload", "true"), "needs parallel.zero = 3"),
        (("--training.fp8", "rowwise", "--parallel.tp", "2", "--model.dim", "96"), "wk.weight is (24, 96) on each"),
    ],
    ids=["offload on a CPU", "offload without zero 3", "fp8 on a TP shard that is not 16s"],
)
def test_what_cannot_run_is_refused_before_the_workers_start(corpus, cli_env, tmp_path, extra, message):
    result = run_cli(train_args(corpus, tmp_path / "run", *extra, "--nproc", "2"), cli_env)
    assert_user_error(result, message)
    assert "rank 1" not in result.stderr  # refused before the workers started
