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
from meshtrain.data.tokenizer import begin_of_text, end_of_text, load_tokenizer, tokenizer_fingerprint
from meshtrain.data.windows import PackedConversations, PreferencePairs, TokenWindows, to_batch
from meshtrain.errors import DataError


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
        content_ids: list[str | None] | None = None,
    ):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by DP degree {dp_size}")
        self.sources = sources if isinstance(sources, list) else [sources]
        self.weights = np.asarray(weights or [1.0] * len(self.sources), dtype=np.float64)
        self.global_batch, self.seed = global_batch, seed
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.pin_memory = pin_memory
        self.content_ids = content_ids or [None] * len(self.sources)  # each source's Dataset.content_id
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
            "content_ids": self.content_ids,
        }

    def load_state_dict(self, state: dict) -> None:
        windows = state["n_windows"] if isinstance(state["n_windows"], list) else [state["n_windows"]]
        if state["seq_len"] != self.sources[0].seq_len or windows != [len(s) for s in self.sources]:
            raise DataError(
                f"the data loader state was saved for {windows} windows of {state['seq_len']} tokens, "
                f"but the data now has {[len(s) for s in self.sources]} of {self.sources[0].seq_len}: the data "
                "or training.seq_len changed"
            )
        saved_ids = state.get("content_ids") or [None] * len(self.content_ids)  # recorded since 2026-11
        changed = [i for i, (a, b) in enumerate(zip(saved_ids, self.content_ids)) if a and b and a != b]
        if changed:
            raise DataError(
                f"the checkpoint was trained on other data: data.path source {changed[0] + 1}'s tokens (or tokenizer, "
                "or loss masks) differ from the ones it read, though their counts agree; resume with that data, or "
                "start a new run"
            )
        weights = state.get("weights", [1.0])
        if not np.allclose(weights, self.weights):
            raise DataError(
                f"the checkpoint was trained with data.path weights {weights}, now {self.weights.tolist()}: "
                "resume with the same blend, or start a new run"
            )
        if state["seed"] != self.seed:
            raise DataError(
                f"the checkpoint's data order was drawn with training.seed = {state['seed']}, now {self.seed}: "
                "resume with the same seed (another would repeat and skip samples), or start a new run"
            )
        self.consumed = state["consumed"]
        self.taken = np.asarray(state.get("taken", [state["consumed"]]), dtype=np.int64)
        self._perms = {}


def validation_batches(
    windows: TokenWindows | PackedConversations | PreferencePairs,
    n_batches: int,
    global_batch: int,
    dp_rank: int,
    dp_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]]:
    """The first n_batches global batches of the validation split, in file order, at most one pass
    over it (as torchtitan's validator stops; the last batch filled by wrapping to the start), as
    (inputs, targets, positions or None, targets in the global batch)."""
    local = global_batch // dp_size
    n_batches = min(n_batches, -(-len(windows) // global_batch))
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

    @property
    def content_id(self) -> str | None:
        """What the data's tokens are: its tokenizer's and shards' checksums from the manifest (chat
        data's also its loss masks' and lengths': the same tokens with other targets is other data),
        hashed (the same input prepared again gives the same id); None for the first format, which
        has no shard checksums. A checkpoint records it, so a resume on other data is refused."""
        if "shards" not in self.manifest:
            return None
        sums = [self.manifest["tokenizer_sha256"]]
        for shard in self.manifest["shards"]:  # plain text: its tokens' alone, as before masks were hashed
            sums += [shard[key] for key in ("sha256", "mask_sha256", "lengths_sha256") if key in shard]
        return hashlib.sha256(" ".join(sums).encode()).hexdigest()[:16]

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
        if not self.tokenizer_path.is_file():
            raise DataError(f"{self.tokenizer_path} is missing; prepare {self.path} again")
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


def _check_document_starts(sources: list[Dataset]) -> None:
    """Text sources begin each document with their tokenizer's prefix (`document_prefix`: a BOS or
    nothing), which the fingerprint leaves out (the post-processor): a blend mixing the two would train
    the model on two starts. Chat data records none, nor do manifests of an earlier meshtrain: skipped."""
    known = [s for s in sources if isinstance(s.manifest.get("document_prefix"), list)]
    for other in known[1:]:
        if other.manifest["document_prefix"] != known[0].manifest["document_prefix"]:
            raise DataError(
                f"data.path: {other.path} begins each document with the tokens {other.manifest['document_prefix']} "
                f"and {known[0].path} with {known[0].manifest['document_prefix']} (their tokenizers' post-processors "
                f"differ); prepare both with one, `meshtrain data prepare --tokenizer {known[0].tokenizer_path} ...`"
            )


def _check_special_tokens(sources: list[Dataset]) -> None:
    """One tokenizer.json can be prepared with different end and begin tokens (the tokenizer_config.json
    beside it: a base model's <|endoftext|>, its instruct model's <|im_end|>). The run keeps the first
    source's, so serve and export would stop on a token the other sources' documents and answers do not
    end with: refused."""

    def special(source: Dataset) -> tuple:
        tok = load_tokenizer(source.tokenizer_path)
        return end_of_text(tok, source.tokenizer_path.parent)[0], begin_of_text(tok, source.tokenizer_path.parent)

    first = special(sources[0])
    for other in sources[1:]:
        if (tokens := special(other)) != first:
            raise DataError(
                f"data.path: {other.path} was prepared with end/begin tokens {tokens} and {sources[0].path} with "
                f"{first} (the tokenizer_config.json beside their tokenizers); prepare both from one directory"
            )


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
        _check_document_starts(self.sources)
        if len(self.sources) > 1:
            _check_special_tokens(self.sources)
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
            [s.train for s in self.sources],
            global_batch,
            dp_rank,
            dp_size,
            seed,
            pin_memory,
            self.weights,
            [s.content_id for s in self.sources],
        )
