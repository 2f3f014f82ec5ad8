"""Direct Preference Optimization (Rafailov et al. 2023): learn from pairs of answers to one prompt,
one preferred (chosen), one not (rejected), with no reward model and no sampling.

    loss = -log sigmoid(beta [(log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))])

log pi(y|x) sums the policy's log-probabilities of the answer's tokens (the targets the data's mask
keeps); `ref` is the model training started from, frozen. With LoRA the reference is the same
weights with the adapters off, so it costs a forward pass and no memory. A batch holds the pairs'
rows interleaved, chosen then rejected (data/loader.py), so any split into micro-batches of whole
pairs keeps each pair together. The metrics are TRL's: each answer's implicit reward
beta (log pi - log ref), their margin, and how often the chosen one's is the larger.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.data.windows import IGNORE_INDEX

DEFAULT_BETA = 0.1  # TRL's


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(rows,) the summed log-probability of each row's target tokens. Works on vocabulary-sharded
    logits under loss_parallel() too (cross-entropy is the op it parallelises)."""
    token_nll = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    if hasattr(token_nll, "full_tensor"):
        token_nll = token_nll.full_tensor()
    return -token_nll.view(targets.shape).sum(-1)


class PreferenceLoss:
    """The DPO loss of a micro-batch, summed over its pairs, and running sums of the reward metrics
    (kept on the device: read only when a step is logged)."""

    def __init__(self, beta: float, device: torch.device):
        self.beta = beta
        self.sums = torch.zeros(4, device=device)  # chosen reward, rejected reward, chosen preferred, pairs

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
        logps = sequence_logps(logits, targets)
        rewards = self.beta * (logps - reference_logps.detach())
        chosen, rejected = rewards[0::2], rewards[1::2]
        with torch.no_grad():
            stats = torch.stack(
                [chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), torch.tensor(float(len(chosen)))]
            )
            self.sums += stats.to(self.sums.device)
        return -F.logsigmoid(chosen - rejected).sum()

    def report(self, dp_group=None) -> dict:
        """The means since the last report over every data-parallel rank's pairs; resets the sums."""
        sums = self.sums.clone()
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        chosen, rejected, preferred, pairs = sums.tolist()
        self.sums.zero_()
        if not pairs:
            return {}
        return {
            "chosen_reward": chosen / pairs,
            "rejected_reward": rejected / pairs,
            "reward_margin": (chosen - rejected) / pairs,
            "reward_accuracy": preferred / pairs,
        }
