"""The base a run starts from, recorded and checked: model.init_from's directory (its config.json's
checksum and its weights' fingerprint) or the seed, so that adapters and a DPO reference are only
ever joined to the base they were trained on."""

from __future__ import annotations

import hashlib
from pathlib import Path

from meshtrain.errors import MeshtrainError
from meshtrain.interop.hf_import import load_hf_weights
from meshtrain.model.args import LoraSpec
from meshtrain.model.llama import Llama, ModelArgs
from meshtrain.model.lora import merge_state_dict


def base_identity(cfg) -> dict:
    """The model a LoRA run's adapters belong to: model.init_from's directory, its config.json's
    SHA-256 and its weights' fingerprint, or the seed of a random initialisation."""
    if not cfg.model.init_from:
        return {"seed": cfg.training.seed}
    directory = Path(cfg.model.init_from.removeprefix("hf:")).resolve()
    return {
        "init_from": str(directory),
        "config_sha256": _config_sha256(directory),
        "weights_sha256": weights_fingerprint(directory),
    }


def _config_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / "config.json").read_bytes()).hexdigest()


FINGERPRINT_BLOCKS = 16  # blocks of 4 KiB read from each weight file's data


def weights_fingerprint(directory: Path) -> str:
    """A SHA-256 of each safetensors file's name, size, header and 16 blocks of 4 KiB spread over its
    data: another model of the same shape (retrained, exported again) differs in nearly every byte,
    so it differs here, without reading gigabytes at each save and resume."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            header = min(int.from_bytes(f.read(8), "little"), size)  # not a safetensors file: its bytes
            digest.update(f.read(header))
            start = 8 + header
            for i in range(FINGERPRINT_BLOCKS):
                f.seek(start + max(size - start, 0) * i // FINGERPRINT_BLOCKS)
                digest.update(f.read(4096))
    return digest.hexdigest()


def check_base(base: dict) -> None:
    """Refuse a LoRA run's Hugging Face base that is gone or is no longer the model its adapters were
    trained on (config.json's checksum or the weights' fingerprint differs; a record without one was
    saved before it was kept): adapters on another base are silently wrong weights."""
    if "init_from" not in base:
        return
    directory = Path(base["init_from"])
    if not (directory / "config.json").is_file():
        raise MeshtrainError(f"the adapters were trained on {directory}, which is gone: put the base model back there")
    for key, what, now in (
        ("config_sha256", "config.json differs", _config_sha256),
        ("weights_sha256", "its weights differ", weights_fingerprint),
    ):
        if base.get(key) not in (None, now(directory)):
            raise MeshtrainError(
                f"the base model at {directory} changed since the adapters were trained on it ({what}): "
                "restore the model the run started from there"
            )


def load_base_model(args: ModelArgs, base: dict) -> Llama:
    """A LoRA run's base on the CPU, as the run started from it."""
    model = Llama(args)
    model.init_weights(base.get("seed", 0))
    check_base(base)
    if "init_from" in base:
        load_hf_weights([model], Path(base["init_from"]), args)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


def merged_onto_base(trained: dict, args: ModelArgs, peft: dict) -> dict:
    """A LoRA run's weights with its adapters merged. The frozen weights are the base read again from
    where the run started (model.init_from, or the seed), not the run's copy of them, which training
    may store in bf16/fp16 or 4-bit: an untouched weight is the base's bit for bit, an adapted one the
    base plus the adapters' update B A in fp32 (what peft computes when it loads the adapters onto
    the base). Of `trained` the adapters and the buffers are used (an MoE router's bias moves under
    LoRA too); its frozen parameters are not."""
    base = load_base_model(args, peft["base"])
    frozen = {name: p.detach() for name, p in base.named_parameters(remove_duplicate=False)}
    state = {**{k: v for k, v in trained.items() if k not in frozen}, **frozen}
    return merge_state_dict(state, LoraSpec.from_dict(peft))[0]
