"""`meshtrain bench serve`: servers of one model, each started alone on this machine, under the same
streamed load: throughput, time to first token and inter-token latency at several concurrencies,
with and without a long system prompt every request shares.

Each client sends its requests one after another (a closed loop, as benchmark_serving's fixed
concurrency does); a row is one server at one concurrency in one scenario. Inter-token latency is
per request: the time from its first token to its last over the tokens between (what a reader
of the stream waits per token; robust to a server that sends several tokens in one event).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import MeshtrainError

# The questions each request ends with; with a system prompt, it comes first.
QUESTIONS = ["def ", "import os\n", "class Foo", "    return ", "for i in range(", "# ", "if x ==", "print("]
SERVERS = ("meshtrain", "meshtrain-no-prefix-caching", "transformers")
START_TIMEOUT_S = 300


@dataclass
class Sample:
    ttft: float
    itl: float | None  # seconds per token after the first (None with fewer than 2 tokens)
    tokens: int


TRANSFORMERS_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def server_command(name: str, model: Path, port: int, max_batch: int, max_context: int, dtype: str) -> list[str]:
    """How a user starts each server: meshtrain's with its batch and context sized for the load;
    transformers' with continuous batching (its strongest CPU/GPU setup without an extra engine)."""
    if name.startswith("meshtrain"):
        cmd = [sys.executable, "-m", "meshtrain", "serve", str(model), "--port", str(port)]
        cmd += ["--max-batch", str(max_batch), "--max-context", str(max_context), "--dtype", dtype]
        return cmd + (["--no-prefix-caching"] if name == "meshtrain-no-prefix-caching" else [])
    cmd = [str(transformers_cli()), "serve", "--continuous-batching", "--dtype", TRANSFORMERS_DTYPES[dtype]]
    return cmd + ["--port", str(port), str(model)]


def transformers_cli() -> Path:
    from transformers.utils import is_serve_available

    cli = Path(sys.executable).parent / "transformers"
    if not cli.is_file() or not is_serve_available():
        raise MeshtrainError(
            f"the transformers baseline needs its `transformers serve` ({cli} is missing): "
            "pip install 'transformers[serving]', or leave transformers out of --servers"
        )
    return cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_tokenizer(model: Path):
    """The model's tokenizer, which sizes the prompts (and meshtrain's context) in tokens."""
    from tokenizers import Tokenizer

    path = model / "tokenizer.json"
    if not path.is_file():
        raise MeshtrainError(f"{model} has no tokenizer.json to count the prompts' tokens with")
    return Tokenizer.from_file(str(path))


def shared_system_prompt(tokenizer, tokens: int) -> str:
    """About `tokens` tokens of Python source (the standard library's, on every machine) in the
    model's tokenizer."""
    import json as json_module

    source = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    ids = tokenizer.encode(source).ids
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


async def _stream(client, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, last, tokens = time.perf_counter(), None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise MeshtrainError(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise MeshtrainError(f"the server sent an error mid-stream: {str(chunk['error'])[:300]}")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter() - start
                first = last if first is None else first
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens == 0 and first is not None:
        raise MeshtrainError("the server streamed text but no usage (stream_options.include_usage): tokens uncounted")
    first = first if first is not None else time.perf_counter() - start
    itl = (last - first) / (tokens - 1) if tokens > 1 and last is not None else None
    return Sample(first, itl, tokens)


async def _load(
    url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, api_key: str | None
):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=1800, headers=headers) as client:

        async def user(i: int) -> list[Sample]:
            return [
                await _stream(client, model, prompts[(i * per_client + j) % len(prompts)], max_tokens)
                for j in range(per_client)
            ]

        start = time.perf_counter()
        samples = [s for group in await asyncio.gather(*(user(i) for i in range(clients))) for s in group]
        return samples, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(samples: list[Sample], wall: float) -> dict:
    itls = [s.itl for s in samples if s.itl is not None]
    tokens = sum(s.tokens for s in samples)
    return {
        "requests": len(samples),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(s.ttft for s in samples),
        "ttft_p99_s": _percentile([s.ttft for s in samples], 0.99),
        "itl_p50_s": statistics.median(itls) if itls else None,
        "itl_p99_s": _percentile(itls, 0.99) if itls else None,
    }


def measure_load(
    url: str,
    model: str,
    prompts: list[str],
    clients: int,
    per_client: int,
    max_tokens: int,
    api_key: str | None = None,
) -> dict:
    """One row: `clients` concurrent streams, `per_client` requests each (client i's j-th sends
    prompt i x per_client + j, round the list), against a running server."""
    samples, wall = asyncio.run(_load(url, model, prompts, clients, per_client, max_tokens, api_key))
    return {"clients": clients, **summarize(samples, wall)}


@contextlib.contextmanager
def running_server(cmd: list[str], url: str):
    """A server started alone and ready (its /health answers), stopped on the way out whatever
    happens, Ctrl-C included. Its log goes to a file (a pipe nobody reads would fill and stop it)."""
    import httpx

    offline = os.environ | {"HF_HUB_OFFLINE": "1"}  # a local directory: nothing is downloaded
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=offline)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet: look again below
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise MeshtrainError(f"{' '.join(cmd)} did not start: {log.read().strip()[-500:]}")
                time.sleep(0.3)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except BaseException:
                proc.kill()
                proc.wait()


