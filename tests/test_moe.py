"""The mixture-of-experts layer (model/moe.py) against a per-token reference and transformers' own
balancing loss; both balancing schemes; the refusals of shapes and layouts it cannot take."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from conftest import SMALL_MODEL, assert_same_run, read_metrics, run_cli, train_args
from meshtrain.errors import ConfigError
from meshtrain.model.args import ModelArgs
from meshtrain.model.moe import MoE, balance_report, end_step, set_aux_weight

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, n_experts=8, top_k=2)


def layer(seed: int = 0, **options) -> MoE:
    args = dataclasses.replace(ARGS, **options)
    moe = MoE(args, 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's definition, one token and one chosen expert at a time."""
    a = moe.args
    logits = x.float() @ moe.router.weight.float().T
    scores = logits.softmax(-1) if a.router_score == "softmax" else logits.sigmoid()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        choice = scores[t] + moe.router.expert_bias
        if a.expert_groups > 1:
            groups = choice.view(a.expert_groups, -1)
            best = groups.topk(2, dim=-1).values.sum(-1).topk(a.kept_groups).indices
            allowed = torch.zeros(a.expert_groups, dtype=torch.bool)
            allowed[best] = True
            choice = groups.masked_fill(~allowed[:, None], float("-inf")).flatten()
        chosen = choice.topk(a.top_k).indices
        weights = scores[t, chosen]
        if a.norm_topk:
            weights = weights / weights.sum()
        for w, e in zip(weights, chosen, strict=True):
            ex = moe.experts
            out[t] += w * (F.silu(x[t] @ ex.w1[e].T) * (x[t] @ ex.w3[e].T)) @ ex.w2[e].T
    if moe.shared is not None:
        out = out + moe.shared(x)
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"norm_topk": False, "top_k": 3},
        {"router_score": "sigmoid", "expert_groups": 4, "groups_kept": 2, "n_shared_experts": 1},
        {"load_balance": "bias", "moe_ffn_dim": 24},
    ],
    ids=["softmax-top2", "unnormalised-top3", "deepseek-groups-shared", "bias-balanced"],
)
def test_the_grouped_layer_equals_its_per_token_definition(options):
    moe = layer(**options)
    if moe.args.load_balance == "bias":
        moe.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, 8))  # moves the choice, not the weights
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x[None])[0], per_token(moe, x), rtol=1e-5, atol=1e-5)


def test_a_capacity_factor_drops_the_latest_tokens_of_a_full_expert_and_counts_them():
    """Every token prefers expert 0: at capacity factor 1 it takes 40 x 2 / 8 = 10 of the 40 tokens
    (the first ten), the other 30 skip it, and every expert past 10 drops its excess likewise;
    evaluation stays dropless."""
    moe = layer(capacity_factor=1.0, top_k=2)
    with torch.no_grad():
        moe.router.weight[0] = 0
        moe.router.weight[0, 0] = 50.0
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)).abs() + 0.1
    moe.train()
    out = moe(x[None])[0]
    reference = per_token(moe, x)
    torch.testing.assert_close(out[:10], reference[:10], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[10:], reference[10:], atol=1e-3)
    assert moe.step_counts[0] == 10
    chosen = torch.bincount(moe.router(x)[1].flatten(), minlength=8)
    assert torch.equal(moe.step_counts, chosen.clamp(max=10).float())
    report = balance_report([moe], [])
    assert report["moe_layer0_dropped"] == pytest.approx(float((chosen - 10).clamp(min=0).sum()) / 80)
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x[None])[0], reference, rtol=1e-5, atol=1e-5)


def test_the_aux_loss_is_transformers_and_reaches_the_router_as_coef_times_its_gradient():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = layer(aux_loss_coef=0.25)
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))
    logits = x.reshape(-1, 32) @ moe.router.weight.T
    expected = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    moe.train()
    set_aux_weight([moe], torch.tensor(1.0))
    out = moe(x)
    report = balance_report([moe], [])
    assert report["moe_aux_loss"] == pytest.approx(expected.item(), rel=1e-5)
    out.square().sum().backward()
    attached = moe.router.weight.grad.clone()
    moe.zero_grad()
    # the same gradient by hand: the output's loss plus coef x the aux loss
    moe.aux_weight = None
    weights, experts, scores = moe.router(x.reshape(-1, 32))
    counts = torch.bincount(experts.flatten(), minlength=8)
    (moe(x).square().sum() + 0.25 * moe.aux_loss(counts, scores)).backward()
    torch.testing.assert_close(attached, moe.router.weight.grad, rtol=1e-5, atol=1e-7)


def skewed(**options) -> MoE:
    moe = layer(load_balance="bias", **options)
    with torch.no_grad():
        moe.router.weight[0] += 0.1  # expert 0 scores high for the (positive) tokens below
    return moe.train()


