"""`meshtrain data prepare`: text, JSONL or Parquet -> tokenizer -> memory-mapped token files.

Output directory:
  tokenizer.json   the Hugging Face tokenizer (loaded, or a byte-level BPE trained on the input)
  train.bin        concatenated token ids, each document followed by the end-of-text token
  val.bin          the same for the held-out documents
  manifest.json    dtype, vocabulary, token counts, split, tokenizer hash

The directory is written under a temporary name and renamed into place, so an interrupted prepare
never leaves a half-written dataset behind, and a finished one is only replaced by a finished one.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtrain.errors import DataError
from meshtrain.files import atomic_directory, check_output_dir

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>")


def end_of_text(tokenizer) -> tuple[str | None, int | None]:
    """The tokenizer's end-of-text token and id (meshtrain's, Llama 3's, SentencePiece's, Gemma's),
    or (None, None). The one place that decides it: data prepare separates documents with it,
    training's sample, `generate` and `serve` stop on it, export names it."""
    token = next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
    return token, tokenizer.token_to_id(token) if token else None


TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
MANIFEST = "manifest.json"


@dataclass
class Document:
    source: str
    text: str


def stdlib_sources() -> list[Path]:
    """The default corpus: this Python's standard library source, present on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            if not found:
                raise DataError(f"input directory {path} holds no {', '.join(TEXT_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {path} does not exist")
    if not files:
        raise DataError("no input files given: pass --input FILE_OR_DIR")
    return files


def _decode(raw: bytes, path: Path, base_offset: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not valid UTF-8 at byte offset {base_offset + e.start}; re-encode it as UTF-8"
        ) from None


def read_documents(path: Path) -> Iterator[Document]:
    """.jsonl: one document per line (its "text" field); .parquet: the "text" column; else one
    document per file."""
    if path.suffix == ".jsonl":
        offset = 0
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = _decode(raw, path, offset).strip()
                offset += len(raw)
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f'{path}:{lineno} has no string "text" field')
                yield Document(f"{path}:{lineno}", record["text"])
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"{path} is not a readable Parquet file ({e})") from None
        if "text" not in table.column_names:
            raise DataError(f'{path} has no "text" column (columns: {", ".join(table.column_names)})')
        for i, text in enumerate(table.column("text").to_pylist()):
            if text:
                yield Document(f"{path}[{i}]", text)
    else:
        yield Document(str(path), _decode(path.read_bytes(), path))


def train_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style) trained on the input with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 257")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"{path} is not a Hugging Face tokenizer.json ({e})") from None


def _is_val(doc: Document, val_fraction: float) -> bool:
    """Split by a hash of the content, so the split is the same on every machine and input order."""
    return zlib.crc32(doc.text.encode()) % 10_000 < val_fraction * 10_000


def prepare(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    val_fraction: float = 0.01,
    dtype: str = "auto",
    progress: bool = True,
) -> dict:
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    check_output_dir(out, [*inputs, *([tokenizer] if tokenizer else [])], "manifest.json", "meshtrain data prepare")
    files = expand_inputs(inputs)
    docs = [d for path in files for d in read_documents(path) if d.text]
    if not docs:
        raise DataError(f"the input ({', '.join(map(str, inputs))}) holds no text")

    tok = load_tokenizer(tokenizer) if tokenizer is not None else train_bpe([d.text for d in docs], vocab_size or 8192)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = end_of_text(tok)[1]

    if dtype == "auto":
        dtype = "uint16" if n_vocab <= 2**16 else "uint32"
    if dtype not in DTYPES:
        raise DataError(f"--token-dtype {dtype} is unknown: use auto, uint16 or uint32")
    if n_vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise DataError(
            f"the vocabulary has {n_vocab} tokens, more than {dtype} can hold; use --token-dtype uint32 (or auto)"
        )

    val_docs = [d for d in docs if _is_val(d, val_fraction)] if val_fraction > 0 else []
    train_docs = [d for d in docs if not (val_fraction > 0 and _is_val(d, val_fraction))]
    if val_fraction > 0 and (not val_docs or not train_docs) and len(docs) >= 2:
        train_docs, val_docs = docs[:-1], docs[-1:]  # too few documents for a hashed split

    with atomic_directory(out) as tmp:  # a finished dataset is only ever replaced by a finished one
        counts = _write_tokens(tmp, tok, train_docs, val_docs, eos_id, dtype, progress)
        tok.save(str(tmp / "tokenizer.json"))
        manifest = {
            "format_version": 1,
            "dtype": dtype,
            "vocab_size": n_vocab,
            "eos_id": eos_id,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest(),
            "tokenizer_fingerprint": tokenizer_fingerprint(tmp / "tokenizer.json"),
            "train_tokens": counts["train"],
            "val_tokens": counts["val"],
            "documents": {"train": len(train_docs), "val": len(val_docs)},
            "val_fraction": val_fraction,
            "input_files": len(files),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_tokens(
    out: Path, tok, train_docs: list[Document], val_docs: list[Document], eos_id: int | None, dtype: str, progress: bool
) -> dict[str, int]:
    """train.bin and val.bin: each document's tokens, then EOS; returns the token counts."""
    from rich.progress import Progress

    counts = {}
    with Progress(disable=not progress, transient=True) as bar:
        for split, split_docs in (("train", train_docs), ("val", val_docs)):
            task = bar.add_task(f"tokenizing {split}", total=sum(len(d.text) for d in split_docs))
            with (out / f"{split}.bin").open("wb") as f:
                counts[split] = 0
                for start in range(0, len(split_docs), 256):
                    chunk = split_docs[start : start + 256]
                    for enc in tok.encode_batch([d.text for d in chunk], add_special_tokens=False):
                        ids = enc.ids + ([eos_id] if eos_id is not None else [])
                        np.asarray(ids, dtype=DTYPES[dtype]).tofile(f)
                        counts[split] += len(ids)
                    bar.advance(task, sum(len(d.text) for d in chunk))
    return counts


def tokenizer_fingerprint(path: str | Path) -> str:
    """What decides which id a text becomes: the model (vocabulary, merges), the added tokens, the
    normalizer and pre-tokenizer of a tokenizer.json, hashed in a canonical form (the same tokenizer
    saved by `tokenizers` or by transformers' save_pretrained has the same fingerprint)."""
    spec = json.loads(Path(path).read_text())
    canonical = {
        "model": spec.get("model"),
        "added_tokens": sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or []),
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
    }
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


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
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{manifest_path} is corrupt ({e}); prepare the data again") from None
    return manifest
