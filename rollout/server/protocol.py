"""OpenAI-compatible request bodies and the OpenAI error shape.

Request models accept (and ignore) fields we do not act on, because official clients send extras such as `user`;
fields whose meaning we cannot honour (penalties, logit_bias, suffix, best_of) are rejected explicitly by the app
rather than silently ignored, so a caller never gets a result computed under settings it did not ask for.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """A request-level failure rendered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or error_type(status_code)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_type(status_code: int) -> str:
    """OpenAI's error `type` for an HTTP status: clients branch on it, so keep the usual names."""
    if status_code == 404:
        return "not_found_error"
    if status_code == 503:
        return "service_unavailable_error"
    if status_code >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
