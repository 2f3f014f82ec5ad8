"""The request bodies of the OpenAI API that serve takes, as pydantic models: strict types, unknown
fields refused (400), so that every field a client sends takes effect or is refused (app.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from meshtrain.serve.loading import SamplingDefaults

MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20


# Request fields whose null means their default (OpenAI's "X or null" with a default), as if left out
NULLABLE_WITH_DEFAULT = frozenset(
    {"n", "stream", "presence_penalty", "frequency_penalty", "echo", "best_of", "logprobs"}
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Sampling(SamplingDefaults):
    """The generation fields both endpoints take. Unknown fields are refused (400), never ignored
    (unlike OpenAI, which ignores some): a misspelled or unsupported option would otherwise change
    nothing without a word. Types are strict: `"0.5"`, or `true` for a number, is refused, not read.
    Every declared field takes effect or is refused in `_check` or its endpoint; `user` is accepted as
    OpenAI's end-user id and has no effect on the answer. temperature,
    top_p and top_k (SamplingDefaults) left out: the model's generation_config.json value, else
    OpenAI's default (1, 1, no top-k)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        """OpenAI types these fields "X or null", and clients send null for "the default"."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in NULLABLE_WITH_DEFAULT)}
        return data

    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1)  # answers to the prompt, prefilled once (at most the server's --max-batch)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # text, or token ids (what lm-evaluation-harness sends)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # a count: true/false refused
    echo: bool = False
    best_of: int | None = Field(None, ge=1)  # answers generated, of which the n likeliest are returned
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
