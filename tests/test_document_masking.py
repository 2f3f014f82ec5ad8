"""training.document_masking: packed documents attend only within themselves, at their own positions."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_same_run, read_metrics, run_cli, train_args
from meshtrain.data import prepare
from meshtrain.data.chat import DEFAULT_CHAT_TEMPLATE
from meshtrain.data.loader import Dataset, DistributedLoader, validation_batches
from meshtrain.data.prepare import ChatOptions
from meshtrain.model import Llama, ModelArgs, masks
from meshtrain.model.masks import DocumentMask, dense_mask, document_ids, segments

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, max_seq_len=64)
LENGTHS = (7, 12, 9)  # three documents, each ending with EOS
EOS = 0


def make(args=ARGS, seed=0) -> Llama:
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def documents(seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, ARGS.vocab_size, (n,), generator=gen) for n in LENGTHS]
    for d in docs:
        d[-1] = EOS
    return docs


def packed_batch(docs):
    """(tokens, positions) of one row holding `docs` back to back."""
    tokens = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return tokens, positions


def test_positions_give_documents_and_their_mask():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3], [0, 0, 1, 1, 1, 1]]
    mask = dense_mask(document_ids(positions))[:, 0]
    assert mask.shape == (2, 6, 6)
    assert mask[0, 4].tolist() == [False, False, False, True, True, False]
    assert mask[1, 1].tolist() == [True, True, False, False, False, False]
    assert not mask.triu(1).any()  # never a later key


@pytest.mark.parametrize("kernel", [None, "varlen", "dense"])  # None: the default (dense at 28 tokens)
def test_packed_logits_and_gradients_equal_each_document_alone(kernel, monkeypatch):
    monkeypatch.setattr(masks, "KERNEL", kernel)
    model, docs = make(), documents()
    tokens, positions = packed_batch(docs)
    packed = model(tokens, positions)
    alone = torch.cat([model(d[None]) for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)

    # the loss of the packed row (every next token within a document, the EOS's too) and its gradients
    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    targets = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    packed_loss = F.cross_entropy(model(tokens, positions)[0], targets, reduction="sum")
    alone_loss = sum(
        F.cross_entropy(model(d[None])[0], torch.cat([d[1:], torch.tensor([-100])]), reduction="sum") for d in docs
    )
    torch.testing.assert_close(packed_loss, alone_loss, rtol=1e-5, atol=1e-5)
    g_packed, g_alone = grads(packed_loss), grads(alone_loss)
    for name in g_packed:
        torch.testing.assert_close(g_packed[name], g_alone[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_positions_the_packed_row_attends_across_documents():
    model, docs = make(), documents()
    tokens, positions = packed_batch(docs)
    alone = torch.cat([model(d[None]) for d in docs], dim=1)
    plain = model(tokens)
    first = LENGTHS[0]
    torch.testing.assert_close(plain[:, :first], alone[:, :first])  # the first document sees nothing before it
    assert (plain[:, first:] - alone[:, first:]).abs().max() > 1e-2  # the others do, unmasked


def test_plain_positions_are_todays_forward_bitwise():
    model = make()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24))
    positions = torch.arange(24).expand(2, 24)
    assert torch.equal(model(tokens), model(tokens, None))
    # plain positions through the mask path: the same numbers up to the kernel's summation order
    torch.testing.assert_close(model(tokens, positions), model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["varlen", "dense"])
def test_mask_attends_the_whole_sequence_for_any_heads(kernel):
    """Context parallelism calls attend with a share of the heads over the full sequence."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    mask = DocumentMask(positions, kernel)
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    out = mask.attend(q, k, v)
    expected = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)
            for a, b in ((0, 4), (4, 7), (7, 8))
        ],
        dim=2,
    )
    torch.testing.assert_close(out, expected)


