"""OpenAI-style errors: the exception the server raises, its status code and `type`, and how engine-side failures
(an `InvalidRequestError`, a FAILED output's `error_kind`) become one."""

from __future__ import annotations

from starlette.responses import JSONResponse

from rollout.engine.core.request import ErrorKind, RequestOutput
from rollout.openai_params import openai_name
from rollout.server.protocol import ErrorInfo, ErrorResponse
from rollout.validation import InvalidRequestError

# HTTP status of a failed sequence, by why it failed: the caller's request (400), the model (500), the server (503).
STATUS_BY_ERROR_KIND = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.CAPACITY: 400,
    ErrorKind.FORWARD: 500,
    ErrorKind.SHUTDOWN: 503,
}
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


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
    """The JSON of an OpenAI error response. Text that came from the client may hold lone surrogates, which JSON
    encoders refuse: they are escaped, so reporting a bad input can never fail in turn."""
    message, param = _encodable(message), _encodable(param) if param is not None else None
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI error response with the usual `type` for its status."""
    return JSONResponse(error_body(message, error_type(status_code), param, code), status_code=status_code,
                        headers=headers)


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def from_invalid_request(err: InvalidRequestError, prompt_param: str) -> OpenAIError:
    """A 400 naming the request field at fault under its OpenAI name.

    The prompt is `prompt_param` ("prompt" or "messages"), and so is a context-length overflow, as OpenAI reports it
    (the prompt is what usually has to shrink, though the message names both).
    """
    if err.param is None:
        return OpenAIError(str(err), code=err.code)
    names_prompt = err.param == "prompt" or err.code == CONTEXT_LENGTH_EXCEEDED
    param = prompt_param if names_prompt else openai_name(err.param)
    message = str(err)
    if err.param != "prompt" and openai_name(err.param) != err.param:
        message += f" ({err.param} is '{openai_name(err.param)}' in this API)"
    return OpenAIError(message, param=param, code=err.code)


def from_failed_output(out: RequestOutput) -> OpenAIError:
    """The error a FAILED sequence fails its HTTP request with; the status comes from its `error_kind`."""
    status = STATUS_BY_ERROR_KIND.get(out.error_kind, 500)
    return OpenAIError(out.error or f"generation of {out.request_id!r} failed", status_code=status)
