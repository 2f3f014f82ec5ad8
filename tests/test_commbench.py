"""`meshtrain bench comm`: real gloo collectives over 2 processes, nccl-tests' bus-bandwidth rules."""

import json

import pytest

from conftest import assert_user_error, run_cli
from meshtrain.commbench import BUS_FACTOR, sizes_between
from meshtrain.config import parse_size


def test_sizes():
    assert parse_size("1K") == 1024 and parse_size("64M") == 64 * 2**20 and parse_size("1GB") == 2**30
    assert sizes_between(1024, 16384) == [1024, 4096, 16384]
    assert BUS_FACTOR["all_reduce"](8) == 2 * 7 / 8 and BUS_FACTOR["all_gather"](4) == 3 / 4


@pytest.mark.multiproc
def test_comm_bench_over_two_processes(cli_env, tmp_path):
    out = tmp_path / "comm.json"
    result = run_cli(
        ["bench", "comm", "--nproc", "2", "--min-bytes", "4K", "--max-bytes", "1M", "--iters", "3", "--out", str(out)],
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == set(BUS_FACTOR) and {r["world_size"] for r in rows} == {2}
    assert {r["nodes"] for r in rows} == {1}  # `meshtrain plan --comm` reads a one-node file as intra-node
    assert sorted({r["bytes"] for r in rows}) == [4096, 16384, 65536, 262144, 1048576]
    for r in rows:
        assert r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * BUS_FACTOR[r["op"]](2))


def test_bad_comm_bench_options(cli_env, tmp_path):
    assert_user_error(run_cli(["bench", "comm", "--ops", "all_to_all"], cli_env), "all_to_all")
    assert_user_error(run_cli(["bench", "comm", "--min-bytes", "lots"], cli_env), "--min-bytes")
    # checked before the measurement (and its processes), not after it
    result = run_cli(["bench", "comm", "--nproc", "2", "--out", str(tmp_path)], cli_env)
    assert_user_error(result, f"--out {tmp_path} is a directory")
