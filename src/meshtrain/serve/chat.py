"""What a chat request becomes before generation: its conversation rendered by the model's chat
template (with the tools, an assistant's earlier calls and the tool results), every part of it the
template would drop refused; and, for tool_choice "required" or a named function, the grammar the
calls are held to."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from meshtrain.errors import DataError
from meshtrain.serve.grammar import matches, one_line, schema_grammar
from meshtrain.serve.loading import ServedModel
from meshtrain.serve.requests import APIError, ChatRequest, Message, NamedToolChoice
from meshtrain.serve.tools import ParsedAnswer, call_grammar, parse_answer, template_tool_calls, tool_format


@dataclass
class ToolUse:
    """A request's tools where it lets the model call them (tool_choice other than none)."""

    fmt: str  # the model's tool-call format (serve/tools.py)
    schemas: list[dict]  # the tools as the chat template receives them
    grammar: str | None  # "required" or a named function: the calls' grammar
    strict: dict[str, str | None]  # function name -> its arguments' grammar where strict (else None)
    vocab: object  # the llguidance tokenizer the grammars are over
    parallel: bool  # parallel_tool_calls
    named: bool  # tool_choice names the function (OpenAI then ends the answer "stop")

    def valid(self, name: str, arguments: dict) -> bool:
        """A call to a given function, its arguments held to the schema where the function is strict."""
        if name not in self.strict:
            return False
        grammar = self.strict[name]
        return grammar is None or matches(self.vocab, grammar, json.dumps(arguments, ensure_ascii=False))

    def read(self, text: str) -> ParsedAnswer:
        """An answer's content and calls; without parallel_tool_calls, its first call only."""
        parsed = parse_answer(text, self.fmt, self.valid)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def finish_reason(self, finish: str, calls: list) -> str:
        return "tool_calls" if calls and finish == "stop" and not self.named else finish


def tool_use(served: ServedModel, body: ChatRequest, vocab) -> ToolUse | None:
    """The request's tools checked: each parameters schema one a grammar can hold arguments to,
    names distinct, a named tool_choice among them, and a chat template that renders tools."""
    if body.tool_choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools: send the tools it chooses among", "tool_choice")
    if "parallel_tool_calls" in body.model_fields_set and not body.tools:
        raise APIError(400, "parallel_tool_calls needs tools: leave it out", "parallel_tool_calls")
    if not body.tools or body.tool_choice == "none":
        return None
    fmt = tool_format(served.chat_template)
    if fmt is None:
        raise APIError(400, "tools: this model's chat template renders no tools (it knows no tool calls)", "tools")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) < len(names):
        raise APIError(400, f"tools: each function needs a name of its own, got {names}", "tools")
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
    strict = {}
    for i, function in enumerate(functions):
        schema = function.get("parameters") or {"type": "object"}
        where = f"tools.{i}.function.parameters"
        if schema.get("type", "object") != "object":
            raise APIError(400, f"{where}: the arguments are a JSON object, so its type must be object", where)
        grammar = schema_grammar(schema, vocab, where)
        strict[function["name"]] = grammar if function.get("strict") else None
    named = isinstance(body.tool_choice, NamedToolChoice)
    chosen = functions
    if named:
        chosen = [f for f in functions if f["name"] == body.tool_choice.function.name]
        if not chosen:
            raise APIError(
                400,
                f"tool_choice names {body.tool_choice.function.name!r}, which is not among the tools {names}",
                "tool_choice",
            )
    grammar = None
    if body.tool_choice == "required" or named:  # one call of the named function; required: as parallel allows
        grammar = call_grammar(fmt, chosen, body.parallel_tool_calls and not named)
        problem = llguidance.LLMatcher.validate_grammar(grammar, vocab)
        if problem:
            raise APIError(400, f"tools: the calls' grammar cannot be built: {one_line(problem)}", "tools")
    schemas = [{"type": "function", "function": f} for f in functions]
    return ToolUse(fmt, schemas, grammar, strict, vocab, body.parallel_tool_calls, named)


def chat_prompt(served: ServedModel, messages: list[Message], tools: list[dict] | None = None) -> str:
    """The rendered conversation. A `developer` message is a system message (OpenAI's newer name for
    it; chat templates know only `system`). A message's `name`, an assistant's earlier `tool_calls`
    and the `tools` go to the chat template; where the template does not render one (the prompt is
    the same without it) the request is refused, since it would otherwise be dropped without a word."""
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    turns = [dict(turn) for turn in plain]
    calls = set()
    for i, (turn, m) in enumerate(zip(turns, messages, strict=True)):
        if m.name:
            turn["name"] = m.name
        if m.tool_calls:
            turn["tool_calls"] = _sent_back_calls(m, i)
            calls |= {call.id for call in m.tool_calls}
        if m.tool_call_id is not None:
            if m.tool_call_id not in calls:
                raise APIError(
                    400,
                    f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call",
                    f"messages.{i}.tool_call_id",
                )
            turn["tool_call_id"] = m.tool_call_id
    try:
        prompt = served.render_chat(turns, tools)
        for i, m in enumerate(messages):
            for key, value in (("name", m.name), ("tool_calls", m.tool_calls)):
                without = {k: v for k, v in turns[i].items() if k != key}
                if value and served.render_chat([*turns[:i], without, *turns[i + 1 :]], tools) == prompt:
                    raise APIError(
                        400,
                        f"messages[{i}].{key} is not supported by this model's chat template: drop it",
                        f"messages.{i}.{key}",
                    )
        if tools and served.render_chat(turns, None) == prompt:
            raise APIError(400, "tools: this model's chat template does not render them: leave them out", "tools")
    except DataError as e:  # the template's own refusal (Mistral's: roles that do not alternate) or failure
        raise APIError(400, str(e), "messages") from None
    return prompt


def _sent_back_calls(message: Message, i: int) -> list[dict]:
    try:
        calls = template_tool_calls([call.model_dump() for call in message.tool_calls])
    except ValueError:
        calls = None
    if calls is None or not all(isinstance(c["function"]["arguments"], dict) for c in calls):
        raise APIError(
            400,
            f"messages[{i}].tool_calls: each function.arguments must be a JSON object, as a call returned it",
            f"messages.{i}.tool_calls",
        )
    return calls
