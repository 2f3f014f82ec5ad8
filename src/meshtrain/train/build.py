"""Everything a training step needs, built once: who am I -> data -> model on the mesh -> optimizer.

`build(cfg)` is what the loop, the tests and the benchmarks use, so all three train the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.checkpoint import Checkpointer
from meshtrain.config import Config, check_model_args, micro_batches, parse_data_path
from meshtrain.data import Blend, DistributedLoader, prepare, read_manifest, stdlib_sources, validation_batches
from meshtrain.errors import DataError
from meshtrain.launch import LaunchEnv, detect
from meshtrain.launch.distributed import init_distributed
from meshtrain.layout import Layout
from meshtrain.logs import log
from meshtrain.model import Llama, ModelArgs, num_params
from meshtrain.optim import build_optimizer
from meshtrain.parallel import ParallelDims, ParallelModel, parallelize
from meshtrain.train.step import cross_entropy, step_context, train_step


def model_args(cfg: Config, data_vocab_size: int | None = None) -> ModelArgs:
    """The model's shape: the preset, or a Hugging Face directory's config.json, with the overrides."""
    if cfg.model.init_from:
        from meshtrain.interop.hf import hf_model_args

        return cfg.model_args(base=hf_model_args(cfg.model.init_from.removeprefix("hf:")))
    return cfg.model_args(data_vocab_size)


def check_training(cfg: Config, world_size: int, data_vocab_size: int | None = None) -> ModelArgs:
    """Every check that needs the resolved model, the world size or the data; before any work."""
    args = model_args(cfg, data_vocab_size)
    check_model_args(args, cfg, data_vocab_size)
    Layout.from_config(cfg, world_size).validate(args, cfg)
    return args


def check_init_tokenizer(cfg: Config, dataset: Blend) -> None:
    """model.init_from: the data must be tokenized with the pretrained model's tokenizer, or every
    id means another token than the one the weights learned (a silent, wrong fine-tune)."""
    if not cfg.model.init_from:
        return
    from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE, template_of
    from meshtrain.data.prepare import tokenizer_fingerprint

    model_dir = Path(cfg.model.init_from.removeprefix("hf:"))
    theirs = model_dir / "tokenizer.json"
    if not theirs.is_file():
        log.warning(f"{model_dir} has no tokenizer.json: cannot check that {cfg.data.path} was tokenized with it")
        return
    if tokenizer_fingerprint(theirs) != tokenizer_fingerprint(dataset.tokenizer_path):
        raise DataError(
            f"{cfg.data.path} was tokenized with another tokenizer than model.init_from ({theirs}): prepare the data "
            f"with it, `meshtrain data prepare --tokenizer {theirs} ...`"
        )
    if dataset.template_path and template_of(model_dir) != DEFAULT_CHAT_TEMPLATE:
        if dataset.template_path.read_text() != template_of(model_dir):
            raise DataError(
                f"{cfg.data.path} was rendered with another chat template than model.init_from's ({model_dir}): "
                f"prepare it with `--tokenizer {theirs}` (which takes the model's template along)"
            )


def ensure_dataset(cfg: Config) -> Blend:
    """Build the default corpus on first use (data.corpus = "stdlib", data.path one directory);
    otherwise the data must already be prepared. Called by the launcher before workers start, and
    by rank 0 of a run started by an external launcher."""
    paths = [Path(p) for p, _ in parse_data_path(cfg.data.path)]
    if len(paths) == 1 and not (paths[0] / "manifest.json").is_file() and cfg.data.corpus:
        log.info(f"preparing the default corpus (Python standard library source) in {paths[0]} ...")
        prepare(stdlib_sources(), paths[0], vocab_size=cfg.data.vocab_size, progress=True)
    for path in paths:
        read_manifest(path)  # a clear error if missing or corrupt
    return Blend(cfg.data.path, cfg.training.seq_len)


def verify_data(dataset: Blend, rank: int, world: int) -> None:
    """Every shard's checksum, each rank reading its share; a damaged shard stops every rank with
    the same line."""
    problems = [p for source in dataset.sources for p in source.verify((rank, world))]
    if dist.is_initialized():
        everyone: list = [None] * world
        dist.all_gather_object(everyone, problems)
        problems = [p for ps in everyone for p in ps]
    if problems:
        raise DataError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


@dataclass
class TrainState:
    """This rank's share of a training run."""

    cfg: Config
    env: LaunchEnv
    device: torch.device
    dims: ParallelDims
    args: ModelArgs
    n_params: int
    model: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: Blend | None = None
    loader: DistributedLoader | None = None
    val: dict[str, list] = field(default_factory=dict)  # validation batches of each source
    checkpointer: Checkpointer | None = None

    @property
    def pp_group(self):
        return self.dims.mesh("pp").get_group() if self.dims.pp > 1 else None

    def context(self):
        return step_context(self.model, self.dims, self.cfg.training, self.device)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, n_targets: int | None = None):
        """One optimizer step (see train.step.train_step); the LR schedule is stepped by the caller.
        `n_targets`: targets in the global batch (None: every token of every rank's batch)."""
        return train_step(
            self.model,
            self.optimizer,
            inputs,
            targets,
            self.cfg.training,
            self.device,
            self.context,
            self.pp_group,
            n_targets,
            self.dims.dp,
        )

    @property
    def accumulation(self) -> int:
        return micro_batches(self.cfg.training, self.dims.dp)


