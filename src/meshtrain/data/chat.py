"""Chat data: one chat template for training and serving, and which tokens of a conversation are
training targets.

A conversation is rendered with the template the model will be served with (the tokenizer's own
template when it has one, `DEFAULT_CHAT_TEMPLATE` otherwise), so the model learns exactly the
prompt format `meshtrain serve`, transformers' `apply_chat_template`, vLLM and TGI will show it.
The targets are the characters of each assistant turn, found by rendering the conversation up to
the turn with the generation prompt (where the answer starts) and up to its end (where it ends,
trimmed after its end-of-turn token); every token that starts inside such a span is a target.

Preference data (for DPO) is a prompt with a chosen and a rejected answer, in TRL's spellings
(`preference_pair`): each answer is stored as the conversation prompt + answer, whose targets are the
answer's assistant turns only.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from meshtrain.errors import DataError

# The chat format of models meshtrain trains: each message after a <|role|> line; an assistant
# turn ends with the end-of-text token, so a served model stops where its answer ends. Functions a
# model may call (`tools`) come first, and its calls are Hermes' <tool_call> blocks (as Qwen's).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTo call functions, answer with one <tool_call>\n"
    '{"name": function name, "arguments": arguments object}\n</tool_call> block per call. '
    "The functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{{ eos_token if message['role'] == 'assistant' else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant")
TARGETS = ("assistant", "all")


def template_of(directory: Path) -> str:
    """The chat template a tokenizer directory carries (chat_template.jinja, or tokenizer_config.json's
    chat_template), else meshtrain's default."""
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text()
    config = directory / "tokenizer_config.json"
    try:
        settings = json.loads(config.read_text()) if config.is_file() else {}
    except ValueError as e:  # not JSON, or not UTF-8
        raise DataError(f"{config} is not valid JSON ({e}): fix or remove it") from None
    if not isinstance(settings, dict):
        raise DataError(f"{config} is not a JSON object: fix or remove it")
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...], as transformers reads it
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise DataError(
                f"{config}: chat_template is a list of named templates ({', '.join(map(str, named)) or 'none'}) "
                f"with none named 'default'; save the one to use as {directory / TEMPLATE_FILE}"
            )
        template = named["default"]
    return template or DEFAULT_CHAT_TEMPLATE


class TemplateRefusal(DataError):
    """A chat template's own refusal of a conversation (its `raise_exception(...)`)."""


def _raise_exception(message: str):
    raise TemplateRefusal(f"the chat template refuses this conversation: {message}")


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """A Jinja chat template, rendered as transformers renders it (sandboxed, trim_blocks, and the
    `raise_exception` and `strftime_now` its templates call: Mistral's refuses roles that do not
    alternate, Llama 3.1's writes today's date)."""

    def __init__(self, source: str, eos_token: str | None, bos_token: str | None = None):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source, self.eos_token, self.bos_token = source, eos_token or "", bos_token or ""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson  # transformers': plain JSON, not Jinja's HTML-escaped one
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise DataError(f"the chat template is not valid Jinja ({e}); fix it or use another") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        """The conversation as text (with the functions the model may call, `tools`, as transformers
        passes them); a template that refuses it or fails on it is a DataError."""
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except DataError:
            raise  # its own refusal (raise_exception)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise DataError(f"the chat template fails on this conversation ({e}); fix it or the data") from None

    def target_spans(
        self, messages: list[dict], targets: str = "assistant", answers_from: int = 0
    ) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, the character spans whose tokens are targets): the assistant
        turns from message `answers_from` on (those before are a prompt) but those of weight 0, or with
        "all" every token."""
        text = self.render(messages)
        for message in messages:  # a template that drops them would train on its own constant text
            content = message.get("content")
            if isinstance(content, str) and content.split("</think>")[-1].strip() not in text:
                raise DataError(
                    f"the chat template leaves out the text of a {message['role']} message ({content[:40]!r}); "
                    "use a template that renders every message's content"
                )
        if targets == "all":
            return text, [(0, len(text))]
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or i < answers_from or message.get("weight") == 0:
                continue
            prompt, through = self.render(messages[:i], add_generation_prompt=True), self.render(messages[: i + 1])
            start, end = len(prompt), len(through)
            if not (text.startswith(through) and through.startswith(prompt)):
                raise DataError(
                    "the chat template does not render a conversation as the sum of its turns, so the "
                    "assistant's tokens cannot be found; use a template without look-ahead"
                )
            if self.eos_token and (eot := text.rfind(self.eos_token, start, end)) >= 0:
                end = eot + len(self.eos_token)  # whitespace after the end-of-turn token is not a target
            spans.append((start, end))
        return text, spans


def conversation(record: object, where: str) -> list[dict]:
    """The messages of one row: OpenAI-style `messages`, or a `prompt`/`completion` pair (a user
    message and the assistant's answer). One-line errors name the row."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is not a JSON object with a messages list")
    if record.get("messages") is None and isinstance(record.get("prompt"), str):
        _only_keys(record, ("prompt", "completion"), where)
        completion = record.get("completion")
        if not isinstance(completion, str):
            raise DataError(f'{where} has a "prompt" but no string "completion"')
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": completion}]
    if record.get("messages") is None and isinstance(record.get("prompt"), list):
        return _conversational_pair(record, where)
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f'{where} has no "messages" list (nor "prompt" and "completion"); is this plain text? '
            "then leave out --format chat"
        )
    parsed = _messages(messages, where)
    # ultrachat_200k and no_robots carry the first user turn again as "prompt"; UltraFeedback's SFT
    # split carries its pair beside the chosen conversation
    first_user = next((m["content"] for m in parsed if m["role"] == "user"), None)
    copies = ("chosen", "rejected", *(["prompt"] if record.get("prompt") == first_user else []))
    _only_keys(record, ("messages",), where, also=copies)
    return parsed