def test_aux_loss_free_bias_balances_a_skewed_router_within_50_steps():
    moe = skewed(bias_update_rate=0.01)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(64, 32, generator=gen).abs() for _ in range(60)]
    first = None
    for step, x in enumerate(batches[:50]):
        moe(x[None])
        if step == 0:
            first = balance_report([moe], [])["moe_layer0_max_over_mean"]
        end_step([moe], [])
    balance_report([moe], [])
    for x in batches[50:]:
        moe(x[None])
    after = balance_report([moe], [])["moe_layer0_max_over_mean"]
    assert first > 3 and after < 1.5, (first, after)


def test_activation_checkpointing_counts_a_batch_once_and_moves_the_bias_alike():
    x = torch.randn(1, 48, 32, generator=torch.Generator().manual_seed(5)).abs().requires_grad_()
    plain, recomputed = skewed(), skewed()
    plain(x).sum().backward()
    checkpoint(recomputed, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(plain.step_counts, recomputed.step_counts)
    assert plain.step_counts.sum() == 48 * 2
    end_step([plain], [])
    end_step([recomputed], [])
    assert torch.equal(plain.router.expert_bias, recomputed.router.expert_bias)
    assert plain.router.expert_bias.abs().sum() > 0


def test_moe_shapes_and_layouts_it_cannot_take_are_refused_in_one_line(tmp_path):
    from meshtrain.config import load_config
    from meshtrain.job import check_dry_run, resolve

    def refusal(world: int = 1, **keys) -> str:
        cfg = load_config(overrides={"model.preset": "tiny-moe", "data.path": str(tmp_path), **keys})
        with pytest.raises(ConfigError) as error:
            resolve(cfg, world)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "model.top_k (9) is more than model.n_experts (8)" in refusal(**{"model.top_k": 9})
    assert "multiple of model.expert_groups (3)" in refusal(**{"model.expert_groups": 3, "model.family": "meshtrain"})
    assert "'llama' has no mixture of experts" in refusal(**{"model.family": "llama", "model.qk_norm": False})
    assert "sigmoid router" in refusal(**{"model.router_score": "sigmoid"})
    assert "no layer is an MoE layer" in refusal(**{"model.first_dense": 6})
    assert "routed experts take none" in refusal(**{"peft.method": "lora", "peft.targets": "all"})
    assert "training.compile with a mixture of experts" in refusal(**{"training.compile": True})
    assert "tensor parallelism of MoE layers is not built" in refusal(2, **{"parallel.tp": 2})
    assert "model.n_experts (8) must be divisible by parallel.ep (16)" in refusal(16, **{"parallel.ep": 16})
    assert "must divide the data-parallel shard ranks dp_shard x cp = 2" in refusal(
        4, **{"parallel.ep": 4, "parallel.pp": 2}
    )
    assert "would overwrite the other ranks' different experts" in refusal(2, **{"parallel.ep": 2, "parallel.zero": 1})
    assert "train in bf16 or fp32" in refusal(2, **{"parallel.ep": 2, "training.dtype": "fp16"})
    uneven = {"parallel.ep": 2, "parallel.zero": 3}  # each expert on 3 ranks, which do not divide dim 256
    assert "the 3 ranks holding it (dp x cp / ep), which must divide model.dim (256)" in refusal(6, **uneven)
    dense = {"model.preset": "tiny", "parallel.ep": 2}
    assert "but this model has none (model.n_experts = 0)" in refusal(2, **dense)
    cfg = load_config(
        overrides={"model.preset": "tiny-moe", "data.path": str(tmp_path), "training.global_batch_size": 512}
    )
    with pytest.raises(ConfigError, match="a dry run builds the job on fake tensors, through which a mixture"):
        check_dry_run(resolve(cfg, 64), [])


MOE_MODEL = [*SMALL_MODEL, "--model.n_experts", "8", "--model.top_k", "2", "--model.family", "meshtrain"]


@pytest.mark.multiproc
def test_an_moe_model_trains_alike_on_one_process_and_every_layout_and_resumes_across_them(corpus, cli_env, tmp_path):
    """Loss, gradient norm, the balance metrics and the final weights of ZeRO-3, PP 2, EP 2 and EP 2 x
    ZeRO-3 against one process; bias balancing under EP 2 (over DDP), stopped at step 5 (its bias and
    split experts in the checkpoint) and resumed on one process, against one process throughout; so
    on 4 ranks, EP 2 x ZeRO-3 (each expert held by two ranks, which shard it); and on 4 ranks EP 2 with
    PP 2 and with CP 2 (bias balancing: no aux loss, whose per-micro-batch statistics differ by batch
    split)."""

    params_mib = {}  # each run's params per rank, its first memory line

    def run(name: str, *extra: str) -> Path:
        result = run_cli(train_args(corpus, tmp_path / name, *extra, model=MOE_MODEL), cli_env)
        assert result.returncode == 0, result.stderr[-3000:]
        params_mib[name] = float(re.search(r"rank 0: params +([\d.]+) MiB", result.stdout + result.stderr)[1])
        return tmp_path / name

    one = run("one")
    ep = ["--parallel.ep", "2"]
    for layout in (["--parallel.zero", "3"], ["--parallel.pp", "2"], ep, [*ep, "--parallel.zero", "3"]):
        other = run("-".join(layout), "--nproc", "2", *layout)
        assert_same_run(other, one)
        for got, want in zip(read_metrics(other), read_metrics(one), strict=True):
            for key in ("moe_aux_loss", "moe_layer0_max_over_mean", "moe_layer1_max_over_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-4), (layout, key)
    bias = ["--model.load_balance", "bias", "--model.bias_update_rate", "0.01"]
    whole = run("bias", *bias)
    assert "moe_aux_loss" not in read_metrics(whole)[-1]
    stopped = ["--checkpoint.every", "5", "--training.stop_at_step", "5"]
    run("bias-resumed", *bias, "--nproc", "2", *ep, *stopped)
    assert_same_run(run("bias-resumed", *bias, "--checkpoint.every", "5"), whole)
    four = ["--nproc", "4", *ep, "--training.micro_batch_size", "2"]
    run("bias-ep2-sharded", *bias, *four, "--parallel.zero", "3", *stopped)
    assert params_mib["bias-ep2-sharded"] == pytest.approx(params_mib["one"] / 4, abs=0.01)  # experts too
    assert_same_run(run("bias-ep2-sharded", *bias, "--checkpoint.every", "5"), whole)
    assert_same_run(run("bias-ep2-pp2", *bias, *four, "--parallel.pp", "2"), whole)
    # CP 2 x EP 2 over DDP 2: each expert on two ranks, which sum its gradient
    assert_same_run(run("bias-ep2-cp2", *bias, *four, "--parallel.cp", "2"), whole)


def test_flops_and_the_planner_count_the_active_experts_only():
    """128 experts of which 8 run per token cost the FLOPs of 8 experts that all run (but for the
    router's 120 more rows), in MFU's count and in the planner's compute time; the parameters
    (memory) are all 128."""
    from meshtrain.layout import Layout
    from meshtrain.model.presets import PRESETS
    from meshtrain.model.shapes import Shape
    from meshtrain.plan.states import stage_sums

    routed = PRESETS["qwen3-30b-a3b"]
    every = dataclasses.replace(routed, n_experts=8)
    a, b = Shape.from_args(routed), Shape.from_args(every)
    router_rows = 6 * routed.n_layers * 120 * routed.dim
    assert a.flops_per_token(4096) - b.flops_per_token(4096) == router_rows
    assert stage_sums(a, Layout(), 0).block_full - stage_sums(b, Layout(), 0).block_full == 120 * routed.dim
    assert a.n_params() > 10 * b.n_params() / 2


def test_the_planner_splits_the_experts_by_ep_and_shards_them_over_their_holders():
    """A rank's parameter bytes (what train's plan check compares with the measured ones): EP 2 holds
    half the experts whole under DDP, and a quarter of them on 4 ranks under ZeRO-3, like the rest."""
    from meshtrain.layout import Layout
    from meshtrain.model.presets import PRESETS
    from meshtrain.model.shapes import Shape
    from meshtrain.plan.states import model_state_bytes

    shape = Shape.from_args(PRESETS["tiny-moe"])
    experts = sum(p.numel for p in shape.parameters() if ".experts." in p.name)
    rest = sum(p.numel for p in shape.parameters()) - experts

    def params(**layout) -> int:
        return model_state_bytes(shape, Layout(**layout))["params"] // 4  # fp32

    assert params(dp_shard=2, ep=2) == rest + experts // 2
    assert params(dp_shard=4, ep=2, zero=3) == params(dp_shard=4, zero=3) == (rest + experts) // 4


def test_an_expert_without_tokens_gets_a_zero_gradient_not_none():
    """DDP waits for every parameter's gradient: an expert no token chose must still get one."""
    moe = layer(top_k=1)
    with torch.no_grad():
        moe.router.weight[0] = 50.0  # every (positive) token to expert 0
    moe.train()(torch.rand(1, 5, 32)).sum().backward()
    assert moe.step_counts.tolist() == [5, 0, 0, 0, 0, 0, 0, 0]
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        assert w.grad is not None and w.grad[0].abs().sum() > 0 and not w.grad[1:].any()
