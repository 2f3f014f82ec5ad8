"""`meshtrain train --dry-run WORLD`: the job built at its true world size on a fake process group,
with fake tensors, against the planner (and, in test_parallel.py, against real runs)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.job import resolve
from meshtrain.job.layout import layout_of
from meshtrain.layout import Layout
from meshtrain.model.presets import PRESETS
from meshtrain.model.shapes import Shape
from meshtrain.plan import Workload, activation_bytes, estimate_memory
from meshtrain.plan.workload import workload_of
from meshtrain.train.dry_run import busiest_ranks, dry_run

TINY = ["--model.preset", "tiny", "--model.n_layers", "4", "--training.seq_len", "256", "--training.dtype", "fp32"]
TINY += ["--training.global_batch_size", "8", "--training.micro_batch_size", "2", "--data.corpus", "stdlib"]
BIG = ["--training.micro_batch_size", "1", "--training.dtype", "bf16", "--training.bf16_compute", "bf16"]
LAYOUTS = {
    "single": (1, TINY),
    "ddp2": (2, TINY),
    "zero1-2": (2, [*TINY, "--parallel.zero", "1"]),
    "zero3-4-ac": (4, [*TINY, "--parallel.zero", "3", "--training.activation_checkpointing", "full"]),
    "hsdp-2x2": (4, [*TINY, "--parallel.zero", "3", "--parallel.dp_replicate", "2"]),
    "tp2-sp": (2, [*TINY, "--parallel.tp", "2"]),
    "tp2-plain": (2, [*TINY, "--parallel.tp", "2", "--parallel.sequence_parallel", "false"]),
    "fsdp2-tp2-selective": (
        4,
        [*TINY, "--parallel.zero", "3", "--parallel.tp", "2", "--training.activation_checkpointing", "selective"],
    ),
    "pp2-gpipe-zero1": (4, [*TINY, "--parallel.pp", "2", "--parallel.zero", "1", "--parallel.pp_schedule", "gpipe"]),
    "pp2-interleaved-tp2": (
        4,
        [*TINY, "--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "interleaved_1f1b"]
        + ["--parallel.pp_virtual_stages", "2"],
    ),
    "pp2-fsdp2-tp2": (8, [*TINY, "--parallel.pp", "2", "--parallel.zero", "3", "--parallel.tp", "2"]),
    # the real sizes: Llama 3 8B on 64 GPUs (FSDP x TP; 8 of its 32 blocks, whose shapes are what is
    # checked: each block is a second of fake forward and backward passes), 70B on 512 (TP 8, PP 8 interleaved)
    "8b-64": (
        64,
        [*BIG, "--model.preset", "llama3-8b", "--model.n_layers", "8", "--parallel.tp", "8", "--parallel.zero", "3"]
        + ["--training.seq_len", "8192", "--training.global_batch_size", "64"],
    ),
    "70b-512": (
        512,
        [*BIG, "--model.preset", "llama3-70b", "--parallel.tp", "8", "--parallel.pp", "8", "--parallel.zero", "3"]
        + ["--parallel.pp_schedule", "interleaved_1f1b", "--parallel.pp_virtual_stages", "2"]
        + ["--training.seq_len", "4096", "--training.global_batch_size", "512"],
    ),
    # the other families: Qwen3's q/k norms and wide queries under TP; tied embeddings (Llama 3.2,
    # small Qwens) with the embedding's copy on the last pipeline stage
    "qwen3-32b-16": (  # 8 of its 64 blocks: the blocks' shapes are what is checked
        16,
        [*BIG, "--model.preset", "qwen3-32b", "--model.n_layers", "8", "--parallel.tp", "8", "--parallel.zero", "3"]
        + ["--training.seq_len", "4096", "--training.global_batch_size", "16"],
    ),
    "pp2-fsdp2-tp2-tied": (
        8,
        [*TINY, "--model.tie_embeddings", "true", "--parallel.pp", "2", "--parallel.zero", "3", "--parallel.tp", "2"],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_built_job_matches_the_planner(name, tmp_path):
    """Model states per rank equal the planner's (its exact formulas against the objects the trainer
    builds); saved activations within 5% (what autograd keeps, counted on fake tensors); the peak of
    live bytes of a step within 5%. A pipeline rank's peak is one micro-batch's, measured, with the
    schedule's other micro-batches in flight added by rule: within 12% on the 4-layer model (whose
    embedding and gradients outweigh its activations), within 5% at 70B."""
    world, overrides = LAYOUTS[name]
    cfg = load_config(None, [*overrides, "--data.path", str(tmp_path / "data")])
    reports = dry_run(cfg, world)
    layout = layout_of(cfg, world)
    assert [r.rank for r in reports] == busiest_ranks(layout)
    for r in reports:
        for key in ("params", "grads", "optimizer"):
            assert r.built[key] == pytest.approx(r.planned[key], rel=0.01), (r.rank, key, r.built, r.planned)
        assert r.built["activations"] == pytest.approx(r.planned["activations"], rel=0.05), (r.rank, r.built)
        assert r.built["params"] > 0 and r.built["activations"] > 0
        bound = 0.12 if layout.pp > 1 and name != "70b-512" else 0.05
        assert r.built["total"] == pytest.approx(r.planned["total"], rel=bound), (r.rank, r.built, r.planned)


# 2-process layouts run for real (gloo) and dry-run: the peak of live bytes of a step, per rank.
REAL = {
    "ddp2": TINY,
    "zero3-2": [*TINY, "--parallel.zero", "3"],
    "tp2": [*TINY, "--parallel.tp", "2"],
    "pp2-1f1b": [*TINY, "--parallel.pp", "2", "--training.micro_batch_size", "1"],
}


def _real_peaks(rank: int, store: str, out: str) -> None:
    """Each REAL layout built by the trainer on this gloo rank: two steps, the second's peak of live
    tensor bytes (the first makes the gradients and AdamW's moments that every later step starts with)."""
    import os

    import torch
    import torch.distributed as dist

    from meshtrain.optim import local_optimizer
    from meshtrain.train.build import build
    from meshtrain.train.measure import PeakLiveBytes

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    peaks = {}
    for name, overrides in REAL.items():
        state = build(load_config(None, overrides), with_data=False)
        dp = state.layout.dp
        batch = torch.randint(0, 8192, (8 // dp, 257), generator=torch.Generator().manual_seed(rank))
        state.step(batch[:, :-1], batch[:, 1:])
        params = state.model.parameters()
        moments = [v for s in local_optimizer(state.optimizer).state.values() for v in s.values()]
        with PeakLiveBytes([*params, *(p.grad for p in params if p.grad is not None), *moments]) as tracker:
            state.step(batch[:, :-1], batch[:, 1:])
        peaks[name] = tracker.peak
    with open(f"{out}.{rank}", "w") as f:
        json.dump(peaks, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown: torch 2.13's gloo objects sometimes abort at exit (see test_plan)


@pytest.mark.multiproc
def test_dry_run_peaks_match_real_runs(tmp_path):
    """The same layouts built for real on 2 gloo processes, every live tensor tracked through a step,
    against the dry run of each rank: within 10% (DDP, ZeRO-3, TP with SP, and a real 1F1B schedule)."""
    import torch.multiprocessing as mp

    out = tmp_path / "peaks"
    mp.spawn(_real_peaks, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    real = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for name, overrides in REAL.items():
        cfg = load_config(None, [*overrides, "--data.path", str(tmp_path / "data")])
        for rank, report in enumerate(dry_run(cfg, 2, [0, 1])):
            want = real[rank][name]
            assert report.rank == rank and report.built["total"] == pytest.approx(want, rel=0.10), (name, rank, want)


@pytest.mark.parametrize(
    "device, keys, fragment",
    [
        ("cpu", ["--parallel.zero", "3", "--parallel.cpu_offload", "true"], "parallel.cpu_offload moves"),
        ("cuda", ["--training.attention_backward", "recompute"], "training.attention_backward = 'recompute'"),
    ],
)
def test_a_fixed_device_is_held_to_what_train_asks_of_it(device, keys, fragment, tmp_path):
    """launch.device fixes the kind of device: the dry run refuses what train would refuse on it."""
    cfg = load_config(None, [*TINY, "--launch.device", device, *keys, "--data.path", str(tmp_path / "data")])
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        dry_run(cfg, 2)


def test_llama3_405b_on_16384_ranks_from_the_command_line(tmp_path, cli_env):
    """TP 8, PP 16, DP 128, sequence 8192: built and measured for its first and last pipeline
    stage in seconds, on the fake tensors' shapes alone; states, activations and peak beside the
    planner's."""
    args = ["train", "--model.preset", "llama3-405b", *BIG, "--parallel.tp", "8", "--parallel.pp", "16"]
    args += ["--parallel.zero", "3", "--training.seq_len", "8192", "--training.global_batch_size", "2048"]
    args += ["--data.path", str(tmp_path / "data"), "--dry-run", "16384", "--json"]
    result = run_cli(args, cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["world"] == 16384 and [r["rank"] for r in out["ranks"]] == [0, 15 * 128 * 8]
    for r in out["ranks"]:
        assert r["built"]["params"] == r["planned"]["params"]
        assert r["built"]["optimizer"] == r["planned"]["optimizer"]
        assert r["built"]["activations"] == pytest.approx(r["planned"]["activations"], rel=0.05)
        assert r["built"]["total"] == pytest.approx(r["planned"]["total"], rel=0.05)
        assert r["coordinates"]["tp"] == 0 and r["coordinates"]["dp"] == 0
    # 405B / (8 x 16) in bf16 storage... fp32 master weights: ~3.2B parameters of a stage / 8 (TP) / 128 (FSDP)
    assert 50 * 2**20 < out["ranks"][0]["built"]["params"] < 200 * 2**20


def test_plan_verify_adds_what_the_built_job_holds(cli_env):
    result = run_cli(
        ["plan", "--model", "small", "--gpu", "a100-80gb", "--gpus", "8", "--seq-len", "1024", "--verify", "2"]
        + ["--json"],
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    layouts = json.loads(result.stdout)["layouts"]
    assert "built" in layouts[0] and "built" in layouts[1] and "built" not in layouts[2]
    for layout in layouts[:2]:
        planned, built = layout["memory_gib"], layout["built"]
        assert set(built) == {*planned, "rank", "planned", "notes"} and set(built["planned"]) == set(planned)
        for key in ("params", "grads", "optimizer"):
            assert built[key] == pytest.approx(planned[key], rel=0.01, abs=2e-3), (layout["layout"], key)
            assert built[key] == pytest.approx(built["planned"][key], rel=1e-3, abs=1e-3), (layout["layout"], key)
        # The dry run runs the host's (CPU) kernels: its composite RMSNorm saves more than CUDA's fused one.
        lay = Layout(**layout["layout"])
        w = Workload(Shape.from_args(PRESETS["small"]), 1024, "bf16", device="cpu")
        cpu_kernels = activation_bytes(w, lay, lay.coordinates(built["rank"])["pp"])["saved"]
        assert built["activations"] * 2**30 == pytest.approx(cpu_kernels, rel=0.05), layout["layout"]


def test_a_qlora_base_is_built_in_bf16_and_says_so(corpus, capsys, tmp_path):
    """NF4 quantizes real weights (train's load_base), not fake ones, so the dry run builds QLoRA's
    base in bf16: a note says what that adds, the whole difference between the built params and the
    NF4 planned. `plan --verify` shows the notes beside its figures, and builds the vocabulary it
    planned (the data's, not the preset's)."""
    from meshtrain.cli import main
    from meshtrain.data import read_manifest
    from meshtrain.model.args import LoraSpec
    from meshtrain.model.lora import target_weights
    from meshtrain.plan import nf4_bytes

    config = tmp_path / "qlora.toml"
    config.write_text(
        f'[model]\npreset = "tiny"\nn_layers = 4\n[data]\npath = "{corpus}"\n[training]\ndtype = "bf16"\n'
        'seq_len = 256\nglobal_batch_size = 2\nmicro_batch_size = 2\n[peft]\nmethod = "qlora"\n'
    )
    vocab = read_manifest(corpus)["vocab_size"]
    shape = Shape.from_args(dataclasses.replace(PRESETS["tiny"], n_layers=4, vocab_size=vocab))
    bf16_over_nf4 = sum(2 * p.numel - nf4_bytes(p.numel) for p in target_weights(shape, LoraSpec("qlora")))
    (report,) = dry_run(load_config(config), 1)
    assert report.built["params"] - report.planned["params"] == bf16_over_nf4
    (note,) = [n for n in report.notes if n.startswith("qlora: the base built in bf16")]
    assert f"hold {bf16_over_nf4 / 2**20:.1f} MiB more than what runs" in note
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--config", str(config), "--gpu", "h100-80gb", "--verify", "--json"])
    out = capsys.readouterr()
    assert exit.value.code == 0, out.err
    planned = json.loads(out.out)
    (layout,) = planned["layouts"]
    assert planned["model"]["vocab_size"] == vocab and layout["built"]["notes"] == [note]
    assert layout["built"]["params"] == pytest.approx(layout["memory_gib"]["params"] + bf16_over_nf4 / 2**30, abs=2e-3)


def test_the_plan_covers_every_rank_of_uneven_stages(tmp_path):
    """5 layers on 2 stages (3 + the embedding, 2 + the output) under full checkpointing: the rank
    with the largest peak is not the one with the most parameters. Each of the planner's items is
    what the rank holding the most of it was built with, the peak the larger of the two built."""
    overrides = [*TINY, "--model.n_layers", "5", "--parallel.pp", "2", "--training.activation_checkpointing", "full"]
    cfg = load_config(None, [*overrides, "--data.path", str(tmp_path / "data")])
    reports = dry_run(cfg, 2, [0, 1])
    job = dataclasses.replace(resolve(cfg, 2), device=torch.device("cpu"))
    plan = estimate_memory(workload_of(job), job.layout)
    for key in ("params", "grads", "optimizer"):
        assert plan[key] == pytest.approx(max(r.built[key] for r in reports), rel=0.01), key
    assert reports[0].built["params"] != pytest.approx(reports[1].built["params"], rel=0.05)
    assert plan["total"] == pytest.approx(max(r.built["total"] for r in reports), rel=0.12)


def test_a_dpo_job_is_built_with_its_pairs_and_its_reference(corpus, cli_env, tmp_path):
    """A DPO step takes each sample as a pair of sequences, after a reference pass (a frozen copy of
    the base, or with LoRA the adapters off): the dry run builds and steps it so, within 5% of the
    planner's activations and peak; a DPO job on the default corpus (plain text) is refused before
    anything is prepared."""
    from meshtrain.data import prepare
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE
    from meshtrain.data.prepare import ChatOptions

    pair = {"prompt": "red or blue?", "chosen": "red", "rejected": "blue"}
    (tmp_path / "pairs.jsonl").write_text(
        "".join(json.dumps({**pair, "prompt": f"{i}: red or blue?"}) + "\n" for i in range(64))
    )
    options = ChatOptions(DEFAULT_CHAT_TEMPLATE, format="preference")
    data = tmp_path / "pairs"
    prepare(
        [tmp_path / "pairs.jsonl"],
        data,
        tokenizer=corpus / "tokenizer.json",
        val_fraction=0,
        progress=False,
        chat=options,
    )
    for extra in ([], ["--peft.method", "lora"]):
        cfg = load_config(None, [*TINY, "--training.objective", "dpo", "--data.path", str(data), *extra])
        (report,) = dry_run(cfg, 2)
        assert report.built["activations"] == pytest.approx(report.planned["activations"], rel=0.05), extra
        assert report.built["total"] == pytest.approx(report.planned["total"], rel=0.05), extra
    fresh = ["train", *TINY, "--training.objective", "dpo", "--data.path", str(tmp_path / "none"), "--dry-run", "2"]
    result = run_cli(fresh, cli_env)
    assert result.returncode == 2 and "dpo learns from preference pairs, but" in result.stderr, result.stderr
    assert "holds no data yet" in result.stderr and not (tmp_path / "none").exists()


def test_a_vocabulary_other_than_the_datas_is_refused_as_train_refuses_it(corpus, cli_env, tmp_path):
    """data.vocab_size against the prepared data: the dry run (and so jobscript and plan --verify)
    refuses it in the words train does, before building anything."""
    from meshtrain.data import read_manifest

    prepared = read_manifest(corpus)["vocab_size"]
    args = ["train", "--data.path", str(corpus), "--data.corpus", "", "--data.vocab_size", str(prepared + 1)]
    result = run_cli([*args, "--run.dir", str(tmp_path / "run"), "--dry-run", "1"], cli_env)
    assert result.returncode == 2, result.stderr
    assert f"data.vocab_size = {prepared + 1} but {corpus} is prepared with a vocabulary of {prepared}" in result.stderr
    assert not (tmp_path / "run").exists()