def _conversational_pair(record: dict, where: str) -> list[dict]:
    """TRL's conversational prompt-completion row: {"prompt": [messages], "completion": [assistant
    messages]}. As in TRL, only the completion is learned: assistant turns inside the prompt get
    weight 0."""
    _only_keys(record, ("prompt", "completion"), where)
    completion = record.get("completion")
    if not isinstance(completion, list) or not completion:
        raise DataError(f'{where} has a "prompt" list but no "completion" list of assistant messages')
    prompt = [
        {**m, "weight": 0} if m["role"] == "assistant" else m
        for m in _messages(record["prompt"], where, "prompt message")
    ]
    answer = _messages(completion, where, "completion message")
    if other := next((m["role"] for m in answer if m["role"] != "assistant"), None):
        raise DataError(f'{where}: the "completion" holds a {other} message; it holds the assistant\'s answer only')
    return prompt + answer


# Row keys that carry text of the conversation in other formats (a system prompt, Alpaca's columns,
# tools): beside the keys a row is read by, they would be dropped, though their author meant them to
# shape what is learned. Other keys are metadata (an id, scores, a source) and are left alone.
CONTENT_KEYS = frozenset(
    {"messages", "prompt", "completion", "chosen", "rejected", "system", "tools", "functions"}
    | {"instruction", "input", "output", "response", "context", "conversations", "question", "answer"}
)


def _only_keys(record: dict, keys: tuple[str, ...], where: str, also: tuple[str, ...] = ()) -> None:
    """Refuse a row's conversation text that meshtrain would drop (a "system" beside the messages, a
    "completion" beside them, ...); `also`: keys this format reads past (UltraFeedback's "messages")."""
    present = {key for key, value in record.items() if value not in (None, "", [], {})}  # a null column: absent
    if dropped := sorted((present & CONTENT_KEYS) - set(keys) - set(also)):
        raise DataError(
            f"{where} has {dropped[0]!r}, which meshtrain cannot use beside {' and '.join(map(repr, keys))}: "
            "drop it from the rows (or fold it into the messages)"
        )


def _messages(messages: list, where: str, what: str = "message") -> list[dict]:
    """Each message as {"role", "content"}, checked; an assistant turn of a conversation may carry
    OpenAI fine-tuning's "weight" (0: not a target, 1: a target), kept as given. Any other key is
    refused: a field meshtrain would drop could be one the data's author meant to take effect."""
    out = []
    for i, message in enumerate(messages, 1):
        if isinstance(message, dict):  # Parquet and `datasets` rows give every message every field, unset ones null
            message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise DataError(f"{where}: {what} {i} has role {role!r}; the roles are {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: {what} {i} ({role}) has no string content")
        weighted = role == "assistant" and what == "message"
        if unknown := sorted(set(message) - {"role", "content", *(["weight"] if weighted else [])}):
            allowed = "role, content and, on an assistant message of a conversation, weight"
            raise DataError(f"{where}: {what} {i} has {unknown[0]!r}, which meshtrain cannot use (keys: {allowed})")
        out.append({"role": role, "content": message["content"]})
        if "weight" in message:
            if message["weight"] not in (0, 1) or isinstance(message["weight"], float | bool):
                raise DataError(f"{where}: {what} {i} has weight {message['weight']!r}; use 0 (not learned) or 1")
            out[-1]["weight"] = message["weight"]
    return out


PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


