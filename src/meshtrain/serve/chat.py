"""What a chat request becomes before generation: its conversation rendered by the model's chat
template (with the tools, an assistant's earlier calls and the tool results), every part of it the
template would drop refused; and, for tool_choice "required" or a named function, the grammar the
calls are held to."""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import DataError
from meshtrain.serve.grammar import schema_grammar
from meshtrain.serve.loading import ServedModel
from meshtrain.serve.requests import APIError, ChatRequest, Message, NamedToolChoice
from meshtrain.serve.tools import call_grammar, template_tool_calls, tool_format


@dataclass
class ToolUse:
    """A request's tools where it lets the model call them (tool_choice other than none)."""

    fmt: str  # the model's tool-call format (serve/tools.py)
    names: set[str]
    schemas: list[dict]  # the tools as the chat template receives them
    grammar: str | None  # "required" or a named function: the calls' grammar


def tool_use(served: ServedModel, body: ChatRequest, vocab) -> ToolUse | None:
    """The request's tools checked: each parameters schema one a grammar can hold arguments to,
    names distinct, a named tool_choice among them, and a chat template that renders tools."""
    if body.tool_choice is not None and not body.tools:
        raise APIError(400, "tool_choice needs tools: send the tools it chooses among", "tool_choice")
    if not body.tools or body.tool_choice == "none":
        return None
    fmt = tool_format(served.chat_template)
    if fmt is None:
        raise APIError(400, "tools: this model's chat template renders no tools (it knows no tool calls)", "tools")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) < len(names):
        raise APIError(400, f"tools: each function needs a name of its own, got {names}", "tools")
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
    for i, function in enumerate(functions):
        schema = function.get("parameters") or {"type": "object"}
        where = f"tools.{i}.function.parameters"
        if schema.get("type", "object") != "object":
            raise APIError(400, f"{where}: the arguments are a JSON object, so its type must be object", where)
        schema_grammar(schema, vocab, where)
    chosen = functions
    if isinstance(body.tool_choice, NamedToolChoice):
        chosen = [f for f in functions if f["name"] == body.tool_choice.function.name]
        if not chosen:
            raise APIError(
                400,
                f"tool_choice names {body.tool_choice.function.name!r}, which is not among the tools {names}",
                "tool_choice",
            )
    required = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    grammar = call_grammar(fmt, chosen, body.parallel_tool_calls) if required else None
    schemas = [{"type": "function", "function": f} for f in functions]
    return ToolUse(fmt, set(names), schemas, grammar)


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
