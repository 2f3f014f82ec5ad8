import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer

from conftest import assert_user_error, run_cli
from meshtrain.data import Dataset, DistributedLoader, TokenWindows, prepare
from meshtrain.errors import DataError

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20


def test_prepare_reads_txt_jsonl_parquet_and_round_trips(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i}: " + TEXT[:80]}) for i in range(5)))
    pq.write_table(pa.table({"text": ["parquet doc " + TEXT[:100], "another one"]}), tmp_path / "c.parquet")
    manifest = prepare([tmp_path], tmp_path / "out", vocab_size=300, val_fraction=0, progress=False)
    assert manifest["documents"] == {"train": 1 + 5 + 2, "val": 0}
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 300
    tokens = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert len(tokens) == manifest["train_tokens"]
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    first_doc = tokens[: list(tokens).index(manifest["eos_id"])]
    assert tok.decode(first_doc.tolist()) == TEXT  # byte-level BPE is lossless


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
    assert (tmp_path / "second" / "train.bin").stat().st_size == 4 * m["train_tokens"]


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


def test_fewer_tokens_than_one_sequence(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=260, val_fraction=0, progress=False)
    with pytest.raises(DataError, match="fewer than one sequence of training.seq_len"):
        Dataset(tmp_path / "out", seq_len=64)


def test_truncated_token_file_is_reported(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="truncated"):
        TokenWindows(tmp_path / "t.bin", "uint16", 1)


def _windows(tmp_path, n_tokens=1000, seq_len=8):
    np.arange(n_tokens, dtype=np.uint16).tofile(tmp_path / "t.bin")
    return TokenWindows(tmp_path / "t.bin", "uint16", seq_len)


def test_dp_ranks_read_disjoint_slices_that_make_the_global_batch(tmp_path):
    w = _windows(tmp_path)
    single = DistributedLoader(w, 8, 0, 1, seed=1)
    ranks = [DistributedLoader(w, 8, r, 4, seed=1) for r in range(4)]
    seen = set()
    for _ in range(30):  # crosses an epoch boundary (124 windows)
        x, y = single.next_batch()
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
    resumed = [DistributedLoader(w, 8, r, 2, seed=0) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    for step in range(7, 20):
        torch.testing.assert_close(torch.cat([loader.next_batch()[0] for loader in resumed]), batches[step])
    other = DistributedLoader(_windows(tmp_path / "..", 2000), 8, 0, 1, seed=5)
    with pytest.raises(DataError, match="data or training.seq_len changed"):
        other.load_state_dict(state)
