"""A deterministic, resumable loader over fixed-length windows of a memory-mapped token file.

The sample order is defined for the whole job, independently of how many data-parallel ranks read
it: global sample g of epoch e = g // n is window perm_e[g % n], with perm_e a seeded permutation.
Step s uses global samples [s*B, (s+1)*B); DP rank r reads the contiguous r-th slice of that batch.
So the state is one number (samples consumed), and a run resumed on another DP degree continues
the same sample sequence, with nothing repeated or skipped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshtrain.data.prepare import DTYPES, read_manifest
from meshtrain.errors import DataError


class TokenWindows:
    """Windows of seq_len + 1 tokens (inputs and shifted targets), stride seq_len, over one file."""

    def __init__(self, path: Path, dtype: str, seq_len: int):
        self.path, self.seq_len = path, seq_len
        if not path.is_file():
            raise DataError(f"{path} is missing; prepare the data again")
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        if path.stat().st_size % itemsize:
            raise DataError(f"{path} is truncated (size not a multiple of {itemsize} bytes); prepare it again")
        n_tokens = path.stat().st_size // itemsize
        self.tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r") if n_tokens else np.zeros(0, np.uint16)
        self.n_windows = max(0, (n_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.n_windows

    def gather(self, windows: np.ndarray, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): two views of one int64 tensor, in page-locked memory with `pin_memory`
        (one pinned buffer per batch, so its copy to the GPU is asynchronous)."""
        rows = np.stack([self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1] for w in windows])
        batch = torch.from_numpy(rows.astype(np.int64))
        if pin_memory:
            batch = batch.pin_memory()
        return batch[:, :-1], batch[:, 1:]


class DistributedLoader:
    """Yields this DP rank's slice of each global batch, in the seeded global order."""

    def __init__(
        self, windows: TokenWindows, global_batch: int, dp_rank: int, dp_size: int, seed: int, pin_memory: bool = False
    ):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by DP degree {dp_size}")
        self.windows, self.global_batch, self.seed = windows, global_batch, seed
        self.dp_rank, self.local_batch = dp_rank, global_batch // dp_size
        self.pin_memory = pin_memory
        self.consumed = 0  # global samples handed out so far, over all ranks
        self._epoch, self._perm = -1, np.empty(0, np.int64)

    def _window(self, sample: int) -> int:
        epoch, pos = divmod(sample, len(self.windows))
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        return int(self._perm[pos])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch / dp_size, seq_len) int64, on the CPU (pinned for a GPU)."""
        start = self.consumed + self.dp_rank * self.local_batch
        windows = np.array([self._window(g) for g in range(start, start + self.local_batch)])
        self.consumed += self.global_batch
        return self.windows.gather(windows, self.pin_memory)

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "seq_len": self.windows.seq_len,
            "n_windows": len(self.windows),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.windows.seq_len or state["n_windows"] != len(self.windows):
            raise DataError(
                f"the data loader state was saved for {state['n_windows']} windows of {state['seq_len']} tokens, "
                f"but the data now has {len(self.windows)} of {self.windows.seq_len}: the data or "
                "training.seq_len changed"
            )
        self.consumed, self.seed = state["consumed"], state["seed"]
        self._epoch = -1


def validation_batches(
    windows: TokenWindows, n_batches: int, global_batch: int, dp_rank: int, dp_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n_batches global batches of the validation file, in file order (wrapping)."""
    local = global_batch // dp_size
    out = []
    for b in range(n_batches):
        start = b * global_batch + dp_rank * local
        out.append(windows.gather(np.arange(start, start + local) % len(windows)))
    return out


class Dataset:
    """A prepared data directory: manifest, tokenizer path, train and validation windows."""

    def __init__(self, path: str | Path, seq_len: int):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.vocab_size: int = self.manifest["vocab_size"]
        self.eos_id: int | None = self.manifest["eos_id"]
        self.tokenizer_path = self.path / self.manifest["tokenizer"]
        dtype = self.manifest["dtype"]
        self.train = TokenWindows(self.path / "train.bin", dtype, seq_len)
        if len(self.train) == 0:
            raise DataError(
                f"{self.train.path} holds {self.manifest['train_tokens']} tokens, fewer than one sequence of "
                f"training.seq_len + 1 = {seq_len + 1}; add data or lower training.seq_len"
            )
        self.val = TokenWindows(self.path / "val.bin", dtype, seq_len)
