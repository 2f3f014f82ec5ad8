"""What export, serve and generate read from a run directory: the latest weights by training step,
a LoRA run's base as it was trained on, and generations that are refused rather than cut short. Run
directories are made by hand with the project's own save functions on a tiny model (no training)."""

import hashlib
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from conftest import a_train_state
from meshtrain.checkpoint import MARKER
from meshtrain.checkpoint.checkpointer import Checkpointer
from meshtrain.errors import CheckpointError, MeshtrainError
from meshtrain.interop.base import load_base_model
from meshtrain.interop.hf import export_adapter, export_hf, load_full_model
from meshtrain.interop.weights import run_model_args, save_model
from meshtrain.model import Llama, ModelArgs
from meshtrain.model.args import LoraSpec
from meshtrain.model.lora import apply_lora
from meshtrain.serve import generate_to_terminal

ARGS = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=512, max_seq_len=32)


def weights(seed: int) -> dict[str, torch.Tensor]:
    model = Llama(ARGS)
    model.init_weights(seed)
    return model.state_dict()


def make_run(run_dir, corpus, seed: int = 0, step: int | None = None):
    save_model(weights(seed), ARGS, run_dir, step=step)
    shutil.copyfile(corpus / "tokenizer.json", run_dir / "tokenizer.json")
    return run_dir


def save_checkpoint(run_dir, seed: int, step: int):
    model = Llama(ARGS)
    model.load_state_dict(weights(seed))
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = Checkpointer(run_dir / "checkpoints", [model], optimizer, keep=2, use_async=False, rank=0)
    checkpointer.save(step, a_train_state(step=step, model=dict(ARGS.__dict__)), blocking=True)
    return next((run_dir / "checkpoints").glob(f"step_*{step}"))


def loaded_is(run_dir, seed: int) -> bool:
    model, _, _ = load_full_model(run_dir)
    return torch.equal(
        model.state_dict()["layers.0.attention.wq.weight"], weights(seed)["layers.0.attention.wq.weight"]
    )


@pytest.mark.parametrize("final_step, final_wins", [(9, True), (5, False), (3, False)])
def test_the_later_step_of_checkpoint_and_final_weights_is_read(corpus, tmp_path, final_step, final_wins):
    """checkpoint.every = 0: a run stopped at step 5 and resumed to the end (step 9) keeps the
    checkpoint of step 5 beside its final weights, which must win; a tie reads the checkpoint."""
    save_checkpoint(tmp_path, seed=1, step=5)
    make_run(tmp_path, corpus, seed=2, step=final_step)
    assert loaded_is(tmp_path, 2 if final_wins else 1)


def test_final_weights_without_a_step_are_chosen_by_time_and_said(corpus, tmp_path, caplog):
    ckpt = save_checkpoint(tmp_path, seed=1, step=5)
    make_run(tmp_path, corpus, seed=2)  # written before meshtrain recorded the step
    final = tmp_path / "model.safetensors"
    os.utime(ckpt / MARKER, (1_000_000, 1_000_000))
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert loaded_is(tmp_path, 2)
    assert f"{final} records no training step: using {final}, written after {ckpt}" in caplog.text
    os.utime(final, (500_000, 500_000))
    assert loaded_is(tmp_path, 1)


def test_save_model_records_the_step(tmp_path):
    from safetensors import safe_open

    save_model(weights(0), ARGS, tmp_path, step=7)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata()["step"] == "7"
    assert run_model_args(tmp_path / "model.json") == ARGS  # read back as the same ModelArgs


@pytest.fixture
def lora_run(corpus, tmp_path):
    """A LoRA run on a Hugging Face base that `meshtrain export` wrote (so it carries meshtrain.json)."""
    (tmp_path / "plain").mkdir()
    base = export_hf(make_run(tmp_path / "plain", corpus), tmp_path / "base")
    spec = LoraSpec("lora", rank=2, alpha=4.0)
    model = Llama(ARGS)
    apply_lora(model, spec)
    digest = hashlib.sha256((base / "config.json").read_bytes()).hexdigest()
    record = {
        **spec.to_dict(),
        "base": {"init_from": str(base.resolve()), "config_sha256": digest},
        "base_storage": "fp32",
    }
    run = tmp_path / "lora"
    run.mkdir()
    save_model(model.state_dict(), ARGS, run, record, step=3)
    shutil.copyfile(corpus / "tokenizer.json", run / "tokenizer.json")
    return run, base, record


