"""The on-disk format of a prepared data set: what `data prepare` writes and the loader, training,
`serve`, export and the dry run read.

A directory holds `tokenizer.json`, token shards (`train-NNNNN.bin`, `val-NNNNN.bin`: the ids of
each document, then its end-of-text token, as `dtype`), for chat data a loss mask (`.mask`, one byte
per token, 1 = a target) and the conversations' lengths (`.len`, uint32) beside each shard, and
`manifest.json`: dtype, vocabulary, tokenizer hash and fingerprint, counts, every shard with its
SHA-256, and the splits as segments [file, first token, tokens]."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from meshtrain.errors import DataError
from meshtrain.files import writing

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
DATA_FORMATS = ("text", "chat", "preference")  # what a manifest's "format" may say


def resolve_dtype(dtype: str, n_vocab: int) -> str:
    """The token width: `auto` is the narrowest that holds the vocabulary."""
    if dtype == "auto":
        dtype = "uint16" if n_vocab <= 2**16 else "uint32"
    if dtype not in DTYPES:
        raise DataError(f"--token-dtype {dtype} is unknown: use auto, uint16 or uint32")
    if n_vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise DataError(
            f"the vocabulary has {n_vocab} tokens, more than {dtype} can hold; use --token-dtype uint32 (or auto)"
        )
    return dtype


def read_manifest(path: str | Path) -> dict:
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise DataError(
            f"{path} holds no prepared data ({MANIFEST} missing): run `meshtrain data prepare --input ... --out {path}`"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        dtype = manifest["dtype"]
        if dtype not in DTYPES:
            raise KeyError("dtype")
        if manifest["vocab_size"] > np.iinfo(DTYPES[dtype]).max + 1:
            raise DataError(f"{manifest_path}: vocabulary of {manifest['vocab_size']} does not fit {dtype}")
        version, kind = manifest.get("format_version", 1), manifest.get("format", "text")
        if version not in range(1, FORMAT_VERSION + 1):
            raise DataError(
                f"{manifest_path} has format_version {version!r}, which this meshtrain (up to {FORMAT_VERSION})"
                " cannot read: upgrade meshtrain or prepare the data again"
            )
        if kind not in DATA_FORMATS:
            raise DataError(
                f"{manifest_path} has format {kind!r}: meshtrain reads {', '.join(DATA_FORMATS)}; prepare it again"
            )
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{manifest_path} is corrupt ({e}); prepare the data again") from None
    return manifest


class _File:
    """One output file, written under a temporary name with its SHA-256."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with writing(self.tmp):
            self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> None:
        with writing(self.path):
            self.file.write(data)
        self.sha.update(data)

    def close(self, commit: bool) -> str:
        """Sync and rename into place, or discard; returns the SHA-256."""
        with writing(self.path):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            if commit:
                os.replace(self.tmp, self.path)
            else:
                self.tmp.unlink()
        return self.sha.hexdigest()


class ShardWriter:
    """One token shard (for chat data with its `.mask` and `.len`), written a document, or a part
    of one, at a time and renamed into place whole."""

    def __init__(self, path: Path, dtype: str, chat: bool = False):
        self.dtype = DTYPES[dtype]
        self.files = {"tokens": _File(path)}
        if chat:
            self.files["mask"] = _File(path.with_suffix(".mask"))
            self.files["lengths"] = _File(path.with_suffix(".len"))
        self.tokens = self.documents = self.last_document = self.targets = 0
        self.open_document = 0  # tokens of the document being written

    def add(self, ids: list[int], mask: list[int] | None = None, end: bool = True) -> None:
        """Append `ids` to the current document; `end`: the document ends with them."""
        self.files["tokens"].write(np.asarray(ids, dtype=self.dtype).tobytes())
        if mask is not None:
            self.files["mask"].write(np.asarray(mask, dtype=np.uint8).tobytes())
            self.files["lengths"].write(np.asarray([len(ids)], dtype=np.uint32).tobytes())
            self.targets += sum(mask)
        self.tokens += len(ids)
        self.open_document += len(ids)
        if end:
            self.documents += 1
            self.last_document, self.open_document = self.open_document, 0

    @property
    def path(self) -> Path:
        return self.files["tokens"].path

    def close(self, commit: bool = True) -> dict:
        """Rename into place (a shard without tokens is not written); without `commit`, discard."""
        shas = {kind: f.close(commit and self.tokens > 0) for kind, f in self.files.items()}
        record = {
            "file": self.path.name if self.tokens else None,
            "tokens": self.tokens,
            "sha256": shas["tokens"],
            "documents": self.documents,
            "last_document_tokens": self.last_document,
        }
        if "mask" in shas:
            record |= {"targets": self.targets, "mask_sha256": shas["mask"], "lengths_sha256": shas["lengths"]}
        return record
