"""Document masking: in a packed sequence each token attends only to the earlier tokens of its own
document, and its rotary position counts from its document's start (torchtitan's and Megatron's
`reset_attention_mask` / `reset_position_ids`).

A batch describes its documents by `positions` (batch, seq), each token's position within its
document: a document starts where positions == 0, so cumsum(positions == 0) numbers the documents of
a row. `DocumentMask` is built from them once per forward, over the whole sequence (context
parallelism hands attention the full sequence for a share of the heads, so it needs no other mask),
and every layer's attention core calls `attend(q, k, v)` with it:

- CUDA: FlexAttention with a block mask (only the blocks on the diagonal of each document are
  computed, so masking costs less than plain causal attention where documents are short);
- elsewhere (FlexAttention has no backward on a CPU in torch 2.13), eager: "varlen", causal SDPA on
  each document alone (views of q, k, v split along the sequence, the outputs concatenated; rows cut
  alike batched), sum(L_i^2)/2 of work and O(seq) memory. The document lengths are read on the host
  once per forward (segments()): free on a CPU, and never done on CUDA;
- elsewhere under torch.compile (the document lengths would recompile each batch), or where varlen
  would not pay: "dense", SDPA with a boolean (batch, 1, seq, seq) mask, q and k in the same
  document and q >= k. The CPU kernel then computes the whole square (the causal one skips the upper
  triangle) and the mask is O(seq^2) memory (256 MiB at 16k tokens a row, plus SDPA's float copy).

The default (choose_kernel) on a CPU: varlen for rows of 2,048 tokens or more with at most
64 (seq / 2048)^2 documents, else dense. Each document costs varlen two kernel calls a layer
(forward, backward) while the dense mask costs seq^2, so the dense mask wins for short rows and for
many tiny documents. Measured on a shared 2-core Xeon (load 6-10 from other jobs, bench/README.md
1d, `tiny`, fp32, documents of 100-500 tokens), the step's speed over plain causal by CPU time:
2 x 1024 tokens (5 documents a row) dense 0.83x, varlen 0.66x; 1 x 2048 (9) dense 0.99x, varlen
1.05x; 1 x 8192 (27) dense 0.57x, varlen 1.26x (2.2x the dense mask's). Attention alone (forward
and backward, 8 heads over 4 KV heads of 32, 1 x 2048), CPU time: documents of 300 tokens dense
220 ms, varlen 90-115, causal 115-150; of 32 tokens dense 170, varlen 46; of 16 tokens (128 a row)
dense 210-220, varlen 220-770 (each small kernel call pays the 2 threads' synchronisation,
milliseconds on the loaded host).

A batch without any document boundary needs no mask: the loader hands it over with positions None,
which the model runs as plain causal attention over positions 0..seq-1.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from meshtrain.model.recompute_attention import applies, recomputed_attention


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """positions (batch, seq) -> the index of each token's document within its row (0, 1, ...;
    tokens before the first position 0 count as document 0 too)."""
    return (positions == 0).cumsum(dim=1)


def dense_mask(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query q may attend to key k: same document and k <= q."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and(causal)[:, None]


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _flex(name: str):
    """FlexAttention's `create_block_mask` or `flex_attention`: compiled once here when called
    eagerly (eager FlexAttention materialises the whole score matrix), as it is when the caller is
    itself being compiled."""
    from torch.nn.attention import flex_attention as flex

    fn = getattr(flex, name)
    return fn if torch.compiler.is_compiling() else _compiled(fn)


def block_mask(documents: torch.Tensor):
    """A FlexAttention BlockMask of document-causal attention for (batch, seq) document ids."""

    def document_causal(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)

    batch, seq = documents.shape
    return _flex("create_block_mask")(document_causal, batch, None, seq, seq, device=documents.device)


def flex_available(device: torch.device) -> bool:
    """FlexAttention trains on CUDA (on a CPU it has no backward in torch 2.13)."""
    return device.type == "cuda"


def segments(documents: torch.Tensor) -> list[tuple[int, ...]]:
    """(batch, seq) document ids -> each row's document lengths, in order (one host read; call it
    only where that costs no device sync)."""
    batch, seq = documents.shape
    cuts: list[list[int]] = [[0] for _ in range(batch)]
    for row, col in (documents[:, 1:] != documents[:, :-1]).nonzero().tolist():
        cuts[row].append(col + 1)
    return [tuple(b - a for a, b in zip(c, c[1:] + [seq])) for c in cuts]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[tuple[int, ...]]):
    """Causal SDPA over each document alone, on (batch, heads, seq, head_dim) q, k, v whose rows hold
    documents of `lengths` (segments()), the outputs concatenated along the sequence; consecutive rows
    cut alike run as one batch. Views in, one concatenation out (split's backward is one
    concatenation too, where slicing would add a full-size zero gradient per document)."""
    runs: list[tuple[tuple[int, ...], int]] = []  # (lengths, rows) of consecutive rows cut alike
    for row in lengths:
        if runs and runs[-1][0] == row:
            runs[-1] = (row, runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    sizes = [n for _, n in runs]
    outs = []
    for (cut, _), qr, kr, vr in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes)):
        parts = [
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            for qd, kd, vd in zip(qr.split(cut, dim=2), kr.split(cut, dim=2), vr.split(cut, dim=2))
        ]
        outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


KERNELS = ("flex", "varlen", "dense")
KERNEL: str | None = None  # forces a kernel for every DocumentMask (bench/masking.py); None: choose_kernel()
VARLEN_MIN_SEQ = 2048  # shorter rows keep the dense mask (measured: module docstring)
VARLEN_MAX_DOCUMENTS_2K = 64  # documents per 2,048-token row up to which varlen beats the dense mask (measured)


def choose_kernel(documents: torch.Tensor) -> str:
    """flex on CUDA; under torch.compile dense (data-dependent document lengths would recompile per
    batch); in eager mode elsewhere varlen for rows of VARLEN_MIN_SEQ tokens or more holding at most
    VARLEN_MAX_DOCUMENTS_2K * (seq / 2048)^2 documents on average (each document costs varlen two
    kernel calls a layer, the dense mask costs seq^2), else dense (module docstring: the numbers).
    One host read: off CUDA only, so never a CUDA sync."""
    if flex_available(documents.device):
        return "flex"
    if torch.compiler.is_compiling():
        return "dense"
    batch, seq = documents.shape
    if seq < VARLEN_MIN_SEQ:
        return "dense"
    boundaries = int((documents[:, 1:] != documents[:, :-1]).sum()) + batch
    return "varlen" if boundaries * 2048**2 <= VARLEN_MAX_DOCUMENTS_2K * batch * seq**2 else "dense"


class DocumentMask:
    """Which keys each query sees in a packed batch, built once per forward from `positions`
    (batch, seq) and handed to every attention layer. `kernel`: "flex" (FlexAttention's block
    mask), "varlen" (causal SDPA per document) or "dense" (SDPA with a boolean mask); default
    KERNEL, else choose_kernel()."""

    def __init__(self, positions: torch.Tensor, kernel: str | None = None):
        if kernel not in (None, *KERNELS):
            raise ValueError(f"kernel {kernel!r}: one of {KERNELS}")
        self.positions = positions
        self.documents = document_ids(positions)
        kernel = kernel or KERNEL or choose_kernel(self.documents)
        varlen = kernel == "varlen" and not torch.compiler.is_compiling()
        self.lengths = segments(self.documents) if varlen else None
        self.kernel = kernel
        self.block_mask = block_mask(self.documents) if kernel == "flex" else None
        self.dense = dense_mask(self.documents) if kernel != "flex" and not varlen else None

    @property
    def flex(self) -> bool:
        return self.kernel == "flex"

    @property
    def seq_len(self) -> int:
        return self.positions.shape[1]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recompute_backward: bool = False
    ) -> torch.Tensor:
        """Attention of (batch, heads, seq, head_dim) q, k, v over the whole sequence the mask
        describes; grouped-query k/v heads shared by their query groups without copies.
        `recompute_backward`: the dense mask's backward recomputed from matmuls where it applies
        (model/recompute_attention.py)."""
        if q.shape[2] != self.seq_len or k.shape[2] != self.seq_len:
            raise ValueError(f"a document mask of {self.seq_len} tokens given q/k of {q.shape[2]}/{k.shape[2]}")
        if self.block_mask is not None:
            return _flex("flex_attention")(q, k, v, block_mask=self.block_mask, enable_gqa=True)
        recompute = recompute_backward and applies(q)  # as configured, eager too, where its scores fit
        if not torch.compiler.is_compiling() and self.lengths is not None and not recompute:
            return varlen_attention(q, k, v, self.lengths)
        # dense; a mask built eagerly and handed to a compiled block gets its dense mask in the graph
        dense = self.dense if self.dense is not None else dense_mask(self.documents)
        if recompute:
            return recomputed_attention(q, k, v, dense)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)


def plain_positions(batch: int, seq: int, device: torch.device | None = None) -> torch.Tensor:
    """0..seq-1 in every row: the positions of a batch with no document boundary."""
    return torch.arange(seq, device=device).expand(batch, seq)
