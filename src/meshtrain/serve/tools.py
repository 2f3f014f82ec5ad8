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


def _call(name: str, arguments) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def parse_answer(text: str, fmt: str, names: set[str]) -> ParsedAnswer:
    """An answer's tool calls, where it holds well-formed ones naming a given function; else the
    whole text is content (as vLLM's parsers do: a malformed call is text)."""
    calls = []
    if fmt == HERMES:
        blocks = HERMES_CALL.findall(text)
        for block in blocks:
            call = _json_object(block)
            if call is None or call.get("name") not in names or not isinstance(call.get("arguments", {}), dict):
                return ParsedAnswer(text, [])
            calls.append(_call(call["name"], call.get("arguments", {})))
        content = text[: text.find("<tool_call>")].strip() if calls else text
        return ParsedAnswer(content or None if calls else content, calls)
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedAnswer(text, [])
    for part in body.split("; "):
        call = _json_object(part)
        arguments = None if call is None else call.get("parameters", call.get("arguments", {}))
        if call is None or call.get("name") not in names or not isinstance(arguments, dict):
            return ParsedAnswer(text, [])
        calls.append(_call(call["name"], arguments))
    return ParsedAnswer(None, calls)


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def call_grammar(fmt: str, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with its %json) for an answer that is only tool calls to
    `functions` ({"name", "parameters"}), each's arguments valid against its parameters: one call, or
    with `parallel` one or more."""
    key = "arguments" if fmt == HERMES else "parameters"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    body = json.dumps({"x-guidance": JSON_STYLE, "anyOf": options})
    if fmt == HERMES:
        call, separator = 'call: "<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
    else:
        call, separator = "call: body", '"; "'
    start = f"start: call ({separator} call)*" if parallel else "start: call"
    return f"{start}\n{call}\nbody: %json {body}\n"


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

    def __init__(self, fmt: str, names: set[str]):
        self.fmt, self.names = fmt, names
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
        parsed = parse_answer(self.text, self.fmt, self.names)
        return ("", parsed.calls) if parsed.calls else (self.text[self.sent :], [])


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    return next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)
