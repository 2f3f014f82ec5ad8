"""Where documents come from: input files, cut into pieces that can be read independently.

Inputs are files, directories, globs and directories written by Hugging Face `datasets`
(`save_to_disk`). Formats, by name: `.txt` and `.py` (one document per file), `.jsonl`, `.jsonl.gz`,
`.jsonl.zst` (one document per line, its `text_field`), `.parquet` (the `text_field` column) and the
Arrow files of a `datasets` directory. A file of any other name is refused, never guessed at: a
`.json` of JSON lines read as text would train on the raw JSON, and a directory that silently left
out its `.csv` files would train on less than the user gave. Hidden files (and those in hidden
directories) are left out of a directory, whatever their names: `.DS_Store`, `.git`, a prepare's
partial, a notebook's `.ipynb_checkpoints` copies of the data.

A document longer than LONG_BYTES (a big `.txt`, a long JSON line) is read as a `LongDocument`:
its text in chunks, never whole, so that memory stays bounded whatever one document holds.

The order of documents is defined by the inputs alone: inputs in the order given, each directory
or glob expanded in sorted path order, documents in file order. A piece is a span of one file that
a worker can read without reading what comes before it: a byte range of a plain `.jsonl` (lines
that start in it), row groups of a Parquet file, or a whole file (text, compressed, Arrow). So any
number of workers and ranks can read the same documents in the same order.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshtrain.data.chat import CONTENT_KEYS, PREFERENCE_COLUMNS
from meshtrain.errors import DataError

KINDS = {  # the suffixes meshtrain reads -> their kind
    ".txt": "txt",
    ".py": "txt",  # the default corpus (stdlib_sources) is Python source
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".parquet": "parquet",
}
SUFFIXES = tuple(KINDS)
READABLE = f"{', '.join(SUFFIXES)} files or a Hugging Face datasets directory"  # for the errors
LONG_BYTES = 1 << 20  # a document longer than this is read in chunks of about this size


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # "txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Piece:
    """Part of one input file: bytes [start, stop) of a plain .jsonl (the lines that start there),
    row groups [start, stop) of a Parquet file, or the whole file (start = stop = 0)."""

    file: InputFile
    start: int
    stop: int
    size: int  # bytes on disk, about: what the grouping into work units balances


def stdlib_sources() -> list[Path]:
    """The default corpus: this Python's standard library source, present on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _kind(path: Path) -> str | None:
    return next((KINDS[s] for s in sorted(SUFFIXES, key=len, reverse=True) if path.name.endswith(s)), None)


