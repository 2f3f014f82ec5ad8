"""fp16's dynamic loss scaling, with torch's GradScaler (the sharded one under FSDP2).

fp16 holds numbers up to 65504 and down to 6e-8 (subnormal): small gradients underflow to zero
unless the loss is multiplied by a large scale first. The scale starts high; a step whose gradients
overflow (inf/NaN) is skipped and the scale halved; after `growth_interval` clean steps it doubles.

How it meets the step (train/step.py): the loss of every micro-batch is scaled before backward (the
pipeline schedules scale it in their loss_fn); after backward `unscale` divides the gradients by the
scale, so the gradient norm, clipping and the optimizer see true gradients. Whether to skip is
decided by the global gradient norm, which every rank computes alike over every shard, stage and
tensor-parallel slice: the scale then moves alike on every rank. GradScaler's own inf check covers
only the gradients this rank's optimizer holds (a ZeRO-1 partition, a pipeline stage), so `update`
hands it the global verdict instead.
"""

from __future__ import annotations

import torch
from torch.amp import GradScaler

from meshtrain.config import TrainingConfig

DEFAULT_INITIAL_SCALE = 2.0**16  # GradScaler's
DEFAULT_WINDOW = 2000  # GradScaler's growth_interval


class LossScaler:
    def __init__(self, t: TrainingConfig, device: torch.device, fsdp: bool):
        if fsdp:  # (FSDP loads DTensor; see dtensor.py)
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as kind
        else:
            kind = GradScaler
        self.growth_interval = t.loss_scale_window or DEFAULT_WINDOW
        self.scaler = kind(
            device.type, init_scale=t.initial_loss_scale or DEFAULT_INITIAL_SCALE, growth_interval=self.growth_interval
        )
        self.one = torch.ones((), device=device)
        self.factor()  # creates the scale now: a pipeline's first stage never scales a loss itself

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def factor(self) -> torch.Tensor:
        """The current scale as a device tensor (no host sync)."""
        return self.scaler.scale(self.one)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale, in place (one pass)."""
        self.scaler.unscale_(optimizer)

    def update(self, optimizer: torch.optim.Optimizer, skipped: torch.Tensor) -> None:
        """Back off after a skipped step, grow after a window of clean ones; `skipped` is the step's
        global verdict (1.0: the gradient norm was not finite on some rank)."""
        state = self.scaler._per_optimizer_states[id(optimizer)]  # what unscale() recorded
        state["found_inf_per_device"] = {skipped.device: skipped.float()}
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The saved scale and clean-step count; the window stays this run's training.loss_scale_window."""
        self.scaler.load_state_dict({**state, "growth_interval": self.growth_interval})
