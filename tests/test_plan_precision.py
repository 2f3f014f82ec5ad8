"""The planner's fp16, FP8 and CPU offload (plan/speed.py, plan/memory.py, plan/states.py): FP8 against
torchtitan's published speed-up and refused without FP8 units, CPU offload's device and host memory
and PCIe time derived by hand from the parameter table, offload only where the trainer takes it, and
docs/planning.md's case: a 13B Llama on 32 V100-16GB, planned in fp16, written, dry-run."""

from __future__ import annotations

import math

import pytest

from meshtrain.config import load_config
from meshtrain.errors import MeshtrainError
from meshtrain.job.model import model_args
from meshtrain.layout import Layout
from meshtrain.model.presets import PRESETS
from meshtrain.model.shapes import Shape
from meshtrain.plan import Workload, device, estimate_memory, evaluate, search, step_time

LLAMA_13B = ["--model.dim", "5120", "--model.n_layers", "40", "--model.n_heads", "40", "--model.n_kv_heads", "40"]
LLAMA_13B += ["--model.ffn_dim", "13824", "--model.vocab_size", "32000", "--model.max_seq_len", "2048"]


def plan(cli_env, tmp_path, *args):
    from conftest import run_cli

    return run_cli(["plan", *args], cli_env, cwd=tmp_path)


def llama_8b_on_8_h100(fp8: str) -> float:
    """tokens/s per GPU of torchtitan's published run: Llama 3.1 8B, FSDP over 8 H100s, local batch
    2 of 8192 tokens, selective checkpointing, compiled."""
    dev, inter = device("h100-80gb", 8)
    layout = Layout(dp_shard=8, zero=3, global_batch_size=16, micro_batch_size=2, activation_checkpointing="selective")
    w = Workload(Shape.from_args(PRESETS["llama3.1-8b"]), 8192, "bf16", compiled=True, fp8=fp8)
    return step_time(w, layout, dev, inter)["tokens_per_s_per_gpu"]


def test_fp8_speeds_up_as_torchtitan_measured_and_needs_fp8_units(cli_env, tmp_path):
    bf16 = llama_8b_on_8_h100("off")
    tensorwise, rowwise = llama_8b_on_8_h100("tensorwise"), llama_8b_on_8_h100("rowwise")
    assert tensorwise / bf16 == pytest.approx(8532 / 6667, rel=0.03)  # torchtitan: 6,667 -> 8,532
    assert rowwise / bf16 == pytest.approx(6424 / 5760, rel=0.03)  # torchtitan 7a04053: 5,760 -> 6,424
    assert 1 < rowwise < tensorwise < 2 * bf16  # FP8 doubles the peak of the GEMMs only
    result = plan(cli_env, tmp_path, "--model", "tiny", "--gpu", "a100-80gb", "--fp8", "tensorwise")
    assert result.returncode == 2 and "a100-80gb has no FP8 units" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    from meshtrain.plan.checks import check_precision

    with pytest.raises(MeshtrainError, match="v100-16gb has no FP8 units"):
        check_precision(device("v100-16gb")[0], "rowwise", False)
    with pytest.raises(MeshtrainError, match="add --cpu-offload, or drop it"):  # nothing would fill it
        check_precision(device("h100-80gb")[0], "off", False, host_memory_gib=512)


def test_fp8_all_gather_halves_the_gathered_block_weights():
    """Under ZeRO-3 with tensorwise FP8 the blocks' linear weights are gathered in fp8: the peak drops
    by the bytes saved on the gathered blocks, not on the saved activations (torchao saves the
    linears' high-precision inputs)."""
    from meshtrain.plan.memory import fsdp_gathered_bytes

    shape = Shape.from_args(PRESETS["llama3.1-8b"])
    layout = Layout(dp_shard=8, zero=3, global_batch_size=8, micro_batch_size=1)
    bf16, fp8 = (Workload(shape, 4096, "bf16", fp8=f) for f in ("off", "tensorwise"))
    block_linear = sum(p.numel for p in shape.parameters() if p.owner == 0 and len(p.shape) == 2)
    # one byte less an element of each gathered block: one at the loss, two in the blocks' backward
    # (the one computing and the one prefetched)
    old, new = fsdp_gathered_bytes(bf16, layout, 0), fsdp_gathered_bytes(fp8, layout, 0)
    assert (old["loss"] - new["loss"], old["blocks"] - new["blocks"]) == (block_linear, 2 * block_linear)
    old, new = estimate_memory(bf16, layout), estimate_memory(fp8, layout)
    assert new["activations"] == old["activations"]
    assert block_linear <= old["total"] - new["total"] <= 2 * block_linear


