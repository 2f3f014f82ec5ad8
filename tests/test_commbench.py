"""`meshtrain bench comm`: real gloo collectives over 2 processes, nccl-tests' bus-bandwidth rules."""

import json

import pytest

from conftest import assert_user_error, run_cli
from meshtrain.commbench import BUS_FACTOR, format_table, iterations, sizes_between
from meshtrain.config import parse_size


def test_sizes():
    assert parse_size("1K") == 1024 and parse_size("64M") == 64 * 2**20 and parse_size("1GB") == 2**30
    assert sizes_between(1024, 16384) == [1024, 4096, 16384]
    assert sizes_between(1024, 20000) == [1024, 4096, 16384, 20000]  # --max-bytes is measured, always last
    assert sizes_between(4096, 4096) == [4096] and sizes_between(1024, 2048) == [1024, 2048]
    assert BUS_FACTOR["all_reduce"](8) == 2 * 7 / 8 and BUS_FACTOR["all_gather"](4) == 3 / 4


def test_large_messages_run_fewer_calls_and_the_table_says_so():
    """--iters is capped at 64 MiB of messages a size (at least one call): each row records the calls it
    timed, and the table shows them under a header that names the cap."""
    assert [iterations(20, size) for size in (2**10, 2**22, 2**24, 2**26, 2**30)] == [20, 16, 4, 1, 1]
    assert iterations(3, 2**10) == 3
    row = {
        "op": "all_reduce",
        "bytes": 2**30,
        "iters": 1,
        "time_us": 1e5,
        "algbw_GBps": 10.0,
        "busbw_GBps": 15.0,
        "world_size": 2,
    }
    header, line = format_table([row]).splitlines()
    assert "iters" in header.split() and "at most 64 MiB / size" in header
    assert line.split()[:3] == ["all_reduce", "1,073,741,824", "1"]


@pytest.mark.multiproc
def test_comm_bench_over_two_processes(cli_env, tmp_path):
    out = tmp_path / "comm.json"
    result = run_cli(
        [
            "bench",
            "comm",
            "--nproc",
            "2",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "1000K",
            "--iters",
            "3",
            "--out",
            str(out),
        ],
        cli_env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["op"] for r in rows} == set(BUS_FACTOR) and {r["world_size"] for r in rows} == {2}
    assert {r["nodes"] for r in rows} == {1}  # `meshtrain plan --comm` reads a one-node file as intra-node
    assert sorted({r["bytes"] for r in rows}) == [4096, 16384, 65536, 262144, 1024000]  # and --max-bytes
    assert {r["iters"] for r in rows} == {3}
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