def _is_hf_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _hf_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk directory, in the order its state.json lists. One
    saved with an indices mapping (select, shuffle, filter or sort, saved by an earlier `datasets`)
    is refused: its Arrow files hold the rows from before, which would be read unselected."""
    try:
        state = json.loads((path / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
        indices = state.get("_indices_data_files")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}/state.json is not a Hugging Face datasets state file ({e})") from None
    if indices:
        raise DataError(
            f"{path} was saved with an indices mapping (a select, shuffle, filter or sort not written out): its "
            "Arrow files hold the rows from before it; save a flattened copy: ds.flatten_indices().save_to_disk(...)"
        )
    return [path / name for name in names]


def _expand_one(item: str) -> list[tuple[Path, str]]:
    path = Path(item)
    if not path.exists() and any(c in item for c in "*?["):
        matched = sorted(glob.glob(item, recursive=True))
        if not matched:
            raise DataError(f"--input {item} matches no files")
        return [entry for m in matched for entry in _expand_one(m)]
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
            raise DataError(
                f"{path} holds the splits of a Hugging Face dataset ({splits}): pass one, e.g. {path}/train"
            )
        if _is_hf_dataset(path):
            return [(p, "arrow") for p in _hf_dataset_files(path)]
        # Hidden files and directories (.ipynb_checkpoints, .venv, .git) are not input, whatever their names:
        # a notebook's checkpoint copy of a .jsonl would be read twice.
        files = sorted(
            p for p in path.rglob("*") if p.is_file() and not any(n.startswith(".") for n in p.relative_to(path).parts)
        )
        unread = [p for p in files if not _kind(p)]
        if unread:
            raise DataError(
                f"input directory {path} holds files meshtrain does not read ({len(unread)}, first {unread[0]}; "
                f"it reads {READABLE}): move them out, or name the files to read as --input (e.g. '{path}/**/*.jsonl')"
            )
        found = [p for p in files if _kind(p)]
        if not found:
            raise DataError(f"input directory {path} holds no {', '.join(SUFFIXES)} files")
        return [(p, _kind(p)) for p in found]
    if path.is_file():
        if not (kind := _kind(path)):
            raise DataError(
                f"input {path} is not a format meshtrain reads ({READABLE}): rename or convert it "
                "(JSON lines in a .json or .ndjson file: rename it .jsonl)"
            )
        return [(path, kind)]
    raise DataError(f"input {path} does not exist")


def expand_inputs(inputs: list[str | Path], text_field: str = "text") -> list[InputFile]:
    """The input files, in the documented order, each checked to be readable (one line if not).
    `text_field` names a JSON field or a Parquet column: given where every input is plain text (one
    document per file) it would do nothing, so it is refused."""
    files = []
    for item in inputs:
        for path, kind in _expand_one(str(item)):
            if not os.access(path, os.R_OK):
                raise DataError(f"cannot read {path}: permission denied (fix its permissions or leave it out)")
            stat = path.stat()
            files.append(InputFile(str(path), kind, stat.st_size, stat.st_mtime_ns))
    if not files:
        raise DataError("no input files given: pass --input FILE_OR_DIR")
    refuse_duplicates(files)
    if text_field != "text" and all(f.kind == "txt" for f in files):
        raise DataError(
            f"--text-field {text_field} names a JSON field or Parquet column, but every input is plain text "
            "(one document per file): leave --text-field out"
        )
    return files


def refuse_duplicates(files: list[InputFile]) -> None:
    """An input given twice (two spellings of one file, a directory and a file in it, a link) or a
    data file copied under another name would count its documents twice and could put one copy in
    the held-out split and the other in training. Plain-text inputs (one document per file) may hold
    the same text, as a source tree's empty `__init__.py` files do: only their paths are compared."""
    seen: dict[tuple[int, int], str] = {}
    for f in files:
        stat = os.stat(f.path)
        if (key := (stat.st_dev, stat.st_ino)) in seen:
            also = "" if seen[key] == f.path else f" (as {seen[key]})"
            raise DataError(f"input {f.path} is given twice{also}: give each file once")
        seen[key] = f.path
    by_size: dict[int, list[InputFile]] = {}
    for f in files:
        if f.kind != "txt":
            by_size.setdefault(f.size, []).append(f)
    for same_size in by_size.values():
        digests: dict[str, str] = {}
        for f in same_size if len(same_size) > 1 else ():
            with open(f.path, "rb") as stream:
                digest = hashlib.file_digest(stream, "sha256").hexdigest()
            if digest in digests:
                raise DataError(f"inputs {digests[digest]} and {f.path} hold the same bytes: give one of them")
            digests[digest] = f.path


def pieces(files: list[InputFile], piece_bytes: int) -> list[Piece]:
    """Every input cut into independently readable pieces (a plain .jsonl every `piece_bytes`), in
    document order."""
    out = []
    for f in files:
        if f.kind == "jsonl":
            for start in range(0, f.size, piece_bytes):
                stop = min(start + piece_bytes, f.size)
                out.append(Piece(f, start, stop, stop - start))
        elif f.kind == "parquet":
            groups = _parquet(f.path).metadata.num_row_groups
            out += [Piece(f, g, g + 1, f.size // max(1, groups)) for g in range(groups)]
        else:
            out.append(Piece(f, 0, f.size, f.size))
    return out


def _parquet(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise DataError(f"{path} is not a readable Parquet file ({e}); replace or leave it out") from None


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not valid UTF-8 at byte offset {e.start}; re-encode it as UTF-8") from None


@dataclass(frozen=True)
class Where:
    """A row's place, "FILE:LINE" (or "FILE row N"), worked out only when an error names it: a plain
    .jsonl read from a byte offset counts the lines before it then; a compressed one was read from
    its start."""

    path: str
    offset: int
    lineno: int
    kind: str = "jsonl"

    def __str__(self) -> str:
        if self.kind == "row":
            return f"{self.path} row {self.lineno}"
        lineno = self.lineno
        if self.path.endswith(".jsonl"):
            with open(self.path, "rb") as f:
                lineno = f.read(self.offset).count(b"\n") + 1
        return f"{self.path}:{lineno}"


def _json_lines(piece: Piece, long_field: str | None = None) -> Iterator[tuple[object, Where]]:
    """The JSON values of a piece's lines; with `long_field`, a long line's string under that key
    comes as a LongDocument."""
    f = piece.file
    if f.kind == "jsonl":
        stream = open(f.path, "rb")
        offset = piece.start
        if offset:
            stream.seek(offset - 1)
            offset += len(stream.readline()) - 1  # the line that starts at or after `start`
    elif f.kind == "jsonl.gz":
        stream, offset = gzip.open(f.path, "rb"), 0
    else:
        import zstandard

        stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(f.path, "rb"), closefd=True))
        offset = 0
    with stream:
        lineno = 0
        while not (f.kind == "jsonl" and offset >= piece.stop):
            raw = _readline(stream, f.path)
            if not raw:
                break
            lineno += 1
            where = Where(f.path, offset, lineno)
            if not raw.endswith(b"\n") and len(raw) == LONG_BYTES:  # a long line
                line = _LongLine(stream, raw, where)
                if long_field is not None and (record := line.streamed(long_field)) is not None:
                    yield record, where
                    line.drain()  # the reader may have stopped early
                    offset += line.bytes
                    continue
                raw = line.whole()
            offset += len(raw)
            if not raw.strip():
                continue
            yield _loads(raw, where), where


def _readline(stream, path: str, limit: int = LONG_BYTES) -> bytes:
    try:
        return stream.readline(limit)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path} is corrupt ({e}); replace or leave it out") from None
    except Exception as e:  # zstandard.ZstdError
        raise DataError(f"{path} is corrupt ({e}); replace or leave it out") from None