def benchmark(
    model: Path,
    servers: list[str],
    concurrency: list[int],
    system_tokens: int,
    max_tokens: int,
    dtype: str = "auto",
    report=print,
    save=lambda rows: None,
) -> list[dict]:
    """Every server, alone in turn, at every concurrency, without and (system_tokens > 0) with the
    shared system prompt, in one precision (auto: bf16 on a GPU, else fp32). One warm-up request per
    scenario first: a server with prefix caching then holds the system prompt, as it does after its
    first user. `save` gets the rows so far after each server."""
    import torch

    if "transformers" in servers:
        transformers_cli()
    positions = _max_positions(model)
    tokenizer = load_tokenizer(model)
    system = shared_system_prompt(tokenizer, system_tokens) if system_tokens else None
    scenarios = {"short prompts": QUESTIONS}
    if system is not None:
        scenarios[f"{system_tokens}-token system prompt"] = [f"{system}\n{q}" for q in QUESTIONS]
    sent = [p for prompts in scenarios.values() for p in [*prompts, f"{prompts[0]} warm-up"]]
    longest = max(len(tokenizer.encode(p).ids) for p in sent)
    context = longest + max_tokens + 1  # + 1: a BOS the server's template may add
    if context > positions:
        raise MeshtrainError(
            f"--system-tokens {system_tokens} and --max-tokens {max_tokens} need a context of {context} tokens; "
            f"the model's max_position_embeddings is {positions}: lower them"
        )
    if dtype == "auto":
        dtype = "bf16" if torch.cuda.is_available() else "fp32"
    rows = []
    for name in servers:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with running_server(server_command(name, model, port, max(concurrency), context, dtype), url):
            served = str(model) if name == "transformers" else model.resolve().name
            for scenario, prompts in scenarios.items():
                measure_load(url, served, [f"{prompts[0]} warm-up"], 1, 1, 4)
                for clients in concurrency:
                    row = measure_load(url, served, prompts, clients, requests_per_client(clients), max_tokens)
                    rows.append({"server": name, "scenario": scenario, "dtype": dtype, **row})
                    report(
                        f"{name}, {scenario}, {clients} clients: {row['tokens_per_s']:,.0f} tok/s, TTFT p50 "
                        f"{row['ttft_p50_s'] * 1e3:,.0f} ms"
                    )
        save(rows)
    return rows


def requests_per_client(clients: int) -> int:
    """2 each below 16 clients, else 1: at least 16 requests a row where the clients allow."""
    return 2 if clients < 16 else 1


def _max_positions(model: Path) -> int:
    from meshtrain.files import read_json_object

    config = model / "config.json"
    if not config.is_file():
        raise MeshtrainError(
            f"{model} has no config.json: give a Hugging Face directory (`meshtrain export` writes one)"
        )
    positions = read_json_object(config).get("max_position_embeddings")
    if not isinstance(positions, int):
        raise MeshtrainError(f"{config} has no max_position_embeddings: not a decoder this benchmark can size")
    return positions


def table(rows: list[dict]) -> str:
    columns = ["server", "scenario", "clients", "requests", "tok/s"]
    columns += ["TTFT p50 (ms)", "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:,.1f}"

    for r in rows:
        lines.append(
            f"| {r['server']} | {r['scenario']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:,.0f} | "
            f"{ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['itl_p50_s'])} | {ms(r['itl_p99_s'])} |"
        )
    return "\n".join(lines)
