"""The benchmark suite's own plumbing, on a small case: `python -m bench memory` through the real
CLI, whose per-rank bytes must follow the ZeRO paper's ratios, then the plots from its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.job.model import model_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
def test_memory_suite_measures_the_zero_ratios_and_plots(corpus, tmp_path):
    env = {**os.environ, "MESHTRAIN_BENCH_RESULTS": str(tmp_path)}
    for suite in (["memory", "--memory-preset", "tiny", "--worlds", "2"], ["plots"]):
        result = subprocess.run(
            [sys.executable, "-m", "bench", *suite, "--data-path", str(corpus)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert [(r["world"], r["zero"]) for r in rows] == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]
    for r in rows:
        assert r["ratio_to_ddp"] == pytest.approx(1.0 if r["zero"] == 0 else 0.75 if r["zero"] == 1 else 0.5, rel=0.05)
        assert r["peak_rss"] > r["model_states"]
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    assert "| 2 | ZeRO-3 |" in (tmp_path / "memory.md").read_text()


def test_profile_splits_a_step_into_kernels_and_host_time():
    """A step of one big matmul is matmul time; a step that sleeps is time outside any kernel."""
    import time

    import torch

    from bench.profile import breakdown, category

    assert [
        category(n)
        for n in (
            "aten::mm",
            "sm90_xmma_gemm_bf16",
            "aten::_fused_adamw_",
            "## Call CompiledFxGraph abc",
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::add_",
        )
    ] == ["matmul", "matmul", "optimizer", "compiled", "attention", "other"]
    a = torch.randn(768, 768)
    ms = breakdown(lambda: a @ a, 3, torch.device("cpu"))
    assert ms["matmul"] > 0.8 * ms["wall"] and ms["outside kernels"] < 0.2 * ms["wall"], ms
    ms = breakdown(lambda: time.sleep(0.02), 3, torch.device("cpu"))
    assert ms["outside kernels"] >= 19 and ms["matmul"] == 0, ms


def test_precision_rows_time_steps_that_train_in_their_precision():
    """The fp16 variants time a step that scales its loss (meshtrain's trainer LossScaler, the HF
    loop's GradScaler) and updates the weights: the loss is finite and falls, and the scale is still
    its start (no step was skipped for an overflow). The fp8 variant runs FP8 GEMMs: from the same
    weights its loss differs from bf16's by FP8's rounding."""
    import math

    import torch

    from bench.throughput import HFStep, MeshtrainStep, meshtrain_config
    from meshtrain.config import load_config

    args = model_args(load_config(overrides={"model.preset": "tiny"}))
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    fp16 = {
        "meshtrain": MeshtrainStep(meshtrain_config("tiny", "fp16", False, "auto", batch), batch),
        "hf": HFStep(args, "fp16", True, batch, torch.device("cpu")),
    }
    for name, step in fp16.items():
        losses = []
        for _ in range(3):
            step()
            losses.append(float(step.loss))
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], (name, losses)
        assert step.loss_scale() == 2.0**16, name
    first = {}
    for dtype in ("bf16", "fp8-tensorwise"):
        step = MeshtrainStep(meshtrain_config("tiny", dtype, False, "bf16", batch), batch)
        assert step.loss_scale() is None
        step()
        first[dtype] = float(step.loss)
    assert 0 < abs(first["fp8-tensorwise"] - first["bf16"]) < 0.01 * first["bf16"], first


def test_context_suite_steps_skips_and_table():
    """bench context: fewer steps at long lengths (the first untimed where there are several), the
    one-process peak extrapolated linearly to decide a skip, and skipped lengths named in the table."""
    from bench.context import estimate_peak, skipped_first, steps_for, table

    assert [steps_for(n, 5) for n in (1024, 4096, 8192, 16384, 32768)] == [5, 5, 3, 1, 1]
    assert [skipped_first(s) for s in (1, 3, 5)] == [0, 1, 2]
    assert estimate_peak(32768, {8192: 1000}) is None
    assert estimate_peak(32768, {4096: 1000, 8192: 2000, 16384: 4000}) == 8000
    row = {"seq_len": 8192, "document_masking": False, "steps": 3, "timed_from_step": 2, "rounds": 1}
    row |= {"single_tokens_per_s": 300.0, "cp2_tokens_per_s": 330.0, "speed_ratio": 1.1, "speed_ratio_runs": [1.1]}
    row |= {"single_peak_mib": 2400.0, "cp2_peak_mib": 1500.0, "memory_ratio": 0.625}
    text = table([row], ["32768: one process would need ~30.0 GiB, 20.0 free"], gpu=False)
    assert "| 8,192 | 2-3 | 300 | 330 | 1.10x | 2,400 | 1,500 | 0.62 |" in text
    assert "| 32768 | skipped: one process would need ~30.0 GiB, 20.0 free |" in text
