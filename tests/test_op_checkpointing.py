"""training.activation_checkpointing = "op" (op-level selective checkpointing): the same step as
without checkpointing, on one process and across ZeRO-3 and TP 2, and the bytes it keeps: between
"full" and "none", as the planner predicts (plan/saved.py op_block)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_same_run, train_args, train_together
from meshtrain.config import load_config
from meshtrain.job.model import model_args
from meshtrain.layout import Layout
from meshtrain.model import Llama
from meshtrain.model.shapes import Shape
from meshtrain.parallel import apply_ac
from meshtrain.plan import Workload, activation_bytes
from meshtrain.train.build import build
from meshtrain.train.measure import SavedActivations
from meshtrain.train.step import cross_entropy

WRAPPED = "._checkpoint_wrapped_module"


def test_op_steps_as_none_does():
    """One in-process step of the default model: the loss and every gradient bitwise those without
    checkpointing (the recomputed ops rerun on the same inputs; the saved ones are the forward's)."""
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("none", "op"):
        state = build(
            load_config(
                None, {"run.dir": "unused", "training.activation_checkpointing": mode, "training.dtype": "fp32"}
            ),
            with_data=False,
        )
        loss = state.step(tokens[:, :-1], tokens[:, 1:])
        part = state.model.parts[0]
        grads[mode] = (loss, {n.replace(WRAPPED, ""): p.grad for n, p in part.named_parameters()})
    (loss, want), (got_loss, got) = grads["none"], grads["op"]
    assert got_loss == loss
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


OP_LAYOUTS = {"zero3": ("--parallel.zero", "3"), "tp2": ("--parallel.tp", "2")}


@pytest.fixture(scope="module")
def op_runs(corpus, cli_env, tmp_path_factory):
    """The run dir of each of OP_LAYOUTS with "op", both trained in one 2-process launch (conftest.train_together)."""
    dirs = {name: tmp_path_factory.mktemp(f"op-{name}") for name in OP_LAYOUTS}
    op = ("--training.activation_checkpointing", "op")
    train_together([train_args(corpus, dirs[name], *extra, *op) for name, extra in OP_LAYOUTS.items()], 2, cli_env)
    return dirs


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(OP_LAYOUTS))
def test_op_trains_as_one_process_does(reference_run, op_runs, name):
    """Two processes with "op" against one without checkpointing: the same losses, gradient norms
    and weights, within the tolerance of a different summation order."""
    assert_same_run(op_runs[name], reference_run())


def test_op_keeps_what_the_planner_predicts_between_full_and_none():
    """What autograd and op's checkpoint cache keep for one micro-batch: strictly between "full" and
    "none", and within 2% of the planner's bytes for "op"."""
    micro, seq = 2, 64
    cfg = load_config(
        None, {"training.seq_len": seq, "model.max_seq_len": seq, "model.vocab_size": 2048, "training.dtype": "fp32"}
    )
    tokens = torch.randint(0, 2048, (micro, seq + 1), generator=torch.Generator().manual_seed(0))
    measured = {}
    for mode in ("none", "op", "full"):
        torch.manual_seed(0)
        model = Llama(model_args(cfg))
        apply_ac(model, mode)
        with SavedActivations(model) as saved:
            cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        measured[mode] = saved.bytes
    assert measured["full"] < measured["op"] < measured["none"], measured
    w = Workload(Shape.from_args(model_args(cfg)), seq, "fp32", device="cpu")
    layout = Layout(global_batch_size=micro, micro_batch_size=micro, activation_checkpointing="op")
    assert activation_bytes(w, layout)["saved"] == pytest.approx(measured["op"], rel=0.02)