def build(cfg: Config, env: LaunchEnv | None = None, with_data: bool = True) -> TrainState:
    """Start the process group, read the data (rank 0 prepares it first), build the model on the
    meta device and apply the layout, then the optimizer. Without data, the model's vocabulary is
    model.vocab_size (or the preset's): for tests and benchmarks that bring their own batches."""
    env = env or detect(launcher=cfg.launch.env)
    device = init_distributed(env, cfg.launch.device)
    dataset = None
    if with_data:
        if env.rank == 0:
            ensure_dataset(cfg)
        if dist.is_initialized():
            dist.barrier()
        dataset = Blend(cfg.data.path, cfg.training.seq_len)
        verify_data(dataset, env.rank, env.world_size)
        check_init_tokenizer(cfg, dataset)
    args = check_training(cfg, env.world_size, dataset.vocab_size if dataset else None)
    t = cfg.training
    torch.manual_seed(t.seed)
    dims = ParallelDims.from_config(cfg, env.world_size)
    dims.build_mesh(device.type)
    if env.rank == 0:
        from meshtrain.plan.check import warn_if_too_big

        warn_if_too_big(cfg, args, env.world_size, device, env.local_world_size)
    with torch.device("meta"):
        full_model = Llama(args)
    model = parallelize(full_model, dims, cfg.parallel, t, device, cross_entropy)
    optimizer, scheduler = build_optimizer(model.parameters(), t, dims.zero, dims.dp_group if dims.dp > 1 else None)
    state = TrainState(cfg, env, device, dims, args, num_params(full_model), model, optimizer, scheduler, dataset)
    if dataset is not None:
        state.loader = dataset.loader(t.global_batch_size, dims.dp_rank, dims.dp, t.seed, device.type == "cuda")
        for name, source in zip(dataset.names, dataset.sources):
            if len(source.val):  # few and fixed: copied to the device once
                batches = validation_batches(source.val, t.eval_batches, t.global_batch_size, dims.dp_rank, dims.dp)
                state.val[name] = [(x.to(device), y.to(device), n) for x, y, n in batches]
        root = Path(cfg.checkpoint.dir or Path(cfg.run.dir) / "checkpoints")
        state.checkpointer = Checkpointer(
            root, model.parts, optimizer, cfg.checkpoint.keep, cfg.checkpoint.async_, env.rank
        )
    return state
