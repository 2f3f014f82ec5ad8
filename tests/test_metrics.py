import json

import torch

from meshtrain.hardware import cpu_peak_key, cpu_peak_tflops


def test_cpu_peak_keeps_the_best_probe(tmp_path, monkeypatch):
    """A low cached probe (taken on a busy machine) is replaced; a higher one is kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = cpu_peak_key(torch.float32)
    cache = tmp_path / "meshtrain" / "cpu_peak.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({key: 1e-9}))
    measured = cpu_peak_tflops(torch.float32)
    assert measured > 1e-9 and json.loads(cache.read_text())[key] == measured
    cache.write_text(json.dumps({key: 1e6}))
    assert cpu_peak_tflops(torch.float32) == 1e6


def test_ranks_probing_at_once_keep_every_record(tmp_path, monkeypatch):
    """Every rank of a run writes the probe cache at the same moment: each record survives."""
    import multiprocessing

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    keys = [f"probe-{i}" for i in range(8)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_record, keys)
    assert sorted(json.loads((tmp_path / "meshtrain" / "cpu_peak.json").read_text())) == keys


def _record(key: str) -> None:
    import time

    from meshtrain.hardware import cached_measurement

    cached_measurement(key, lambda: time.sleep(0.2) or 1.0, keep_max=False)