@pytest.mark.parametrize("export", [export_hf, export_adapter])
def test_an_export_onto_the_lora_base_is_refused(lora_run, export):
    run, base, _ = lora_run
    before = load_file(base / "model.safetensors")
    # the base is an earlier `meshtrain export` (it carries the export marker): only being the
    # adapters' base protects it
    with pytest.raises(MeshtrainError, match=f"--out {base.resolve()} is the input"):
        export(run, base)
    assert load_file(base / "model.safetensors").keys() == before.keys()


def test_a_changed_lora_base_is_refused(lora_run, tmp_path):
    run, base, record = lora_run
    export_adapter(run, tmp_path / "adapter")  # the base as trained on: accepted
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    message = f"the base model at {base.resolve()} changed since the adapters were trained on it"
    with pytest.raises(MeshtrainError, match=message):
        load_base_model(ARGS, record["base"])
    with pytest.raises(MeshtrainError, match=message):
        export_adapter(run, tmp_path / "adapter")


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


def test_generate_refuses_more_tokens_than_the_context_holds(corpus, tmp_path, capsys):
    run = make_run(tmp_path, corpus)
    prompt = "def f():"
    n = len(Tokenizer.from_file(str(corpus / "tokenizer.json")).encode(prompt).ids)
    with pytest.raises(MeshtrainError, match=f"lower --max-tokens to {32 - n} or shorten the prompt"):
        generate_to_terminal(str(run), prompt, 32 - n + 1, GREEDY, None, "cpu")
    assert generate_to_terminal(str(run), prompt, 32 - n, GREEDY, None, "cpu") == 0
    with pytest.raises(MeshtrainError, match="--seed shapes sampling, but --temperature 0 decodes greedily"):
        generate_to_terminal(str(run), prompt, 4, GREEDY, 3, "cpu")
    assert capsys.readouterr().out.startswith(prompt)


def test_saving_a_step_that_is_already_committed_keeps_that_checkpoint(tmp_path, monkeypatch):
    """A finished run started again (its last checkpoint is the last step) saves that step again at
    its end: the committed checkpoint is kept as it is, never deleted first (a failed second write
    would have lost the only copy of the final weights)."""
    path = save_checkpoint(tmp_path, seed=0, step=5)
    marker = (path / MARKER).read_bytes()
    model = Llama(ARGS)
    model.load_state_dict(weights(1))
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = Checkpointer(tmp_path / "checkpoints", [model], optimizer, keep=2, use_async=False, rank=0)
    monkeypatch.setattr("torch.distributed.checkpoint.save", lambda *a, **k: pytest.fail("saved over step 5"))
    checkpointer.save(5, a_train_state(step=5, model=dict(ARGS.__dict__)), blocking=True)
    assert (path / MARKER).read_bytes() == marker and loaded_is(tmp_path, 0)


def test_a_lora_base_with_other_weights_of_the_same_shape_is_refused(lora_run):
    """The base exported again from another run of the same shape: config.json is byte for byte the
    same, the weights are not. A record with the weights' fingerprint refuses it; a record saved
    before the fingerprint was kept (only config.json's checksum) still loads."""
    from safetensors.torch import save_file

    from meshtrain.interop.base import weights_fingerprint

    _, base, record = lora_run
    recorded = {**record["base"], "weights_sha256": weights_fingerprint(base)}
    load_base_model(ARGS, recorded)
    weights = load_file(base / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MeshtrainError, match="changed since the adapters were trained on it \\(its weights differ\\)"):
        load_base_model(ARGS, recorded)
    load_base_model(ARGS, record["base"])  # an older record: nothing to compare the weights with


def test_a_checkpoint_whose_optimizer_groups_differ_is_refused_in_one_line(tmp_path):
    """DCP reports a key the checkpoint lacks as a CheckpointException, a BaseException: named in one
    line like any other load failure, not a traceback (an MoE checkpoint saved before its experts had
    an optimizer group of their own)."""
    path = save_checkpoint(tmp_path, seed=0, step=5)
    model = Llama(ARGS)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:2]}, {"params": params[2:]}])
    checkpointer = Checkpointer(tmp_path / "checkpoints", [model], optimizer, keep=2, use_async=False, rank=0)
    with pytest.raises(CheckpointError, match="could not be loaded into this job: Missing key") as error:
        checkpointer.load(path, dict(ARGS.__dict__))
    assert "\n" not in str(error.value)
