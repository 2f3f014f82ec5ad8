"""Where documents come from: input files, cut into pieces that can be read independently.

Inputs are files, directories, globs and directories written by Hugging Face `datasets`
(`save_to_disk`). Formats, by name: `.txt` (one document per file), `.jsonl`, `.jsonl.gz`,
`.jsonl.zst` (one document per line, its `text_field`), `.parquet` (the `text_field` column) and the
Arrow files of a `datasets` directory.

The order of documents is defined by the inputs alone: inputs in the order given, each directory
or glob expanded in sorted path order, documents in file order. A piece is a span of one file that
a worker can read without reading what comes before it: a byte range of a plain `.jsonl` (lines
that start in it), row groups of a Parquet file, or a whole file (text, compressed, Arrow). So any
number of workers and ranks can read the same documents in the same order.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


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


def _kind(path: Path) -> str | None:
    name = path.name
    return next((s.lstrip(".") for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _is_hf_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _hf_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk directory, in the order its state.json lists."""
    try:
        state = json.loads((path / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}/state.json is not a Hugging Face datasets state file ({e})") from None
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
        found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
        if not found:
            raise DataError(f"input directory {path} holds no {', '.join(SUFFIXES)} files")
        return [(p, _kind(p)) for p in found]
    if path.is_file():
        kind = _kind(path) or "txt"  # any other single file given by name: one text document
        return [(path, kind)]
    raise DataError(f"input {path} does not exist")


def expand_inputs(inputs: list[str | Path]) -> list[InputFile]:
    """The input files, in the documented order, each checked to be readable (one line if not)."""
    files = []
    for item in inputs:
        for path, kind in _expand_one(str(item)):
            if not os.access(path, os.R_OK):
                raise DataError(f"cannot read {path}: permission denied (fix its permissions or leave it out)")
            stat = path.stat()
            files.append(InputFile(str(path), kind, stat.st_size, stat.st_mtime_ns))
    if not files:
        raise DataError("no input files given: pass --input FILE_OR_DIR")
    return files


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


def _json_lines(piece: Piece) -> Iterator[tuple[object, Where]]:
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
            try:
                raw = stream.readline()
            except (OSError, EOFError, zlib.error) as e:
                raise DataError(f"{f.path} is corrupt ({e}); replace or leave it out") from None
            except Exception as e:  # zstandard.ZstdError
                raise DataError(f"{f.path} is corrupt ({e}); replace or leave it out") from None
            if not raw:
                break
            lineno += 1
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            where = Where(f.path, start, lineno)
            try:
                yield json.loads(raw), where
            except UnicodeDecodeError:
                _decode(raw, str(where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not valid JSON ({e.msg})") from None


def _rows(piece: Piece, wanted: list[str], needed: bool) -> Iterator[tuple[dict, Where]]:
    """Rows of a Parquet piece or an Arrow file, as {column: value} over the `wanted` columns it has
    (with `needed`, all of them must exist)."""
    f = piece.file
    import pyarrow as pa

    try:
        if f.kind == "parquet":
            parquet = _parquet(f.path)
            names = parquet.schema_arrow.names
            columns = [c for c in wanted if c in names]
            batches = parquet.iter_batches(batch_size=1024, row_groups=range(piece.start, piece.stop), columns=columns)
        else:
            reader = pa.ipc.open_stream(pa.memory_map(f.path))
            names = reader.schema.names
            columns = [c for c in wanted if c in names]
            batches = (batch.select(columns) for batch in reader)
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


def _records(piece: Piece, columns: list[str], needed: bool) -> Iterator[tuple[object, Where]]:
    try:
        if piece.file.kind in ("parquet", "arrow"):
            yield from _rows(piece, columns, needed)
        else:
            yield from _json_lines(piece)
    except OSError as e:
        raise DataError(f"cannot read {piece.file.path}: {e.strerror or e}") from None


def read_piece(piece: Piece, text_field: str = "text") -> Iterator[str]:
    """The documents of one piece, in order (empty documents skipped)."""
    if piece.file.kind == "txt":
        try:
            with open(piece.file.path, "rb") as f:
                text = _decode(f.read(), piece.file.path)
        except OSError as e:
            raise DataError(f"cannot read {piece.file.path}: {e.strerror or e}") from None
        if text:
            yield text
        return
    for record, where in _records(piece, [text_field], needed=True):
        text = record.get(text_field) if isinstance(record, dict) else None
        if text is None and where.kind == "row":
            continue  # a null cell
        if not isinstance(text, str):
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
    yield from _records(piece, ["messages", "prompt", "completion"], needed=False)
