"""Training: `build` what a step runs on, `train_step` one step, `train` the loop."""

from meshtrain.train.build import TrainState, build, check_init_tokenizer, check_training, ensure_dataset, model_args
from meshtrain.train.loop import train
from meshtrain.train.step import cross_entropy, evaluate, train_step

__all__ = [
    "TrainState",
    "build",
    "check_init_tokenizer",
    "check_training",
    "cross_entropy",
    "ensure_dataset",
    "evaluate",
    "model_args",
    "train",
    "train_step",
]
