"""A deterministic, resumable loader over fixed-length windows of prepared token shards, one source
or a weighted blend of several.

The sample order is defined for the whole job, independently of how many data-parallel ranks read
it. Global sample g comes from the source that is furthest behind its weight (weight * (g + 1) -
taken so far, the greedy mix Megatron's blended dataset uses: every prefix of the run holds each
source's share within one sample). A source's k-th sample is window perm_e[k % n] of that source,
with e = k // n its epoch and perm_e a seeded permutation. Step s uses global samples
[s*B, (s+1)*B); DP rank r reads the contiguous r-th slice of that batch. So the state is a few
numbers (samples consumed, per source), and a run resumed on another DP degree continues the same
sample sequence, with nothing repeated or skipped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from meshtrain.config import parse_data_path
from meshtrain.data.format import DTYPES, read_manifest
from meshtrain.data.tokenizer import tokenizer_fingerprint
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


class DistributedLoader:
    """Yields this DP rank's slice of each global batch, in the seeded global order (see the module
    docstring). `sources`: one TokenWindows, or several with their `weights`."""

    def __init__(
        self,
        sources: TokenWindows | list[TokenWindows],
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        pin_memory: bool = False,
        weights: list[float] | None = None,
    ):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by DP degree {dp_size}")
        self.sources = sources if isinstance(sources, list) else [sources]
        self.weights = np.asarray(weights or [1.0] * len(self.sources), dtype=np.float64)
        self.global_batch, self.seed = global_batch, seed
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.pin_memory = pin_memory
        self.consumed = 0  # global samples handed out so far, over all ranks
        self.taken = np.zeros(len(self.sources), dtype=np.int64)  # of them, from each source
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _window(self, source: int, k: int) -> int:
        """Source `source`'s k-th sample: a window of its epoch's permutation (source 0 draws as a
        single-source loader does)."""
        n = len(self.sources[source])
        epoch, pos = divmod(k, n)
        if (source, epoch) not in self._perms:
            self._perms = {key: p for key, p in self._perms.items() if key[0] != source}
            seeds = [self.seed, epoch] if source == 0 else [self.seed, epoch, source]
            self._perms[(source, epoch)] = np.random.default_rng(seeds).permutation(n)
        return int(self._perms[(source, epoch)][pos])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(inputs, targets, positions, targets in the whole global batch): inputs and targets
        (global_batch / dp_size, seq_len) int64, on the CPU (pinned for a GPU); positions alike, each
        token's within its document, or None (no document masking, or no boundary in this slice)."""
        picks = []  # (source, its sample index) of every sample of the global batch
        for g in range(self.consumed, self.consumed + self.global_batch):
            source = int(np.argmax(self.weights * (g + 1) - self.taken))
            picks.append((source, int(self.taken[source])))
            self.taken[source] += 1
        self.consumed += self.global_batch
        windows = [(s, self._window(s, k)) for s, k in picks]
        n_targets = sum(self.sources[s].targets_in(w) for s, w in windows)
        mine = windows[self.dp_rank * self.local_batch : (self.dp_rank + 1) * self.local_batch]
        rows = [self.sources[s].window(w) for s, w in mine]
        positions = [self.sources[s].positions(w, t) for (s, w), (t, _) in zip(mine, rows)]
        return (*to_batch(rows, self.pin_memory, positions), n_targets)

    def mix(self) -> list[float]:
        """Each source's share of the samples (= tokens) read so far."""
        return (self.taken / max(1, self.consumed)).tolist()

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "seq_len": self.sources[0].seq_len,
            "n_windows": [len(s) for s in self.sources],
            "weights": self.weights.tolist(),
            "taken": self.taken.tolist(),
        }

    def load_state_dict(self, state: dict) -> None:
        windows = state["n_windows"] if isinstance(state["n_windows"], list) else [state["n_windows"]]
        if state["seq_len"] != self.sources[0].seq_len or windows != [len(s) for s in self.sources]:
            raise DataError(
                f"the data loader state was saved for {windows} windows of {state['seq_len']} tokens, "
                f"but the data now has {[len(s) for s in self.sources]} of {self.sources[0].seq_len}: the data "
                "or training.seq_len changed"
            )
        weights = state.get("weights", [1.0])
        if not np.allclose(weights, self.weights):
            raise DataError(
                f"the checkpoint was trained with data.path weights {weights}, now {self.weights.tolist()}: "
                "resume with the same blend, or start a new run"
            )
        self.consumed, self.seed = state["consumed"], state["seed"]
        self.taken = np.asarray(state.get("taken", [state["consumed"]]), dtype=np.int64)
        self._perms = {}


