"""`meshtrain bench comm`: collective bandwidth, as nccl-tests reports it, under any launcher.

algbw = bytes / time. busbw normalises to the bandwidth each link must carry, so numbers compare
across world sizes: all-reduce x 2(n-1)/n, all-gather and reduce-scatter x (n-1)/n, broadcast x 1.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


# Large messages run fewer timed calls: at most this many bytes of messages a size (at least one
# call), so that a sweep up to 1 GiB takes seconds, not minutes; --iters' help and the table say so.
ITER_BYTES = 64 * 2**20


def sizes_between(low: int, high: int) -> list[int]:
    """`low`, x4 each step, and `high` last (measured even where it is not low x 4^k)."""
    sizes, size = [], low
    while size < high:
        sizes.append(size)
        size *= 4
    return [*sizes, high]


def iterations(iters: int, size: int) -> int:
    """Timed calls for a message of `size` bytes: `iters`, capped at ITER_BYTES / size (at least 1)."""
    return max(1, min(iters, ITER_BYTES // size))


def _run(op: str, buf: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, buf)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, buf)
    else:
        dist.broadcast(buf, src=0)


def bench_collective(op: str, nbytes: int, device: torch.device, iters: int, warmup: int = 2) -> dict:
    """One message size: mean time per call over `iters`, with algbw and busbw in GB/s. `nbytes`
    is the per-rank message (nccl-tests' "size": the full buffer for all-reduce/broadcast, the
    gathered output for all-gather, the input for reduce-scatter)."""
    world = dist.get_world_size()
    numel = max(world, nbytes // 4 // world * world)
    if op == "all_gather":
        buf, out = torch.ones(numel // world, device=device), torch.empty(numel, device=device)
    elif op == "reduce_scatter":
        buf, out = torch.ones(numel, device=device), torch.empty(numel // world, device=device)
    else:
        buf = out = torch.ones(numel, device=device)
    for _ in range(warmup):
        _run(op, buf, out)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        _run(op, buf, out)
    _sync(device)
    elapsed = (time.perf_counter() - start) / iters
    size = numel * 4
    algbw = size / elapsed / 1e9
    return {
        "op": op,
        "bytes": size,
        "iters": iters,
        "time_us": elapsed * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * BUS_FACTOR[op](world),
        "world_size": world,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_comm_bench(ops: list[str], low: int, high: int, iters: int) -> list[dict]:
    """Every rank runs this; rank 0 gets the rows (others an empty list)."""
    from meshtrain.launch import detect
    from meshtrain.launch.distributed import init_distributed

    env = detect()
    device = init_distributed(env)
    if not dist.is_initialized():  # one process: a group of one still measures the call overhead
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    rows = []
    for op in ops:
        for size in sizes_between(low, high):
            rows.append(
                {
                    **bench_collective(op, size, device, iterations(iters, size)),
                    "nodes": max(1, env.world_size // max(1, env.local_world_size)),
                }
            )
    return rows if dist.get_rank() == 0 else []


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'op':>15} {'size':>12} {'iters':>6} {'time (us)':>12} {'algbw GB/s':>11} {'busbw GB/s':>11}"
        f"   (world {rows[0]['world_size']}; iters: --iters, at most {ITER_BYTES // 2**20} MiB / size)"
    ]
    for r in rows:
        lines.append(
            f"{r['op']:>15} {r['bytes']:>12,} {r['iters']:>6} {r['time_us']:>12.1f} {r['algbw_GBps']:>11.3f} "
            f"{r['busbw_GBps']:>11.3f}"
        )
    return "\n".join(lines)
