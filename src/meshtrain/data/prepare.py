"""`meshtrain data prepare`: text, JSONL (also gzip/zstd), Parquet or a Hugging Face `datasets`
directory -> tokenizer -> memory-mapped token shards, streamed, on every core and rank.

The inputs are cut into work units (whole small files, byte ranges of a .jsonl, Parquet row
groups; see `data.sources`), each tokenized on its own by one of `--workers` processes on one of
the job's ranks (rank r takes units r, r + world, ...). A unit writes `train-NNNNN.bin` and
`val-NNNNN.bin` (each document's token ids, then the end-of-text token; a document goes to
validation by a hash of its text) and a record of its counts and checksums. So memory is bounded by
one batch of documents per worker, whatever the input size, and the output depends on the inputs
alone, not on how many workers or ranks wrote it: the dataset is the units' shards in unit order.

With `--format chat` the rows are conversations (`data.chat`): each is rendered with the chat
template and stored as its tokens (no end-of-text token added: the template ends each answer), with
a `.mask` of its target tokens and its length in a `.len` beside each shard. With `--format
preference` the rows are preference pairs (`data.chat.preference_pair`): each pair is stored as two
such conversations, prompt + chosen answer then prompt + rejected answer, adjacent in one split, each
masked to its answer (the prompt's own assistant turns are not targets); the shards' documents are
the pairs.

Output directory:
  tokenizer.json   the Hugging Face tokenizer (given, or a byte-level BPE trained on a bounded sample)
  train-*.bin      training token shards, val-*.bin the held-out ones (chat: also *.mask, *.len)
  manifest.json    dtype, vocabulary, tokenizer hash, counts, shards with their SHA-256, the splits
  chat_template.jinja  chat data: the template the conversations were rendered with

The work happens in `.<out>.partial` beside the output (`data.partial`): a killed or failed prepare
started again with the same inputs and options keeps the units already done and ends with the same
bytes. The finished directory is renamed into place, so a dataset is only ever replaced by a complete
one. A symlink given as `out` is kept: the directory it points to is replaced.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshtrain.data.chat import TEMPLATE_FILE, ChatTemplate, conversation, preference_pair, tokenize_conversations
from meshtrain.data.format import FORMAT_VERSION, MANIFEST, ShardWriter, resolve_dtype
from meshtrain.data.partial import (
    after_failure,
    finished_manifest,
    install,
    make_spec,
    open_partial,
    unit_done,
    unit_record,
)
from meshtrain.data.sources import LongDocument, Piece, expand_inputs, pieces, preference_rows, read_piece, read_rows
from meshtrain.data.tokenizer import (
    begin_of_text,
    copy_tokenizer,
    document_prefix,
    encode_long,
    end_of_text,
    load_tokenizer,
    tokenizer_fingerprint,
    train_bpe,
)
from meshtrain.data.workers import Ranks, default_workers, run_units
from meshtrain.errors import DataError
from meshtrain.files import atomic_write, check_output_dir, mark_output, write_json
from meshtrain.lock import RunLock
from meshtrain.logs import log

COMMAND = "meshtrain data prepare"
UNIT_BYTES = (1 << 20, 256 << 20)  # a work unit holds 1/64 of the input, within these bounds
BATCH_CHARS = 1 << 20  # characters tokenized per encode_batch call (a worker's memory bound)


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


def plan_units(inputs: list[str | Path], text_field: str = "text") -> list[Unit]:
    """The inputs' pieces grouped, in order, into units of about 1/64 of the input (1-256 MiB)."""
    files = expand_inputs(inputs, text_field)
    target = min(UNIT_BYTES[1], max(UNIT_BYTES[0], sum(f.size for f in files) // 64))
    units: list[Unit] = []
    current: list[Piece] = []
    for piece in pieces(files, target):
        current.append(piece)
        if sum(p.size for p in current) >= target:
            units.append(Unit(len(units), tuple(current)))
            current = []
    if current:
        units.append(Unit(len(units), tuple(current)))
    return units


@dataclass(frozen=True)
class ChatOptions:
    """--format chat (or preference, `format`): conversations rendered with `template`; which tokens
    are targets; the longest conversation kept (0: any; longer ones, or pairs with a longer one, are
    skipped and counted)."""

    template: str
    targets: str = "assistant"
    max_tokens: int = 0
    format: str = "chat"

    @property
    def preference(self) -> bool:
        return self.format == "preference"


def _conversations(piece: Piece, chat: ChatOptions) -> Iterator[tuple[list[tuple[list[dict], str]], int]]:
    """The rows of a chat piece, each as its conversations [(messages, where)] (a preference pair: prompt +
    chosen, prompt + rejected) and the index of the first message that may be a target."""
    if not chat.preference:
        for record, where in read_rows(piece):
            yield [(conversation(record, where), where)], 0
        return
    for record, where in preference_rows(piece):
        prompt, chosen, rejected = preference_pair(record, where)
        yield [(prompt + chosen, where), (prompt + rejected, where)], len(prompt)


def _texts(piece: Piece, text_field: str, chat: ChatOptions | None) -> Iterator[str]:
    """A piece's documents, or for chat data the contents of its conversations' messages."""
    if not chat:
        for document in read_piece(piece, text_field):
            if document is not None:
                yield from document.chunks if isinstance(document, LongDocument) else [document]
        return
    for conversations, first in _conversations(piece, chat):
        for i, (messages, _) in enumerate(conversations):
            for message in messages[first if i else 0 :]:  # a pair's prompt once
                yield message["content"]


def tokenizer_sample(
    units: list[Unit], text_field: str, sample_bytes: int, chat: ChatOptions | None = None
) -> Iterator[str]:
    """What a BPE is trained on: the first documents of every unit, an equal share of `sample_bytes`
    each (at least one document per unit), so the sample spans the whole input."""
    share = max(1, sample_bytes // max(1, len(units)))
    for unit in units:
        taken = 0
        for piece in unit.pieces:
            for text in _texts(piece, text_field, chat):
                yield text
                taken += len(text)
                if taken >= share:
                    break
            if taken >= share:
                break


def _is_val(text: str, val_fraction: float) -> bool:
    """Split by a hash of the content, so the split is the same on every machine and input order."""
    return val_fraction > 0 and zlib.crc32(text.encode()) % 10_000 < val_fraction * 10_000


# --- one work unit: what each worker process runs -----------------------------------------------


@dataclass(frozen=True)
class UnitJob:
    """What a worker needs besides the unit (sent once per unit: small)."""

    work: str
    tokenizer: str
    text_field: str
    val_fraction: float
    dtype: str
    eos_id: int | None
    chat: ChatOptions | None = None
    eos_token: str | None = None
    bos_token: str | None = None  # what a chat template's bos_token renders
    prefix: tuple[int, ...] = ()  # the special tokens that begin each text document (document_prefix)


_TOKENIZERS: dict[str, object] = {}


def tokenize_unit(job: UnitJob, unit: Unit) -> dict:
    """Tokenize one unit into its train and val shards, then write its record (the commit mark)."""
    if job.tokenizer not in _TOKENIZERS:
        _TOKENIZERS[job.tokenizer] = load_tokenizer(job.tokenizer)
    tok = _TOKENIZERS[job.tokenizer]
    work = Path(job.work)
    shards = {
        split: ShardWriter(work / f"{split}-{unit.index:05d}.bin", job.dtype, chat=job.chat is not None)
        for split in ("train", "val")
    }
    try:
        skipped = (_chat_unit if job.chat else _text_unit)(job, unit, tok, shards)
    except BaseException:
        for shard in shards.values():
            shard.close(commit=False)
        raise
    records = {split: shard.close() for split, shard in shards.items()}
    record = {"index": unit.index, "bytes": unit.size, **records, "skipped": skipped}
    write_json(unit_record(work, unit.index), record)
    return record


def _text_unit(job: UnitJob, unit: Unit, tok, shards: dict[str, ShardWriter]) -> int:
    """Documents in batches of about BATCH_CHARS characters: the tokenizer's prefix (a BOS), ids,
    then the end-of-text token; a longer document alone, a window at a time (`_long_document`).
    Returns how many rows had null text (no document)."""
    eos, prefix = [job.eos_id] if job.eos_id is not None else [], list(job.prefix)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: ids without character offsets
    batch: list[str] = []

    def flush() -> None:
        for text, enc in zip(batch, encode(batch, add_special_tokens=False)):
            shards["val" if _is_val(text, job.val_fraction) else "train"].add(prefix + enc.ids + eos)
        batch.clear()

    chars = nulls = 0
    for piece in unit.pieces:
        for text in read_piece(piece, job.text_field):
            if text is None:
                nulls += 1
                continue
            if isinstance(text, LongDocument) or len(text) > BATCH_CHARS:
                _long_document(job, tok, text, shards, eos)
                continue
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
                chars = 0
    flush()
    return nulls


def _long_document(job: UnitJob, tok, document: str | LongDocument, shards: dict[str, ShardWriter], eos) -> None:
    """One document of more than BATCH_CHARS characters, tokenized in bounded memory. Its split
    is decided by a hash of its first chunk (what is read before any of it is written)."""
    if isinstance(document, LongDocument):
        chunks = iter(document.chunks)
    else:
        chunks = (document[i : i + BATCH_CHARS] for i in range(0, len(document), BATCH_CHARS))
    first = next(chunks, "")
    if not first:
        return
    shard = shards["val" if _is_val(first, job.val_fraction) else "train"]
    shard.add(list(job.prefix), end=False)
    for ids in encode_long(tok, itertools.chain([first], chunks)):
        shard.add(ids, end=False)
    shard.add(eos)


def _chat_unit(job: UnitJob, unit: Unit, tok, shards: dict[str, ShardWriter]) -> int:
    """Conversations rendered with the chat template, tokenized with their loss masks; returns how
    many rows were longer than --max-tokens (skipped). A preference row is two conversations, chosen
    then rejected, written as one document (kept or skipped together, in one split)."""
    template, skipped = ChatTemplate(job.chat.template, job.eos_token, job.bos_token), 0
    rows: list[list[tuple[list[dict], str]]] = []  # each row's conversations
    firsts: list[int] = []  # each conversation's first message that may be a target

    def flush() -> int:
        long = 0
        batch = [c for row in rows for c in row]
        encoded = iter(tokenize_conversations(tok, template, batch, job.chat.targets, firsts))
        for row in rows:
            sequences = [next(encoded) for _ in row]
            if job.chat.max_tokens and max(len(ids) for ids, _ in sequences) > job.chat.max_tokens:
                long += 1
                continue
            key = json.dumps([messages for messages, _ in row] if len(row) > 1 else row[0][0], sort_keys=True)
            shard = shards["val" if _is_val(key, job.val_fraction) else "train"]
            for i, (ids, mask) in enumerate(sequences):
                shard.add(ids, mask, end=i == len(sequences) - 1)
        rows.clear()
        firsts.clear()
        return long

    chars = 0
    for piece in unit.pieces:
        for conversations, first in _conversations(piece, job.chat):
            rows.append(conversations)
            firsts.extend([first] * len(conversations))
            chars += sum(len(m["content"]) for messages, _ in conversations for m in messages)
            if chars >= BATCH_CHARS:
                skipped += flush()
                chars = 0
    return skipped + flush()


# --- the job: ranks, the tokenizer, the manifest (the partial directory: data.partial) ----------


def _make_tokenizer(
    work: Path, units: list[Unit], tokenizer, vocab_size: int, text_field: str, sample: int, chat: ChatOptions | None
) -> Path:
    """The tokenizer in the partial directory: the given one with the tokenizer_config.json beside it
    (its eos and bos tokens, for training, serve and export), or a BPE trained on a sample."""
    path = work / "tokenizer.json"
    if path.is_file():
        return path
    if tokenizer:
        return copy_tokenizer(tokenizer, work)
    tok = train_bpe(tokenizer_sample(units, text_field, sample, chat), vocab_size)
    if (trained := tok.get_vocab_size(with_added_tokens=True)) < vocab_size:  # no pair left to merge
        log.warning(
            f"the tokenizer has {trained} tokens, not the {vocab_size} of --vocab-size: the text it learned from (a "
            f"sample of the input, at most --tokenizer-sample {sample:,} bytes) has no more pairs to merge; give more "
            "text or a smaller --vocab-size"
        )
    return atomic_write(path, lambda tmp: tok.save(str(tmp)))


def _splits(records: list[dict], val_fraction: float) -> tuple[dict, dict]:
    """The train and val splits as segments [file, first token, tokens] over the units' shards, in
    unit order. A corpus too small for the hashed split to give both splits a document: the last
    document goes to validation, the rest to training."""
    splits = {
        split: [[r[split]["file"], 0, r[split]["tokens"]] for r in records if r[split]["tokens"]]
        for split in ("train", "val")
    }
    docs = {split: sum(r[split]["documents"] for r in records) for split in ("train", "val")}
    if val_fraction > 0 and sum(docs.values()) >= 2 and not all(docs.values()):
        source = "train" if docs["train"] else "val"
        last = next(r[source] for r in reversed(records) if r[source]["tokens"])
        n = last["last_document_tokens"]
        segments = splits[source]
        file, first, count = segments[-1]
        segments[-1] = [file, first, count - n]
        if count == n:
            segments.pop()
        splits = {"train": segments, "val": [[file, first + count - n, n]]}
        docs = {"train": sum(docs.values()) - 1, "val": 1}
    return splits, docs


def _finish(work: Path, units: list[Unit], val_fraction: float, job: UnitJob) -> dict:
    """The manifest, written into the partial directory from the units' records (or read back, where
    a prepare stopped after writing it)."""
    if (manifest := finished_manifest(work)) is not None:
        return manifest
    records = []
    for unit in units:
        try:
            records.append(json.loads(unit_record(work, unit.index).read_text()))
        except (OSError, ValueError):
            raise DataError(f"unit {unit.index} of the prepare in {work} is missing: run the prepare again") from None
    splits, docs = _splits(records, val_fraction)  # preference data: a document is a pair
    skipped = sum(r["skipped"] for r in records)
    preference = job.chat is not None and job.chat.preference
    if not sum(docs.values()):
        raise DataError(
            f"all {skipped} {'pairs have a conversation' if preference else 'conversations are'} longer than "
            f"--max-tokens {job.chat.max_tokens}; raise it"
            if skipped and job.chat
            else f"the input holds no text ({skipped} rows of null {job.text_field!r})"
            if skipped
            else "the input holds no text"
        )
    tok = load_tokenizer(work / "tokenizer.json")
    manifest = {
        "format_version": FORMAT_VERSION,
        "format": job.chat.format if job.chat else "text",
        "dtype": job.dtype,
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "eos_id": job.eos_id,
        "document_prefix": None if job.chat else list(job.prefix),
        "tokenizer": "tokenizer.json",
        "tokenizer_sha256": hashlib.sha256((work / "tokenizer.json").read_bytes()).hexdigest(),
        "tokenizer_fingerprint": tokenizer_fingerprint(work / "tokenizer.json"),
        "train_tokens": sum(s[2] for s in splits["train"]),
        "val_tokens": sum(s[2] for s in splits["val"]),
        "documents": {split: 2 * n for split, n in docs.items()} if preference else docs,
        "val_fraction": val_fraction,
        "text_field": job.text_field,
        "input_files": len({p.file.path for u in units for p in u.pieces}),
        "input_bytes": sum(u.size for u in units),
        "order": "inputs as given, directories and globs in sorted path order, documents in file order",
        "shards": [
            {k: r[split][k] for k in ("file", "tokens", "sha256", "mask_sha256", "lengths_sha256") if k in r[split]}
            for r in records
            for split in ("train", "val")
            if r[split]["tokens"]
        ],
        "splits": splits,
    }
    if job.chat:
        manifest |= {
            "chat_template": TEMPLATE_FILE,
            "chat_targets": job.chat.targets,
            "target_tokens": sum(r["train"].get("targets", 0) for r in records),
            "max_tokens": job.chat.max_tokens,
            "skipped_longer": skipped,
        }
    else:
        manifest["skipped_null"] = skipped  # rows whose text is null: no document
    if preference:
        manifest["pairs"] = docs
    mark_output(work, MANIFEST, manifest)  # the bookkeeping is hidden: not listed, and gone before the rename
    return manifest


def prepare(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    val_fraction: float = 0.01,
    dtype: str = "auto",
    progress: bool = True,
    text_field: str = "text",
    workers: int | None = None,
    sample_bytes: int = 64 << 20,
    distributed: bool = False,
    chat: ChatOptions | None = None,
) -> dict:
    """Prepare `inputs` into `out` (see the module docstring). With `distributed`, every rank of the
    process group calls this and each tokenizes its share of the units."""
    out = Path(out).resolve()  # a symlink's target is checked and replaced, from beside it
    if not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    workers = workers or default_workers()
    ranks = Ranks(distributed)
    work = out.parent / f".{out.name}.partial"
    check = functools.partial(check_output_dir, out, [*inputs, *([tokenizer] if tokenizer else [])], MANIFEST, COMMAND)
    ranks.everyone(check)

    locks: list[RunLock] = []  # rank 0's hold on the partial directory

    def start() -> tuple[list[Unit], UnitJob]:
        if tokenizer:
            load_tokenizer(tokenizer)  # a clear error if it is missing or not one
        units = plan_units(inputs, "text" if chat else text_field)  # chat rows have no text field
        spec = make_spec(units, tokenizer, vocab_size or 8192, val_fraction, dtype, text_field, sample_bytes, chat)
        locks.append(open_partial(work, spec))
        tok_path = _make_tokenizer(work, units, tokenizer, vocab_size or 8192, text_field, sample_bytes, chat)
        tok = load_tokenizer(tok_path)
        resolved = resolve_dtype(dtype, tok.get_vocab_size(with_added_tokens=True))
        config_dir = Path(tokenizer).parent if tokenizer else None
        eos_token, eos_id = end_of_text(tok, config_dir)
        if chat:
            atomic_write(work / TEMPLATE_FILE, lambda tmp: tmp.write_text(chat.template))
        bos_token, prefix = begin_of_text(tok, config_dir), tuple(document_prefix(tok))
        special = {"eos_token": eos_token, "bos_token": bos_token, "prefix": prefix}
        return units, UnitJob(str(work), str(tok_path), text_field, val_fraction, resolved, eos_id, chat, **special)

    try:
        units, job = ranks.from_first(start)
        mine = [u for u in units if u.index % ranks.world == ranks.rank and not unit_done(work, u.index)]
        ranks.everyone(lambda: run_units(functools.partial(tokenize_unit, job), mine, workers, progress))

        def finish() -> dict:
            manifest = _finish(work, units, val_fraction, job)
            install(work, out, locks[0], check)  # `out` checked again: hours may have passed
            return manifest

        return ranks.from_first(finish)
    except DataError:
        if locks:  # the input is at fault, or could not be read: finished units are kept to resume from
            after_failure(work)
        raise
    finally:
        for lock in locks:
            lock.release()
