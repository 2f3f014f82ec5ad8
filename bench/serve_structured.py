"""Structured output's cost: the grammar libraries side by side, then the engine with and without a
JSON-schema constraint, in one run.

1. llguidance (what serve uses) and xgrammar (where installed: it is not a dependency) on a 32k BPE
   vocabulary trained here from the Python standard library: compiling a nested schema, and the
   mask plus the token's acceptance per generated token (random logits sampled under the mask).
2. The engine (continuous batching; dim 256, 4 layers, that vocabulary, random weights) decoding 8
   requests at once, each constrained by the schema or not: ms per generated token.
"""

from __future__ import annotations

import glob
import json
import statistics
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from bench.common import markdown, write_results
from meshtrain.model import Llama, ModelArgs
from meshtrain.serve.engine import Engine, Request, SamplingParams
from meshtrain.serve.grammar import JSON_STYLE, Constraint, grammar_tokenizer, response_format_grammar

VOCAB = 32000
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": ["string", "null"]}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def stdlib_tokenizer(directory: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:300]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train(files, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def library_rows(tokenizer: Tokenizer, answers: int) -> list[dict]:
    """Each library: schema compile ms, and mask + accept µs per token over `answers` sampled answers."""
    import llguidance

    gen = torch.Generator().manual_seed(0)
    bits = torch.arange(32, dtype=torch.int32)

    def run(make, mask_into, accept, done, words: torch.Tensor) -> tuple[float, float]:
        compile_ms, per_token = [], []
        for _ in range(answers):
            start = time.perf_counter()
            state = make()
            compile_ms.append((time.perf_counter() - start) * 1e3)
            spent, tokens = 0.0, 0
            while not done(state) and tokens < 400:
                start = time.perf_counter()
                mask_into(state)
                allowed = ((words.reshape(-1)[:, None] >> bits) & 1).bool().reshape(-1)[:VOCAB]
                spent += time.perf_counter() - start
                logits = torch.randn(VOCAB, generator=gen).masked_fill(~allowed, float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                start = time.perf_counter()
                accept(state, token)
                spent += time.perf_counter() - start
                tokens += 1
            per_token.append(spent / max(1, tokens) * 1e6)
        return statistics.median(compile_ms), statistics.median(per_token)

    rows = []
    lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=VOCAB, eos_token=[0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_STYLE)
    words = torch.empty((VOCAB + 31) // 32, dtype=torch.int32)
    ms, us = run(
        lambda: llguidance.LLMatcher(lltok, grammar),
        lambda m: m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4),
        lambda m, t: m.consume_token(t),
        lambda m: m.is_stopped(),
        words,
    )
    rows.append({"library": "llguidance", "compile_ms": ms, "us_per_token": us})
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return rows
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=VOCAB, stop_token_ids=[0]
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    xwords = xgrammar.allocate_token_bitmask(1, VOCAB)
    ms, us = run(
        lambda: xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)),
        lambda m: m.fill_next_token_bitmask(xwords, 0),
        lambda m, t: m.accept_token(t),
        lambda m: m.is_terminated(),
        xwords,
    )
    rows.append({"library": "xgrammar", "compile_ms": ms, "us_per_token": us})
    return rows


def engine_ms_per_token(tokenizer: Tokenizer, constrained: bool, batch: int, max_tokens: int) -> float:
    args = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=VOCAB, max_seq_len=512)
    torch.manual_seed(0)
    model = Llama(args)
    model.init_weights(0)
    engine = Engine(model, tokenizer, [0] if constrained else [], batch, args.max_seq_len)
    lltok = grammar_tokenizer(tokenizer, VOCAB, [0])
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, lltok)
    done = threading.Semaphore(0)
    requests = [
        Request(
            [1 + i, 2, 3],
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
            lambda event: done.release() if event[0] != "text" else None,
            constraint=Constraint(lltok, grammar, VOCAB) if constrained else None,
        )
        for i in range(batch)
    ]
    start = time.perf_counter()
    for request in requests:
        engine.submit(request)
    for _ in requests:
        done.acquire()
    seconds = time.perf_counter() - start
    engine.close()
    return seconds * 1e3 / sum(len(r.generated) for r in requests)


def main(a) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = stdlib_tokenizer(Path(tmp))
    rows = library_rows(tokenizer, answers=8)
    engine = {
        name: statistics.median(engine_ms_per_token(tokenizer, name == "json_schema", 8, 96) for _ in range(3))
        for name in ("unconstrained", "json_schema")
    }
    summary = {"engine_ms_per_token": engine, "constrained_over_plain": engine["json_schema"] / engine["unconstrained"]}
    table = markdown(
        ["library", "schema compile (ms)", "mask + accept (µs/token)"],
        [[r["library"], f"{r['compile_ms']:.1f}", f"{r['us_per_token']:.0f}"] for r in rows],
    )
    table += (
        f"\n\nThe engine, 8 requests at once, dim 256, 4 layers, vocabulary {VOCAB}, random weights: "
        f"{engine['unconstrained']:.2f} ms per generated token unconstrained, {engine['json_schema']:.2f} ms "
        f"constrained by the schema ({summary['constrained_over_plain']:.2f}x)."
    )
    write_results("serve_structured", [*rows, summary], table)
    return rows
