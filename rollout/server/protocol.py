"""OpenAI-compatible request and response bodies, and the OpenAI error shape.

Request models accept (and ignore) fields we do not act on, because official clients send extras such as `user`;
fields whose meaning we cannot honour (penalties, logit_bias, suffix, best_of) are rejected explicitly by the server
rather than silently ignored, so a caller never gets a result computed under settings it did not ask for.

Response models are the only way a response body is built. OpenAI's own fields are always present (null when empty,
as OpenAI sends them); this server's extensions (`rollout`, `token_ids`, `prompt_token_ids`, a stream chunk's
`usage`) appear only when the request asked for them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI names, plus the vLLM-style extensions users expect)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Weight updates while a request runs: tokens carry the version that produced them (see the `rollout` field).


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: text, list of texts, token ids, or list of token-id lists."""

    prompt: Any = None
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: the tokenizer's chat template renders `messages`, ending with the assistant turn."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class UpdateFromPathRequest(BaseModel):
    """POST /update_weights: load every *.safetensors file of `path` (a directory on the server's host)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    on_update: str = "keep"


# ------------------------------------------------------------------------------------------------------ responses
class _Body(BaseModel):
    """A response body: the fields named in `optional` are left out when None instead of sent as null."""

    optional: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler) -> dict[str, Any]:
        data = handler(self)
        out = {key: value for key, value in data.items() if key not in self.optional}
        out.update((key, value) for key, value in data.items() if key in self.optional and value is not None)
        return out


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RolloutTokens(BaseModel):
    """The RL contract per generated token (see the `rollout` field in rollout/server/app.py's docstring)."""

    token_ids: list[int]
    logprobs: list[float | None]
    policy_logprobs: list[float | None]
    kept_logmass: list[float | None]
    weight_versions: list[int]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs object."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class _ChoiceExtras(_Body):
    """What a choice carries beyond OpenAI's fields when the request asked for it."""

    optional: ClassVar[frozenset[str]] = frozenset({"rollout", "prompt_token_ids", "token_ids"})

    rollout: RolloutTokens | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionChoice(_ChoiceExtras):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(_ChoiceExtras):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatDelta(_Body):
    optional: ClassVar[frozenset[str]] = frozenset({"role", "content"})

    role: str | None = None
    content: str | None = None


class ChatStreamChoice(_ChoiceExtras):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class _Response(_Body):
    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionStreamResponse(_Response):
    """One SSE chunk of a streamed completion (OpenAI reuses the non-streamed `object` name here)."""

    optional: ClassVar[frozenset[str]] = frozenset({"usage"})

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionStreamResponse(_Response):
    optional: ClassVar[frozenset[str]] = frozenset({"usage"})

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rollout"
    root: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
