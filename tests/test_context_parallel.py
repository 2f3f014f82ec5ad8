"""Context parallelism (parallel/context_parallel.py): the all-to-all attention against attention over
the whole sequence on one process, then whole training runs against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from meshtrain.parallel.context_parallel import UlyssesAttention


def _sdpa(q, k, v, mask=None):
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _full_and_grads(q, k, v, mask):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = _sdpa(q, k, v, mask)
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ulysses_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results = {}
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, masked in ((4, 2, False), (4, 1, False), (4, 2, True)):
        batch, seq, dim = 2, 16, 8
        q = torch.randn(batch, heads, seq, dim, generator=gen)
        k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
        mask = None
        if masked:  # two documents: tokens 0-5 and 6-15
            doc = (torch.arange(seq) >= 6).long()
            mask = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        want = _full_and_grads(q, k, v, mask)
        mine = slice(rank * seq // 2, (rank + 1) * seq // 2)
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        attend = UlyssesAttention(_sdpa, dist.group.WORLD, 2)
        got = attend(*local, mask) if masked else attend(*local)
        got.square().sum().backward()
        results[(heads, kv_heads, masked)] = [
            (got.detach() - want[0][:, :, mine]).abs().max().item(),
            *[(g.grad - w[:, :, mine]).abs().max().item() for g, w in zip(local, want[1:])],
        ]
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.multiproc
def test_all_to_all_attention_equals_attention_over_the_whole_sequence(tmp_path):
    """Two ranks, each with half of every sequence: outputs and the gradients of q, k and v equal
    full-sequence attention's, with grouped key/value heads, fewer key/value heads than ranks, and a
    document mask."""
    out = tmp_path / "out"
    mp.spawn(_ulysses_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    for rank in range(2):
        for case, errors in torch.load(f"{out}.{rank}").items():
            assert max(errors) < 1e-5, (rank, case, errors)
