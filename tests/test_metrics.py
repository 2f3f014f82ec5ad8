import json

import torch

from meshtrain.hardware import cpu_peak_key, cpu_peak_tflops


def test_cpu_peak_keeps_the_best_probe_until_quiet_probes_settle_it(tmp_path, monkeypatch):
    """A low cached probe (taken on a busy machine) is replaced and a higher one kept; after
    SETTLED_PROBES probes on a quiet machine the peak is read, not measured; a busy probe does not
    count toward them; a record of another format is measured again."""
    from conftest import pretend_other_load
    from meshtrain import hardware

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = cpu_peak_key(torch.float32)
    cache = tmp_path / "meshtrain" / "cpu_peak.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({key: {"best": 1e-9, "quiet_probes": 0}}))
    pretend_other_load(monkeypatch, 0.0)
    measured = cpu_peak_tflops(torch.float32)
    assert measured > 1e-9 and json.loads(cache.read_text())[key] == {"best": measured, "quiet_probes": 1}
    cache.write_text(json.dumps({key: {"best": 1e6, "quiet_probes": 0}}))
    assert cpu_peak_tflops(torch.float32) == 1e6
    assert json.loads(cache.read_text())[key] == {"best": 1e6, "quiet_probes": 1}

    probes = []
    monkeypatch.setattr(hardware, "measure_cpu_peak_tflops", lambda dtype: probes.append(dtype) or 2.0)
    cache.write_text(json.dumps({key: 1.0}))  # an earlier version's bare number: measured again
    pretend_other_load(monkeypatch, 0.9)
    assert [cpu_peak_tflops(torch.float32) for _ in range(2)] == [2.0, 2.0]
    assert json.loads(cache.read_text())[key] == {"best": 2.0, "quiet_probes": 0}  # busy: not settled
    pretend_other_load(monkeypatch, 0.0)
    for _ in range(hardware.SETTLED_PROBES + 2):
        cpu_peak_tflops(torch.float32)
    assert len(probes) == 2 + hardware.SETTLED_PROBES  # then read
    assert json.loads(cache.read_text())[key] == {"best": 2.0, "quiet_probes": hardware.SETTLED_PROBES}


def test_cpu_peak_probe_keeps_the_fastest_size_within_its_budget(monkeypatch):
    """The peak is the best rate over the square sizes (no one size is fastest everywhere), and a
    size whose matmul would take over the budget (8x the last size's time) is never run."""
    import time

    from meshtrain import hardware

    rates = {256: 0.01, 512: 0.03, 1024: 0.02, 2048: 0.05}  # TFLOP/s: 512 beats 1024
    sizes = []

    def matmul(a, b):  # takes the time a matmul of a's size takes at that rate
        sizes.append(len(a))
        time.sleep(2 * len(a) ** 3 / rates[len(a)] / 1e12)

    monkeypatch.setattr(hardware.torch, "matmul", matmul)
    peak = hardware.measure_cpu_peak_tflops(torch.float32, budget_s=0.15)
    assert 0.02 < peak <= 0.03  # 512's rate (sleep only ever oversleeps), not 1024's
    assert sorted(set(sizes)) == [256, 512, 1024]  # 1024 took 107 ms: 2048 would take ~0.9 s


def test_a_window_faster_than_the_measured_peak_raises_it(tmp_path, monkeypatch):
    """A CPU peak that read low (a probe in a slow second of a shared VM) never shows MFU above 100%:
    a window that went faster raises the record (its quiet probes kept) for this and later runs; a
    peak given by training.peak_tflops is the user's and stays."""
    from meshtrain.hardware import mfu_peak_floor
    from meshtrain.metrics import Throughput

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = cpu_peak_key(torch.float32)
    cache = tmp_path / "meshtrain" / "cpu_peak.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({key: {"best": 1e-6, "quiet_probes": 3}}))  # settled, and low
    cpu = torch.device("cpu")
    meter = Throughput(1e9, 1e-6, 1, mfu_peak_floor(cpu, "fp32"))
    meter.add(1000)
    report = meter.report()
    assert report["tflops"] > 1e-6 and report["mfu"] == 1.0
    assert json.loads(cache.read_text())[key] == {"best": report["tflops"], "quiet_probes": 3}
    assert cpu_peak_tflops(torch.float32) == report["tflops"]
    assert mfu_peak_floor(cpu, "fp32", override=50.0) is None
    assert mfu_peak_floor(torch.device("cuda"), "bf16") is None


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
