"""training.document_masking: packed documents attend only within themselves, at their own positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.model import Llama, ModelArgs
from meshtrain.model.masks import DocumentMask, dense_mask, document_ids

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


def test_packed_logits_and_gradients_equal_each_document_alone():
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


def test_mask_attends_the_whole_sequence_for_any_heads():
    """Context parallelism calls attend with a share of the heads over the full sequence."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0]])
    mask = DocumentMask(positions)
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


def test_masking_passes_checkpoint_wrappers_and_fp32_attention():
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
