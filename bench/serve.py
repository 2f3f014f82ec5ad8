"""Serving throughput: `meshtrain serve` (continuous batching over a KV cache) against a baseline
server that runs transformers' generate() one request at a time (bench/hf_server.py), on the same
exported model, in one run. For 1, 4 and 16 concurrent streaming clients: aggregate generated
tokens/s and time to first token (p50, p99). Each server runs alone, as a user would start it."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.common import markdown, write_results
from meshtrain.config import load_config
from meshtrain.interop import export_hf
from meshtrain.interop.weights import save_model
from meshtrain.job.data import ensure_dataset
from meshtrain.job.model import model_args
from meshtrain.model import Llama

PROMPTS = ["def ", "import os\n", "class Foo", "    return ", "for i in range(", "# ", "if x ==", "print("]


def exported_model(preset: str, data_path: str, out: Path, max_seq_len: int | None = None) -> Path:
    """A freshly initialised `preset` with the tokenizer of `data_path` (default: the default
    corpus's), exported for Hugging Face."""
    data = {"data.path": data_path, "data.corpus": ""} if data_path else {}
    context = {"model.max_seq_len": max_seq_len} if max_seq_len else {}
    cfg = load_config(overrides={"model.preset": preset, **data, **context})
    dataset = ensure_dataset(cfg)
    args = model_args(cfg, dataset.vocab_size)
    model = Llama(args)
    model.init_weights(0)
    run_dir = out / "run"
    save_model(model.state_dict(), args, run_dir)
    (run_dir / "tokenizer.json").write_bytes(dataset.tokenizer_path.read_bytes())
    return export_hf(run_dir, out / "hf")


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} did not start:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.3)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(time to first token, tokens generated) of one streamed completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                first = time.perf_counter() - start
            tokens = chunk.get("usage", {}).get("completion_tokens", tokens) if chunk.get("usage") else tokens
    return (first if first is not None else time.perf_counter() - start), tokens


async def load(
    url: str, model: str, clients: int, requests_per_client: int, max_tokens: int, prompts: list[str] = PROMPTS
) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def user(i: int):
            return [
                await one_request(client, model, prompts[(i * requests_per_client + j) % len(prompts)], max_tokens)
                for j in range(requests_per_client)
            ]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(user(i) for i in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": sum(n for _, n in results),
        "wall_s": wall,
        "tokens_per_s": sum(n for _, n in results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(
    name: str,
    cmd: list[str],
    port: int,
    model: str,
    levels: list[int],
    max_tokens: int,
    prompts: list[str] = PROMPTS,
    warm_up: list[str] = PROMPTS[:1],
) -> list[dict]:
    proc = start([*cmd, "--port", str(port)], port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(load(url, model, 1, 1, 8, warm_up))
        rows = []
        for clients in levels:
            row = asyncio.run(load(url, model, clients, 2 if clients < 16 else 1, max_tokens, prompts))
            rows.append({"server": name, **row})
            print(
                f"  {name} {clients} clients: {row['tokens_per_s']:,.0f} tok/s, TTFT p50 "
                f"{row['ttft_p50_s'] * 1e3:,.0f} ms",
                flush=True,
            )
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(a) -> list[dict]:
    levels = [1, 4, 16]
    with tempfile.TemporaryDirectory() as tmp:
        hf = exported_model(a.serve_preset, a.data_path, Path(tmp))
        dtype = "bf16" if torch.cuda.is_available() else "fp32"
        mesh = measure(
            "meshtrain serve",
            [sys.executable, "-m", "meshtrain", "serve", str(hf), "--max-batch", "16", "--dtype", dtype],
            free_port(),
            "hf",
            levels,
            a.serve_tokens,
        )
        base = measure(
            "transformers generate()",
            [sys.executable, "-m", "bench.hf_server", str(hf)],
            free_port(),
            "hf",
            levels,
            a.serve_tokens,
        )
    rows = mesh + base
    by = {(r["server"], r["clients"]): r for r in rows}
    summary = {
        "scaling_16_vs_1": by["meshtrain serve", 16]["tokens_per_s"] / by["meshtrain serve", 1]["tokens_per_s"],
        "vs_baseline_16": by["meshtrain serve", 16]["tokens_per_s"] / by["transformers generate()", 16]["tokens_per_s"],
    }
    lines = [
        [
            r["server"],
            str(r["clients"]),
            str(r["requests"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ttft_p50_s'] * 1e3:,.0f}",
            f"{r['ttft_p99_s'] * 1e3:,.0f}",
        ]
        for r in rows
    ]
    table = markdown(["server", "clients", "requests", "generated tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)"], lines)
    table += (
        f"\n\n{a.serve_preset}, {a.serve_tokens} new tokens per request, greedy, {dtype}: meshtrain serve at 16 "
        f"clients = {summary['scaling_16_vs_1']:.1f}x its 1-client tokens/s and "
        f"{summary['vs_baseline_16']:.1f}x the baseline's."
    )
    write_results("serve", [*rows, summary], table)
    return rows
