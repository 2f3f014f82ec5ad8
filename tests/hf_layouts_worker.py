"""Run under torchrun (2 processes): import Hugging Face directories into meshtrain's parallel
layouts with the trainer's own `build` and `load_hf_weights`, and save the logits of fixed tokens.

argv: OUT_DIR HF_DIR [HF_DIR ...]. For every directory and layout (TP 2, PP 2, ZeRO-3) the rank
holding the output writes OUT_DIR/<dir name>-<layout>.pt. A directory given as memory:DIR is only
imported under ZeRO-3, and each rank writes OUT_DIR/memory-<rank>.json: the peak of its anonymous
memory above what it held before the import (sampled every millisecond)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.config import load_config
from meshtrain.interop import load_hf_weights
from meshtrain.train.build import build

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import probe_tokens  # noqa: E402

LAYOUTS = {
    "tp2": {"parallel.tp": 2},
    "pp2": {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"},
    "zero3": {"parallel.zero": 3},
}


def logits_of(state, tokens: torch.Tensor) -> torch.Tensor | None:
    """The full model's logits on the rank that holds the output (None elsewhere). The pipeline is
    run by hand, one stage after the other: what is checked is where each weight landed."""
    part = state.model.parts[0]
    if state.layout.pp == 1:
        out = part(tokens)
        return out.full_tensor() if isinstance(out, DTensor) else out
    group = state.dims.mesh("pp").get_group()
    if state.model.has_first_stage:
        dist.send(part(tokens).contiguous(), group_dst=1, group=group)
        return None
    hidden = torch.empty(*tokens.shape, state.args.dim)
    dist.recv(hidden, group_src=0, group=group)
    return part(hidden)


def anonymous_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def import_peak(state, directory: Path) -> int:
    """The most anonymous memory the import added at any moment."""
    import threading

    before, peak, done = anonymous_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            done.wait(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    load_hf_weights(state.model.parts, directory, state.args)
    done.set()
    sampler.join()
    return max(peak[0], anonymous_bytes()) - before


def main() -> None:
    import json

    out = Path(sys.argv[1])
    tokens = probe_tokens()
    for arg in sys.argv[2:]:
        if arg.startswith("memory:"):
            directory = Path(arg.removeprefix("memory:"))
            overrides = {"model.init_from": f"hf:{directory}", "training.seq_len": 64, "parallel.zero": 3}
            overrides["training.dtype"] = "fp32"
            state = build(load_config(None, {**overrides, "launch.device": "cpu"}), with_data=False)
            peak = import_peak(state, directory)
            (out / f"memory-{dist.get_rank()}.json").write_text(json.dumps({"peak": peak}))
            continue
        directory = Path(arg)
        for name, layout in LAYOUTS.items():
            overrides = {
                "model.init_from": f"hf:{directory}",
                "training.seq_len": tokens.shape[1],
                "training.global_batch_size": 2,
                "training.micro_batch_size": 1,
                "launch.device": "cpu",
                "training.dtype": "fp32",
                **layout,
            }
            state = build(load_config(None, overrides), with_data=False)
            load_hf_weights(state.model.parts, directory, state.args)
            with torch.no_grad():
                logits = logits_of(state, tokens)
            if logits is not None and (state.layout.pp > 1 or dist.get_rank() == 0):
                torch.save(logits, out / f"{directory.name}-{name}.pt")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
