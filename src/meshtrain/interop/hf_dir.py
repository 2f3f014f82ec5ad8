"""A Hugging Face model directory's weights, read as transformers reads them: a directory it would
load differently (another weights file, peft adapters applied on top, tensors its index does not
list) is refused in one line before any work, rather than imported as a model transformers never
computes."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.files import read_json_object

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
# peft's adapters, which transformers applies on loading the directory where peft is installed
PEFT_ADAPTERS = "adapter_config.json"
INDEX_FIELDS = {"weight_map", "metadata"}  # metadata: total_size and the like, which change no weight


def check_model_directory(directory: Path) -> None:
    """Refuse what would make transformers load another model from `directory` than meshtrain would:
    both a single weights file and an index (transformers takes the file, an index left from an
    earlier save would be stale), or peft adapters beside the model (transformers with peft applies
    them; meshtrain would compute the bare base). meshtrain's own merged export has neither; its
    `export --adapter` writes the adapters alone, without a config.json."""
    if (directory / SINGLE).is_file() and (directory / INDEX).is_file():
        raise MeshtrainError(f"{directory} holds both {SINGLE} and {INDEX}: remove the stale one")
    if (directory / PEFT_ADAPTERS).is_file():
        raise MeshtrainError(
            f"{directory} holds peft adapters ({PEFT_ADAPTERS}) beside the model: merge them (peft's "
            f"merge_and_unload) or move {PEFT_ADAPTERS} away"
        )


class HFWeights:
    """The tensors of a Hugging Face directory (one safetensors file, or shards with an index), read
    one at a time on demand: a rank pays for the tensors it asks for, not for the model."""

    def __init__(self, directory: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open

        check_model_directory(directory)
        where = _weight_map(directory / INDEX) if (directory / INDEX).is_file() else None
        if where is None and not (directory / SINGLE).is_file():
            raise MeshtrainError(f"model.init_from: {directory} has no {SINGLE} (nor an index)")
        self.files = {}
        for file in sorted(set(where.values())) if where is not None else [SINGLE]:
            if not (directory / file).is_file():
                raise MeshtrainError(f"model.init_from: {directory / file} is missing (named in the index)")
            try:
                self.files[file] = stack.enter_context(safe_open(directory / file, framework="pt"))
            except Exception as e:  # safetensors' own error type: a header cut short or not JSON
                raise unreadable(directory / file, e) from None
        self.directory = directory
        self.where = where if where is not None else dict.fromkeys(self.files[SINGLE].keys(), SINGLE)
        if where is not None:
            self._check_shards(directory)

    def _check_shards(self, directory: Path) -> None:
        """Every tensor of a shard is in the index under that shard, and every one the index lists is
        there: transformers would otherwise load a tensor meshtrain never sees, or fail on one."""
        for file, shard in self.files.items():
            held, listed = set(shard.keys()), {name for name, f in self.where.items() if f == file}
            if extra := sorted(held - listed):
                raise MeshtrainError(
                    f"{directory / file} holds {', '.join(extra[:3])}, which {INDEX} does not list there: "
                    "correct the index's weight_map (or remove the tensor)"
                )
            if missing := sorted(listed - held):
                raise MeshtrainError(
                    f"{INDEX} in {directory} places {', '.join(missing[:3])} in {file}, which does not hold it: "
                    "correct the index's weight_map"
                )

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        try:
            t = self.files[self.where[name]].get_tensor(name)
        except Exception as e:  # the file ends before this tensor's bytes
            raise unreadable(self.directory / self.where[name], e) from None
        if not t.is_floating_point():
            raise MeshtrainError(f"model.init_from: {name} is {t.dtype}: quantized weights cannot be imported")
        return t.float()


def _weight_map(index: Path) -> dict[str, str]:
    """An index's tensor -> shard file map, refused in one line where it is not one."""
    content = read_json_object(index)
    if unknown := sorted(set(content) - INDEX_FIELDS):
        raise MeshtrainError(
            f"{index}: {', '.join(unknown)}: not a field of a safetensors index (weight_map, metadata); remove it"
        )
    where = content.get("weight_map")
    if not isinstance(where, dict) or not where:
        raise MeshtrainError(f"{index} has no weight_map of tensor names to shard files: correct or remove it")
    for name, file in where.items():
        if not isinstance(file, str) or not file:
            raise MeshtrainError(f"{index}: weight_map's {name!r} is {file!r}, not a shard file name: correct it")
    return where


def unreadable(path: Path, error: Exception) -> MeshtrainError:
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return MeshtrainError(
        f"model.init_from: {path} cannot be read ({first}): it is truncated or not a safetensors file; "
        "download or copy it again"
    )
