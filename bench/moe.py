"""The mixture-of-experts layer's forward + backward against transformers' own Qwen3-MoE block on the
same shapes and weights (model/moe.py's per-expert kernel on a CPU, the grouped GEMM where a GPU runs
it), timed in interleaved rounds in one process; the two outputs are compared first."""

from __future__ import annotations

import statistics

import torch

from bench.common import device, markdown, timed, write_results

# (name, tokens, dim, experts, top_k, expert hidden): tiny-moe's and small-moe's layers, and one with
# Qwen3-30B-A3B's routing (128 experts, 8 per token) at a CPU's width
SHAPES = [
    ("tiny-moe", 2048, 256, 8, 2, 192),
    ("small-moe", 2048, 640, 8, 2, 512),
    ("qwen3-30b-a3b routing", 2048, 256, 128, 8, 96),
]


def layers(dim: int, experts: int, top_k: int, hidden: int, dev: torch.device, dtype: torch.dtype):
    """meshtrain's MoE and transformers' Qwen3MoeSparseMoeBlock holding the same weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from meshtrain.model.args import ModelArgs
    from meshtrain.model.moe import MoE

    args = ModelArgs(
        dim=dim, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=hidden, vocab_size=256, n_experts=experts, top_k=top_k
    )
    ours = MoE(args, 0)
    config = Qwen3MoeConfig(
        hidden_size=dim,
        moe_intermediate_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )
    theirs = Qwen3MoeSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat((ours.experts.w1, ours.experts.w3), dim=1))
        theirs.experts.down_proj.copy_(ours.experts.w2)
    return ours.to(dev, dtype).train(), theirs.to(dev, dtype).train()


def forward_backward(layer, x: torch.Tensor):
    def run():
        inputs = x.clone().requires_grad_()
        layer(inputs).square().mean().backward()
        layer.zero_grad(set_to_none=True)

    return run


def main(a) -> None:
    dev = device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for name, tokens, dim, experts, top_k, hidden in SHAPES:
        ours, theirs = layers(dim, experts, top_k, hidden, dev, dtype)
        x = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        with torch.no_grad():
            difference = (ours(x) - theirs(x)).abs().max().item() / theirs(x).abs().max().item()

        runs = {"meshtrain": forward_backward(ours, x), "transformers": forward_backward(theirs, x)}
        for fn in runs.values():
            fn()  # warm-up
        times = {key: [] for key in runs}
        for _ in range(a.rounds):
            for key, fn in runs.items():
                times[key].append(timed(fn, 3, dev))
        ms = {key: 1000 * statistics.median(values) for key, values in times.items()}
        ratios = [t / o for o, t in zip(times["meshtrain"], times["transformers"], strict=True)]
        rows.append(
            {
                "shape": name,
                "tokens": tokens,
                "dim": dim,
                "experts": experts,
                "top_k": top_k,
                "hidden": hidden,
                "dtype": str(dtype).removeprefix("torch."),
                "max_relative_difference": difference,
                "meshtrain_ms": ms["meshtrain"],
                "transformers_ms": ms["transformers"],
                "speedup": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)],
            }
        )
    table = markdown(
        [
            "layer",
            "tokens x dim",
            "experts / top-k / hidden",
            "max rel. diff",
            "meshtrain ms",
            "transformers ms",
            "speed-up",
        ],
        [
            [
                r["shape"],
                f"{r['tokens']} x {r['dim']}",
                f"{r['experts']} / {r['top_k']} / {r['hidden']}",
                f"{r['max_relative_difference']:.1e}",
                f"{r['meshtrain_ms']:.1f}",
                f"{r['transformers_ms']:.1f}",
                f"{r['speedup']:.2f}x [{r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}]",
            ]
            for r in rows
        ],
    )
    write_results("moe", rows, table)
