"""OpenAI-compatible request and response bodies, and the OpenAI error shape.

Request models accept (and ignore) fields we do not act on, because official clients send extras such as `user`;
fields whose meaning we cannot honour (presence/frequency penalties, suffix, best_of) are rejected explicitly by the
server rather than silently ignored, so a caller never gets a result computed under settings it did not ask for.

Types are strict, like the OpenAI API: `"n": "2"`, `"stream": "yes"` or `"max_tokens": true` are 400s, not coerced.
Numbers must be finite, text must be valid Unicode (a lone UTF-16 surrogate is refused: no tokenizer or JSON encoder
takes one), and every per-request quantity the schema can bound is bounded here (the bounds that depend on the model
or the server's options, such as the context length or `n`, are checked when the request is translated, in `jobs`).

Response models are the only way a response body is built. OpenAI's own fields are always present (null when empty,
as OpenAI sends them); this server's extensions (`rollout`, `token_ids`, `prompt_token_ids`, a stream chunk's
`usage`) appear only when the request asked for them.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
)

MAX_LOGPROBS = 20  # top logprobs a request may ask for (completions `logprobs`, chat `top_logprobs`)
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
# apply_chat_template's own parameters: as template variables they would change how the server renders or returns
# the prompt, so clients may not set them through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def valid_unicode(text: str) -> str:
    """Refuse a lone UTF-16 surrogate ("\\ud800" in JSON): it is no character, and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"contains a lone UTF-16 surrogate at character {err.start}; send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[Text, Field(max_length=MAX_STOP_LENGTH)]
OnUpdate = Literal["keep", "recompute"]
# Validated in `jobs` (which names the shape it expected); documented here so the schema still says what it takes.
PromptInput = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
    {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1}]}}]})]


def _refuse_template(value: Any) -> None:
    if value is not None:
        raise ValueError("chat templates are not accepted from clients; the server renders messages with the model's "
                         "own template")


class _Request(BaseModel):
    """A request body: strict types, unknown fields accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: the schema the output must follow (`name`, `strict` are accepted as is)."""

    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(_Request):
    """vLLM's `structured_outputs` extension (one of these): a JSON schema, a regex, a choice or an EBNF grammar."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Sampling fields shared by both endpoints (OpenAI names, plus the vLLM-style extensions users expect)."""

    model: Text | None = None
    n: int = 1
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None
    min_p: Finite | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    repetition_penalty: Finite | None = None
    min_tokens: int | None = None
    presence_penalty: Finite | None = 0.0
    frequency_penalty: Finite | None = 0.0
    logit_bias: dict[str, Finite] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Weight updates while a request runs: tokens carry the version that produced them (see the `rollout` field).


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: text, list of texts, token ids, or list of token-id lists."""

    prompt: PromptInput = None
    max_tokens: int | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None


class ContentPart(_Request):
    """One part of a message's content; only `{"type": "text", "text": ...}` parts are supported."""

    type: Text
    text: Text | None = None


class ChatMessageParam(_Request):
    """One chat message; fields besides these (tool_calls, ...) are handed to the chat template as they are."""

    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: the tokenizer's chat template renders `messages`, ending with the assistant turn.

    Token in (this server's extension): `prompt_token_ids` is the conversation so far as token ids, typically an
    earlier response's `prompt_token_ids + token_ids`; `messages` then holds only what follows it (tool results, a
    user turn), rendered on their own and appended, and may be empty. Nothing given as ids is re-tokenized.
    """

    prompt_token_ids: Annotated[list[int], Field(min_length=1)] | None = None  # before messages: checked first
    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Annotated[Any, AfterValidator(_refuse_template), WithJsonSchema({"type": "null"})] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs or {}))
        if reserved:
            raise ValueError(f"{reserved} may not be set by clients (chat templates come from the model; the other "
                             "names are the server's own rendering options)")
        return kwargs

    @field_validator("messages")
    @classmethod
    def _messages_or_ids(cls, messages: list[ChatMessageParam], info: ValidationInfo) -> list[ChatMessageParam]:
        if not messages and info.data.get("prompt_token_ids") is None:
            raise ValueError("is empty: send at least one message, or prompt_token_ids to continue from")
        return messages


# ----------------------------------------------------------------------------------------------- RL control bodies
class _ControlRequest(BaseModel):
    """An RL control body: strict, and unknown fields are an error (a typo must not be ignored here)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class EmptyRequest(_ControlRequest):
    """`{}`: the body of control routes that take no arguments (a JSON body is what makes them preflighted)."""


class UpdateFromPathRequest(_ControlRequest):
    """POST /update_weights: load every *.safetensors file of `path`, a directory (or file) under one of the
    server's weights directories (absolute, or relative to one of them)."""

    path: Annotated[Text, Field(min_length=1, max_length=4096)]
    on_update: OnUpdate = "keep"


class CommitRequest(_ControlRequest):
    """POST /update_weights/commit: apply every chunk of an upload; `num_tensors` (what the client sent) makes a
    lost chunk an error rather than a partial update."""

    update_id: Annotated[Text, Field(max_length=64)]
    on_update: OnUpdate = "keep"
    num_tensors: Annotated[int, Field(ge=0)] | None = None


class AbortRequest(_ControlRequest):
    update_id: Annotated[Text, Field(max_length=64)]


# ------------------------------------------------------------------------------------------------------ responses
class _Body(BaseModel):
    """A response body: the fields named in `optional` are left out when None instead of sent as null (its JSON
    schema is the fields' own, with those fields not required)."""

    optional: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler):  # unannotated: the JSON schema stays the fields' own
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


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    optional: ClassVar[frozenset[str]] = frozenset({"tool_calls"})

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


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


class HealthResponse(_Body):
    """GET /health. `reason` and `error` (OpenAI's error shape, so clients show why) come with a 503 only."""

    optional: ClassVar[frozenset[str]] = frozenset({"reason", "error"})

    status: Literal["ok", "degraded", "unhealthy"]
    reason: str | None = None
    paused: bool
    weight_version: int
    consecutive_failures: int | None = None
    last_error: str | None = None
    last_error_time: float | None = None
    last_success_time: float | None = None
    error: ErrorInfo | None = None


class WeightVersionResponse(BaseModel):
    weight_version: int


class UpdateStartedResponse(BaseModel):
    update_id: str


class ChunkResponse(BaseModel):
    update_id: str
    num_tensors: int


class AbortResponse(BaseModel):
    aborted: bool


class ResetPrefixCacheResponse(BaseModel):
    dropped_blocks: int


class PauseResponse(BaseModel):
    paused: bool