def random_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths_per_row])


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_varlen_equals_the_dense_mask_with_gradients(heads):
    """Several documents of different lengths a row, rows cut differently, a row of one document,
    two rows cut alike (batched together), a first document that started in an earlier window."""
    rows = [[5, 17, 1, 9], [32], [3, 3, 20, 6], [3, 3, 20, 6], [11, 21]]
    positions = random_positions(rows)
    positions[4, :11] += 7  # mid-document at the window's start: positions 7..17, still one document
    assert segments(document_ids(positions)) == [tuple(r) for r in rows]
    n_q, n_kv = heads
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(5, n, 32, 16, generator=gen) for n in (n_q, n_kv, n_kv)]
    weight = torch.randn(5, n_q, 32, 16, generator=gen)
    results = {}
    for kernel in ("dense", "varlen"):
        q, k, v = (t.clone().requires_grad_() for t in qkv)
        mask = DocumentMask(positions, kernel=kernel)
        assert mask.kernel == kernel and (mask.dense is None) == (kernel == "varlen")
        out = mask.attend(q, k, v)
        (out * weight).sum().backward()
        results[kernel] = (out, q.grad, k.grad, v.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["dense"], results["varlen"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_default_kernel_is_varlen_unless_documents_are_many_and_dense_when_compiling(monkeypatch):
    assert DocumentMask(random_positions([[300, 500, 1248], [2048]])).kernel == "varlen"
    assert DocumentMask(random_positions([[300, 500, 224], [1024]])).kernel == "dense"  # under 2,048 tokens
    # up to 64 documents a 2,048-token row, scaled by (seq / 2048)^2: 256 at 4,096 tokens
    assert DocumentMask(random_positions([[32] * 64, [2048]])).kernel == "varlen"
    assert DocumentMask(random_positions([[31] * 66 + [2], [31] * 66 + [2]])).kernel == "dense"
    assert DocumentMask(random_positions([[16] * 256])).kernel == "varlen"
    assert DocumentMask(random_positions([[15] * 272 + [16]])).kernel == "dense"
    monkeypatch.setattr(masks, "KERNEL", "dense")
    assert DocumentMask(random_positions([[10, 22]])).kernel == "dense"
    monkeypatch.setattr(masks, "KERNEL", None)

    @torch.compile(fullgraph=True, backend="eager")
    def compiled(positions, q, k, v):
        mask = DocumentMask(positions)
        return mask.attend(q, k, v), mask.dense is not None

    positions = random_positions([[10, 22]])
    q = torch.randn(1, 2, 32, 8)
    out, dense = compiled(positions, q, q, q)
    assert dense
    eager = DocumentMask(positions)
    torch.testing.assert_close(out, eager.attend(q, q, q))
    # a mask built eagerly (varlen) handed to a compiled block: the dense mask in the graph
    block = torch.compile(lambda mask, q: mask.attend(q, q, q), fullgraph=True, backend="eager")
    torch.testing.assert_close(block(eager, q), out)


@pytest.mark.parametrize("kernel", ["varlen", "dense"])
def test_masking_passes_checkpoint_wrappers_and_fp32_attention(kernel, monkeypatch):
    monkeypatch.setattr(masks, "KERNEL", kernel)
    from meshtrain.parallel.activation_checkpoint import apply_ac
    from meshtrain.parallel.precision import apply_fp32_compute

    docs = documents()
    tokens, positions = packed_batch(docs)
    reference = make()(tokens, positions)
    for mode in ("full", "op"):
        model = make()
        apply_ac(model, mode)
        out = model(tokens, positions)
        out.sum().backward()
        torch.testing.assert_close(out, reference)
    model = make()
    apply_fp32_compute(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, positions)
    alone = []
    for d in docs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            alone.append(model(d[None]))
    torch.testing.assert_close(out.float(), torch.cat(alone, 1).float(), rtol=0.05, atol=0.05)


# --- the loader: positions restart where documents do ------------------------------------------


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def short_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def short_docs(corpus, tmp_path_factory) -> Path:
    """Plain text of short documents (a few to a dozen tokens each): most windows cross several."""
    root = tmp_path_factory.mktemp("short-docs")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in short_documents(1500)))
    prepare(
        [root / "docs.jsonl"], root / "data", tokenizer=corpus / "tokenizer.json", val_fraction=0.05, progress=False
    )
    return root / "data"


def expected_positions(inputs: list[int], eos: int) -> list[int]:
    out, at = [], 0
    for token in inputs:
        out.append(at)
        at = 0 if token == eos else at + 1
    return out


def test_text_positions_restart_after_each_end_of_text(short_docs):
    dataset = Dataset(short_docs, 32)
    train, eos = dataset.train, dataset.eos_id
    assert eos is not None
    inputs, targets, positions = train.gather(range(6))
    assert positions.shape == inputs.shape == (6, 32) and positions.dtype == torch.int64
    for row, p in zip(inputs.tolist(), positions.tolist()):
        assert p == expected_positions(row, eos)  # 0 at the start, 0 after every EOS (the EOS its document's)
    assert (positions[:, 1:] == 0).any()
    # the loader hands over the same, and the model attends per document with them
    x, y, p, n = DistributedLoader(train, 4, 0, 1, seed=0).next_batch()
    assert p is not None and all(row == expected_positions(xs, eos) for xs, row in zip(x.tolist(), p.tolist()))
    # masking off: no positions at all
    assert Dataset(short_docs, 32, document_masking=False).train.gather(range(6))[2] is None
    assert validation_batches(dataset.val, 1, 4, 0, 1)[0][2] is not None


