"""`meshtrain serve` (an OpenAI-compatible server) and `meshtrain generate` (a prompt's continuation
streamed to the terminal), for a run, a checkpoint or a Hugging Face directory."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

from meshtrain.cli.options import add_options, options_of
from meshtrain.config import DEVICES, option

DEVICE_FLAGS = ("--launch.device", "--device")


def check_host(host: str) -> None:
    if not host.strip():
        raise ValueError("is empty (it would listen on every address): give one (127.0.0.1, 0.0.0.0), or leave it out")


def check_api_key(key: str | None) -> None:
    if key is None:
        return
    if not key.strip() or key.lower() in ("none", "null"):  # an unset variable in --api-key "$KEY", or jq's null
        raise ValueError("is no key: give the key, or leave out --api-key to serve without one")
    if not (key == key.strip() and key.isascii() and key.isprintable()):
        # HTTP drops a header's surrounding spaces and reads it as latin-1: no request could match
        raise ValueError("holds spaces at its ends or characters outside printable ASCII: no client could send it")


@dataclass
class ServeOptions:
    model: str = option(positional=True)
    """A run directory, a checkpoint, or a directory `meshtrain export` wrote."""
    host: str = option("127.0.0.1", check=check_host)
    """Address to bind (default: loopback only)."""
    port: int = option(8000, ge=1, le=65535)
    """Port to listen on."""
    api_key: str | None = option(None, verbatim=True, check=check_api_key)
    """Require Authorization: Bearer KEY (an empty KEY, or one no client can send, is refused)."""
    max_batch: int = option(16, ge=1)
    """Requests decoded together."""
    max_context: int | None = option(None, ge=2)
    """Prompt + completion tokens per request (default: the model's max_seq_len, at most 8192)."""
    kv_cache_gib: float | None = option(None, gt=0)
    """Memory of the paged KV cache; requests wait for room in it (default: max-batch x max-context
    tokens, room for every request at its longest)."""
    block_size: int = option(16, ge=1)
    """Tokens per KV-cache block (what the prefix cache shares)."""
    prefill_chunk: int = option(512, ge=1)
    """Prompt tokens computed per engine step, between two decode steps of the running requests."""
    prefix_caching: bool = True
    """Reuse the KV-cache blocks of a prompt's prefix another request computed (--no-prefix-caching: off)."""
    device: Literal[DEVICES] = option("auto", flags=DEVICE_FLAGS)
    """auto: CUDA where there is a GPU, else the CPU; cuda; cpu (launch.device's choices, but neuron is
    refused: the engine runs on CUDA or the CPU)."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Serving precision (auto: on a GPU a Hugging Face directory's fp16, else bf16; on a CPU fp32)."""


@dataclass
class GenerateOptions:
    model: str = option(positional=True)
    """A run directory, a checkpoint, or a directory `meshtrain export` wrote."""
    prompt: str = option()
    """The text to continue."""
    max_tokens: int | None = option(None, ge=1)
    """Tokens to generate (default: the model's generation_config.json max_new_tokens, else 64)."""
    temperature: float | None = option(None, ge=0.0, le=2.0)
    """0 to 2; 0: greedy (default: the model's generation_config.json, as `serve` takes it, else 0.8)."""
    top_p: float | None = option(None, gt=0.0, le=1.0)
    """Nucleus sampling, (0, 1] (default: the model's generation_config.json, else 1)."""
    top_k: int | None = option(None, ge=0)
    """0: off (default: the model's generation_config.json, else 50)."""
    seed: int | None = option(None, ge=0, le=2**63 - 1)
    """Seed of the sampling (0 to 2**63-1)."""
    device: Literal[DEVICES] = option("auto", flags=DEVICE_FLAGS)
    """auto: CUDA where there is a GPU, else the CPU; cuda; cpu (launch.device's choices, but neuron is
    refused: the engine runs on CUDA or the CPU)."""


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve a run, checkpoint or Hugging Face directory (OpenAI-compatible API)")
    add_options(s, ServeOptions)
    g = sub.add_parser("generate", help="stream a continuation of a prompt to the terminal")
    add_options(g, GenerateOptions)


def run_serve(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtrain.serve import CacheSettings, serve

    o: ServeOptions = options_of(args, ServeOptions)
    cache = CacheSettings(o.kv_cache_gib, o.block_size, o.prefill_chunk, o.prefix_caching)
    return serve(o.model, o.host, o.port, o.api_key, o.max_batch, o.max_context, o.device, o.dtype, cache)


def run_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from meshtrain.serve import generate_to_terminal

    o: GenerateOptions = options_of(args, GenerateOptions)
    sampling = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k}
    return generate_to_terminal(o.model, o.prompt, o.max_tokens, sampling, o.seed, o.device)
