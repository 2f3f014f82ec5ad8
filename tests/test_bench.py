"""The benchmark suite's own plumbing, on a small case: `python -m bench memory` through the real
CLI, whose per-rank bytes must follow the ZeRO paper's ratios, then the plots from its results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiproc
def test_memory_suite_measures_the_zero_ratios_and_plots(corpus, tmp_path):
    env = {**os.environ, "MESHTRAIN_BENCH_RESULTS": str(tmp_path)}
    for suite in (["memory", "--memory-preset", "tiny", "--worlds", "2"], ["plots"]):
        result = subprocess.run([sys.executable, "-m", "bench", *suite, "--data-path", str(corpus)], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert [(r["world"], r["zero"]) for r in rows] == [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)]
    for r in rows:
        assert r["ratio_to_ddp"] == pytest.approx(1.0 if r["zero"] == 0 else 0.75 if r["zero"] == 1 else 0.5, rel=0.05)
        assert r["peak_rss"] > r["model_states"]
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    assert "| 2 | ZeRO-3 |" in (tmp_path / "memory.md").read_text()
