import json

import torch

from meshtrain.metrics import cpu_peak_key, cpu_peak_tflops


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
