import errno
import gzip
import importlib
import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from conftest import assert_user_error, faulty, field_paths, run_cli, with_field
from meshtrain.data import Blend, Dataset, DistributedLoader, TokenWindows, prepare, stdlib_sources
from meshtrain.errors import ConfigError, DataError
from meshtrain.files import WriteError

prep = importlib.import_module("meshtrain.data.prepare")  # `meshtrain.data.prepare` is the function

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20


def split_tokens(out, split="train") -> np.ndarray:
    """A prepared split as one token stream (its segments in order)."""
    manifest = json.loads((out / "manifest.json").read_text())
    return np.concatenate(
        [np.fromfile(out / f, dtype=manifest["dtype"])[a : a + n] for f, a, n in manifest["splits"][split]]
    )


def documents(out, split="train") -> list[str]:
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = json.loads((out / "manifest.json").read_text())["eos_id"]
    tokens, docs, start = split_tokens(out, split).tolist(), [], 0
    for i, t in enumerate(tokens):
        if t == eos:
            docs.append(tok.decode(tokens[start:i]))
            start = i + 1
    return docs


def tree(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_every_input_format_gives_the_same_documents_in_the_documented_order(tmp_path):
    """.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet (two row groups), a datasets save_to_disk
    directory, and a glob: documents in input order, sorted within a directory, lossless."""
    import datasets
    import zstandard

    docs = [f"document {i}: " + TEXT[: 40 + 7 * i] for i in range(24)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(docs[0])
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[1:6]))
    with gzip.open(src / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[6:10])
    (src / "d.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"text": d}) + "\n" for d in docs[10:14]).encode())
    )
    pq.write_table(pa.table({"text": docs[14:18]}), src / "e.parquet", row_group_size=2)
    datasets.Dataset.from_dict({"text": docs[18:21]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "x1.jsonl").write_text(json.dumps({"text": docs[21]}) + "\n")
    (tmp_path / "x2.jsonl").write_text(json.dumps({"text": docs[22]}) + "\n\n" + json.dumps({"text": docs[23]}))
    manifest = prepare(
        [src, tmp_path / "hf", str(tmp_path / "x*.jsonl")],
        tmp_path / "out",
        vocab_size=300,
        val_fraction=0,
        progress=False,
    )
    assert manifest["documents"] == {"train": 24, "val": 0} and manifest["input_files"] == 8
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 300
    assert documents(tmp_path / "out") == docs  # byte-level BPE is lossless


def test_an_input_given_twice_or_copied_is_refused_before_any_work(tmp_path):
    """The same file twice, under two spellings, through a link, or inside a directory also given,
    and a data file copied under another name: each would count its documents twice (and could hold
    one copy out for validation and train on the other). Plain-text files may share their text."""
    from meshtrain.data.sources import expand_inputs

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(data / "a.jsonl")
    spelled = tmp_path / "data" / ".." / "data" / "a.jsonl"
    for inputs in ([data / "a.jsonl"] * 2, [data / "a.jsonl", spelled], [data, tmp_path / "link.jsonl"]):
        with pytest.raises(DataError, match=r"jsonl is given twice.*: give each file once"):
            expand_inputs(inputs)
    (tmp_path / "copy.jsonl").write_bytes((data / "a.jsonl").read_bytes())
    with pytest.raises(DataError, match=r"inputs .*a.jsonl and .*copy.jsonl hold the same bytes: give one of them"):
        prepare([data, tmp_path / "copy.jsonl"], tmp_path / "out", vocab_size=300, val_fraction=0, progress=False)
    assert not (tmp_path / "out").exists()
    (data / "empty_a.txt").write_text("")
    (data / "empty_b.txt").write_text("")
    assert len(expand_inputs([data])) == 3


def test_text_field_names_the_json_key_or_column(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "from jsonl " + TEXT, "text": 1}) + "\n")
    pq.write_table(pa.table({"content": ["from parquet " + TEXT]}), tmp_path / "b.parquet")
    prepare([tmp_path], tmp_path / "out", vocab_size=300, val_fraction=0, text_field="content", progress=False)
    assert documents(tmp_path / "out") == ["from jsonl " + TEXT, "from parquet " + TEXT]


