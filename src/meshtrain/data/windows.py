"""The windows a loader draws from, and how a list of them becomes a batch: plain text as fixed
windows over one token stream (each token's position within its document, for document masking),
chat data as whole conversations packed into sequences, preference data as (chosen, rejected)
pairs; `to_batch` turns windows into (inputs, targets, positions)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshtrain.data.format import DTYPES
from meshtrain.errors import DataError


class Stream:
    """Segments (file, first item, items) of memory-mapped files, read as one array."""

    OPEN_FILES = 256  # memory maps kept open (each holds a file descriptor; a corpus has thousands)

    def __init__(self, segments: list[tuple[Path, int, int]], dtype):
        self.segments, self.dtype = segments, dtype
        self.starts = np.cumsum([0] + [n for _, _, n in segments])
        self._open: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _part(self, i: int) -> np.ndarray:
        if i not in self._open:
            if len(self._open) >= self.OPEN_FILES:
                del self._open[next(iter(self._open))]
            path, first, n = self.segments[i]
            self._open[i] = np.memmap(path, dtype=self.dtype, mode="r")[first : first + n]
        return self._open[i]

    def read(self, start: int, stop: int) -> np.ndarray:
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            take = min(stop, int(self.starts[i + 1])) - start
            offset = start - int(self.starts[i])
            pieces.append(self._part(i)[offset : offset + take])
            start += take
            i += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def positions_from_starts(starts: np.ndarray) -> np.ndarray | None:
    """Each token's position within its document, given where documents start (bool, one per input
    token; the first token starts one whatever it says); None when no document starts after the
    first token (plain positions 0..n-1: the model needs no mask)."""
    if not starts[1:].any():
        return None
    index = np.arange(len(starts))
    return index - np.maximum.accumulate(np.where(starts, index, 0))


class TokenWindows:
    """Windows of seq_len + 1 tokens (inputs and shifted targets), stride seq_len, over a split:
    segments (file, first token, tokens) of token files read as one stream. Every token is a target.
    `eos_id` (document masking): a document ends with this token and the next one starts a new one;
    a window starts at position 0 wherever it falls in its document. None: no document positions."""

    def __init__(
        self, segments: list[tuple[Path, int, int]], dtype: str, seq_len: int, name: str = "", eos_id: int | None = None
    ):
        self.seq_len, self.name, self.eos_id = seq_len, name, eos_id
        self.tokens = Stream(segments, DTYPES[dtype])
        self.n_windows = max(0, (len(self.tokens) - 1) // seq_len)

    @classmethod
    def from_file(cls, path: Path, dtype: str, seq_len: int, eos_id: int | None = None) -> TokenWindows:
        """One whole token file (checked to hold whole tokens)."""
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        if not path.is_file():
            raise DataError(f"{path} is missing; prepare the data again")
        if path.stat().st_size % itemsize:
            raise DataError(f"{path} is truncated (size not a multiple of {itemsize} bytes); prepare it again")
        n = path.stat().st_size // itemsize
        return cls([(path, 0, n)] if n else [], dtype, seq_len, str(path), eos_id)

    def __len__(self) -> int:
        return self.n_windows

    def window(self, w: int) -> tuple[np.ndarray, None]:
        """(seq_len + 1 tokens, no mask)."""
        return self.tokens.read(w * self.seq_len, w * self.seq_len + self.seq_len + 1), None

    def targets_in(self, w: int) -> int:
        return self.seq_len

    def positions(self, w: int, tokens: np.ndarray) -> np.ndarray | None:
        """Window w's input positions within their documents (`tokens`: its window), None when
        plain: no document masking, or no end-of-text before its last input."""
        if self.eos_id is None:
            return None
        return positions_from_starts(np.concatenate([[True], tokens[: self.seq_len - 1] == self.eos_id]))

    def gather(self, windows, pin_memory: bool = False):
        """(inputs, targets, positions or None) of these windows."""
        return gather(self, windows, pin_memory)


class _Conversations:
    """Chat data's split: token and mask streams, and the (stream start, length) of every conversation."""

    def __init__(self, segments: list[tuple[Path, int, int]], dtype: str, seq_len: int, pad_id: int, name: str = ""):
        self.seq_len, self.name, self.pad_id = seq_len, name, pad_id
        self.tokens = Stream(segments, DTYPES[dtype])
        self.mask = Stream([(p.with_suffix(".mask"), a, n) for p, a, n in segments], np.uint8)
        lengths = []
        for path, first, n in segments:  # each segment holds whole conversations (see prepare._splits)
            own = np.fromfile(path.with_suffix(".len"), dtype=np.uint32).astype(np.int64)
            ends = np.cumsum(own)
            lengths.append(own[(ends > first) & (ends <= first + n)])
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths

    def _read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self.tokens.read(start, start + length), self.mask.read(start, start + length)

    def positions(self, w: int, tokens: np.ndarray) -> np.ndarray | None:
        return None

    def gather(self, windows, pin_memory: bool = False):
        """(inputs, targets, positions or None) of these windows."""
        return gather(self, windows, pin_memory)


