"""`meshtrain export`: a run or checkpoint -> a Hugging Face directory of its family."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from meshtrain.cli.options import add_options, options_of
from meshtrain.config import option, parse_size


@dataclass
class ExportOptions:
    source: str = option(positional=True)
    """A run directory (the later training step of its newest checkpoint and model.safetensors) or a checkpoint."""
    out: str = option()
    """Output directory."""
    max_shard_size: int | None = option(None, parse=parse_size)
    """Split the safetensors above this size (default 5G; not with --adapter)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Weights' dtype on disk; auto: the dtype of the Hugging Face model the run started from, else fp32
    (the adapters: fp32)."""
    adapter: bool = False
    """A LoRA run: write its adapters in the peft format (adapter_config.json + adapter_model.safetensors)
    instead of the merged model."""


def add_parser(sub) -> None:
    x = sub.add_parser(
        "export", help="write a Hugging Face directory (Llama, Mistral, Qwen2, Qwen3) from a run or checkpoint"
    )
    add_options(x, ExportOptions)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtrain.errors import MeshtrainError
    from meshtrain.interop.hf import export_adapter, export_hf

    o: ExportOptions = options_of(args, ExportOptions)
    if o.adapter:
        if o.max_shard_size is not None:
            raise MeshtrainError("--max-shard-size splits a model's weights; the adapters are one small file")
        print(f"wrote {export_adapter(o.source, o.out, o.dtype)}")
        return 0
    print(f"wrote {export_hf(o.source, o.out, o.max_shard_size or 5 << 30, o.dtype)}")
    return 0
