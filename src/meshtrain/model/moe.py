"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, the tokens are grouped
by expert, each expert (a SwiGLU MLP) runs on its group, and the outputs are summed back weighted by
the router (Shazeer et al. 2017; Switch, GShard; Mixtral, Qwen3-MoE and DeepSeek-V3 as options).

    scores  = softmax or sigmoid(router(x))                       fp32, whatever the model's dtype
    experts = top-k of (scores + balancing bias), within the best expert groups where grouped
    weights = scores of those experts (renormalised to sum to 1 where the family does)
    y       = sum_k weights_k * expert_k(x) + shared experts(x)

Dropless by default: every expert takes every token routed to it. With a capacity factor c an expert
takes at most ceil(c x tokens x k / experts) of them (the earliest in the batch) and the rest skip it
(counted as dropped). The experts' weights are 3-D tensors (expert, out, in) so that one grouped GEMM
runs them all; where a device's `torch._grouped_mm` gives the same result as the per-expert loop (probed
once per device and dtype), it is used, otherwise the loop over each expert's contiguous group.

Load balancing, both schemes. The auxiliary loss (Switch/GShard as Mixtral and Qwen3-MoE configure it:
experts x sum_e fraction_e x mean probability_e, per layer, averaged over the MoE layers and weighted
by aux_loss_coef) reaches the gradients through `AuxLoss` without changing the returned logits, so it
works unchanged under pipelines and loss scaling. DeepSeek-V3's aux-loss-free bias is a buffer added to
the scores for the choice only; `update_balance` moves it once per optimizer step from the tokens each
expert took, summed over micro-batches and data-parallel ranks. Tokens are counted in forward but not in
activation checkpointing's recomputation (which runs inside backward), so a batch counts once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.model.args import ModelArgs
from meshtrain.model.feed_forward import FeedForward


class AuxLoss(torch.autograd.Function):
    """Identity on `out` in forward; in backward also sends `weight` as the gradient of `aux`, so the
    balancing loss joins the training loss's gradient wherever backward starts (a pipeline's last
    stage, a loss scaled for fp16: `weight` carries those scales)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.aux_dtype = aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad, weight.to(ctx.aux_dtype).reshape(()), None


def in_recomputation() -> bool:
    """Whether this forward is activation checkpointing's recomputation (it runs inside backward)."""
    if torch.compiler.is_compiling():
        return False  # a compiled graph's recomputation is the partitioner's: the forward runs once
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Scores every expert for each token in fp32 and picks its top-k."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_experts, args.dim))
        # aux-loss-free balancing's per-expert bias: shifts which experts are chosen, never their weights
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=args.load_balance == "bias")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (weights (tokens, k) fp32, experts (tokens, k), scores (tokens, experts) fp32)."""
        a = self.args
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if a.router_score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias if a.load_balance == "bias" else scores.detach()
        if a.expert_groups > 1:  # DeepSeek-V3: a token goes to its best groups' experts only
            grouped = choice.unflatten(-1, (a.expert_groups, -1))
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            kept = group_score.topk(a.kept_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(-1, kept, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if a.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, scores


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs as 3-D weights: w1/w3 (experts, hidden, dim), w2 (experts, dim, hidden).
    Under expert parallelism the weights are this rank's experts and `dispatch` sends each pair to the
    rank holding its expert and back (parallel/expert_parallel.py)."""

    dispatch = None

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim), sorted by expert, `counts[e]` of them for expert e -> (tokens, dim)."""
        if self.dispatch is not None:
            return self.dispatch(x, counts, self.local_experts)
        return self.local_experts(x, counts)

    def local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on their groups of x, in x's dtype (bf16 under FSDP's mixed precision,
        which does not cast the experts it leaves to expert parallelism)."""
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
        if grouped_mm_works(x):
            return grouped_swiglu(x, counts, w1, w2, w3)
        return looped_swiglu(x, counts, w1, w2, w3)


