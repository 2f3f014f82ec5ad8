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
    {"n", "stream", "presence_penalty", "frequency_penalty", "echo", "best_of", "logprobs", "parallel_tool_calls"}
)


class APIError(Exception):
    """A request refused: the HTTP status and OpenAI's error fields (`param`: the field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


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


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON, as OpenAI sends it back


class ToolCall(BaseModel):
    """A call an earlier answer made, sent back in an assistant message."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message takes one")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the arguments are held to `parameters` by a grammar where a call is required


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