def test_a_batch_without_a_document_boundary_has_no_positions(corpus):
    # the standard library's files are thousands of tokens long: most windows of 16 hold no EOS
    train = Dataset(corpus, 16).train
    plain = [w for w in range(200) if train.eos_id not in train.window(w)[0][:15]]
    assert len(plain) > 100
    assert train.gather(plain[:8])[2] is None
    bounded = next(w for w in range(2000) if train.eos_id in train.window(w)[0][:15])
    _, _, positions = train.gather([plain[0], bounded])
    assert positions[0].tolist() == list(range(16))  # the row without one is plain beside the other
    assert (positions[1, 1:] == 0).sum() == 1


@pytest.fixture(scope="module")
def chat_docs(corpus, tmp_path_factory) -> Path:
    """Chat data whose conversations hold several end-of-text tokens (one per assistant turn)."""
    root = tmp_path_factory.mktemp("chat-docs")
    rng, rows = random.Random(1), []
    for _ in range(200):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [
                {"role": "user", "content": rng.choice(WORDS)},
                {"role": "assistant", "content": rng.choice(WORDS)},
            ]
        rows.append({"messages": turns})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = ChatOptions(DEFAULT_CHAT_TEMPLATE)
    prepare([root / "chat.jsonl"], root / "data", tokenizer=corpus / "tokenizer.json", progress=False, chat=options)
    return root / "data"


def test_chat_positions_restart_per_conversation_not_per_end_of_text(chat_docs):
    dataset = Dataset(chat_docs, 96)
    train, eos = dataset.train, dataset.eos_id
    _, _, positions = train.gather(range(len(train)))
    several_eos = 0
    for w in range(len(train)):
        tokens, _ = train.window(w)
        want, at = [], 0
        for _, length in train.sequences[w]:
            want += list(range(length))
            several_eos += int((tokens[at : at + length] == eos).sum() > 1)
            at += length
        want += list(range(96 + 1 - at))  # the padding: a document of its own
        assert positions[w].tolist() == want[:96]
    assert several_eos > 0  # multi-turn conversations were not split at their inner EOS tokens
    pairs = Dataset(chat_docs, 96, document_masking=False).train
    assert pairs.gather([0])[2] is None


# --- end to end: the CLI with masking, one process and a pipeline -----------------------------


def run_on(data, run_dir, cli_env, *extra):
    args = train_args(data, run_dir, "--training.steps", "4", "--training.eval_every", "0", *extra)
    result = run_cli(args, cli_env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def masked_run(short_docs, cli_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("masked")
    run_on(short_docs, run_dir, cli_env)
    return run_dir


def test_training_masks_documents_by_default_and_off_differs(masked_run, short_docs, cli_env, tmp_path):
    masked = read_metrics(masked_run)
    assert len(masked) == 4 and all(math.isfinite(m["loss"]) for m in masked)
    unmasked = run_on(short_docs, tmp_path, cli_env, "--training.document_masking", "false")
    assert masked[0]["loss"] != unmasked[0]["loss"]  # the mask is in force (the weights start alike)


@pytest.mark.multiproc
def test_a_pipeline_masks_as_one_process_does(masked_run, short_docs, cli_env, tmp_path):
    run_on(short_docs, tmp_path, cli_env, "--nproc", "2", "--parallel.pp", "2")
    assert_same_run(tmp_path, masked_run)


def test_document_masking_takes_a_boolean(capsys):
    from test_bad_inputs import TRAIN, assert_one_line, run_main

    assert_one_line(*run_main([*TRAIN, "--training.document_masking", "maybe"], capsys), "true or false")


def test_a_configured_recomputed_backward_is_used_where_the_varlen_kernel_would_run(monkeypatch):
    """training.attention_backward = recompute on an eager CPU step with long rows (where varlen is the
    kernel): the recomputed backward runs, as the start line says, with varlen's numbers."""
    import meshtrain.model.masks as masks

    torch.manual_seed(0)
    positions = torch.cat([torch.arange(1200), torch.arange(848)]).expand(1, -1)  # two documents of one row
    mask = masks.DocumentMask(positions, kernel="varlen")
    assert mask.lengths is not None
    q, k, v = (torch.randn(1, 2, 2048, 16, requires_grad=True) for _ in range(3))
    calls = []
    recomputed = masks.recomputed_attention
    monkeypatch.setattr(masks, "recomputed_attention", lambda *a: calls.append(1) or recomputed(*a))
    out = mask.attend(q, k, v, recompute_backward=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert calls == [1]
    ref = mask.attend(q, k, v)  # varlen: the kernel the run would use without it
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert calls == [1]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
