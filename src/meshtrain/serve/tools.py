"""Tool calls: the request's tools rendered by the model's own chat template (as transformers'
apply_chat_template passes them), the answer read back into OpenAI's `tool_calls` in the format of
the model's family, and `tool_choice` "required" or a named function held to the functions'
parameter schemas by a grammar (serve/grammar.py), so that the arguments validate.

Two formats, told apart by the chat template:
- Hermes (Qwen 2.5/3, and meshtrain's default template): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` after any text, one block per call;
- Llama 3.1/3.2: the whole answer one JSON object `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several separated by `; `.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from meshtrain.serve.grammar import JSON_STYLE

HERMES, LLAMA = "hermes", "llama3"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_format(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches its model; None where it renders no tools."""
    if "<tool_call>" in chat_template:
        return HERMES
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return LLAMA
    return None


@dataclass
class ParsedAnswer:
    content: str | None  # the text before the calls (None when there is none and there are calls)
    calls: list[dict]  # OpenAI's tool_calls: {"id", "type": "function", "function": {"name", "arguments"}}


def _call(name: str, arguments: dict) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_answer(text: str, fmt: str, valid: Callable[[str, dict], bool]) -> ParsedAnswer:
    """An answer's tool calls, where every call is well formed and `valid(name, arguments)` (a given
    function; with `strict`, arguments that validate); else the whole text is content (as vLLM's
    parsers do: a malformed call is text)."""
    found = []
    if fmt == HERMES:
        for block in HERMES_CALL.findall(text):
            call = _json_object(block)
            found.append(None if call is None else (call.get("name"), call.get("arguments", {})))
        content = text[: text.find("<tool_call>")].strip() or None
    else:
        body, decoder = text.strip().removeprefix("<|python_tag|>").strip(), json.JSONDecoder()
        while body.startswith("{"):  # calls one after another, separated by "; " (never split inside one)
            try:
                call, end = decoder.raw_decode(body)
            except ValueError:
                return ParsedAnswer(text, [])
            found.append((call.get("name"), call.get("parameters", call.get("arguments", {}))))
            body = body[end:].strip().removeprefix(";").strip()
        if body:  # text after the calls, or an answer that is text
            return ParsedAnswer(text, [])
        content = None
    if not found or not all(c is not None and isinstance(c[1], dict) and valid(*c) for c in found):
        return ParsedAnswer(text, [])
    return ParsedAnswer(content, [_call(name, arguments) for name, arguments in found])


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def call_grammar(fmt: str, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with its %json) for an answer that is only tool calls to
    `functions` ({"name", "parameters"}), each's arguments valid against its parameters: one call, or
    with `parallel` one or more. Each function is a rule of its own whose schema keeps the
    parameters' $defs at its root, where their "#/$defs/..." references point."""
    key = "arguments" if fmt == HERMES else "parameters"
    rules = []
    for i, function in enumerate(functions):
        parameters = dict(function.get("parameters") or {"type": "object"})
        defs = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
        schema = {
            "x-guidance": JSON_STYLE,
            "type": "object",
            "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key],
            "additionalProperties": False,
            **defs,
        }
        rules.append(f"function{i}: %json {json.dumps(schema)}")
    body = "body: " + " | ".join(f"function{i}" for i in range(len(functions)))
    if fmt == HERMES:
        call, separator = 'call: "<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
    else:
        call, separator = "call: body", '"; "'
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    return "\n".join([start, call, body, *rules]) + "\n"


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's tool_calls as chat templates read them (transformers' convention: the
    arguments an object, not OpenAI's JSON string)."""
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
        }
        for c in calls
    ]


class CallStream:
    """One streamed answer's text, passed on as content except what may be a tool call, which is
    held back until the answer ends and then sent as OpenAI's tool_calls deltas (or, where it was no
    well-formed call, as the content it is)."""

    def __init__(self, fmt: str, read: Callable[[str], ParsedAnswer]):
        self.fmt, self.read = fmt, read
        self.text, self.sent, self.content = "", 0, False  # content: a Llama answer known to be text

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self.text += delta
        if self.fmt == HERMES:
            at = self.text.find("<tool_call>")
            safe = at if at >= 0 else len(self.text) - _partial_suffix(self.text, "<tool_call>")
        else:
            head = self.text.lstrip()
            call_like = not head or head.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(head)
            self.content = self.content or not call_like
            safe = len(self.text) if self.content else 0
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(the content still held back, the calls)."""
        parsed = self.read(self.text)
        return ("", parsed.calls) if parsed.calls else (self.text[self.sent :], [])


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    return next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)