def _loads(raw: bytes, where: Where):
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        _decode(raw, str(where))
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON ({e.msg})") from None


class LongDocument:
    """A document read in chunks of text, once, in order (see LONG_BYTES)."""

    def __init__(self, chunks: Iterator[str]):
        self.chunks = chunks


_PLACEHOLDER = "\u0000meshtrain: the streamed text\u0000"


class _LongLine:
    """A JSON line longer than LONG_BYTES: read whole, or with its text field's string streamed in
    chunks cut at spaces (never inside an escape or a UTF-8 sequence). The rest of the line, with a
    placeholder for the string, is parsed at the end: the line is checked as JSON all the same."""

    def __init__(self, stream, first: bytes, where: Where):
        self.stream, self.buffer, self.where, self.bytes = stream, first, where, len(first)
        self.done = False  # the line's end has been read
        self.chunks: Iterator[str] | None = None

    def _more(self) -> bool:
        if self.done:
            return False
        raw = _readline(self.stream, self.where.path)
        self.buffer += raw
        self.bytes += len(raw)
        self.done = not raw or raw.endswith(b"\n")
        return bool(raw)

    def whole(self) -> bytes:
        while self._more():
            pass
        return self.buffer

    def streamed(self, field: str) -> dict | None:
        """{field: LongDocument} if the line's first `field` key holds a string, else None."""
        key = re.search(rb'"' + re.escape(json.dumps(field).encode()[1:-1]) + rb'"\s*:\s*"', self.buffer)
        if key is None:
            return None
        prefix, self.buffer = self.buffer[: key.end() - 1], self.buffer[key.end() :]
        self.chunks = self._text(prefix, field)
        return {field: LongDocument(self.chunks)}

    def _text(self, prefix: bytes, field: str) -> Iterator[str]:
        while True:
            end = _string_end(self.buffer)
            if end >= 0:
                if end:
                    yield self._decode(self.buffer[:end])
                rest, self.buffer = self.buffer[end + 1 :], b""
                break
            cut = self.buffer.rfind(b" ")
            if cut > 0 and len(self.buffer) >= LONG_BYTES:
                yield self._decode(self.buffer[:cut])
                self.buffer = self.buffer[cut:]
            if not self._more():
                raise DataError(f"{self.where} is not valid JSON (the line ends inside a string)")
        rest += self.whole()
        placeholder = json.dumps(_PLACEHOLDER).encode()
        record = _loads(prefix + placeholder + rest, self.where)
        if not isinstance(record, dict) or record.get(field) != _PLACEHOLDER:
            raise DataError(
                f'{self.where}: a line of over {LONG_BYTES >> 20} MiB must have "{field}" as the first key '
                "of that name; put the text's key before nested objects that use it"
            )

    def _decode(self, raw: bytes) -> str:
        return _loads(b'"' + raw + b'"', self.where)

    def drain(self) -> None:
        """Read the line to its end (and check it), whatever the reader took of its text."""
        for _ in self.chunks or ():
            pass
        self.whole()


def _string_end(raw: bytes) -> int:
    """The index of the quote that ends a JSON string's contents `raw`, or -1."""
    at = raw.find(b'"')
    while at >= 0:
        before = at
        while before and raw[before - 1] == 0x5C:  # a backslash
            before -= 1
        if (at - before) % 2 == 0:
            return at
        at = raw.find(b'"', at + 1)
    return -1


