"""Training: `preflight` every check before work, `build` what a step runs on, `train_step` one
step, `train` the loop; `dry_run` the same build at any world size on fake tensors."""

from meshtrain.train.build import TrainState, build, build_model, ensure_dataset
from meshtrain.train.loop import train
from meshtrain.train.preflight import check_init_tokenizer, model_args, preflight
from meshtrain.train.step import cross_entropy, evaluate, train_step

__all__ = [
    "TrainState",
    "build",
    "build_model",
    "check_init_tokenizer",
    "cross_entropy",
    "ensure_dataset",
    "evaluate",
    "model_args",
    "preflight",
    "train",
    "train_step",
]
