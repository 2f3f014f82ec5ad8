"""A Hugging Face directory in (`model.init_from = "hf:DIR"`, `serve DIR`): its config.json as the
model's shape, its weights into this rank's model, and its own files kept with the run that starts
from it. Import reads one tensor at a time from the safetensors files, and only those this rank
keeps: a model under ZeRO-3, TP or a pipeline never passes through one rank's memory whole."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from meshtrain.data.chat import TEMPLATE_FILE
from meshtrain.errors import MeshtrainError
from meshtrain.files import read_json_object
from meshtrain.interop.families import check_longer_context, config_to_args
from meshtrain.interop.hf_dir import HFWeights, check_model_directory
from meshtrain.interop.hf_names import halves_to_pairs, rotary_heads, to_hf_names
from meshtrain.model.llama import ModelArgs, clean_fqn, copy_full_into
from meshtrain.model.lora import ADAPTER_NAMES
from meshtrain.model.shapes import Shape

# The files of a Hugging Face directory besides its weights: kept with a run that starts from one
# (<run>/hf_source/), so its export and its server use the model's own tokenizer, end tokens and
# chat template, and its config.json comes back unchanged.
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    TEMPLATE_FILE,
)


SOURCE_DIR = "hf_source"


def hf_model_args(directory: str | Path, vocab_multiple: int = 64) -> ModelArgs:
    """The shape of a Hugging Face directory's model: the first thing training, serving and generating
    read from it, so a directory transformers would load as another model is refused before any work."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise MeshtrainError(f"model.init_from: {path} does not exist (expected a Hugging Face model directory)")
    check_model_directory(Path(directory))
    return config_to_args(read_json_object(path), f"model.init_from: {path}", vocab_multiple)


def check_context_length(directory: str | Path, max_seq_len: int, length: str = "model.max_seq_len") -> None:
    """A context longer than the directory's config.json gives (`length`: the setting that raised it)
    is refused where transformers would attend within a sliding window past that config's context."""
    path = Path(directory) / "config.json"
    check_longer_context(read_json_object(path), max_seq_len, length, f"model.init_from: {path}")


def load_hf_weights(parts, directory: str | Path, args: ModelArgs) -> None:
    """Copy Hugging Face weights into this rank's (possibly sharded, possibly partial) model, one
    tensor at a time."""
    directory = Path(directory)
    wanted = {clean_fqn(n): p for part in parts for n, p in part.named_parameters() if not n.endswith(ADAPTER_NAMES)}
    with contextlib.ExitStack() as stack, torch.no_grad():
        weights = HFWeights(directory, stack)
        params = [p.name for p in Shape.from_args(args).parameters()] + ["output.weight"]
        known = {theirs for name in params for theirs in to_hf_names(name, args)}
        unknown = [n for n in weights.names() if n not in known and not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise MeshtrainError(
                f"model.init_from: {directory} has weights meshtrain cannot place: {', '.join(unknown[:3])}"
            )
        if args.tie_embeddings and "lm_head.weight" in weights.where:
            if not torch.equal(weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")):
                raise MeshtrainError(
                    f"model.init_from: {directory} ties its embeddings (tie_word_embeddings) but holds an "
                    "lm_head.weight that differs from them: set tie_word_embeddings to false to use both"
                )
        for ours, param in wanted.items():
            names = to_hf_names(ours, args) if not (args.tie_embeddings and ours == "output.weight") else []
            names = names or ["model.embed_tokens.weight"]
            if missing := [name for name in names if name not in weights.where]:
                raise MeshtrainError(f"model.init_from: {directory} has no {missing[0]} (needed for {ours})")
            name = names[0] if len(names) == 1 else names[0].replace(".experts.0.", ".experts.*.")
            t = weights.get(names[0]) if len(names) == 1 else torch.stack([weights.get(n) for n in names])
            if (heads := rotary_heads(ours, args)) is not None and t.shape[0] % (2 * heads) == 0:
                t = halves_to_pairs(t, heads)
            if ours in ("tok_embeddings.weight", "output.weight") and t.shape[0] != args.vocab_size:
                raise MeshtrainError(
                    f"model.init_from: {name} has {t.shape[0]} rows, but config.json's vocab_size is "
                    f"{args.vocab_size}: they must agree (correct vocab_size)"
                )
            if ours in ("tok_embeddings.weight", "output.weight") and t.shape[0] < param.shape[0]:
                full = torch.zeros(param.shape)
                full[: t.shape[0]] = t
                t = full
            if tuple(t.shape) != tuple(param.shape):
                raise MeshtrainError(
                    f"model.init_from: {name} has shape {tuple(t.shape)}, the model needs {tuple(param.shape)}"
                )
            copy_full_into(param, t)
            del t


def keep_source_files(directory: str | Path, run_dir: Path) -> None:
    """Copy a Hugging Face directory's files other than its weights into <run>/hf_source/."""
    from meshtrain.files import copy_file

    for name in SOURCE_FILES:
        if (Path(directory) / name).is_file():
            copy_file(Path(directory) / name, run_dir / SOURCE_DIR / name)
