"""Prefix caching: `meshtrain serve` with and without it, on requests that share a 2,000-token
system prompt (each with its own question), at 1, 8 and 32 concurrent streaming clients: time to
first token and generated tokens/s. Each server runs alone; both see the same requests."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from bench.common import markdown, write_results
from bench.serve import PROMPTS, exported_model, free_port, measure


def shared_system_prompt(hf: Path, tokens: int) -> str:
    """About `tokens` tokens of Python source (the standard library's, on every machine) in the
    served tokenizer: the system prompt every request of the prefix-caching bench starts with."""
    import inspect
    import json as json_module

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    source = inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)
    ids = tokenizer.encode(source).ids[:tokens]
    return tokenizer.decode(ids)


def main(a) -> list[dict]:
    """`meshtrain serve` with prefix caching on and off: requests that share a 2,000-token system
    prompt, each with its own question, at 1, 8 and 32 concurrent clients."""
    levels = [1, 8, 32]
    with tempfile.TemporaryDirectory() as tmp:
        hf = exported_model(a.serve_preset, a.data_path, Path(tmp), max_seq_len=4096)
        system = shared_system_prompt(hf, a.prefix_tokens)
        prompts = [f"{system}\n# question {i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(64)]
        dtype = "bf16" if torch.cuda.is_available() else "fp32"
        rows = []
        for caching in ("--prefix-caching", "--no-prefix-caching"):
            cmd = [sys.executable, "-m", "meshtrain", "serve", str(hf), "--max-batch", "32", "--dtype", dtype]
            cmd += ["--max-context", "2304", caching]
            name = f"meshtrain serve {caching}"
            # the warm-up computes the system prompt once: the cached server starts with it, as after its first user
            rows += measure(name, cmd, free_port(), "hf", levels, a.serve_tokens, prompts, [f"{system}\n# warm-up"])
    by = {(r["server"], r["clients"]): r for r in rows}
    summary = {
        f"ttft_speedup_{n}": by["meshtrain serve --no-prefix-caching", n]["ttft_p50_s"]
        / by["meshtrain serve --prefix-caching", n]["ttft_p50_s"]
        for n in levels
    }
    lines = [
        [
            r["server"].removeprefix("meshtrain serve "),
            str(r["clients"]),
            str(r["requests"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ttft_p50_s'] * 1e3:,.0f}",
            f"{r['ttft_p99_s'] * 1e3:,.0f}",
        ]
        for r in rows
    ]
    header = ["prefix caching", "clients", "requests", "generated tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)"]
    table = markdown(header, lines)
    table += (
        f"\n\n{a.serve_preset}, a {a.prefix_tokens}-token shared system prompt, {a.serve_tokens} new tokens per "
        f"request, greedy, {dtype}: time to first token with prefix caching "
        + ", ".join(f"{summary[f'ttft_speedup_{n}']:.1f}x faster at {n} clients" for n in levels)
        + "."
    )
    write_results("serve_prefix", [*rows, summary], table)
    return rows
