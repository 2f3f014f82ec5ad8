"""DPO: the loss of a batch of preference pairs equals the paper's formula (as TRL computes it), its
reference is the base with the adapters off, and training on pairs makes held-out pairs preferred
the chosen way."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_run, assert_user_error, read_metrics, run_cli, train_args, train_together
from meshtrain.config import load_config
from meshtrain.data import prepare
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE
from meshtrain.data.prepare import ChatOptions
from meshtrain.data.windows import IGNORE_INDEX
from meshtrain.model.llama import copy_full_into
from meshtrain.train.build import build as build_state

BETA = 0.25


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


MODEL = {
    "training.dtype": "fp32",
    "model.dim": 64,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.ffn_dim": 128,
}


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


@pytest.mark.parametrize("peft", ["lora", "none"])
def test_the_dpo_loss_is_trls_formula_against_the_base(peft):
    """The reference: LoRA's base with the adapters off, or without adapters a frozen copy of the
    base (recomputed here from the seed, apart from the trainer's copy)."""
    from meshtrain.model import Llama

    overrides = {
        **MODEL,
        "model.vocab_size": 256,
        "training.objective": "dpo",
        "training.dpo_beta": BETA,
        "training.global_batch_size": 4,
        "training.micro_batch_size": 2,
        "training.seq_len": 24,
        "run.dir": "unused",
    }
    s = build_state(load_config(None, {**overrides, "peft.method": peft}), with_data=False)
    part = s.model.parts[0]
    inputs, targets = pair_batch(4, 24, 256)
    with torch.no_grad():
        base = Llama(s.args)
        base.init_weights(s.cfg.training.seed)
        reference_logits = base(inputs)
        # a policy apart from its base: B != 0, or every weight moved
        moved = [p for n, p in part.named_parameters() if n.endswith("lora_b") or peft == "none"]
        for i, p in enumerate(moved):
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            copy_full_into(p, p.detach().clone() + (0.3 if peft == "lora" else 0.02) * noise)
        policy_logits = part(inputs)
    want, chosen, rejected = trl_dpo_loss(policy_logits, reference_logits, targets, BETA)
    assert want.item() > 0.05 and (chosen - rejected).abs().max() > 1e-3  # the policy differs from its base

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


COLORS, THINGS = "red blue green black white".split(), "cat dog fish bird tree sun moon star rain snow wind".split()


def color_pairs(n: int, seed: int = 0) -> list[dict]:
    """A preference no prompt decides: answers of colour words preferred over answers of things."""
    rng = random.Random(seed)

    def three(words):
        return " ".join(rng.choice(words) for _ in range(3))

    return [
        {
            "prompt": [{"role": "user", "content": three(COLORS + THINGS)}],
            "chosen": [{"role": "assistant", "content": three(COLORS)}],
            "rejected": [{"role": "assistant", "content": three(THINGS)}],
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def pairs_data(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prefs") / "pairs"
    write_jsonl(out.with_suffix(".jsonl"), color_pairs(1500))
    prepare(
        [out.with_suffix(".jsonl")],
        out,
        tokenizer=corpus / "tokenizer.json",
        val_fraction=0.1,
        progress=False,
        workers=1,
        chat=ChatOptions(DEFAULT_CHAT_TEMPLATE, format="preference"),
    )
    return out


def preferred_share(model, pairs) -> float:
    """How often the model gives the chosen answer the higher log-probability (held-out pairs)."""
    from meshtrain.train.preference import sequence_logps

    wins = 0
    with torch.no_grad():
        for w in range(len(pairs)):
            inputs, targets, _ = pairs.gather([w])
            logps = sequence_logps(model(inputs), targets)
            wins += int(logps[0] > logps[1])
    return wins / len(pairs)


DPO_RUN = ("--training.objective", "dpo", "--peft.method", "lora", "--training.lr", "1e-2", "--training.seq_len", "64")


def test_dpo_makes_held_out_pairs_preferred_the_chosen_way(pairs_data, cli_env, tmp_path):
    from meshtrain.data.loader import Dataset
    from meshtrain.interop.hf import load_full_model
    from meshtrain.model import Llama

    run = tmp_path / "run"
    args = train_args(pairs_data, run, *DPO_RUN, "--training.steps", "120", "--training.global_batch_size", "16")
    result = run_cli([*args, "--training.micro_batch_size", "16", "--training.eval_every", "60"], cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run)
    assert {"chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "pairs"} <= metrics[0].keys()
    assert metrics[-1]["val_reward_accuracy"] >= 0.9 and metrics[-1]["val_reward_margin"] > 0
    held_out = Dataset(pairs_data, 64).val
    trained, args_, _ = load_full_model(run)
    base = Llama(args_)
    base.init_weights(0)  # the run's base: the seed's initialisation
    before, after = preferred_share(base.eval(), held_out), preferred_share(trained.eval(), held_out)
    assert after >= 0.8 and after >= before + 0.4, (before, after)  # 0.32 -> 0.89 when written


@pytest.mark.multiproc
def test_dpo_is_the_same_on_one_process_zero3_and_tp2_with_lora_and_without(pairs_data, cli_env, tmp_path):
    """With LoRA, and full-weight (its frozen copy of the base laid out as the model)."""
    runs = {}
    layouts = {
        "single": (),
        "zero3": ("--parallel.zero", "3"),
        "tp2": ("--parallel.tp", "2"),
        "full-single": ("--peft.method", "none"),
        "full-zero3": ("--peft.method", "none", "--parallel.zero", "3"),
    }
    two_process = []  # trained in one launch (conftest.train_together)
    for name, extra in layouts.items():
        runs[name] = tmp_path / name
        args = train_args(pairs_data, runs[name], *DPO_RUN, "--training.steps", "4", "--training.eval_every", "2")
        if {"--parallel.zero", "--parallel.tp"} & set(extra):
            two_process.append([*args, *extra])
            continue
        result = run_cli([*args, *extra], cli_env)
        assert result.returncode == 0, result.stderr[-3000:]
    train_together(two_process, 2, cli_env)
    for name, reference in (("zero3", "single"), ("tp2", "single"), ("full-zero3", "full-single")):
        assert_same_run(runs[name], runs[reference])
        for got, want in zip(read_metrics(runs[name]), read_metrics(runs[reference])):
            assert got["reward_margin"] == pytest.approx(want["reward_margin"], rel=1e-3, abs=1e-6)


def test_dpo_needs_preference_data_and_preference_data_needs_dpo(corpus, pairs_data, cli_env, tmp_path):
    result = run_cli(train_args(corpus, tmp_path / "a", *DPO_RUN), cli_env)
    assert_user_error(result, "learns from preference pairs", "--format preference")
    result = run_cli(train_args(pairs_data, tmp_path / "b", "--peft.method", "lora"), cli_env)
    assert_user_error(result, "holds preference pairs", "training.objective = dpo")
