"""`train_step` folds clipping and non-finite skipping into the fused AdamW kernel (its grad_scale
and found_inf): the result must equal the textbook loop (clip_grad_norm_, then a plain AdamW)."""

import torch
import torch.nn.functional as F

from meshtrain.config import load_config
from meshtrain.job.model import model_args
from meshtrain.model import Llama
from meshtrain.train.build import build as build_state

MODEL = [
    "--training.dtype",
    "fp32",
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--model.ffn_dim",
    "128",
    "--model.vocab_size",
    "256",
    "--model.max_seq_len",
    "32",
    "--training.seq_len",
    "16",
    "--training.global_batch_size",
    "4",
    "--training.micro_batch_size",
    "2",
]


def build(clip: float):
    cfg = load_config(
        None, [*MODEL, "--training.grad_clip", str(clip), "--training.lr", "1e-2", "--training.warmup_steps", "0"]
    )  # the LR schedule is not under test
    state = build_state(cfg, with_data=False)
    return cfg, state.model.parts[0], state.step


def batches(n: int):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 17), generator=gen) for _ in range(n)]


def test_clipping_in_the_optimizer_equals_clip_grad_norm_then_adamw():
    cfg, model, step = build(clip=0.05)  # small enough that every step clips
    ref = Llama(model_args(cfg))
    ref.load_state_dict(model.state_dict())
    t = cfg.training
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=1e-8,
        foreach=False,
    )
    for tokens in batches(3):
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss, norm, skipped = step(x, y)
        ref_opt.zero_grad()
        ref_loss = (
            F.cross_entropy(ref(x[:2]).flatten(0, 1), y[:2].flatten()) / 2
            + F.cross_entropy(ref(x[2:]).flatten(0, 1), y[2:].flatten()) / 2
        )
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        assert ref_norm > 0.05 and skipped.item() == 0
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_non_finite_gradients_skip_the_update_on_the_device():
    _, model, step = build(clip=1.0)
    (x0, x1) = batches(2)
    step(x0[:, :-1], x0[:, 1:])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = model.layers["0"].attention.wq.weight.register_hook(lambda g: g * float("nan"))
    _, norm, skipped = step(x1[:, :-1], x1[:, 1:])
    handle.remove()
    assert not torch.isfinite(norm) and skipped.item() == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    _, norm, skipped = step(x1[:, :-1], x1[:, 1:])  # and training goes on
    assert torch.isfinite(norm) and skipped.item() == 0.0
    assert not torch.equal(model.layers["0"].attention.wq.weight, before["layers.0.attention.wq.weight"])


def test_one_process_compiles_the_whole_model_into_one_graph():
    """training.compile on one process: a step enters compiled code twice (model, loss), not once per
    block: the host launches a few graphs instead of walking every module."""
    from torch.profiler import profile

    cfg = load_config(None, [*MODEL, "--training.compile", "true"])
    step = build_state(cfg, with_data=False).step
    (tokens,) = batches(1)
    step(tokens[:, :-1], tokens[:, 1:])  # compiles
    with profile() as prof:
        step(tokens[:, :-1], tokens[:, 1:])
    regions = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    assert len(regions) == 2 * 2, [e.name for e in regions]  # 2 micro-batches x (model, loss)


def test_a_mask_built_before_the_whole_model_graph_keeps_one_graph_and_the_eager_loss(monkeypatch):
    """On CUDA FlexAttention's block mask is built eagerly in `Llama.forward` and handed to the
    compiled trunk, so document masking does not split the model into per-block graphs (on an H200
    that had made the compiled step host-bound at 0.79x HF's). Built the same way here (the forward
    told FlexAttention is available; the mask dense): still two graphs a micro-batch (model, loss),
    and the loss and gradient norm of the eager step on the same packed batch."""
    from torch.profiler import profile

    import meshtrain.model.llama as llama
    import meshtrain.model.masks as masks

    monkeypatch.setattr(llama, "flex_available", lambda device: True)
    monkeypatch.setattr(masks, "KERNEL", "dense")
    built = []
    monkeypatch.setattr(
        llama, "DocumentMask", lambda positions: built.append(positions) or masks.DocumentMask(positions)
    )
    (tokens,) = batches(1)
    positions = torch.cat([torch.arange(5), torch.arange(11)]).expand(4, 16)  # two documents a row
    results = {}
    for compiled in ("false", "true"):
        step = build_state(load_config(None, [*MODEL, "--training.compile", compiled]), with_data=False).step
        step(tokens[:, :-1], tokens[:, 1:], positions=positions)  # compiles; both runs take this step
        built.clear()
        with profile() as prof:
            results[compiled] = step(tokens[:, :-1], tokens[:, 1:], positions=positions)
        assert len(built) == 2  # one mask a micro-batch, built outside any graph
    regions = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    assert len(regions) == 2 * 2, [e.name for e in regions]
    (loss, norm, _), (ref_loss, ref_norm, _) = results["true"], results["false"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=0)


def test_gradients_for_cuda_graphs_accumulate_in_buffers_of_their_own():
    """With training.cuda_graphs and several micro-batches the gradients are zeroed in place, not set
    to None: a CUDA graph's backward hands over gradients in its own memory pool, which the next
    micro-batch's replay writes over. The buffers outlive the steps, and the steps equal the plain
    ones bit for bit (the graphs themselves need a GPU: tests/test_gpu.py)."""
    import dataclasses

    runs = {}
    for stable in (False, True):
        cfg = load_config(None, MODEL)
        state = build_state(cfg, with_data=False)
        training = dataclasses.replace(state.cfg.training, cuda_graphs=stable)
        state.job = dataclasses.replace(state.job, cfg=dataclasses.replace(state.cfg, training=training))
        model = state.model.parts[0]
        buffers, losses = [], []
        for tokens in batches(3):
            losses.append(state.step(tokens[:, :-1], tokens[:, 1:])[0])
            buffers.append({name: p.grad.data_ptr() for name, p in model.named_parameters()})
        runs[stable] = losses, model.state_dict(), buffers
    (plain_losses, plain_weights, _), (losses, weights, buffers) = runs[False], runs[True]
    assert buffers[0] == buffers[1] == buffers[2]
    assert [float(x) for x in losses] == [float(x) for x in plain_losses]
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name


def test_cuda_graphs_are_refused_where_they_cannot_run():
    """Without compile (nothing to replay), on several ranks (no whole-model graph) and off CUDA."""
    import pytest

    from meshtrain.errors import ConfigError
    from meshtrain.job import resolve
    from meshtrain.job.device import check_device

    with pytest.raises(ConfigError, match="training.compile is false"):
        load_config(None, [*MODEL, "--training.cuda_graphs", "true"])
    cfg = load_config(None, [*MODEL, "--training.compile", "true", "--training.cuda_graphs", "true"])
    resolve(cfg, 1)
    with pytest.raises(ConfigError, match="this layout has 2 ranks"):
        resolve(cfg, 2)
    check_device(cfg, torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="this job trains on cpu"):
        check_device(cfg, torch.device("cpu"))