def preference_pair(record: object, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen answer, rejected answer) of one row, as messages, in any of TRL's spellings:
    {"prompt": str, "chosen": str, "rejected": str} (a user message and the assistant's answers);
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}; or {"chosen": [whole
    conversation], "rejected": [...]}, whose prompt is their longest common prefix of messages. A
    "messages" beside them must be prompt + chosen (UltraFeedback's copy): anything else would be text
    meshtrain drops. One-line errors name the row."""
    if not isinstance(record, dict):
        raise DataError(f'{where} is not a JSON object with "prompt", "chosen" and "rejected"')
    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(answer, str | list):
            raise DataError(
                f'{where} has no "{name}" string or list of messages (rows: "prompt", "chosen", "rejected")'
            )
    _only_keys(record, ("prompt", "chosen", "rejected"), where, also=("messages",))  # UltraFeedback's copy: below
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError(f'{where}: "chosen" and "rejected" must both be strings or both lists of messages')
    if isinstance(chosen, str):
        if prompt is None:
            raise DataError(
                f'{where} has string answers but no "prompt": add the prompt (only conversations, lists of '
                "messages, may leave it implicit)"
            )
        if not isinstance(prompt, str):
            raise DataError(f'{where}: with string answers, "prompt" must be a string')
        prompt_messages = [{"role": "user", "content": prompt}]
        chosen_messages = [{"role": "assistant", "content": chosen}]
        rejected_messages = [{"role": "assistant", "content": rejected}]
    else:
        chosen_messages = _messages(chosen, where, "chosen message")
        rejected_messages = _messages(rejected, where, "rejected message")
        opening = {"role": "user", "content": prompt}
        if isinstance(prompt, str) and chosen_messages[:1] == rejected_messages[:1] == [opening]:
            prompt = None  # UltraFeedback's: the prompt's text beside whole conversations that begin with it
        if prompt is None:  # implicit: the messages both conversations begin with
            pairs = zip(chosen_messages, rejected_messages)
            n = next((i for i, (c, r) in enumerate(pairs) if c != r), min(len(chosen_messages), len(rejected_messages)))
            if chosen_messages == rejected_messages:
                raise DataError(f"{where}: chosen and rejected are the same conversation; a pair must differ")
            if n == 0:
                raise DataError(f"{where}: chosen and rejected share no first message, so there is no prompt")
            prompt_messages, chosen_messages, rejected_messages = (
                chosen_messages[:n],
                chosen_messages[n:],
                rejected_messages[n:],
            )
        elif isinstance(prompt, list) and prompt:
            prompt_messages = _messages(prompt, where, "prompt message")
        else:
            raise DataError(
                f'{where}: with answers as lists of messages, "prompt" must be a non-empty list of messages'
            )
    for name, answer in (("chosen", chosen_messages), ("rejected", rejected_messages)):
        if not answer or not "".join(m["content"] for m in answer).strip():
            raise DataError(f"{where}: the {name} answer is empty")
        if (role := next((m["role"] for m in answer if m["role"] != "assistant"), None)) is not None:
            raise DataError(
                f"{where}: the {name} answer holds a {role} message; after the prompt come assistant messages only"
            )
    if chosen_messages == rejected_messages:
        raise DataError(f"{where}: chosen and rejected are the same answer; a pair must differ")
    if record.get("messages") not in (None, "", [], {}) and record["messages"] != prompt_messages + chosen_messages:
        raise DataError(
            f'{where} has "messages" other than its prompt + chosen answer (the copy UltraFeedback carries, the '
            "only one meshtrain reads past): drop it from the rows, or make it that conversation"
        )
    return prompt_messages, chosen_messages, rejected_messages


def tokenize_conversations(
    tokenizer,
    template: ChatTemplate,
    conversations: list[tuple[list[dict], str]],
    targets: str,
    answers_from: list[int] | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(token ids, 1 for a target token else 0) of each (messages, where), its targets from message
    `answers_from[i]` on (default: all its assistant turns); a conversation with no target token is
    an error (it would teach nothing, silently)."""
    firsts = answers_from or [0] * len(conversations)
    if targets == "all":
        for messages, where in conversations:
            if any(m.get("weight") == 0 for m in messages):
                raise DataError(
                    f"{where}: an answer has weight 0 (not learned; also an assistant turn inside a prompt-completion "
                    "row's prompt), but --chat-targets all learns every token: drop the weight or the flag"
                )
    rendered = []
    for (messages, where), first in zip(conversations, firsts):
        try:
            rendered.append(template.target_spans(messages, targets, first))
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
    encodings = tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    out = []
    for (_, spans), encoding, (_, where) in zip(rendered, encodings, conversations):
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
        if not any(mask):
            raise DataError(
                f"{where}: the conversation has no assistant message (of weight 1), so no token to learn from; "
                "add the answer, leave the row out, or prepare with --chat-targets all"
            )
        out.append((encoding.ids, mask))
    return out
