"""Constrained decoding: a chat request's `response_format` compiled by llguidance into a grammar over
the served tokenizer, and each answer's matcher masking its logits at every step, so that the answer
parses (and, for a JSON schema, validates) whatever the model prefers.

llguidance, not xgrammar: both cost about 0.2 ms a token on a 32k vocabulary and compile a schema in
1-15 ms (bench/serve_structured.py), but llguidance is one 3 MB wheel while xgrammar brings triton.
JSON is written compact and in one style (`{"a": 1, "b": [2, 3]}`, json.dumps' separators, no
other whitespace): a grammar that allowed any whitespace would let a model pad an answer with
blanks until it ran out of tokens.
"""

from __future__ import annotations

import llguidance
import torch

from meshtrain.serve.requests import APIError

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # a mask word's 32 tokens, lowest bit first
SCHEMA_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def grammar_tokenizer(tokenizer, n_vocab: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """The served tokenizer as llguidance reads it (about a second on a 128k vocabulary: made once
    per server). n_vocab: the model's logits, which may be padded past the tokenizer's ids."""
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=list(eos_ids) or None)


def response_format_grammar(response_format: dict | None, tokenizer: llguidance.LLTokenizer) -> str | None:
    """OpenAI's response_format as an llguidance grammar: None for plain text. `json_object`: any JSON
    object; `json_schema`: {"name", "schema", "strict", "description"}, the schema enforced whether
    or not `strict` is set (the grammar holds every answer to it). Anything else is a 400."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    expected = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in expected:
        raise APIError(
            400, f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format.type"
        )
    extra = sorted(set(response_format) - expected[kind])
    missing = sorted(expected[kind] - set(response_format))
    if extra or missing:
        raise APIError(
            400,
            f"response_format of type {kind} takes {sorted(expected[kind])}: "
            + (f"unknown {extra}" if extra else f"missing {missing}"),
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar({"type": "object"}, tokenizer, "response_format")
    return schema_grammar(_schema_of(response_format["json_schema"]), tokenizer, "response_format.json_schema.schema")


def schema_grammar(schema: dict, tokenizer: llguidance.LLTokenizer, param: str) -> str:
    """A JSON schema as a grammar of the JSON that validates against it; one that cannot be enforced
    is a 400 naming `param`, the field it came in."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except ValueError as e:
        raise APIError(400, f"{param}: {one_line(str(e))}", param) from None
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem:
        raise APIError(400, f"{param} cannot be enforced: {one_line(problem)}", param)
    return grammar


def _schema_of(spec) -> dict:
    """The schema of OpenAI's json_schema object, its other fields checked."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError(400, f"{where} must be an object with name and schema", where)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise APIError(400, f"{where}: unknown field(s) {unknown}: it takes name, schema, strict, description", where)
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64 or not set(name) <= SCHEMA_NAME_CHARS:
        raise APIError(400, f"{where}.name must be 1-64 letters, digits, _ or -, got {name!r}", f"{where}.name")
    if not isinstance(spec.get("strict", False), bool):
        raise APIError(400, f"{where}.strict must be true or false", f"{where}.strict")
    if not isinstance(spec.get("description", ""), str):
        raise APIError(400, f"{where}.description must be a string", f"{where}.description")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: left out, any JSON object
    if not isinstance(schema, dict):
        raise APIError(400, f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return schema


def one_line(message: str) -> str:
    """A library's (multi-line) error message as one line."""
    return " ".join(message.split())


class Constraint:
    """One answer's place in its grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, n_vocab: int):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.n_vocab = n_vocab
        self.words = torch.empty((n_vocab + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary: the tokens the grammar lets come next (an end token
        where the answer is complete)."""
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        bits = (self.words[:, None] >> BIT_SHIFTS) & 1
        return bits.bool().reshape(-1)[: self.n_vocab]

    def take(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The answer is whole: the grammar allows nothing but its end."""
        return self.matcher.is_stopped()


def matches(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether `text` is a whole answer of `grammar` (a tool call's arguments, written after the
    fact, against a strict function's schema)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()
