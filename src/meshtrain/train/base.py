"""What a run starts from, and what its checkpoints belong to: the base weights (model.init_from, or
the seeded initialisation) loaded into the model and DPO's frozen reference, and the records that
keep a resume on the same base: a LoRA checkpoint's adapters, a full-weight checkpoint's init_from,
a full-weight DPO checkpoint's reference model."""

from __future__ import annotations

from pathlib import Path

from meshtrain.checkpoint import read_train_state
from meshtrain.errors import MeshtrainError
from meshtrain.logs import log
from meshtrain.model.lora import quantize_base
from meshtrain.train.build import TrainState


def load_base(s: TrainState, into_model: bool = True) -> None:
    """The weights training starts from: model.init_from's, else the seeded initialisation already
    in place; into the model (`into_model`) and DPO's frozen reference copy. QLoRA then stores the
    adapted linears' weights in 4-bit."""
    if s.cfg.model.init_from:
        from meshtrain.interop import load_hf_weights

        directory = s.cfg.model.init_from.removeprefix("hf:")
        for parts in (s.model.parts if into_model else None, s.model.reference):
            if parts:
                load_hf_weights(parts, directory, s.args)
        log.info(f"initialised from {s.cfg.model.init_from}")
    if s.lora is not None and s.lora.quantized:
        for part in s.model.parts:
            quantize_base(part)


def peft_record(s: TrainState) -> dict | None:
    """What a LoRA checkpoint's adapters belong to: their settings and the base model."""
    if s.lora is None:
        return None
    storage = s.cfg.training.dtype if s.cfg.training.dtype in ("bf16", "fp16") else "fp32"
    return {**s.lora.to_dict(), "base": s.base, "base_storage": storage}


def reference_record(s: TrainState) -> dict | None:
    """What a full-weight DPO checkpoint's frozen reference is: the base as the run started from it.
    The reference is not in the checkpoint (it never changes): a resume loads it from model.init_from
    again, which must still hold the same model."""
    return s.base if s.model.reference is not None and s.lora is None else None


def check_same_base(s: TrainState, path: Path) -> None:
    """The checkpoint to resume belongs to this run's model: LoRA adapters to the same base and
    settings; every weight to a run started from the same model.init_from (the checkpoint's weights
    are what trains on, so another init_from would be ignored without a word)."""
    state = read_train_state(path)
    saved, mine, init_from = state.get("peft"), peft_record(s), s.base.get("init_from")
    if saved and mine:  # what the checkpoint recorded of its base (the weights' fingerprint since 2026-11-27)
        mine = {**mine, "base": {k: v for k, v in mine["base"].items() if k in saved.get("base", {})}}
    if saved is None and mine is None and state.get("init_from", init_from) != init_from:  # recorded since 2026-11
        raise MeshtrainError(
            f"checkpoint {path} continues a run started from {state['init_from'] or 'a random initialisation'}, but "
            f"this run's model.init_from is {s.cfg.model.init_from or 'unset'}: its weights would be ignored (they "
            "come from the checkpoint); resume with the same model.init_from, or set checkpoint.resume = none"
        )
    if (reference := state.get("reference")) and (now := reference_record(s)) is not None:
        if changed := [k for k in reference if k in now and reference[k] != now[k]]:
            raise MeshtrainError(
                f"checkpoint {path} is a DPO run whose reference model is "
                f"{s.cfg.model.init_from or 'the seeded random initialisation'} as it was when the "
                f"run started, but its {changed[0]} changed since: the loss would move without a word; restore that "
                "model, or set checkpoint.resume = none"
            )
    if saved == mine:  # also both None: every weight
        return
    if saved is None or mine is None:
        held = "LoRA adapters" if saved else "every weight"
        raise MeshtrainError(
            f"checkpoint {path} holds {held}, but this run's peft.method is {s.cfg.peft.method}: resume with the "
            "peft settings it was saved with, or set checkpoint.resume = none"
        )
    diff = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in mine.items() if saved.get(k) != v)
    if [k for k in mine if saved.get(k) != mine[k]] == ["base_storage"] and s.job.arithmetic.how != "given":
        raise MeshtrainError(  # training.dtype = auto can choose otherwise on another machine, thread count, load
            f"checkpoint {path} holds adapters trained on a {saved['base_storage']} base, but this start stores it "
            f"in {mine['base_storage']} ({s.job.arithmetic.describe()}): set training.dtype = {saved['base_storage']} "
            "to resume them"
        )
    raise MeshtrainError(
        f"checkpoint {path} holds adapters for another setting or base ({diff}); resume with the same [peft] and "
        "model.init_from, or set checkpoint.resume = none"
    )