def test_mfu_divides_by_the_peak_train_divides_by(monkeypatch, capsys):
    """MFU against train's peak (hardware.mfu_peak_tflops): the training dtype's data-sheet peak, with
    FP8 the FP8 peak. training.peak_tflops (--peak-tflops) is that one divisor, which a plan with FP8
    (a bf16 peak and an FP8 peak) cannot take for both: refused, never applied to one of them."""
    import torch

    from meshtrain import hardware
    from meshtrain.cli import main
    from meshtrain.plan.checks import check_peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    dev, inter = device("h100-80gb", 8)
    layout = Layout(dp_shard=8, zero=3, global_batch_size=16, micro_batch_size=2)
    for fp8 in ("off", "tensorwise", "rowwise"):
        w = Workload(Shape.from_args(PRESETS["llama3.1-8b"]), 8192, "bf16", fp8=fp8)
        speed = step_time(w, layout, dev, inter)
        trains = hardware.mfu_peak_tflops(torch.device("cuda"), "bf16", fp8=fp8)
        assert speed["mfu"] == pytest.approx(speed["tflops_per_gpu"] / trains), fp8
    assert trains == dev.peak("fp8") > dev.peak("bf16")
    with pytest.raises(MeshtrainError, match="--peak-tflops .training.peak_tflops. 500 with --fp8 rowwise"):
        check_peak(500.0, "rowwise")
    check_peak(500.0, "off")
    check_peak(0.0, "tensorwise")
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--model", "tiny", "--gpu", "h100-80gb", "--fp8", "tensorwise", "--peak-tflops", "500"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "the plan also needs the bf16 peak" in err and err.count("\n") == 1, err


def offload_case(**changes):
    shape = Shape.from_args(PRESETS["tiny"])
    layout = Layout(dp_shard=4, zero=3, global_batch_size=4, micro_batch_size=1, cpu_offload=True)
    dev, inter = device("v100-16gb", 4, **changes)
    w = Workload(shape, 256, "fp16")
    return shape, layout, dev, inter, w


def test_cpu_offload_moves_the_states_to_the_host_and_pays_pcie():
    shape, layout, dev, inter, w = offload_case()
    # rank 0's shard, by hand: FSDP2 splits dim 0 of every parameter as torch.chunk does
    shard = sum(math.ceil(p.shape[0] / 4) * math.prod(p.shape[1:]) for p in shape.parameters())
    on = evaluate(w, layout, dev, inter)
    off = evaluate(w, Layout(**{**layout.__dict__, "cpu_offload": False}), dev, inter)
    assert off.memory["params"] == 4 * shard and off.memory["optimizer"] == 8 * shard
    assert on.memory["params"] == on.memory["grads"] == on.memory["optimizer"] == 0
    assert off.memory["total"] - 16 * shard <= on.memory["total"] <= off.memory["total"] - 12 * shard
    assert on.host_per_node == 16 * shard * 4 and off.host_per_node == 0  # fp32 params, grads, 2 moments x 4 ranks
    # one micro-batch: the fp32 shard to the GPU for the forward's and the backward's all-gathers, the
    # fp32 gradient shard back; then AdamW on the host, 28 bytes a parameter at 20 GB/s
    assert on.speed["seconds"]["pcie"] == pytest.approx((2 * 4 + 4) * shard / 12e9)
    assert on.speed["seconds"]["optimizer"] == pytest.approx(28 * shard / 20e9)
    assert off.speed["seconds"]["pcie"] == 0
    assert on.speed["step_time_s"] > off.speed["step_time_s"]
    small_host = evaluate(w, layout, *offload_case(host_memory_gib=16 * shard * 3 / 2**30)[2:4])
    assert not small_host.fits and "host memory per node" in small_host.why_not


def test_cpu_offload_only_where_pinned_and_only_on_zero_3():
    shape, _, dev, inter, w = offload_case()
    base = load_config(None, ["--training.dtype", "fp16", "--training.seq_len", "256"])
    args = model_args(base)
    free, _ = search(w, dev, inter, 4, 8, {}, base, args)
    assert free and not any(e.layout.cpu_offload for e in free)  # never searched: off unless asked
    pinned, refused = search(w, dev, inter, 4, 8, {"cpu_offload": True}, base, args)
    assert pinned and all(e.layout.cpu_offload and e.layout.zero == 3 and e.layout.dp_shard > 1 for e in pinned)
    assert any("parallel.cpu_offload" in reason and "zero = 3" in reason for reason in refused)
    none, refused = search(w, dev, inter, 4, 8, {"cpu_offload": True, "zero": 2}, base, args)
    assert not none and all("parallel.zero = 3" in reason for reason in refused)
    gpt = Workload(Shape.gpt(256, 2, 4, 1024, 256), 256, "fp16")
    none, refused = search(gpt, dev, inter, 4, 8, {"cpu_offload": True, "zero": 1})
    assert not none and list(refused) == [
        "cpu offload moves ZeRO-3's shards to host memory: it needs zero 3 over more than one shard"
    ]


