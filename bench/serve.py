"""Serving: `meshtrain serve` (with and without prefix caching) against `transformers serve
--continuous-batching` on the same freshly initialised model, each started alone, by `meshtrain bench
serve` (serve/loadtest.py): short prompts and a 2,000-token shared system prompt, at 1, 8 and 32
concurrent streaming clients."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench.common import write_results
from meshtrain.config import load_config
from meshtrain.interop import export_hf
from meshtrain.interop.weights import save_model
from meshtrain.job.data import ensure_dataset
from meshtrain.job.model import model_args
from meshtrain.model import Llama
from meshtrain.serve.loadtest import SERVERS, benchmark, table


def exported_model(preset: str, data_path: str, out: Path, max_seq_len: int) -> Path:
    """A freshly initialised `preset` with the tokenizer of `data_path` (default: the default
    corpus's), its context set to `max_seq_len`, exported for Hugging Face."""
    data = {"data.path": data_path, "data.corpus": ""} if data_path else {}
    cfg = load_config(overrides={"model.preset": preset, "model.max_seq_len": max_seq_len, **data})
    dataset = ensure_dataset(cfg)
    args = model_args(cfg, dataset.vocab_size)
    model = Llama(args)
    model.init_weights(0)
    run_dir = out / "run"
    save_model(model.state_dict(), args, run_dir)
    (run_dir / "tokenizer.json").write_bytes(dataset.tokenizer_path.read_bytes())
    return export_hf(run_dir, out / "hf")


def main(a) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        hf = exported_model(a.serve_preset, a.data_path, Path(tmp), a.system_tokens + a.serve_tokens + 256)
        rows = benchmark(hf, list(SERVERS), [1, 8, 32], a.system_tokens, a.serve_tokens)
    by = {(r["server"], r["scenario"], r["clients"]): r for r in rows}
    shared = f"{a.system_tokens}-token system prompt"
    summary = {
        "tokens_per_s_vs_transformers_32": by["meshtrain", "short prompts", 32]["tokens_per_s"]
        / by["transformers", "short prompts", 32]["tokens_per_s"],
        "ttft_vs_transformers_shared_32": by["transformers", shared, 32]["ttft_p50_s"]
        / by["meshtrain", shared, 32]["ttft_p50_s"],
        "ttft_prefix_caching_shared_1": by["meshtrain-no-prefix-caching", shared, 1]["ttft_p50_s"]
        / by["meshtrain", shared, 1]["ttft_p50_s"],
    }
    text = table(rows) + (
        f"\n\n{a.serve_preset}, {a.serve_tokens} new tokens per request, greedy: at 32 clients meshtrain serve "
        f"generates {summary['tokens_per_s_vs_transformers_32']:.1f}x transformers serve's tokens/s on short "
        f"prompts, and with the shared system prompt its first token comes "
        f"{summary['ttft_vs_transformers_shared_32']:.1f}x sooner; prefix caching makes a lone request's first "
        f"token {summary['ttft_prefix_caching_shared_1']:.1f}x sooner."
    )
    write_results("serve", [*rows, summary], text)
    return rows
