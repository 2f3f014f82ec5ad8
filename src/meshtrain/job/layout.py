"""A job's layout resolved from its config at a world size, and every rule that refuses one, in the
words the user reads: the degrees against the world, hybrid sharding and ZeRO, CPU offload; then the
layout against the model's shape, the batch, the pipeline schedule and context parallelism. The
`Layout` itself (layout.py) only derives; the planner's search refuses a layout with these same rules."""

from __future__ import annotations

from meshtrain.config import SINGLE_STAGE_SCHEDULES, Config, TrainingConfig
from meshtrain.errors import ConfigError
from meshtrain.layout import CONFIG_SECTIONS, Layout
from meshtrain.model.args import ModelArgs


def layout_of(cfg: Config, world: int) -> Layout:
    """The layout of a config on `world` ranks, with the reasons when its degrees do not fit."""
    p = cfg.parallel  # single values are checked by config.validate
    model_ranks = p.tp * p.pp * p.cp
    if world % model_ranks:
        raise ConfigError(
            f"world size {world} is not divisible by parallel.tp ({p.tp}) x parallel.pp ({p.pp}) x parallel.cp "
            f"({p.cp}) = {model_ranks}: the data-parallel degree is world / (tp x pp x cp), so use a world size "
            f"that is a multiple of {model_ranks} or change tp/pp/cp"
        )
    dp = world // model_ranks
    if dp % p.dp_replicate:
        raise ConfigError(
            f"the data-parallel degree world / (tp x pp x cp) = {dp} is not divisible by parallel.dp_replicate "
            f"({p.dp_replicate})"
        )
    if p.dp_shard and p.dp_shard != dp // p.dp_replicate:
        raise ConfigError(
            f"parallel.dp_shard = {p.dp_shard} does not fit {world} ranks: world / (tp x pp x cp x dp_replicate)"
            f" = {dp // p.dp_replicate}; leave it 0 to derive it"
        )
    if p.dp_replicate > 1 and p.zero < 2:
        raise ConfigError(
            f"parallel.dp_replicate = {p.dp_replicate} is hybrid sharding and needs parallel.zero = 2 or 3; "
            "with zero 0/1 every data-parallel rank is already a replica (set dp_replicate = 1)"
        )
    if p.dp_replicate > 1 and p.dp_replicate == dp:
        raise ConfigError(
            f"parallel.dp_replicate = {p.dp_replicate} leaves a shard degree of 1: use parallel.zero = 0 for "
            "pure replication, or a smaller dp_replicate"
        )
    if p.zero < 2 and p.tp > 1 and dp * p.cp > 1:
        raise ConfigError(
            f"parallel.zero = {p.zero} (DDP) cannot replicate tensor-parallel (DTensor) parameters: "
            "use parallel.zero = 2 or 3 with parallel.tp > 1 (zero 0/1 work with pp and plain data parallel)"
        )
    shards = dp // p.dp_replicate * p.cp
    if p.ep > 1 and shards % p.ep:
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide the data-parallel shard ranks dp_shard x cp = {shards} on {world} "
            "ranks (the experts are split over data-parallel ranks): use a divisor of it, or more ranks"
        )
    if p.ep > 1 and p.zero == 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} with parallel.zero = 1: ZeRO-1's optimizer broadcasts each updated parameter "
            "from the rank that owns its states, which would overwrite the other ranks' different experts; "
            "use parallel.zero = 0, 2 or 3"
        )
    if p.ep > 1 and cfg.training.dtype == "fp16":
        raise ConfigError(
            f"training.dtype = fp16 with parallel.ep = {p.ep}: fp16's loss scaler cannot unscale the split experts' "
            "gradients together with the others (DTensors on another mesh); train in bf16 or fp32"
        )
    if p.ep > 1 and p.cpu_offload:
        raise ConfigError(
            f"parallel.cpu_offload with parallel.ep = {p.ep}: offloading expert-parallel experts is not built "
            "(they would stay in GPU memory); drop one of them"
        )
    if p.cpu_offload and (p.zero != 3 or shards == 1):
        raise ConfigError(
            f"parallel.cpu_offload moves ZeRO-3's parameter shards to host memory: it needs parallel.zero = 3 "
            f"over more than one data-parallel rank (here zero {p.zero}, {shards} shard(s)); "
            "drop cpu_offload, or shard over more ranks"
        )
    values = {name: getattr(getattr(cfg, section), name) for name, section in CONFIG_SECTIONS.items()}
    return Layout(**values | {"dp_shard": dp // p.dp_replicate})


def check_layout(layout: Layout, args: ModelArgs, cfg: Config) -> None:
    """The layout against the model's shape, the batch and the schedule."""
    _check_model(layout, args)
    t = cfg.training
    per_step = layout.micro_batch_size * layout.dp
    if layout.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size ({layout.global_batch_size}) must be divisible by "
            f"training.micro_batch_size ({layout.micro_batch_size}) x data-parallel degree ({layout.dp}) = {per_step}"
        )
    check_schedule(layout, cfg.parallel.pp_microbatches)
    _check_context(layout, args, t)


def _check_context(layout: Layout, args: ModelArgs, t: TrainingConfig) -> None:
    """Context parallelism against the sequence and the heads it splits (parallel/context_parallel.py)."""
    if layout.cp == 1:
        return
    if t.seq_len % layout.cp:
        raise ConfigError(
            f"training.seq_len ({t.seq_len}) must be divisible by parallel.cp ({layout.cp}): each rank holds "
            "an equal slice of every sequence"
        )
    local = t.seq_len // layout.cp
    if layout.tp > 1 and layout.sequence_parallel and local % layout.tp:
        raise ConfigError(
            f"a context-parallel slice of {local} tokens (training.seq_len / parallel.cp) must be divisible "
            f"by parallel.tp ({layout.tp}) for sequence parallelism; change seq_len or cp"
        )
    heads, kv_heads = args.n_heads // layout.tp, args.n_kv_heads // layout.tp
    if heads % layout.cp or (kv_heads % layout.cp and layout.cp % kv_heads):
        raise ConfigError(
            f"parallel.cp = {layout.cp} splits each rank's attention heads ({heads} query, {kv_heads} key/value "
            "heads per tensor-parallel rank) for its all-to-all: the query heads must be divisible by cp, and "
            "the key/value heads divisible by cp or cp by them; lower cp or tp"
        )
    if t.objective == "dpo":
        raise ConfigError(
            "training.objective = 'dpo' with parallel.cp > 1 is not supported (DPO scores whole sequences); "
            "set parallel.cp = 1"
        )


def _check_model(layout: Layout, args: ModelArgs) -> None:
    if layout.ep > 1 and not args.n_experts:
        raise ConfigError(
            f"parallel.ep = {layout.ep} splits the experts of a mixture of experts, but this model has none "
            "(model.n_experts = 0): set parallel.ep = 1"
        )
    if layout.ep > 1 and args.n_experts % layout.ep:
        raise ConfigError(
            f"model.n_experts ({args.n_experts}) must be divisible by parallel.ep ({layout.ep}): each expert-"
            "parallel rank holds as many experts"
        )
    holders = layout.expert_replicas
    if layout.ep > 1 and layout.fsdp and holders > 1 and (args.dim % holders or args.expert_ffn_dim % holders):
        raise ConfigError(
            f"parallel.ep = {layout.ep} with ZeRO-{layout.zero} shards each expert's rows over the {holders} ranks "
            f"holding it (dp x cp / ep), which must divide model.dim ({args.dim}) and the experts' hidden size "
            f"({args.expert_ffn_dim}): change ep or the number of ranks"
        )
    if args.n_heads % layout.tp or args.n_kv_heads % layout.tp:
        raise ConfigError(
            f"model.n_heads ({args.n_heads}) and model.n_kv_heads ({args.n_kv_heads}) must both be divisible "
            f"by parallel.tp ({layout.tp})"
        )
    if args.ffn_dim % layout.tp:
        raise ConfigError(f"model.ffn_dim ({args.ffn_dim}) must be divisible by parallel.tp ({layout.tp})")
    if args.vocab_multiple % layout.tp:
        raise ConfigError(
            f"model.vocab_multiple ({args.vocab_multiple}) must be a multiple of parallel.tp ({layout.tp}) so "
            "the padded vocabulary splits evenly"
        )
    stages = layout.pp * layout.pp_virtual_stages
    if layout.pp > 1 and args.n_layers < stages:
        raise ConfigError(
            f"model.n_layers ({args.n_layers}) must be at least parallel.pp x parallel.pp_virtual_stages = "
            f"{layout.pp} x {layout.pp_virtual_stages} = {stages} (one layer per pipeline stage)"
        )


def check_schedule(layout: Layout, pp_microbatches: int) -> None:
    """The schedule against the micro-batches it splits each step into (local batch / micro batch)."""
    if layout.pp == 1:
        return
    n_microbatches = layout.micro_batches
    if pp_microbatches and pp_microbatches != n_microbatches:
        raise ConfigError(
            f"parallel.pp_microbatches ({pp_microbatches}) does not match the local batch / "
            f"training.micro_batch_size = {n_microbatches}; leave it 0 to derive it"
        )
    v, schedule = layout.pp_virtual_stages, layout.pp_schedule
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} runs one stage per rank: set "
            "parallel.pp_virtual_stages = 1, or use interleaved_1f1b / zero_bubble / zbv"
        )
    if schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError("parallel.pp_schedule = 'interleaved_1f1b' needs parallel.pp_virtual_stages >= 2")
    if schedule == "zbv" and v != 2:
        raise ConfigError(
            "parallel.pp_schedule = 'zbv' places exactly 2 stages per rank in a V: set parallel.pp_virtual_stages = 2"
        )
    if schedule == "1f1b" and n_microbatches < layout.pp:
        raise ConfigError(
            f"parallel.pp_schedule = '1f1b' needs at least parallel.pp ({layout.pp}) "
            f"micro-batches per step, got {n_microbatches}: raise training.global_batch_size "
            "or lower training.micro_batch_size"
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and n_microbatches % layout.pp:
        raise ConfigError(
            f"parallel.pp_schedule = {schedule!r} needs a number of micro-batches "
            f"divisible by parallel.pp ({layout.pp}), got {n_microbatches}"
        )