def test_13b_llama_on_32_v100s_fits_in_fp16(cli_env, tmp_path):
    """docs/planning.md's case. 13B parameters x 16 bytes of states are 194 GiB: sharded over 32 GPUs
    (ZeRO-3) 6.1 GiB, which leaves room for fp16 activations under full checkpointing on a 15.8 GiB
    V100; not without sharding them. CPU offload frees the GPU of those 6.1 GiB, costs a node 8 x
    that in host memory and is slower (PCIe and a CPU optimizer step): the plan does not pick it."""
    cfg = load_config(None, LLAMA_13B + ["--training.seq_len", "2048", "--training.dtype", "fp16"])
    model = model_args(cfg)
    w = Workload(Shape.from_args(model), 2048, "fp16")
    dev, inter = device("v100-16gb", 8)
    assert w.shape.n_params() == pytest.approx(13.0e9, rel=0.01)
    fixed = {"tp": 1, "pp": 1, "dp_replicate": 1, "activation_checkpointing": "full", "micro_batch_size": 4}
    (fsdp,), _ = search(w, dev, inter, 32, 128, fixed | {"zero": 3}, cfg, model)
    (offload,), _ = search(w, dev, inter, 32, 128, fixed | {"zero": 3, "cpu_offload": True}, cfg, model)
    (zero1,), _ = search(w, dev, inter, 32, 128, fixed | {"zero": 1, "micro_batch_size": 1}, cfg, model)
    states = 16 * w.shape.n_params() / 32
    assert fsdp.fits and sum(fsdp.memory[k] for k in ("params", "grads", "optimizer")) == pytest.approx(
        states, rel=0.01
    )
    assert not zero1.fits and zero1.memory["params"] + zero1.memory["grads"] == 8 * w.shape.n_params()
    assert offload.fits and offload.memory["total"] < fsdp.memory["total"] - 4 * w.shape.n_params() / 32
    assert offload.host_per_node == pytest.approx(8 * states, rel=0.01) and offload.host_per_node < 512 * 2**30
    assert offload.speed["tokens_per_s_per_gpu"] < fsdp.speed["tokens_per_s_per_gpu"]
    fp32 = Workload(w.shape, 2048, "fp32")
    assert not evaluate(fp32, fsdp.layout, dev, inter).fits  # fp32 activations do not fit beside the states
    out = tmp_path / "v100.toml"
    flags = ["--layers", "40", "--hidden", "5120", "--heads", "40", "--ffn", "13824", "--vocab", "32000"]
    result = plan(
        cli_env,
        tmp_path,
        *flags,
        "--seq-len",
        "2048",
        "--gpu",
        "v100-16gb",
        "--gpus",
        "32",
        "--tp",
        "1",
        "--pp",
        "1",
        "--write-config",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    written = load_config(out)  # what is written loads, and trains in fp16
    assert written.training.dtype == "fp16" and written.parallel.zero == 3 and not written.parallel.cpu_offload


@pytest.mark.parametrize(
    "keys",
    [
        ["--training.dtype", "fp16", "--parallel.cpu_offload", "true"],
        ["--training.dtype", "bf16", "--training.fp8", "tensorwise"],
    ],
    ids=["fp16-offload", "fp8"],
)
def test_the_dry_run_builds_fp16_offload_and_fp8_jobs(keys):
    """`train --dry-run` (and so `plan --verify`) builds what --write-config writes: fp16 with CPU
    offload (built without the offload policy, its states counted where they are) and FP8 (emulated
    on this CPU); the model states built are the planner's."""
    from meshtrain.train.dry_run import dry_run

    cfg = load_config(
        None,
        [
            "--model.preset",
            "tiny",
            "--parallel.zero",
            "3",
            "--training.global_batch_size",
            "4",
            "--training.micro_batch_size",
            "1",
            "--training.seq_len",
            "64",
            *keys,
        ],
    )
    (report,) = dry_run(cfg, 4)
    for key in ("params", "grads", "optimizer"):
        assert report.built[key] == report.planned[key], key
    assert ("cpu_offload" in " ".join(report.notes)) == ("--parallel.cpu_offload" in keys)