def test_null_text_is_no_document_and_counted_in_every_format(tmp_path):
    """A row whose text is null (a table's null cell, a JSON null) is the same in every format: no
    document, counted in the manifest and printed; a row without the field stays an error."""
    rows = [{"text": "first " + TEXT}, {"text": None}, {"text": "third " + TEXT}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    for name in ("a.jsonl", "b.parquet"):
        manifest = prepare(
            [tmp_path / name], tmp_path / name.split(".")[0], vocab_size=300, val_fraction=0, progress=False
        )
        assert manifest["skipped_null"] == 1 and documents(tmp_path / name.split(".")[0]) == [
            "first " + TEXT,
            "third " + TEXT,
        ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": TEXT}) + "\n")
    with pytest.raises(DataError, match='c.jsonl:1 has no string "text" field'):
        prepare([tmp_path / "c.jsonl"], tmp_path / "c", vocab_size=300, val_fraction=0, progress=False)


def test_hidden_files_are_no_input_and_a_named_python_file_is_text(tmp_path):
    """A directory's files of other names are refused (test_bad_data_gets_one_clear_line), but not
    its hidden ones (.DS_Store, a .git directory), and hidden files of readable names are not read
    (a notebook's .ipynb_checkpoints copies); Python source named as input is one text document
    (the default corpus)."""
    d = tmp_path / "d"
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / ".DS_Store").write_bytes(b"\x00\x01\x02")
    (d / "a.jsonl").write_text(json.dumps({"text": "from jsonl " + TEXT}) + "\n")
    (d / ".ipynb_checkpoints").mkdir()  # a notebook's copy of the data, and a hidden file of a readable name
    (d / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text((d / "a.jsonl").read_text())
    (d / ".scratch.txt").write_text("hidden " + TEXT)
    (tmp_path / "b.py").write_text("from python " + TEXT)
    prepare([d, tmp_path / "b.py"], tmp_path / "out", vocab_size=300, val_fraction=0, progress=False)
    assert documents(tmp_path / "out") == ["from jsonl " + TEXT, "from python " + TEXT]


@pytest.mark.parametrize("workers", [1, 2])
def test_input_without_documents_is_refused_on_any_number_of_workers(workers, tmp_path):
    """An empty .jsonl cuts into no work unit: the same one line on one worker or several (a pool of no
    unit is never started)."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "tok").mkdir()
    (tmp_path / "a.txt").write_text(TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "tok", vocab_size=300, val_fraction=0, progress=False)
    with pytest.raises(DataError, match="the input holds no text"):
        prepare(
            [tmp_path / "empty.jsonl"],
            tmp_path / "out",
            tokenizer=tmp_path / "tok" / "tokenizer.json",
            val_fraction=0,
            progress=False,
            workers=workers,
        )


def test_split_is_by_document_and_deterministic(tmp_path):
    for i in range(40):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n" + TEXT[: 50 + i])
    a = prepare([tmp_path], tmp_path / "a", vocab_size=300, val_fraction=0.2, progress=False)
    b = prepare(
        sorted(tmp_path.glob("*.txt"), reverse=True), tmp_path / "b", vocab_size=300, val_fraction=0.2, progress=False
    )
    assert a["documents"]["val"] > 0 and a["documents"]["train"] > 0
    assert a["documents"] == b["documents"] and a["val_tokens"] == b["val_tokens"]


def test_prepare_with_an_existing_tokenizer_and_uint32(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "first", vocab_size=280, progress=False)
    m = prepare(
        [tmp_path / "a.txt"],
        tmp_path / "second",
        tokenizer=tmp_path / "first" / "tokenizer.json",
        dtype="uint32",
        progress=False,
    )
    assert m["tokenizer_sha256"] == json.loads((tmp_path / "first" / "manifest.json").read_text())["tokenizer_sha256"]
    assert sum((tmp_path / "second" / s["file"]).stat().st_size for s in m["shards"]) == 4 * (
        m["train_tokens"] + m["val_tokens"]
    )
    assert split_tokens(tmp_path / "second").tolist() == split_tokens(tmp_path / "first").tolist()


def test_replacing_a_dataset_keeps_the_old_one_until_the_new_one_is_complete(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=280, progress=False)
    with pytest.raises(DataError):
        prepare([tmp_path / "missing.txt"], tmp_path / "out", vocab_size=280, progress=False)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["vocab_size"] == 280
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("missing", ["nope.txt", "does not exist"]),
        ("empty", ["holds no text"]),
        ("binary", ["bad.txt", "not valid UTF-8", "byte offset 6"]),
        ("jsonl", ["x.jsonl:2", '"text"']),
        ("vocab", ["70000 tokens", "uint16", "uint32"]),
        ("field", ["p.parquet", 'no "text" column', "body", "--text-field"]),
        ("parquet", ["bad.parquet", "not a readable Parquet file"]),
        ("gzip", ["bad.jsonl.gz", "corrupt"]),
        ("zstd", ["bad.jsonl.zst", "corrupt"]),
        ("unreadable", ["cannot read"]),
        ("suffix", ["train.json is not a format meshtrain reads", ".jsonl.zst", "rename it .jsonl"]),
        ("directory", ["holds files meshtrain does not read (2, first", "b.csv", "move them out", "--input"]),
        ("text field", ["--text-field body", "every input is plain text", "leave --text-field out"]),
    ],
)
def test_bad_data_gets_one_clear_line(tmp_path, cli_env, case, fragments):
    args = ["data", "prepare", "--out", str(tmp_path / "out")]
    if case == "missing":
        args += ["--input", str(tmp_path / "nope.txt")]
    elif case == "empty":
        (tmp_path / "e.txt").write_text("")
        args += ["--input", str(tmp_path / "e.txt")]
    elif case == "binary":
        (tmp_path / "bad.txt").write_bytes(b"hello \xff\xfe world")
        args += ["--input", str(tmp_path / "bad.txt")]
    elif case == "jsonl":
        (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
        args += ["--input", str(tmp_path / "x.jsonl")]
    elif case == "field":
        pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "p.parquet")
        args += ["--input", str(tmp_path / "p.parquet")]
    elif case == "parquet":
        (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
        args += ["--input", str(tmp_path / "bad.parquet")]
    elif case == "gzip":
        good = gzip.compress(b"".join(json.dumps({"text": f"doc {i} " * 50}).encode() + b"\n" for i in range(200)))
        (tmp_path / "bad.jsonl.gz").write_bytes(good[: len(good) // 2] + bytes(64))
        args += ["--input", str(tmp_path / "bad.jsonl.gz")]
    elif case == "zstd":
        (tmp_path / "bad.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage, not a zstd frame")
        args += ["--input", str(tmp_path / "bad.jsonl.zst")]
    elif case == "unreadable":
        if os.geteuid() == 0:  # root reads any file: take one whose read fails for everyone
            (tmp_path / "mem.txt").symlink_to("/proc/self/mem")
            args += ["--input", str(tmp_path / "mem.txt")]
        else:
            (tmp_path / "secret.txt").write_text("text")
            (tmp_path / "secret.txt").chmod(0)
            args += ["--input", str(tmp_path / "secret.txt")]
    elif case == "suffix":  # JSON lines under another name: not guessed to be one text document
        (tmp_path / "train.json").write_text('{"text": "a document"}\n')
        args += ["--input", str(tmp_path / "train.json")]
    elif case == "directory":  # not silently left out of the directory
        for name in ("a.jsonl", "b.csv", "c.ndjson"):
            (tmp_path / "d" / name).parent.mkdir(exist_ok=True)
            (tmp_path / "d" / name).write_text('{"text": "a document"}\n')
        args += ["--input", str(tmp_path / "d")]
    elif case == "text field":  # plain text has no fields
        (tmp_path / "a.txt").write_text("a document")
        args += ["--input", str(tmp_path / "a.txt"), "--text-field", "body"]
    else:
        from tokenizers import Tokenizer as T
        from tokenizers.models import WordLevel

        T(WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0")).save(str(tmp_path / "big.json"))
        (tmp_path / "a.txt").write_text("w1 w2")
        args += [
            "--input",
            str(tmp_path / "a.txt"),
            "--tokenizer",
            str(tmp_path / "big.json"),
            "--token-dtype",
            "uint16",
        ]
    assert_user_error(run_cli(args, cli_env), *fragments)
    assert not (tmp_path / "out").exists()
    # only a unit finished (the empty one, refused at the end) is kept, to resume from
    assert (tmp_path / ".out.partial").exists() == (case == "empty")


def test_a_datasets_directory_saved_with_an_indices_mapping_is_refused(tmp_path):
    """An earlier `datasets` saved a select, shuffle or filter as an indices file beside the rows from
    before it: read without it, the rows left out would be tokenized too."""
    import datasets

    from meshtrain.data.sources import expand_inputs

    datasets.Dataset.from_dict({"text": ["kept", "left out"]}).save_to_disk(str(tmp_path / "hf"))
    state = json.loads((tmp_path / "hf" / "state.json").read_text())
    for indices in (None, []):  # no mapping
        (tmp_path / "hf" / "state.json").write_text(json.dumps({**state, "_indices_data_files": indices}))
        assert [f.kind for f in expand_inputs([tmp_path / "hf"])] == ["arrow"]
    (tmp_path / "hf" / "state.json").write_text(
        json.dumps({**state, "_indices_data_files": [{"filename": "indices.arrow"}]})
    )
    with pytest.raises(DataError, match=r"hf was saved with an indices mapping .* ds.flatten_indices\(\).save_to_disk"):
        expand_inputs([tmp_path / "hf"])


def _four_units(tmp_path, monkeypatch) -> list:
    """Four text files, a work unit each."""
    monkeypatch.setattr(prep, "UNIT_BYTES", (1, 256 << 20))
    for i in range(4):
        (tmp_path / "in" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i}\n" + TEXT)
    return [tmp_path / "in"]


def test_a_failed_prepare_keeps_its_finished_units_and_resumes_from_them(tmp_path, monkeypatch):
    """A read error in the third of four units (it may pass: a network file system) is named, and the
    two units done stay for the same command, which goes on from them (also from a partial directory
    of an earlier meshtrain) and ends with the bytes of a prepare never interrupted."""
    inputs = _four_units(tmp_path, monkeypatch)
    prepare(inputs, tmp_path / "whole", vocab_size=300, val_fraction=0, progress=False, workers=1)
    tokenizer = tmp_path / "whole" / "tokenizer.json"
    text_unit = prep._text_unit

    def unreadable(job, unit, tok, shards):
        if unit.index == 2:
            raise DataError(f"cannot read {unit.pieces[0].file.path}: Input/output error")
        return text_unit(job, unit, tok, shards)

    monkeypatch.setattr(prep, "_text_unit", unreadable)
    with pytest.raises(DataError, match=r"cannot read .*2.txt: Input/output error"):
        prepare(inputs, tmp_path / "out", tokenizer=tokenizer, val_fraction=0, progress=False, workers=1)
    partial = tmp_path / ".out.partial"
    assert sorted(p.name for p in partial.glob(".unit-*.json")) == [".unit-00000.json", ".unit-00001.json"]
    first_unit = (partial / "train-00000.bin").stat().st_mtime_ns
    for record in [*partial.glob(".unit-*.json"), partial / ".spec.json"]:  # as an earlier meshtrain named them
        record.rename(partial / record.name[1:])
    monkeypatch.setattr(prep, "_text_unit", text_unit)
    prepare(inputs, tmp_path / "out", tokenizer=tokenizer, val_fraction=0, progress=False, workers=1)
    assert (tmp_path / "out" / "train-00000.bin").stat().st_mtime_ns == first_unit  # kept, not redone
    assert tree(tmp_path / "out") == tree(tmp_path / "whole") and not partial.exists()


@pytest.mark.parametrize("settings", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizers_settings_changed_since_a_failed_prepare_start_it_afresh(settings, tmp_path, monkeypatch):
    """The files beside a tokenizer.json name its eos token, which ends every document: one added (or
    changed) after a prepare stopped makes the next start afresh, not end half the documents with
    the old token."""
    inputs = _four_units(tmp_path, monkeypatch)
    prepare(inputs, tmp_path / "bpe", vocab_size=300, val_fraction=0, progress=False, workers=1)
    (tmp_path / "tok").mkdir()
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.write_bytes((tmp_path / "bpe" / "tokenizer.json").read_bytes())
    text_unit = prep._text_unit

    def unreadable(job, unit, tok, shards):
        if unit.index == 2:
            raise DataError("cannot read it: Input/output error")
        return text_unit(job, unit, tok, shards)

    monkeypatch.setattr(prep, "_text_unit", unreadable)
    with pytest.raises(DataError, match="Input/output error"):
        prepare(inputs, tmp_path / "out", tokenizer=tokenizer, val_fraction=0, progress=False, workers=1)
    assert (tmp_path / ".out.partial" / ".unit-00001.json").is_file()
    monkeypatch.setattr(prep, "_text_unit", text_unit)
    eos = Tokenizer.from_file(str(tokenizer)).id_to_token(100)
    (tmp_path / "tok" / settings).write_text(json.dumps({"eos_token": eos}))
    prepare(inputs, tmp_path / "out", tokenizer=tokenizer, val_fraction=0, progress=False, workers=1)
    prepare(inputs, tmp_path / "whole", tokenizer=tokenizer, val_fraction=0, progress=False, workers=1)
    assert tree(tmp_path / "out") == tree(tmp_path / "whole")
    assert (split_tokens(tmp_path / "out") == 100).sum() == 4  # each document ends with the new token


class Killed(Exception):
    """Where a prepare killed at that moment would stop."""


@pytest.mark.parametrize("stop", ["killed while syncing", "rename refused", "output changed"])
def test_a_prepare_stopped_at_the_end_is_finished_by_the_next(stop, tmp_path, monkeypatch):
    """Stopped after its manifest is written (killed while its files are synced, its rename refused,
    or someone's file put into --out meanwhile, which the check just before the rename finds and
    keeps): the partial directory stays resumable, the earlier output stays whole, and the same
    command then only renames the partial into place."""
    import meshtrain.data.partial

    inputs, out, partial = _four_units(tmp_path, monkeypatch), tmp_path / "out", tmp_path / ".out.partial"
    prepare(inputs, tmp_path / "whole", vocab_size=300, val_fraction=0, progress=False, workers=1)
    args = {"tokenizer": tmp_path / "whole" / "tokenizer.json", "val_fraction": 0, "progress": False, "workers": 1}
    prepare([inputs[0] / "0.txt"], out, **args)  # an earlier output, to be replaced
    earlier = tree(out)
    with monkeypatch.context() as fault:
        if stop == "killed while syncing":

            def killed(directory):
                raise Killed

            fault.setattr(meshtrain.data.partial, "sync_tree", killed)
        elif stop == "rename refused":
            rename = type(out).rename

            def refuse(self, target):
                if self.name == ".out.partial":
                    raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
                return rename(self, target)

            fault.setattr(type(out), "rename", refuse)
        else:
            run_units = prep.run_units

            def meanwhile(*args):
                run_units(*args)
                (out / "notes.txt").write_text("mine")

            fault.setattr(prep, "run_units", meanwhile)
        with pytest.raises(Killed if stop == "killed while syncing" else WriteError):
            prepare(inputs, out, **args)
    assert (partial / "manifest.json").is_file() and (partial / ".spec.json").is_file()
    if stop == "output changed":
        assert (out / "notes.txt").read_text() == "mine"
        (out / "notes.txt").unlink()
    assert tree(out) == earlier
    shard = (partial / "train-00000.bin").stat().st_mtime_ns
    prepare(inputs, out, **args)
    assert (out / "train-00000.bin").stat().st_mtime_ns == shard  # finished, not redone
    assert tree(out) == tree(tmp_path / "whole") and not partial.exists()


def test_a_symlinked_output_is_kept_and_the_directory_it_names_replaced(tmp_path):
    """--out a symlink (to a bigger disk): the directory it points to is checked, written beside and
    replaced; the link stays."""
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "disk").mkdir()
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "disk" / "data")
    for vocab_size in (270, 280):
        prepare([tmp_path / "a.txt"], link, vocab_size=vocab_size, progress=False)
        assert link.is_symlink() and json.loads((link / "manifest.json").read_text())["vocab_size"] == vocab_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "data", "disk"]
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["data"]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):  # its unit is kept: in the target's file system
        prepare([tmp_path / "empty.txt"], link, vocab_size=270, progress=False)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == [".data.partial", "data"]


def test_a_vocabulary_the_sample_cannot_fill_is_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("meshtrain"), "propagate", True)  # off once a CLI set up logging
    (tmp_path / "a.txt").write_text(TEXT)
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        manifest = prepare([tmp_path / "a.txt"], tmp_path / "big", vocab_size=5000, progress=False)
    assert manifest["vocab_size"] < 5000
    assert f"the tokenizer has {manifest['vocab_size']} tokens, not the 5000 of --vocab-size" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="meshtrain"):
        assert prepare([tmp_path / "a.txt"], tmp_path / "small", vocab_size=280, progress=False)["vocab_size"] == 280
    assert "--vocab-size" not in caplog.text


def test_fewer_tokens_than_one_sequence(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=260, val_fraction=0, progress=False)
    with pytest.raises(DataError, match="fewer than one sequence of training.seq_len"):
        Dataset(tmp_path / "out", seq_len=64)


def test_truncated_token_file_is_reported(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="truncated"):
        TokenWindows.from_file(tmp_path / "t.bin", "uint16", 1)


def test_a_manifest_or_tokenizer_meshtrain_would_misread_is_refused(tmp_path):
    """A manifest of a newer format, or of a kind meshtrain does not know, would be read as plain
    text; a tokenizer.json saved with truncation or padding on would cut or pad every document."""
    from meshtrain.data.format import read_manifest
    from meshtrain.data.tokenizer import load_tokenizer, train_bpe

    base = {"dtype": "uint16", "vocab_size": 300, "tokenizer": "tokenizer.json", "eos_id": 0}
    for extra, message in (({"format_version": 3}, "format_version 3"), ({"format": "code"}, "format 'code'")):
        (tmp_path / "manifest.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(DataError, match=message):
            read_manifest(tmp_path)
    tokenizer = train_bpe(["a b a b a b a b"], 260)
    tokenizer.save(str(tmp_path / "plain.json"))
    assert (
        load_tokenizer(tmp_path / "plain.json").encode("a b a b a b a b").ids == tokenizer.encode("a b a b a b a b").ids
    )
    tokenizer.enable_truncation(4)
    tokenizer.save(str(tmp_path / "cut.json"))
    with pytest.raises(DataError, match='sets truncation .* set "truncation": null'):
        load_tokenizer(tmp_path / "cut.json")
    tokenizer.no_truncation()
    tokenizer.enable_padding(length=64)
    tokenizer.save(str(tmp_path / "padded.json"))
    with pytest.raises(DataError, match='sets padding .* set "padding": null'):
        load_tokenizer(tmp_path / "padded.json")


def _windows(tmp_path, n_tokens=1000, seq_len=8, name="t.bin"):
    np.arange(n_tokens, dtype=np.uint16).tofile(tmp_path / name)
    return TokenWindows.from_file(tmp_path / name, "uint16", seq_len)


def test_dp_ranks_read_disjoint_slices_that_make_the_global_batch(tmp_path):
    w = _windows(tmp_path)
    single = DistributedLoader(w, 8, 0, 1, seed=1)
    ranks = [DistributedLoader(w, 8, r, 4, seed=1) for r in range(4)]
    seen = set()
    for _ in range(30):  # crosses an epoch boundary (124 windows)
        x, y, _, _ = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert all(p[0].shape == (2, 8) for p in parts)
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
        starts = [p[0][:, 0].tolist() for p in parts]
        flat = [s for ss in starts for s in ss]
        assert len(set(flat)) == 8  # disjoint within a batch
        seen.update(flat)
    assert len(seen) == len(w)  # every window is visited in the first epoch


def test_order_is_seeded(tmp_path):
    w = _windows(tmp_path)
    a, b, c = (DistributedLoader(w, 4, 0, 1, seed=s) for s in (0, 0, 1))
    assert a.next_batch()[0].tolist() == b.next_batch()[0].tolist() != c.next_batch()[0].tolist()


def test_resume_continues_exactly_even_on_another_dp_degree(tmp_path):
    w = _windows(tmp_path)
    straight = DistributedLoader(w, 8, 0, 1, seed=5)
    batches = [straight.next_batch()[0] for _ in range(20)]
    first = DistributedLoader(w, 8, 0, 1, seed=5)
    for _ in range(7):
        first.next_batch()
    state = first.state_dict()
    resumed = [DistributedLoader(w, 8, r, 2, seed=5) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    with pytest.raises(DataError, match=r"drawn with training.seed = 5, now 0: resume with the same seed"):
        DistributedLoader(w, 8, 0, 2, seed=0).load_state_dict(state)  # it would repeat and skip samples
    for step in range(7, 20):
        torch.testing.assert_close(torch.cat([loader.next_batch()[0] for loader in resumed]), batches[step])
    other = DistributedLoader(_windows(tmp_path / "..", 2000), 8, 0, 1, seed=5)
    with pytest.raises(DataError, match="data or training.seq_len changed"):
        other.load_state_dict(state)
    # as many windows, other tokens (data prepared again from other text): the checksums tell
    saved = DistributedLoader(w, 8, 0, 1, seed=5, content_ids=["a1"]).state_dict()
    with pytest.raises(DataError, match="trained on other data: data.path source 1's tokens"):
        DistributedLoader(w, 8, 0, 1, seed=5, content_ids=["b2"]).load_state_dict(saved)
    DistributedLoader(w, 8, 0, 1, seed=5, content_ids=["a1"]).load_state_dict(saved)
    DistributedLoader(w, 8, 0, 1, seed=5, content_ids=["b2"]).load_state_dict(state)  # saved before it was recorded


def _stdlib_jsonl(path, n_bytes: int) -> None:
    """Standard-library sources as JSON lines, about n_bytes of them."""
    with path.open("w") as f:
        written = 0
        for source in stdlib_sources():
            if written >= n_bytes:
                break
            written += f.write(json.dumps({"text": source.read_text(errors="replace")}) + "\n")


@pytest.fixture(scope="module")
def three_units(tmp_path_factory):
    """About 3 MiB of JSON lines (three work units) and a tokenizer for them."""
    root = tmp_path_factory.mktemp("units")
    _stdlib_jsonl(root / "docs.jsonl", 3 << 20)
    (root / "tok").mkdir()
    prepare(stdlib_sources()[:20], root / "tok", vocab_size=400, val_fraction=0, progress=False)
    return root


def test_workers_and_a_killed_prepare_give_the_same_bytes(three_units, cli_env, tmp_path):
    """--workers 2 writes what --workers 1 writes; a prepare killed halfway through its second unit,
    then started again, keeps the first unit and ends with the same bytes as one never killed."""
    args = ["data", "prepare", "--input", str(three_units / "docs.jsonl"), "--val-fraction", "0.05"]
    args += ["--tokenizer", str(three_units / "tok" / "tokenizer.json")]
    for name, workers, env in (
        ("one", 1, cli_env),
        ("two", 2, cli_env),
        ("killed", 1, faulty(cli_env, MESHTRAIN_KILL_IN_UNIT="1")),
    ):
        result = run_cli([*args, "--out", str(tmp_path / name), "--workers", str(workers)], env)
        assert result.returncode == (-signal.SIGKILL if name == "killed" else 0), result.stderr
    assert len(json.loads((tmp_path / "one" / "manifest.json").read_text())["shards"]) >= 6  # 3 units x 2 splits
    assert tree(tmp_path / "two") == tree(tmp_path / "one")
    partial = tmp_path / ".killed.partial"
    assert not (tmp_path / "killed").exists() and (partial / ".unit-00000.json").is_file()
    assert not (partial / ".unit-00001.json").exists() and list(partial.glob(".train-00001.bin.tmp-*"))
    first_unit = (partial / "train-00000.bin").stat().st_mtime_ns
    result = run_cli([*args, "--out", str(tmp_path / "killed"), "--workers", "1"], cli_env)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout and not partial.exists()
    assert (tmp_path / "killed" / "train-00000.bin").stat().st_mtime_ns == first_unit  # kept, not redone
    assert tree(tmp_path / "killed") == tree(tmp_path / "one")


def _peak_rss_mb(cli_env, args) -> float:
    """The peak RSS of a `meshtrain` run, measured from a fresh parent (RUSAGE_CHILDREN is a maximum
    over every child a process ever waited for)."""
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, sys.executable, "-m", "meshtrain", *args],
        env=cli_env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split()[-1]) / 1024


def _one_document(path, n_bytes: int, ensure_ascii: bool = False) -> str:
    """One document of about n_bytes (standard-library sources with quotes, backslashes, tabs,
    newlines, and characters outside the BMP, whose JSON escapes are surrogate pairs), as a .txt or
    a single JSON line (`ensure_ascii`: every non-ASCII character escaped)."""
    text, parts = "", []
    for source in stdlib_sources():
        parts.append(source.read_text(errors="replace") + ' caf\u00e9 \U0001f600 "q" \\ ')
        if sum(map(len, parts)) >= n_bytes:
            break
    text = "".join(parts)
    if path.suffix == ".txt":
        path.write_text(text)
    else:
        path.write_text(json.dumps({"id": 1, "text": text, "meta": {"text": "x"}}, ensure_ascii=ensure_ascii) + "\n")
    return text


@pytest.mark.parametrize("kind", ["documents", "one document"])
def test_memory_does_not_grow_with_the_input(kind, three_units, cli_env, tmp_path):
    """Streaming: 10x the input, the same peak memory within 1.3x, whether the input is many
    documents (read and tokenized in bounded batches) or a single one (read in chunks, tokenized a
    window at a time; whole, 20 MB of text would take 2.5 GB)."""
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    if kind == "documents":
        _stdlib_jsonl(small, 2 << 20)
        large.write_text(small.read_text() * 10)
    else:
        _one_document(small, 2 << 20)
        _one_document(large, 20 << 20)
    peaks = [
        _peak_rss_mb(
            cli_env,
            ["data", "prepare", "--input", str(path), "--out", str(tmp_path / path.stem), "--workers", "1"]
            + ["--tokenizer", str(three_units / "tok" / "tokenizer.json")],
        )
        for path in (small, large)
    ]
    assert peaks[1] < 1.3 * peaks[0], peaks


def test_a_long_document_is_tokenized_as_a_whole(three_units, tmp_path):
    """A document longer than the tokenizing window, as a .txt and as a JSON line (UTF-8, and
    ASCII with escapes): the ids equal the tokenizer's encoding of the whole text, then the
    end-of-text token; the line's other keys (one nested "text" among them) are checked, not read."""
    from meshtrain.data.tokenizer import load_tokenizer

    tokenizer = three_units / "tok" / "tokenizer.json"
    tok = load_tokenizer(tokenizer)
    for name, ascii_only in (("doc.txt", False), ("doc.jsonl", False), ("ascii.jsonl", True)):
        text = _one_document(tmp_path / name, 3 << 20, ensure_ascii=ascii_only)
        out = tmp_path / f"out-{name}"
        prepare(
            [tmp_path / name], out, tokenizer=three_units / "tok" / "tokenizer.json", val_fraction=0, progress=False
        )
        ids = np.fromfile(out / "train-00000.bin", dtype=np.uint16).tolist()
        expected = tok.encode(text, add_special_tokens=False).ids + [tok.token_to_id("<|endoftext|>")]
        assert ids == expected, name


def test_a_long_line_that_is_not_json_is_named(three_units, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "' + "word " * 400_000 + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1 is not valid JSON"):
        prepare([bad], tmp_path / "out", tokenizer=three_units / "tok" / "tokenizer.json", progress=False)


def _blend_loaders(tmp_path, dp: int, weights=(0.7, 0.3), seed=3):
    web = _windows(tmp_path, 1000, name="web.bin")
    code = TokenWindows.from_file(tmp_path / "code.bin", "uint16", 8) if (tmp_path / "code.bin").exists() else None
    if code is None:
        (np.arange(600, dtype=np.uint16) + 5000).tofile(tmp_path / "code.bin")  # tokens >= 5000: "code"
        code = TokenWindows.from_file(tmp_path / "code.bin", "uint16", 8)
    return [DistributedLoader([web, code], 8, r, dp, seed, weights=list(weights)) for r in range(dp)]


def test_a_blend_keeps_its_weights_resumes_exactly_and_ignores_the_dp_degree(tmp_path):
    (single,) = _blend_loaders(tmp_path, 1)
    four = _blend_loaders(tmp_path, 4)
    from_code, batches = 0, []
    for step in range(1000):  # 8,000 samples: both sources wrap around several epochs
        x, _, _, _ = single.next_batch()
        assert torch.equal(x, torch.cat([loader.next_batch()[0] for loader in four]))
        from_code += int((x[:, 0] >= 5000).sum())
        if step < 40:
            batches.append(x)
        if step + 1 in (10, 100, 1000):
            assert abs(from_code / (8 * (step + 1)) - 0.3) < 0.01
            assert single.mix() == pytest.approx([1 - from_code / (8 * (step + 1)), from_code / (8 * (step + 1))])
    (first,) = _blend_loaders(tmp_path, 1)
    for _ in range(17):
        first.next_batch()
    resumed = _blend_loaders(tmp_path, 2)
    for loader in resumed:
        loader.load_state_dict(first.state_dict())
    for step in range(17, 40):
        assert torch.equal(torch.cat([loader.next_batch()[0] for loader in resumed]), batches[step])
    (other,) = _blend_loaders(tmp_path, 1, weights=(0.5, 0.5))
    with pytest.raises(DataError, match="same blend"):
        other.load_state_dict(first.state_dict())


def test_a_blend_needs_one_tokenizer_and_positive_weights(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "web", vocab_size=300, val_fraction=0, progress=False)
    prepare([tmp_path / "a.txt"], tmp_path / "code", vocab_size=280, val_fraction=0, progress=False)
    with pytest.raises(DataError, match="different tokenizers"):
        Blend(f"{tmp_path / 'web'}:0.7,{tmp_path / 'code'}:0.3", seq_len=16)
    with pytest.raises(ConfigError, match="above 0"):
        Blend(f"{tmp_path / 'web'}:0.7,{tmp_path / 'code'}:0", seq_len=16)


def test_a_blend_needs_one_document_start(tmp_path):
    """Two tokenizers alike but for the post-processor (one begins each text with a BOS) have one
    fingerprint, but their data would teach the model two starts of a document. A manifest of an
    earlier meshtrain records no start: not compared."""
    from tokenizers import processors

    (tmp_path / "a.txt").write_text(TEXT)
    prepare([tmp_path / "a.txt"], tmp_path / "plain", vocab_size=300, val_fraction=0, progress=False)
    tok = Tokenizer.from_file(str(tmp_path / "plain" / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    (tmp_path / "bos").mkdir()
    tok.save(str(tmp_path / "bos" / "tokenizer.json"))
    prepare([tmp_path / "a.txt"], tmp_path / "with_bos", tokenizer=tmp_path / "bos" / "tokenizer.json", progress=False)
    spec = f"{tmp_path / 'plain'}:0.5,{tmp_path / 'with_bos'}:0.5"
    with pytest.raises(
        DataError, match=rf"with_bos begins each document with the tokens \[{bos}\] and .*plain with \[\]"
    ):
        Blend(spec, seq_len=16)
    manifest = json.loads((tmp_path / "with_bos" / "manifest.json").read_text())
    del manifest["document_prefix"]
    (tmp_path / "with_bos" / "manifest.json").write_text(json.dumps(manifest))
    assert len(Blend(spec, seq_len=16).sources) == 2


def test_damaged_shards_are_found_before_training(tmp_path):
    from meshtrain.train.build import verify_data

    for i in range(8):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n" + TEXT)
    prepare([tmp_path], tmp_path / "out", vocab_size=300, val_fraction=0.3, progress=False)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    verify_data(Blend(str(tmp_path / "out"), 16), 0, 1)
    shard = tmp_path / "out" / manifest["shards"][-1]["file"]
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(data)
    blend = Blend(str(tmp_path / "out"), 16)
    assert len(manifest["shards"]) == 2
    assert sorted(len(blend.sources[0].verify((k, 2))) for k in range(2)) == [0, 1]  # each rank reads its share
    with pytest.raises(DataError, match=f"{shard.name} does not match its checksum"):
        verify_data(blend, 0, 1)
    shard.write_bytes(data[:-2])
    with pytest.raises(DataError, match="truncated or replaced"):
        Blend(str(tmp_path / "out"), 16)


def test_a_vocabulary_size_set_for_data_prepared_with_another_is_refused(corpus):
    """data.vocab_size is the BPE trained for the default corpus: beside data already prepared with
    another vocabulary it would be silently ignored, so it is refused (unset, the data's is used)."""
    from meshtrain.config import load_config
    from meshtrain.job.data import ensure_dataset

    given = {"data.path": str(corpus), "data.corpus": ""}
    assert ensure_dataset(load_config(None, given)).vocab_size == 512
    assert ensure_dataset(load_config(None, {**given, "data.vocab_size": 512})).vocab_size == 512
    for corpus_name in ("", "stdlib"):
        cfg = load_config(None, {**given, "data.corpus": corpus_name, "data.vocab_size": 16384})
        with pytest.raises(DataError, match=r"data.vocab_size = 16384 but .* prepared with a vocabulary of 512"):
            ensure_dataset(cfg)


def _small_tokenizer(path, kind: str) -> None:
    """A Llama-style BPE (Metaspace pre-tokenizer of prepend scheme `kind`, byte fallback) with <unk>,
    <s> and </s>, or (`kind` "bert") a BERT WordPiece that keeps case."""
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    if kind == "bert":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=kind, split=False)
        specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))


def test_tokenizer_config_flags_that_make_transformers_encode_otherwise_are_refused(corpus, tmp_path):
    """transformers rebuilds a GPT-2 tokenizer's pre-tokenizer from tokenizer_config.json's
    add_prefix_space, a Llama one's from add_prefix_space and legacy, a BERT one's normalizer from
    do_lower_case: where a flag disagrees with tokenizer.json, which meshtrain encodes with, the model
    would be served other ids than it was trained on, so prepare refuses it. Flags that agree, and
    fields that change no id, are kept."""
    from transformers import AutoTokenizer

    (tmp_path / "in.txt").write_text(TEXT)
    text = "Hello World</s> the quick<s>Fox. café"
    eot = Tokenizer.from_file(str(corpus / "tokenizer.json")).token_to_id("<|endoftext|>")
    harmless = {
        "model_max_length": 8,
        "padding_side": "left",
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,  # BERT's: a byte-level BPE has no lowercasing to switch
        "added_tokens_decoder": {str(eot): {"content": "<|endoftext|>", "special": True}},
    }
    llama = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    cases = [
        ("gpt2", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": True}, "add_prefix_space is true"),
        ("gpt2", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **harmless}, None),
        ("first", {**llama, "legacy": True}, "legacy is true"),
        ("first", {**llama, "add_prefix_space": False}, "add_prefix_space is false"),
        ("first", {**llama, "legacy": False, "add_prefix_space": True}, None),
        ("always", {**llama, "legacy": False}, "legacy is false"),
        ("always", {**llama, "legacy": True}, None),
        ("bert", {"tokenizer_class": "BertTokenizer", "do_lower_case": True}, "do_lower_case is true"),
        ("bert", {"tokenizer_class": "BertTokenizer", "do_lower_case": False}, None),
    ]
    for i, (kind, config, refused) in enumerate(cases):
        directory = tmp_path / f"tok{i}"
        directory.mkdir()
        if kind == "gpt2":
            (directory / "tokenizer.json").write_bytes((corpus / "tokenizer.json").read_bytes())
        else:
            _small_tokenizer(directory / "tokenizer.json", kind)
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        ours = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        theirs = AutoTokenizer.from_pretrained(str(directory))(text, add_special_tokens=False)["input_ids"]
        assert (theirs == ours) == (refused is None), (kind, config)  # what the refusal keeps from training
        args = {"tokenizer": directory / "tokenizer.json", "val_fraction": 0, "progress": False, "workers": 1}
        if refused is None:
            prepare([tmp_path / "in.txt"], tmp_path / f"out{i}", **args)
            continue
        with pytest.raises(DataError) as error:
            prepare([tmp_path / "in.txt"], tmp_path / f"out{i}", **args)
        flag, value = refused.split(" is ")
        fix = f"set {flag} to {json.dumps(value != 'true')} or remove it"
        assert f"tokenizer_config.json: {refused} but tokenizer.json" in str(error.value) and fix in str(error.value)
        assert "\n" not in str(error.value)


def test_split_special_tokens_in_tokenizer_config_is_refused(corpus, tmp_path):
    """tokenizer_config.json's split_special_tokens true makes transformers encode a special token
    written in a text as plain characters, where meshtrain (as tokenizer.json) reads it as the special
    token: the model would be served other ids than it was trained on, so prepare refuses it in one
    line; false (transformers' default) is kept."""
    from transformers import AutoTokenizer

    (tmp_path / "in.txt").write_text(TEXT)
    text = "x = 1<|endoftext|>y = 2"
    for i, (value, refused) in enumerate([(True, True), (False, False)]):
        directory = tmp_path / f"tok{i}"
        directory.mkdir()
        (directory / "tokenizer.json").write_bytes((corpus / "tokenizer.json").read_bytes())
        (directory / "tokenizer_config.json").write_text(json.dumps({"split_special_tokens": value}))
        ours = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        theirs = AutoTokenizer.from_pretrained(str(directory))(text, add_special_tokens=False)["input_ids"]
        assert (theirs == ours) == (not refused), value  # what the refusal keeps from training
        args = {"tokenizer": directory / "tokenizer.json", "val_fraction": 0, "progress": False, "workers": 1}
        if not refused:
            prepare([tmp_path / "in.txt"], tmp_path / f"out{i}", **args)
            continue
        with pytest.raises(DataError) as error:
            prepare([tmp_path / "in.txt"], tmp_path / f"out{i}", **args)
        message = str(error.value)
        assert "tokenizer_config.json: split_special_tokens is true" in message and "\n" not in message
        assert "set split_special_tokens to false or remove it" in message


def test_tokens_the_tokenizer_files_add_must_be_in_tokenizer_json(corpus, tmp_path):
    """transformers adds a token that tokenizer_config.json's added_tokens_decoder (or an
    additional_special_tokens list) names and tokenizer.json lacks, and encodes it as one token:
    meshtrain, reading tokenizer.json, would encode its characters. Refused by name; a token that
    tokenizer.json holds at the id named is accepted."""
    from meshtrain.data.tokenizer import end_of_text

    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    cases = [
        ({"added_tokens_decoder": {str(eot): {"content": "<|endoftext|>", "special": True}}}, {}, None),
        ({"added_tokens_decoder": {"9000": {"content": "<|im_end|>", "special": True}}}, {}, "not in tokenizer.json"),
        (
            {"added_tokens_decoder": {str(eot + 1): {"content": "<|endoftext|>", "special": True}}},
            {},
            f"is id {eot} in tokenizer.json, not {eot + 1}",
        ),
        ({"additional_special_tokens": ["<|im_start|>"]}, {}, "not in tokenizer.json"),
        ({}, {"additional_special_tokens": [{"content": "<tool>"}]}, "not in tokenizer.json"),
    ]
    for config, special_map, refusal in cases:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_map))
        if refusal is None:
            end_of_text(tokenizer, tmp_path)
        else:
            with pytest.raises(DataError, match=refusal) as refused:
                end_of_text(tokenizer, tmp_path)
            assert "save_pretrained" in str(refused.value) and "\n" not in str(refused.value)


def test_every_field_of_a_manifest_past_its_bounds_is_refused_in_one_line(corpus, tmp_path_factory):
    """Each field of a prepared directory's manifest.json (nested ones too: shards, splits, their
    segments), given a value of the wrong type, NaN, infinite, negative or huge, is refused in one
    line naming the manifest when the directory is opened: never a traceback of another kind, never
    read as if nothing were wrong."""
    import math
    import shutil

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    directory = tmp_path_factory.mktemp("edited") / "data"
    shutil.copytree(corpus, directory)
    manifest = json.loads((corpus / "manifest.json").read_text())

    bad = st.sampled_from([math.nan, math.inf, -math.inf, -1, -0.5, 1e300, 2**70, True, [1, "x"], {"a": "b"}])

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(field_paths(manifest), key=str)), bad)
    def refused(path, value):
        (directory / "manifest.json").write_text(json.dumps(with_field(manifest, path, value)))
        with pytest.raises(DataError) as refusal:
            Dataset(directory, 32)
        assert "\n" not in str(refusal.value) and "manifest.json" in str(refusal.value), (path, value)

    refused()
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert len(Dataset(directory, 32).train) > 0  # the unedited copy opens