def _rows(
    piece: Piece, wanted: list[str], needed: bool, also: frozenset[str] = frozenset()
) -> Iterator[tuple[dict, Where]]:
    """Rows of a Parquet piece or an Arrow file, as {column: value} over the `wanted` columns it has
    (with `needed`, all of them must exist) and those of `also` it has (chat data's other content
    columns: read to be refused as a JSON line's keys are, not silently dropped)."""
    f = piece.file
    import pyarrow as pa

    try:
        if f.kind == "parquet":
            parquet = _parquet(f.path)
            names = parquet.schema_arrow.names
        else:
            reader = pa.ipc.open_stream(pa.memory_map(f.path))
            names = reader.schema.names
        columns = [c for c in wanted if c in names]
        read = columns + [c for c in names if c in also and c not in wanted]
        if f.kind == "parquet":
            batches = parquet.iter_batches(batch_size=1024, row_groups=range(piece.start, piece.stop), columns=read)
        else:
            batches = (batch.select(read) for batch in reader)
        if not columns or (needed and len(columns) < len(wanted)):
            quoted = " / ".join(json.dumps(c) for c in wanted)
            hint = "choose one with --text-field" if len(wanted) == 1 else "is this plain text? leave out --format chat"
            raise DataError(f"{f.path} has no {quoted} column (columns: {', '.join(names)}); {hint}")
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield record, Where(f.path, 0, row, "row")
    except DataError:
        raise
    except Exception as e:  # pyarrow's errors for a damaged file
        raise DataError(f"{f.path} is corrupt ({e}); replace or leave it out") from None


def _records(
    piece: Piece, columns: list[str], needed: bool, long_field: str | None = None, also: frozenset[str] = frozenset()
) -> Iterator[tuple[object, Where]]:
    try:
        if piece.file.kind in ("parquet", "arrow"):
            yield from _rows(piece, columns, needed, also)
        else:
            yield from _json_lines(piece, long_field)
    except OSError as e:
        raise DataError(f"cannot read {piece.file.path}: {e.strerror or e}") from None


def _text_file(path: str) -> Iterator[str]:
    """A text file's contents, decoded as UTF-8 in chunks of LONG_BYTES."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with open(path, "rb") as f:
            while True:
                raw = f.read(LONG_BYTES)
                try:
                    text = decoder.decode(raw, final=not raw)
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path} is not valid UTF-8 at byte offset {offset + e.start}; re-encode it as UTF-8"
                    ) from None
                if text:
                    yield text
                if not raw:
                    return
                offset += len(raw)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def read_piece(piece: Piece, text_field: str = "text") -> Iterator[str | LongDocument | None]:
    """The documents of one piece, in order (empty documents skipped); a long one (over
    LONG_BYTES) as a LongDocument, to be read before the next document is asked for; None for a
    row whose text is null (a table's null cell, a JSON null), which the caller counts."""
    if piece.file.kind == "txt":
        chunks = _text_file(piece.file.path)
        if piece.file.size > LONG_BYTES:
            yield LongDocument(chunks)
        elif text := "".join(chunks):
            yield text
        return
    for record, where in _records(piece, [text_field], needed=True, long_field=text_field):
        text = record.get(text_field) if isinstance(record, dict) else None
        if text is None and (where.kind == "row" or (isinstance(record, dict) and text_field in record)):
            yield None  # a null cell or value: no document, counted
            continue
        if not isinstance(text, str | LongDocument):
            raise DataError(f'{where} has no string "{text_field}" field (choose the field with --text-field)')
        if text:
            yield text


def read_rows(piece: Piece) -> Iterator[tuple[object, Where]]:
    """The rows of one piece for chat data (JSON objects or table rows), each with its place."""
    if piece.file.kind == "txt":
        raise DataError(
            f"{piece.file.path} is plain text; --format chat reads JSON lines or Parquet rows with "
            '"messages" (or "prompt" and "completion")'
        )
    yield from _records(piece, ["messages", "prompt", "completion"], needed=False, also=CONTENT_KEYS)


def preference_rows(piece: Piece) -> Iterator[tuple[object, Where]]:
    """The rows of one piece for preference data, each with its place."""
    if piece.file.kind == "txt":
        raise DataError(
            f'{piece.file.path} is plain text; --format preference reads JSON lines or Parquet rows with "prompt", '
            '"chosen" and "rejected"'
        )
    yield from _records(piece, list(PREFERENCE_COLUMNS), needed=False, also=CONTENT_KEYS)
