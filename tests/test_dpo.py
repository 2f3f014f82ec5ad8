"""DPO: the loss of a batch of preference pairs equals the paper's formula (as TRL computes it), its
reference is the base with the adapters off, and training on pairs makes held-out pairs preferred
the chosen way."""

import pytest
import torch
import torch.nn.functional as F

from meshtrain.config import load_config
from meshtrain.data.loader import IGNORE_INDEX
from meshtrain.model.llama import copy_full_into
from meshtrain.train import build as build_state

BETA = 0.25
MODEL = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128}


def pair_batch(pairs: int, seq: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows chosen, rejected, chosen, ...: a shared prompt, then different answers of different
    lengths; targets only on the answers, padding ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2 * pairs, seq + 1), generator=g)
    targets = tokens[:, 1:].clone()
    for p in range(pairs):
        prompt = 4 + p
        tokens[2 * p + 1, : prompt + 1] = tokens[2 * p, : prompt + 1]
        for row, end in ((2 * p, seq - p), (2 * p + 1, seq - 2 * p - 1)):
            targets[row, :prompt] = IGNORE_INDEX
            targets[row, end:] = IGNORE_INDEX
    return tokens[:, :-1], targets


def trl_dpo_loss(policy_logits, reference_logits, targets, beta):
    """TRL's DPOTrainer, sigmoid loss, written out: per-sequence summed log-probabilities of the
    answer tokens, then -log sigmoid(beta x (policy log-ratio - reference log-ratio)), mean over
    pairs; the rewards are beta x (policy - reference) log-probabilities."""

    def logps(logits):
        mask = targets != IGNORE_INDEX
        per_token = torch.gather(logits.log_softmax(-1), 2, targets.clamp(min=0).unsqueeze(2)).squeeze(2)
        return (per_token * mask).sum(-1)

    policy, reference = logps(policy_logits), logps(reference_logits)
    chosen_logratios = policy[0::2] - policy[1::2]
    reference_logratios = reference[0::2] - reference[1::2]
    losses = -F.logsigmoid(beta * (chosen_logratios - reference_logratios))
    chosen_rewards = beta * (policy[0::2] - reference[0::2])
    rejected_rewards = beta * (policy[1::2] - reference[1::2])
    return losses.mean(), chosen_rewards, rejected_rewards


def test_the_dpo_loss_is_trls_formula_against_the_base_with_adapters_off():
    cfg = load_config(
        None,
        {
            **MODEL,
            "model.vocab_size": 256,
            "peft.method": "lora",
            "training.objective": "dpo",
            "training.dpo_beta": BETA,
            "training.global_batch_size": 4,
            "training.micro_batch_size": 2,
            "training.seq_len": 24,
            "run.dir": "unused",
        },
    )
    s = build_state(cfg, with_data=False)
    part = s.model.parts[0]
    inputs, targets = pair_batch(4, 24, 256)
    with torch.no_grad():  # adapters that change the model; the reference: B = 0, the base alone
        b_matrices = {n: p for n, p in part.named_parameters() if n.endswith("lora_b")}
        for name, p in b_matrices.items():
            copy_full_into(p, 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        policy_logits = part(inputs)
        trained = {n: p.detach().clone() for n, p in b_matrices.items()}
        for p in b_matrices.values():
            p.zero_()
        reference_logits = part(inputs)
        for name, p in b_matrices.items():
            p.copy_(trained[name])
    want, chosen, rejected = trl_dpo_loss(policy_logits, reference_logits, targets, BETA)
    assert want.item() > 0.05 and (chosen - rejected).abs().max() > 1e-3  # the adapters matter

    loss, _, _ = s.step(inputs, targets, n_targets=4)  # two micro-batches of two pairs
    assert torch.allclose(loss, want, rtol=1e-5), (loss.item(), want.item())
    report = s.model.preference.report()
    assert report["chosen_reward"] == pytest.approx(chosen.mean().item(), rel=1e-4)
    assert report["rejected_reward"] == pytest.approx(rejected.mean().item(), rel=1e-4)
    assert report["reward_margin"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-4)
    assert report["reward_accuracy"] == (chosen > rejected).float().mean().item()

    # descending the loss on this batch raises the chosen answers' margin
    margins = []
    for _ in range(8):
        s.step(inputs, targets, n_targets=4)
        margins.append(s.model.preference.report()["reward_margin"])
    assert margins[-1] > margins[0] + 0.1, margins