def looped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    """Each expert's contiguous group through its own three matmuls (the CPU kernel). An expert
    without tokens still multiplies its empty group: its weights get a zero gradient instead of none,
    which DDP would wait for forever."""
    groups = x.split(counts.tolist())
    return torch.cat([F.linear(F.silu(F.linear(g, w1[e])) * F.linear(g, w3[e]), w2[e]) for e, g in enumerate(groups)])


GROUP_ALIGN = 16  # torch._grouped_mm's row alignment for 16-bit operands


def grouped_swiglu(x, counts, w1, w2, w3) -> torch.Tensor:
    """All experts in three grouped GEMMs: each group's rows padded to GROUP_ALIGN, offsets cumulative."""
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    padded = torch.where(counts > 0, padded, torch.full_like(padded, GROUP_ALIGN))
    ends = padded.cumsum(0)
    starts = ends - padded
    # row r of the sorted input goes to its expert's start + its rank within the expert
    expert_of = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
    rank = torch.arange(x.shape[0], device=x.device) - (counts.cumsum(0) - counts)[expert_of]
    rows = starts[expert_of] + rank
    total = int(ends[-1])
    buffer = x.new_zeros(total, x.shape[1]).index_copy(0, rows, x)
    offsets = ends.to(torch.int32)
    h = F.silu(torch._grouped_mm(buffer, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(buffer, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)[rows]


_grouped_mm_ok: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs on x's device and dtype and agrees with the loop there (probed
    once: torch 2.13's CPU build has the op but raises on every shape; CUDA runs it from sm90)."""
    key = (x.device.type, x.dtype)
    if key not in _grouped_mm_ok:
        _grouped_mm_ok[key] = _probe_grouped_mm(x.device, x.dtype)
    return _grouped_mm_ok[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(40, 64, generator=gen).to(device, dtype)
    w1, w3 = (torch.randn(3, 32, 64, generator=gen).to(device, dtype) for _ in range(2))
    w2 = torch.randn(3, 64, 32, generator=gen).to(device, dtype)
    counts = torch.tensor([17, 0, 23], device=device)
    try:
        with torch.no_grad():
            got, want = grouped_swiglu(x, counts, w1, w2, w3), looped_swiglu(x, counts, w1, w2, w3)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


class MoE(nn.Module):
    """The feed-forward of an MoE layer: router, routed experts, optional shared experts."""

    aux_weight: torch.Tensor | None = None  # d(training loss)/d(this layer's aux loss): set by the step

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.args = args
        self.layer = layer  # its index among the model's layers: metrics name it, pipelines gather by it
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_ffn_dim)
        shared = args.n_shared_experts * args.expert_ffn_dim
        self.shared = FeedForward(args.dim, shared) if shared else None
        # this rank's counts: the tokens each expert took since the last optimizer step (the bias's
        # update), and since the last metrics record: those, (pairs routed, dropped), (aux loss sum, forwards)
        self.register_buffer("step_counts", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("log_sums", torch.zeros(args.n_experts + 4), persistent=False)

    def reset_buffers(self, device: torch.device) -> None:
        """Zero the balancing bias and the counters (a model built on the meta device holds garbage)."""
        for name in ("step_counts", "log_sums"):
            setattr(self, name, torch.zeros_like(getattr(self, name), device=device))
        self.router.expert_bias = torch.zeros_like(self.router.expert_bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, scores = self.router(x)
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=self.args.n_experts)
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert, in token order
        taken = counts
        if self.training and (keep := self.room(counts, len(flat))) is not None:
            order = order[keep]
            taken = torch.bincount(flat[order], minlength=self.args.n_experts)
        token = order // self.args.top_k
        out = self.experts(x[token], taken)
        out = out * weights.flatten()[order, None].to(out.dtype)
        y = x.new_zeros(x.shape).index_add_(0, token, out.to(x.dtype))
        if self.shared is not None:
            y = y + self.shared(x)
        # a training forward counts once: not in a recomputation, not in a no-grad pass (DPO's reference)
        training = self.training and torch.is_grad_enabled()
        counted = training and not in_recomputation()
        if counted:
            with torch.no_grad():
                self.step_counts += taken
                pairs = torch.stack((counts.sum(), counts.sum() - taken.sum()))
                self.log_sums[:-2] += torch.cat((taken, pairs))
        if training and self.args.load_balance == "aux_loss" and self.aux_weight is not None:
            aux = self.aux_loss(counts, scores)
            if counted:
                with torch.no_grad():
                    self.log_sums[-2:] += torch.stack((aux.detach(), torch.ones_like(aux)))
            y = AuxLoss.apply(y, aux, self.aux_weight)
        return y.reshape(shape)

    def room(self, counts: torch.Tensor, pairs: int) -> torch.Tensor | None:
        """With a capacity factor, for each routed pair in expert order whether its expert still has
        room for it (an expert takes its earliest tokens); None when dropless."""
        if not self.args.capacity_factor:
            return None
        capacity = math.ceil(self.args.capacity_factor * pairs / self.args.n_experts)
        starts = counts.cumsum(0) - counts
        rank = torch.arange(pairs, device=counts.device) - starts.repeat_interleave(counts, output_size=pairs)
        return rank < capacity

    def aux_loss(self, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Switch/GShard: experts x sum_e (share of the tokens routed to e) x (mean probability of e), as
        transformers computes it for Mixtral and Qwen3-MoE (the share sums to k over the experts)."""
        probs = scores if self.args.router_score == "softmax" else scores / scores.sum(-1, keepdim=True)
        share = counts.float() / scores.shape[0]
        return self.args.n_experts * (share * probs.mean(0)).sum()


def moe_layers(parts) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def clear_counters(parts) -> None:
    for m in moe_layers(parts):
        m.step_counts.zero_(), m.log_sums.zero_()


def set_aux_weight(parts, weight: torch.Tensor) -> None:
    """d(training loss)/d(each layer's aux loss) for the coming step: aux_loss_coef averaged over the
    MoE layers and the rank's micro-batches, times fp16's loss scale (the caller's)."""
    for m in moe_layers(parts):
        m.aux_weight = weight * (m.args.aux_loss_coef / len(m.args.moe_layers))


def _table(layers: list[MoE], buffer: str, groups: list) -> torch.Tensor:
    """One row per MoE layer of the whole model: each layer's `buffer`, summed over `groups` (data
    parallel, then the pipeline stages, each holding some of the layers and zeros for the others)."""
    args = layers[0].args
    first = getattr(layers[0], buffer)
    table = first.new_zeros(len(args.moe_layers), first.numel())
    for m in layers:
        table[args.moe_layers.index(m.layer)] = getattr(m, buffer)
        getattr(m, buffer).zero_()
    for group in groups:
        if group is not None:
            torch.distributed.all_reduce(table, group=group)
    return table


@torch.no_grad()
def end_step(parts, groups: list) -> None:
    """After an optimizer step, aux-loss-free balancing: each expert's bias moves by bias_update_rate
    toward the mean load, from the tokens it took in the step summed over micro-batches and ranks."""
    layers = moe_layers(parts)
    if not layers or layers[0].args.load_balance != "bias":
        return
    counts = _table(layers, "step_counts", groups)
    for m in layers:
        load = counts[m.args.moe_layers.index(m.layer)]
        m.router.expert_bias += m.args.bias_update_rate * torch.sign(load.mean() - load)


@torch.no_grad()
def balance_report(parts, groups: list) -> dict[str, float]:
    """Since the last report, over every rank: the aux loss (mean over layers and micro-batches), and
    per MoE layer the max/mean tokens per expert and the share of routed tokens the capacity dropped."""
    layers = moe_layers(parts)
    if not layers:
        return {}
    args = layers[0].args
    table = _table(layers, "log_sums", groups)
    counts, (routed, dropped, aux, forwards) = table[:, : args.n_experts], table[:, args.n_experts :].T
    balance = (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).tolist()
    metrics = {}
    if forwards.sum() > 0:
        metrics["moe_aux_loss"] = float((aux / forwards.clamp(min=1)).mean())
    for i, layer in enumerate(args.moe_layers):
        metrics[f"moe_layer{layer}_max_over_mean"] = balance[i]
        metrics[f"moe_layer{layer}_dropped"] = float(dropped[i] / routed[i].clamp(min=1))
    return metrics
