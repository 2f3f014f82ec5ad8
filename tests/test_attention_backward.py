"""Attention's backward recomputed from matmuls (model/recompute_attention.py) and the probe that
picks it (job/attention_backward.py)."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import pretend_other_load
from meshtrain.config import load_config
from meshtrain.errors import ConfigError
from meshtrain.job import arithmetic, attention_backward
from meshtrain.job.device import check_device
from meshtrain.job.layout import layout_of
from meshtrain.job.model import model_args
from meshtrain.job.probe_timing import own_code
from meshtrain.model import Llama
from meshtrain.model.llama import ModelArgs
from meshtrain.model.masks import dense_mask, document_ids
from meshtrain.model.recompute_attention import MAX_SCORES, applies, recomputed_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def inputs(dtype, batch=2, heads=4, kv_heads=2, seq=48, head_dim=16):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, h, seq, head_dim, generator=gen, dtype=dtype, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    positions = torch.cat([torch.arange(13), torch.arange(seq - 13)]).expand(batch, seq).clone()
    positions[1] = torch.arange(seq)  # one row of two documents, one of a single document
    return q, k, v, torch.randn(q.shape, generator=gen, dtype=dtype), dense_mask(document_ids(positions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_recomputed_gradients_are_the_kernel_s(dtype, masked):
    q, k, v, grad, allowed = inputs(dtype)
    allowed = allowed if masked else None
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, attn_mask=allowed, is_causal=not masked, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, exact, grad.double())
    kernel = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=not masked, enable_gqa=True)
    kernel_grads = torch.autograd.grad(kernel, (q, k, v), grad)
    out = recomputed_attention(q, k, v, allowed)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    assert torch.equal(out, kernel)  # the forward is the kernel's
    for ours, theirs, exact_grad in zip(grads, kernel_grads, ref_grads):
        if dtype == torch.float32:
            torch.testing.assert_close(ours.double(), exact_grad, atol=2e-6, rtol=1e-5)
        else:  # bf16: within a few roundings of the largest gradient, as the kernel is
            error, kernel_error = ((g.double() - exact_grad).abs().max() for g in (ours, theirs))
            bound = 4 * 2**-8 * exact_grad.abs().max()
            assert kernel_error <= bound and error <= bound, (error, kernel_error, bound)


def test_compiled_recompute_is_eager_s():
    q, k, v, grad, allowed = inputs(torch.bfloat16)
    compiled = torch.compile(recomputed_attention, dynamic=False)
    for mask in (None, allowed):
        eager_grads = torch.autograd.grad(recomputed_attention(q, k, v, mask), (q, k, v), grad)
        compiled_grads = torch.autograd.grad(compiled(q, k, v, mask), (q, k, v), grad)
        for a, b in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_it_applies_only_to_gradients_of_plain_cpu_tensors_within_its_memory_bound():
    q = torch.zeros(2, 4, 64, 8, requires_grad=True)
    assert applies(q) and not applies(q.detach())
    assert not applies(torch.zeros(1, 1, 1, 1, device="meta", requires_grad=True))
    seq = int((MAX_SCORES // 8) ** 0.5) + 1  # batch 2 x 4 heads: just over the bound
    assert not applies(torch.zeros(2, 4, seq, 1, requires_grad=True))


@pytest.mark.parametrize("documents", [False, True])
def test_a_model_with_recomputed_backward_gets_the_kernel_s_gradients(documents):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    models = [Llama(args), Llama(args)]
    models[0].init_weights(seed=0)
    models[1].load_state_dict(models[0].state_dict())
    for block in models[1].layers.values():
        block.attention.recompute_backward = True
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(20), torch.arange(44)]).expand(2, 64) if documents else None
    grads = []
    for model in models:
        model(tokens, positions=positions).float().square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


def config(**training):
    overrides = {"model.preset": "tiny", "training.seq_len": 32, "training.micro_batch_size": 1}
    overrides |= {"training.global_batch_size": 1}
    return load_config(overrides=overrides | {f"training.{k}": v for k, v in training.items()})


def test_auto_is_measured_compiled_on_a_cpu_once_and_the_kernel_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    layout = layout_of(config(), 1)
    for cfg, device, kind, how in [
        (config(attention_backward="recompute"), CPU, "recompute", "given"),
        (config(attention_backward="flash", compile=True), CPU, "flash", "given"),
        (config(compile=True, dtype="bf16"), CUDA, "flash", "device"),
        (config(dtype="bf16"), CPU, "flash", "eager"),  # recomputing pays only compiled
        (config(compile=True, seq_len=64, micro_batch_size=MAX_SCORES // (2 * 64 * 64) + 1), CPU, "flash", "too large"),
    ]:
        resolved, choice = attention_backward.resolve(cfg, args, layout, device)
        assert (resolved.training.attention_backward, choice.kind, choice.how) == (kind, kind, how)
    cfg = config(compile=True, dtype="bf16", bf16_compute="bf16")
    resolved, choice = attention_backward.resolve(cfg, args, layout, CPU)
    assert choice.how in ("measured", "busy") and set(choice.ms) == {"flash", "recompute"}
    faster = choice.ms["recompute"] * (1 + attention_backward.MARGIN) < choice.ms["flash"]
    assert choice.kind == ("recompute" if faster else "flash") == resolved.training.attention_backward
    assert "bfloat16" in choice.key and "heads 4/2 of 16" in choice.key
    cache = tmp_path / "meshtrain" / "arithmetic.json"
    if choice.how == "measured":  # a quiet machine's record is read at the next start
        assert attention_backward.resolve(cfg, args, layout, CPU)[1].how == "cached"
    record = json.loads(cache.read_text())[choice.key]
    record["ms"] = {"flash": 10.0, "recompute": 9.7}  # ahead by less than the margin: the kernel
    cache.write_text(json.dumps({choice.key: record | {"busy": 0.0}}))
    assert attention_backward.resolve(cfg, args, layout, CPU)[1].kind == "flash"
    cache.write_text(json.dumps({choice.key: {"ms": {"flash": 10.0, "recompute": 9.0}, "busy": 0.0, "x": 1}}))
    assert attention_backward.resolve(cfg, args, layout, CPU)[1].how in ("measured", "busy")  # another format


def test_a_compiled_run_s_arithmetic_probe_times_its_contenders_compiled(monkeypatch, tmp_path):
    # measured on a Xeon with AMX (tiny, 1 process): the eager probe put bf16 GEMMs + fp32 attention
    # ahead, while compiled with the recomputed bf16 backward all-bf16 trained 7% faster
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probed = []
    blocks = {"bf16": 10.0, "fp32": 30.0, "bf16/bf16-gemm": 9.0, "bf16/bf16-attention": 31.0, "bf16/fp32": 29.0}
    compiled_blocks = blocks | {"bf16": 8.0}
    heads = {"bf16": 5.0, "fp32": 15.0, "bf16/fp32": 16.0}

    def probe(args, sequences, length, names, compiled=None):
        probed.append(compiled)
        return {n: (blocks if compiled is None else compiled_blocks)[n] for n in names}, heads

    monkeypatch.setattr(arithmetic, "probe", probe)
    monkeypatch.setattr(arithmetic, "bf16_gemm_slowdown", lambda args: 1.0)  # every candidate probed
    pretend_other_load(monkeypatch, 0.0)  # a fake probe takes no time: the machine's load in it is noise
    kinds = {torch.bfloat16: "recompute", torch.float32: "flash"}  # the bf16 backward recomputed, fp32's kept
    monkeypatch.setattr(
        attention_backward, "cpu_choice", lambda shape, dtype: attention_backward.AttentionBackward(kinds[dtype], "x")
    )
    args = model_args(config())
    layout = layout_of(config(), 1)
    eager = arithmetic.resolve(config(dtype="auto"), args, CPU, layout)[1]
    assert eager.name == "bf16/bf16-gemm" and probed == [None]  # 59 ms a micro-batch against 65
    compiled = arithmetic.resolve(config(dtype="auto", compile=True), args, CPU, layout)[1]
    assert compiled.name == "bf16" and compiled.how == "measured" and compiled.key != eager.key
    assert probed[1] == {  # each candidate with the backward picked for its attention arithmetic
        "bf16": True,
        "fp32": False,
        "bf16/bf16-gemm": False,
        "bf16/bf16-attention": True,
        "bf16/fp32": False,
    }
    assert compiled.step_ms["bf16"] == pytest.approx(args.n_layers * 8.0 + 5.0)
    assert arithmetic.resolve(config(dtype="auto", compile=True), args, CPU, layout)[1].how == "cached"


def test_the_compiled_probe_compiles_each_contender_under_a_code_object_of_its_own():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    names = ["bf16", "bf16/bf16-gemm"]
    graphs = counters["stats"]["unique_graphs"]
    # shapes no other test probes: a contender compiled before at the same shapes would not count again
    blocks, heads = arithmetic.probe(args, 3, 40, names, compiled={"bf16": True, "bf16/bf16-gemm": False})
    assert counters["stats"]["unique_graphs"] >= graphs + len(names)  # each contender's block, compiled
    assert set(blocks) == set(names) and set(heads) == {"bf16"} and min(blocks.values()) > 0

    # dynamo keeps at most recompile_limit (8) graphs per code object and runs the rest eagerly: the
    # probes' functions, one per candidate and shape, each get a code object of their own
    def shifted(n):
        return lambda x: x + n

    functions = [own_code(shifted(n)) for n in range(torch._dynamo.config.recompile_limit + 2)]
    graphs = counters["stats"]["unique_graphs"]
    for fn in functions:  # (dynamo's cache is what is checked: no inductor code generated for it)
        torch.compile(fn, backend="eager", dynamic=False)(torch.zeros(3))
    assert counters["stats"]["unique_graphs"] == graphs + len(functions)
    assert all(len(_debug_get_cache_entry_list(fn.__code__)) == 1 for fn in functions)


def test_recompute_is_refused_on_a_gpu_and_beyond_its_memory_bound():
    with pytest.raises(ConfigError, match="attention_backward = 'recompute'.*cuda"):
        check_device(config(attention_backward="recompute"), CUDA)
    check_device(config(attention_backward="recompute"), CPU)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    too_large = config(attention_backward="recompute", seq_len=64, micro_batch_size=MAX_SCORES // (4 * 64 * 64) + 1)
    with pytest.raises(ConfigError, match="over its bound"):
        attention_backward.resolve(too_large, args, layout_of(config(), 1), CPU)


# --- a DPO micro-batch holds two rows a sample (train/step.py's rows_per_sample) ---


def test_a_dpo_micro_batch_counts_as_two_rows_a_pair_in_the_recompute_bound_and_the_probes(monkeypatch):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    layout = layout_of(config(), 1)
    micro = MAX_SCORES // (2 * 4 * 64 * 64) + 1  # within the bound as plain rows, over it as pairs

    def rows(n):  # a rank's q at run time: n rows of 4 heads x 64 tokens (expanded: no memory)
        return torch.zeros(1, 4, 64, 16, requires_grad=True).expand(n, -1, -1, -1)

    lm = config(attention_backward="recompute", seq_len=64, micro_batch_size=micro)
    assert attention_backward.resolve(lm, args, layout, CPU)[1].kind == "recompute" and applies(rows(micro))
    dpo = config(attention_backward="recompute", seq_len=64, micro_batch_size=micro, objective="dpo")
    assert not applies(rows(2 * micro))  # what the step would find: the kernel, not what was configured
    with pytest.raises(ConfigError, match=rf"{micro} x 2 \(DPO's pairs\) x heads x 64\^2 .* over its bound"):
        attention_backward.resolve(dpo, args, layout, CPU)
    auto = config(compile=True, seq_len=64, micro_batch_size=micro, objective="dpo")
    assert attention_backward.resolve(auto, args, layout, CPU)[1].how == "too large"

    shapes, micro_batches = [], []  # the probes time the step's rows: 2 x 3 for 3 pairs
    monkeypatch.setattr(
        attention_backward,
        "cpu_choice",
        lambda shape, dtype: shapes.append(shape) or attention_backward.AttentionBackward("flash", "x"),
    )
    monkeypatch.setattr(
        arithmetic,
        "cpu_choice",
        lambda args, micro_batch, *_: micro_batches.append(micro_batch) or arithmetic.Choice("bf16", "bf16", "x"),
    )
    small = config(compile=True, dtype="auto", micro_batch_size=3, objective="dpo")
    attention_backward.resolve(arithmetic.resolve(small, args, CPU, layout)[0], args, layout, CPU)
    assert micro_batches == [6] and shapes == [(6, 4, 2, 32, 16)]