def validation_batches(
    windows: TokenWindows | PackedConversations | PreferencePairs,
    n_batches: int,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
    """The first n_batches global batches of the validation split, in file order (wrapping), as
    (inputs, targets, positions or None, targets in the global batch)."""
    local = global_batch // dp_size
    out = []
    for b in range(n_batches):
        everyone = np.arange(b * global_batch, (b + 1) * global_batch) % len(windows)
        n_targets = sum(windows.targets_in(int(w)) for w in everyone)
        out.append((*windows.gather(everyone[dp_rank * local : (dp_rank + 1) * local]), n_targets))
    return out


class Dataset:
    """A prepared data directory: manifest, tokenizer path, train and validation windows. Shard
    sizes and the tokenizer's hash are checked on opening; shard checksums by `verify`.

    `chat`: rendered with a chat template (`template_path`), with a loss mask: chat data
    (PackedConversations) and preference data; `preference`: preference pairs (PreferencePairs, whose
    batches hold two rows per pair).

    `document_masking`: batches carry each token's position within its document (plain text: split
    after each end-of-text token, if the tokenizer has one; chat: each conversation alone); preference
    pairs never need it (one conversation a row)."""

    def __init__(self, path: str | Path, seq_len: int, document_masking: bool = True):
        self.path = Path(path)
        self.document_masking = document_masking
        self.manifest = read_manifest(self.path)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int | None = self.manifest["eos_id"]
        self.tokenizer_path = self.path / self.manifest["tokenizer"]
        dtype = self.manifest["dtype"]
        self.preference = self.manifest.get("format") == "preference"
        self.chat = self.manifest.get("format") == "chat" or self.preference
        self.template_path = self.path / self.manifest["chat_template"] if self.chat else None
        if self.manifest.get("format_version", 1) == 1:  # one train.bin and one val.bin
            eos = self.eos_id if document_masking else None
            self.train = TokenWindows.from_file(self.path / "train.bin", dtype, seq_len, eos)
            self.val = TokenWindows.from_file(self.path / "val.bin", dtype, seq_len, eos)
        else:
            self._check_files()
            self.train, self.val = (self._split(s, dtype, seq_len) for s in ("train", "val"))
        if self.preference and len(self.train) == 0:
            raise DataError(
                f"every one of the {self.train.too_long} training pairs in {self.path} has a conversation (prompt "
                f"and answer) longer than training.seq_len + 1 = {seq_len + 1} tokens; raise training.seq_len"
            )
        if self.chat and len(self.train) == 0:
            raise DataError(
                f"every one of the {self.train.too_long} training conversations in {self.path} is longer than "
                f"training.seq_len + 1 = {seq_len + 1} tokens; raise training.seq_len"
            )
        if len(self.train) == 0:
            raise DataError(
                f"{self.path} holds {self.manifest['train_tokens']} training tokens, fewer than one sequence of "
                f"training.seq_len + 1 = {seq_len + 1}; add data or lower training.seq_len"
            )

    def _split(self, split: str, dtype: str, seq_len: int):
        segments = [(self.path / f, a, n) for f, a, n in self.manifest["splits"][split]]
        name = f"{self.path} ({split})"
        if self.preference:
            return PreferencePairs(segments, dtype, seq_len, self.eos_id or 0, name)
        if self.chat:
            return PackedConversations(segments, dtype, seq_len, self.eos_id or 0, name, self.document_masking)
        return TokenWindows(segments, dtype, seq_len, name, self.eos_id if self.document_masking else None)

    def _files(self, shard: dict) -> list[tuple[Path, str, int | None]]:
        """(path, manifest checksum, expected size or None) of a shard's files."""
        path = self.path / shard["file"]
        itemsize = np.dtype(DTYPES[self.manifest["dtype"]]).itemsize
        files = [(path, shard["sha256"], shard["tokens"] * itemsize)]
        if "mask_sha256" in shard:
            files += [(path.with_suffix(".mask"), shard["mask_sha256"], shard["tokens"])]
            files += [(path.with_suffix(".len"), shard["lengths_sha256"], None)]
        return files

    def _check_files(self) -> None:
        for shard in self.manifest["shards"]:
            for path, _, size in self._files(shard):
                if not path.is_file():
                    raise DataError(f"{path} is missing; prepare {self.path} again")
                if size is not None and path.stat().st_size != size:
                    raise DataError(
                        f"{path} holds {path.stat().st_size} bytes, its manifest says {size}: "
                        f"truncated or replaced; prepare {self.path} again"
                    )
        tokenizer_sha = hashlib.sha256(self.tokenizer_path.read_bytes()).hexdigest()
        if tokenizer_sha != self.manifest["tokenizer_sha256"]:
            raise DataError(f"{self.tokenizer_path} is not the tokenizer {self.path} was prepared with; prepare again")

    def verify(self, share: tuple[int, int] = (0, 1)) -> list[str]:
        """Problems found in shards k, k + n, ... (share = (k, n)): a checksum that does not match."""
        k, n = share
        problems = []
        for shard in self.manifest.get("shards", [])[k::n]:
            for path, checksum, _ in self._files(shard):
                sha = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(1 << 24):
                        sha.update(block)
                if sha.hexdigest() != checksum:
                    problems.append(
                        f"{path} does not match its checksum in the manifest: the file is damaged; "
                        f"prepare {self.path} again"
                    )
        return problems


class Blend:
    """data.path: one prepared directory, or several with weights, all tokenized alike (and all
    preference data, `preference`, or none). `document_masking`: see Dataset."""

    def __init__(self, spec: str, seq_len: int, document_masking: bool = True):
        parsed = parse_data_path(spec)
        self.names = [path for path, _ in parsed]
        self.weights = [weight for _, weight in parsed]
        self.sources = [Dataset(path, seq_len, document_masking) for path in self.names]
        first = self.sources[0]
        for other in self.sources[1:]:
            if tokenizer_fingerprint(other.tokenizer_path) != tokenizer_fingerprint(first.tokenizer_path):
                raise DataError(
                    f"data.path: {other.path} and {first.path} were prepared with different tokenizers; prepare "
                    f"both with one, `meshtrain data prepare --tokenizer {first.tokenizer_path} ...`"
                )
        self.vocab_size, self.eos_id, self.tokenizer_path = first.vocab_size, first.eos_id, first.tokenizer_path
        self.preference = first.preference
        for other in self.sources[1:]:
            if other.preference != self.preference:
                pairs, rest = (other, first) if other.preference else (first, other)
                raise DataError(
                    f"data.path: {pairs.path} holds preference pairs and {rest.path} does not; a blend is all "
                    "preference data (for training.objective dpo) or none"
                )
        chat = [s for s in self.sources if s.chat]
        self.template_path = chat[0].template_path if chat else None
        for other in chat[1:]:
            if other.template_path.read_text() != self.template_path.read_text():
                raise DataError(
                    f"data.path: {other.path} and {chat[0].path} were rendered with different chat templates; "
                    "prepare both with one"
                )

    @property
    def unmasked_text(self) -> list[str]:
        """Sources of plain text whose documents cannot be told apart (their tokenizer has no
        end-of-text token): with document masking on, they train plain causal."""
        return [str(s.path) for s in self.sources if s.document_masking and not s.chat and s.eos_id is None]

    @property
    def train_windows(self) -> int:
        return sum(len(s.train) for s in self.sources)

    def loader(self, global_batch: int, dp_rank: int, dp_size: int, seed: int, pin_memory: bool = False):
        return DistributedLoader(
            [s.train for s in self.sources], global_batch, dp_rank, dp_size, seed, pin_memory, self.weights
        )
