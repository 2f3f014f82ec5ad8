"""Context parallelism (parallel/context_parallel.py): the all-to-all attention against attention over
the whole sequence on one process, then whole training runs against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import assert_same_run, assert_user_error, read_metrics, run_cli, train_args
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
    results["model"] = _model_with_documents(rank)
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _model_with_documents(rank: int) -> list[float]:
    """The model on two ranks with packed documents (per-document rotary positions and masks):
    this rank's slice of the logits and every weight's gradient against one process's."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshtrain.model.llama import Llama, ModelArgs
    from meshtrain.parallel.context_parallel import apply_cp

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    starts = [[0, 5, 17], [0, 11]]  # row 0: three documents (one across the ranks' boundary), row 1: two
    positions = torch.stack(
        [torch.arange(24) - torch.tensor([max(s for s in row if s <= i) for i in range(24)]) for row in starts]
    )
    grads = {}
    for split in (False, True):
        model = Llama(args)
        model.init_weights(seed=0)
        if split:
            apply_cp(model, init_device_mesh("cpu", (2,)))
        logits = model(tokens, positions)
        logits.square().mean().backward()
        grads[split] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (whole, want), (mine, got) = grads[False], grads[True]
    # each rank's loss is of its half; the two ranks' gradients sum to the whole sequence's
    for name in got:
        dist.all_reduce(got[name])
    errors = [(mine - whole[:, rank * 12 : (rank + 1) * 12]).abs().max().item()]
    return errors + [((got[n] / 2 - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-12)).item() for n in want]


@pytest.mark.multiproc
def test_all_to_all_attention_equals_attention_over_the_whole_sequence(tmp_path):
    """Two ranks, each with half of every sequence: outputs and the gradients of q, k and v equal
    full-sequence attention's, with grouped key/value heads, fewer key/value heads than ranks, and a
    document mask; and the model with packed documents (a document across the ranks' boundary)
    gives each rank its slice of one process's logits, and the same gradients."""
    out = tmp_path / "out"
    mp.spawn(_ulysses_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    for rank in range(2):
        for case, errors in torch.load(f"{out}.{rank}").items():
            if case == "model":
                assert max(errors) < 1e-4, (rank, errors)
                continue
            assert max(errors) < 1e-5, (rank, case, errors)


LAYOUTS = {
    "cp2": (("--parallel.cp", "2"), 2),
    "cp2-zero3": (("--parallel.cp", "2", "--parallel.zero", "3"), 2),
    "cp2-tp2-zero3": (("--parallel.cp", "2", "--parallel.tp", "2", "--parallel.zero", "3"), 4),
    "cp2-pp2": (("--parallel.cp", "2", "--parallel.pp", "2"), 4),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", LAYOUTS)
def test_context_parallel_trains_as_one_process_does(reference_run, name):
    """Each sequence split over two ranks, alone (gradients averaged over the two), with ZeRO-3
    sharding over them, under TP 2 (one key/value head per TP rank, copied for the all-to-all) and
    with two pipeline stages: every step's loss and gradient norm, the validation loss and the final
    weights equal one process's (1e-4)."""
    layout, nproc = LAYOUTS[name]
    assert_same_run(reference_run(*layout, nproc=nproc), reference_run())


@pytest.mark.multiproc
def test_a_16k_token_sequence_trains_on_two_processes(corpus, cli_env, tmp_path):
    """16,384 tokens a sequence, each rank holding 8,192: the loss falls, and each rank's saved
    activations are about half of what one process holds for the whole sequence (memory.json)."""
    seq = "16384"
    extra = ["--training.seq_len", seq, "--model.max_seq_len", seq, "--training.global_batch_size", "1"]
    extra += ["--training.micro_batch_size", "1", "--training.steps", "4", "--training.lr", "3e-3"]
    extra += ["--training.eval_every", "0", "--training.eval_batches", "1", "--parallel.cp", "2", "--nproc", "2"]
    run_dir = tmp_path / "long"
    result = run_cli(train_args(corpus, run_dir, *extra), cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (("--parallel.cp", "2", "--training.seq_len", "33", "--model.max_seq_len", "64"), "divisible by parallel.cp"),
        (("--parallel.cp", "4", "--parallel.tp", "2", "--parallel.zero", "3", "--nproc", "8"), "query heads"),
        (("--parallel.cp", "3", "--training.seq_len", "48", "--nproc", "3"), "query heads must be divisible by cp"),
        (("--parallel.cp", "2", "--nproc", "3"), "not divisible by parallel.tp"),
    ],
    ids=["seq", "heads-after-tp", "heads", "world"],
)
def test_context_parallel_refusals(corpus, cli_env, tmp_path, extra, fragment):
    """A CP degree that does not fit the sequence, the heads or the world: one line, before any
    process starts."""
    args = train_args(corpus, tmp_path / "run", *extra)
    if "--nproc" not in extra:
        args += ["--nproc", "2"]
    assert_user_error(run_cli(args, cli_env, timeout=120), fragment)


@pytest.mark.multiproc
def test_a_context_parallel_checkpoint_resumes_on_one_process(corpus, cli_env, tmp_path, reference_run):
    """Stopped at step 5 on CP 2 x ZeRO-3 (shards over the two sequence slices), resumed on one
    process: the run ends where the uninterrupted one-process run does."""
    run_dir = tmp_path / "resharded"
    stop = ["--checkpoint.every", "5", "--training.stop_at_step", "5"]
    first = run_cli(
        train_args(corpus, run_dir, *stop, "--parallel.cp", "2", "--parallel.zero", "3", "--nproc", "2"), cli_env
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(train_args(corpus, run_dir), cli_env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    assert_same_run(run_dir, reference_run())