class PackedConversations(_Conversations):
    """Chat data: conversations packed, in order, into sequences of seq_len + 1 tokens, none split
    (a sequence is closed when the next conversation does not fit, and padded with masked
    end-of-text tokens). A conversation longer than seq_len + 1 is left out and counted
    (`too_long`). With `document_masking` each conversation is its own document (the padding
    another): attention stays within it and its positions count from its start; without, attention
    is causal over the whole sequence, as in Megatron's packed SFT."""

    def __init__(
        self,
        segments: list[tuple[Path, int, int]],
        dtype: str,
        seq_len: int,
        pad_id: int,
        name: str = "",
        document_masking: bool = False,
    ):
        super().__init__(segments, dtype, seq_len, pad_id, name)
        self.document_masking = document_masking
        lengths, starts = self.lengths, self.starts
        fits = lengths <= seq_len + 1
        self.too_long = int((~fits).sum())
        self.conversations = int(fits.sum())
        self.sequences: list[list[tuple[int, int]]] = []  # each: (stream start, length) of its conversations
        room = 0
        for start, length in zip(starts[fits].tolist(), lengths[fits].tolist()):
            if length > room:
                self.sequences.append([])
                room = seq_len + 1
            self.sequences[-1].append((start, length))
            room -= length

    def __len__(self) -> int:
        return len(self.sequences)

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(seq_len + 1 tokens, their target mask)."""
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.seq_len + 1, dtype=np.uint8)
        at = 0
        for start, length in self.sequences[w]:
            tokens[at : at + length], mask[at : at + length] = self._read(start, length)
            at += length
        return tokens, mask

    def positions(self, w: int, tokens: np.ndarray) -> np.ndarray | None:
        """Window w's input positions, restarting at each conversation (and at the padding), by the
        conversations' lengths (their end-of-text tokens are not boundaries: a chat turn ends with
        one); None without document masking or when one conversation fills the inputs."""
        if not self.document_masking:
            return None
        ends = np.cumsum([0] + [length for _, length in self.sequences[w]])
        starts = np.zeros(self.seq_len, dtype=bool)
        starts[ends[ends < self.seq_len]] = True
        return positions_from_starts(starts)

    def targets_in(self, w: int) -> int:
        """Target tokens of window w (the first token of a sequence is never one: nothing predicts it)."""
        first, _ = self.sequences[w][0]
        return sum(int(self.mask.read(start, start + length).sum()) for start, length in self.sequences[w]) - int(
            self.mask.read(first, first + 1)[0]
        )


class PreferencePairs(_Conversations):
    """Preference data (DPO): one window per pair, its chosen and its rejected conversation (stored
    adjacent, in that order) each alone in a row of seq_len + 1 tokens, padded with pad_id and mask 0.
    A pair with a conversation longer than seq_len + 1 is left out and counted (`too_long`);
    `conversations` (= `pairs`) counts the pairs kept. A window's target count is 1: the DPO loss is a
    mean over pairs."""

    def __init__(self, segments: list[tuple[Path, int, int]], dtype: str, seq_len: int, pad_id: int, name: str = ""):
        super().__init__(segments, dtype, seq_len, pad_id, name)
        if len(self.lengths) % 2:
            raise DataError(f"{name} holds an odd number of conversations, so not whole pairs; prepare it again")
        starts, lengths = self.starts.reshape(-1, 2), self.lengths.reshape(-1, 2)
        fits = (lengths <= seq_len + 1).all(axis=1)
        self.too_long = int((~fits).sum())
        self.pairs = self.conversations = int(fits.sum())
        self.pair_starts, self.pair_lengths = starts[fits], lengths[fits]  # (pairs, 2): chosen, rejected

    def __len__(self) -> int:
        return self.pairs

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, target mask), each (2, seq_len + 1): row 0 the chosen conversation, row 1 the rejected."""
        tokens = np.full((2, self.seq_len + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((2, self.seq_len + 1), dtype=np.uint8)
        for row, (start, length) in enumerate(zip(self.pair_starts[w].tolist(), self.pair_lengths[w].tolist())):
            tokens[row, :length], mask[row, :length] = self._read(start, length)
        return tokens, mask

    def targets_in(self, w: int) -> int:
        return 1


IGNORE_INDEX = -100  # a target the loss leaves out (cross_entropy's ignore_index)


def gather(source, windows, pin_memory: bool = False):
    """(inputs, targets, positions or None) of a source's windows (see to_batch)."""
    rows = [source.window(int(w)) for w in windows]
    return to_batch(rows, pin_memory, [source.positions(int(w), t) for w, (t, _) in zip(windows, rows)])


def to_batch(
    rows: list[tuple[np.ndarray, np.ndarray | None]],
    pin_memory: bool = False,
    positions: list[np.ndarray | None] | None = None,
):
    """(inputs, targets, positions) of (tokens, target mask or None) rows: the targets are the tokens
    shifted by one, IGNORE_INDEX where the mask says the token is not a target. A row of shape
    (2, seq_len + 1), a preference pair, gives two rows of the batch, chosen then rejected: B pairs
    are 2B rows [chosen 0, rejected 0, chosen 1, ...]. `positions`: each row's input positions within
    their documents (None: plain); the batch's (B, seq_len) int64, or None when no row has a document
    boundary (the model then runs plain causal attention, with no mask to build). In page-locked
    memory with `pin_memory` (so the copy to the GPU is asynchronous)."""
    tokens = torch.from_numpy(np.concatenate([t.reshape(-1, t.shape[-1]) for t, _ in rows]).astype(np.int64))
    position_batch = None
    if positions is not None and any(p is not None for p in positions):
        plain = np.arange(tokens.shape[1] - 1)
        position_batch = torch.from_numpy(np.stack([plain if p is None else p for p in positions]).astype(np.int64))
        position_batch = position_batch.pin_memory() if pin_memory else position_batch
    if all(mask is None for _, mask in rows):  # plain text: two views of one buffer
        batch = tokens.pin_memory() if pin_memory else tokens
        return batch[:, :-1], batch[:, 1:], position_batch
    masks = np.concatenate([(np.ones(t.shape, np.uint8) if m is None else m).reshape(-1, t.shape[-1]) for t, m in rows])
    targets = tokens[:, 1:].clone()
    targets[torch.from_numpy(masks[:, 1:] == 0)] = IGNORE_INDEX
    batch = torch.stack([tokens[:, :-1], targets])
    if pin_memory:
        batch = batch.pin_memory()
    return batch[0], batch[1], position_batch
