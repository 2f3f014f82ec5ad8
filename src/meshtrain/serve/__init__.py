"""Serving what was trained: `meshtrain serve` (an OpenAI-compatible server with continuous batching
over a KV cache) and `meshtrain generate` (the same engine, streaming to the terminal)."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.errors import MeshtrainError
from meshtrain.files import read_json_object
from meshtrain.model.kv_cache import kv_bytes_per_token
from meshtrain.serve.engine import Engine, Request, SamplingParams
from meshtrain.serve.loading import ServedModel, default_completion_length, load_served_model, truncations_given

__all__ = [
    "CacheSettings",
    "Engine",
    "Request",
    "SamplingParams",
    "ServedModel",
    "generate_to_terminal",
    "load_engine",
    "load_served_model",
    "sample_text",
    "serve",
]


# `generate`'s (and the end-of-run sample's) sampling and length where neither a flag nor the model sets them
TERMINAL_SAMPLING = {"temperature": 0.8, "top_p": 1.0, "top_k": 50, "max_new_tokens": 64}
DEFAULT_CONTEXT = 8192  # serve/generate without --max-context: the model's max_seq_len up to this
SERVE_DEVICES = ("auto", "cuda", "cpu")
SERVE_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CacheSettings:
    """The paged KV cache's: its size (None: max_batch x max_context tokens, room for every request
    at its longest), block size, the prompt tokens computed per engine step, prefix caching."""

    kv_cache_gib: float | None = None
    block_size: int = 16
    prefill_chunk: int = 512
    prefix_caching: bool = True


def load_engine(
    source: str,
    max_batch: int = 16,
    max_context: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
    cache: CacheSettings = CacheSettings(),
) -> tuple[ServedModel, Engine]:
    if max_batch < 1:
        raise MeshtrainError(f"--max-batch {max_batch} must be at least 1")
    served = _load(source, device, dtype)
    limit = served.model.args.max_seq_len
    if max_context is not None and not 2 <= max_context <= limit:
        raise MeshtrainError(f"--max-context {max_context} must be between 2 and the model's max_seq_len ({limit})")
    # without --kv-cache-gib the cache holds max_batch x max_context tokens: a 128K-context model's
    # full length would take hundreds of GiB at 16 requests, so the default stops at DEFAULT_CONTEXT
    context = max_context or min(limit, DEFAULT_CONTEXT)
    engine = Engine(
        served.model,
        served.tokenizer,
        served.eos_ids,
        max_batch,
        context,
        kv_cache_tokens=_kv_cache_tokens(served, cache.kv_cache_gib, context),
        block_size=cache.block_size,
        prefill_chunk=cache.prefill_chunk,
        prefix_caching=cache.prefix_caching,
    )
    return served, engine


def _kv_cache_tokens(served: ServedModel, gib: float | None, context: int) -> int | None:
    """--kv-cache-gib in tokens of this model's keys and values; refused below one request's
    context, or above the GPU's free memory, before the cache is made."""
    if gib is None:
        return None
    per_token = kv_bytes_per_token(served.model)
    tokens = int(gib * 2**30 // per_token)
    if tokens < context:
        raise MeshtrainError(
            f"--kv-cache-gib {gib:g} holds {tokens} tokens of this model's keys and values ({per_token} bytes each), "
            f"fewer than one request's context of {context}: give at least {context * per_token / 2**30:.3g} "
            "or lower --max-context"
        )
    device = served.model.tok_embeddings.weight.device
    if device.type == "cuda" and gib * 2**30 > (free := torch.cuda.mem_get_info(device)[0]):
        raise MeshtrainError(
            f"--kv-cache-gib {gib:g} is more than the {free / 2**30:.1f} GiB free on {device} after the weights: "
            "lower it"
        )
    return tokens


def _load(source: str, device: str, dtype: str) -> ServedModel:
    dev = _device(device)
    if dtype not in SERVE_DTYPES:
        raise MeshtrainError(f"--dtype {dtype} is unknown: use auto, fp32, bf16 or fp16")
    return load_served_model(source, dev, SERVE_DTYPES[dtype] if dtype != "auto" else auto_dtype(Path(source), dev))


def auto_dtype(source: Path, device: torch.device) -> torch.dtype:
    """--dtype auto: fp32 on a CPU; on a GPU a Hugging Face directory's own half precision (its
    config.json dtype: an fp16 model cast to bf16 loses three bits of every weight), else bf16."""
    if device.type != "cuda":
        return torch.float32
    config = source / "config.json"
    stored = read_json_object(config) if config.is_file() else {}
    return torch.float16 if (stored.get("dtype") or stored.get("torch_dtype")) == "float16" else torch.bfloat16


def _device(device: str) -> torch.device:
    """Where serve and generate run: CUDA or the CPU. The CLI shares launch.device's choices, but the
    engine has no Neuron path, so neuron (or cuda without a GPU) is refused before the model loads
    rather than silently run elsewhere."""
    if device not in SERVE_DEVICES:
        raise MeshtrainError(
            f"--device {device} is not supported by serve and generate (CUDA or the CPU only); use auto, cuda or cpu"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise MeshtrainError("--device cuda but no CUDA device is visible; use auto or cpu")
    return torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


def serve(
    source: str,
    host: str,
    port: int,
    api_key: str | None,
    max_batch: int,
    max_context: int | None,
    device: str,
    dtype: str,
    cache: CacheSettings = CacheSettings(),
) -> int:
    import uvicorn

    from meshtrain.serve.app import create_app

    _check_can_listen(host, port)
    served, engine = load_engine(source, max_batch, max_context, device, dtype, cache)
    config = uvicorn.Config(
        create_app(served, engine, api_key), host=host, port=port, log_level="warning", timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)

    def stop_when_the_engine_fails() -> None:
        while not server.should_exit:
            if engine.failure is not None:
                print(f"error: the generation engine stopped ({engine.failure}); shutting down", file=sys.stderr)
                server.should_exit = True
            time.sleep(0.5)

    threading.Thread(target=stop_when_the_engine_fails, daemon=True).start()
    print(
        f"serving {served.name} at http://{host}:{port}/v1 (max batch {max_batch}, context {engine.max_context} "
        f"tokens, KV cache {engine.cache.blocks * engine.cache.block_size} tokens in blocks of "
        f"{engine.cache.block_size}, prefix caching {'on' if cache.prefix_caching else 'off'}"
        f"{', API key required' if api_key else ''})",
        flush=True,
    )
    server.run()
    engine.close()
    return 1 if engine.failure is not None else 0


def _check_can_listen(host: str, port: int) -> None:
    """A port in use or an address not on this machine: one line before the model is loaded."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as e:
        raise MeshtrainError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port or --host"
        ) from None


def generate_to_terminal(
    source: str,
    prompt: str,
    max_tokens: int | None,
    sampling: dict[str, float | None],
    seed: int | None,
    device: str = "auto",
) -> int:
    """The prompt and its continuation of --max-tokens tokens, on a cache sized for exactly them (one
    sequence: no DEFAULT_CONTEXT cap); above the model's max_seq_len it is refused, as serve refuses
    it, rather than cut short. `sampling`: temperature, top_p and top_k as given (None: left out,
    so the model's generation_config.json value, as `serve` takes it, else TERMINAL_SAMPLING's);
    `max_tokens` None: its max_new_tokens (up to the context's room), else 64."""
    served = _load(source, device, "auto")
    ids = served.prompt_ids(prompt, chat=False)
    limit = served.model.args.max_seq_len
    if not ids:
        raise MeshtrainError("the prompt has no tokens: give a non-empty --prompt")
    given = {**sampling, "max_new_tokens": max_tokens}
    chosen = {key: served.sampling_defaults.get(key, TERMINAL_SAMPLING[key]) for key in given} | {
        key: value for key, value in given.items() if value is not None
    }
    if max_tokens is None:  # the model's own length (max_new_tokens, else max_length), as serve takes it
        fallback = TERMINAL_SAMPLING["max_new_tokens"]
        chosen["max_new_tokens"] = default_completion_length(
            served.sampling_defaults, len(ids), limit - len(ids), fallback
        )
    greedy = chosen["temperature"] == 0  # the model's top_p and top_k take no part
    from_model = [
        f"{key} {chosen[key]}"
        for key in given
        if given[key] is None and key in served.sampling_defaults and not (greedy and key in ("top_p", "top_k"))
    ]
    if chosen["temperature"] == 0 and (
        idle := truncations_given(given["top_p"], given["top_k"]) + (["seed"] if seed is not None else [])
    ):
        why = "--temperature 0" if given["temperature"] is not None else "the model's generation_config.json"
        raise MeshtrainError(
            f"--{idle[0].replace('_', '-')} shapes sampling, but {why} decodes greedily: give a --temperature "
            "above 0, or drop it"
        )
    if from_model:
        print(f"sampling with the model's generation_config.json: {', '.join(from_model)}", file=sys.stderr)
    params = SamplingParams(
        chosen["max_new_tokens"], chosen["temperature"], chosen["top_p"], max(0, chosen["top_k"]), [], seed
    )
    if len(ids) + params.max_tokens > limit:
        raise MeshtrainError(
            f"the prompt has {len(ids)} tokens and --max-tokens asks for {params.max_tokens}: together above the "
            f"model's context of {limit} tokens (max_seq_len); lower --max-tokens to {limit - len(ids)} or shorten "
            "the prompt"
            if len(ids) < limit
            else f"the prompt has {len(ids)} tokens: the model's context holds {limit}; shorten the prompt"
        )
    engine = Engine(served.model, served.tokenizer, served.eos_ids, 1, len(ids) + params.max_tokens)
    done, failed = threading.Event(), []

    def emit(event: tuple) -> None:
        if event[0] == "text":
            sys.stdout.write(event[1])
            sys.stdout.flush()
        else:
            if event[0] == "error":
                print(f"\nerror: {event[1]}", file=sys.stderr)
                failed.append(event[1])
            done.set()

    sys.stdout.write(prompt)
    engine.submit(Request(ids, params, emit))
    done.wait()
    print()
    engine.close()
    return 1 if failed else 0


def sample_text(state: dict[str, torch.Tensor], args, tokenizer_path, prompt: str, max_tokens: int) -> str:
    """The end-of-run demo: the prompt and a continuation sampled from the full weights (on the CPU,
    by the engine that serves: one sampling and stopping implementation)."""
    from meshtrain.data.tokenizer import encode_prompt, end_of_text, load_tokenizer
    from meshtrain.model import Llama

    model = Llama(args)
    model.load_full_state(state)
    tokenizer = load_tokenizer(tokenizer_path)
    ids = encode_prompt(tokenizer, prompt)[-(args.max_seq_len - 1) :]
    context = min(args.max_seq_len, len(ids) + max_tokens)  # a cache for this sample, not the model's longest
    # the end token data prepare used: the tokenizer_config.json kept beside the data's tokenizer
    engine = Engine(model, tokenizer, end_of_text(tokenizer, Path(tokenizer_path).parent)[1], 1, context)
    sampling = {key: TERMINAL_SAMPLING[key] for key in ("temperature", "top_p", "top_k")}
    try:
        text, _, _ = engine.complete(ids, SamplingParams(context - len(ids), **sampling, seed=0))
    finally:
        engine.close()
    return prompt + text
