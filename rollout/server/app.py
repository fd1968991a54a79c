"""OpenAI-compatible HTTP server on the continuous-batching manager, plus the RL control endpoints.

OpenAI surface: `/v1/completions`, `/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/health`,
`/metrics` (Prometheus text). Extensions, so one server can be an RL rollout worker:

- `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to every choice (the stop token included, as the
  engine produced it; the text has stop tokens and stop strings removed, like OpenAI).
- `logprobs` (completions: an int; chat: `logprobs: true`) returns the sampled token's logprob under the distribution
  actually sampled from (after temperature and top-k/top-p/min-p; greedy is a point mass, so 0), and a `rollout`
  field per choice with the full RL contract: `token_ids`, `logprobs`, `policy_logprobs` (fp32 log_softmax of
  logits / T over the whole vocabulary), `kept_logmass` and `weight_versions`. The engine does not compute top-k
  alternatives, so `top_logprobs` only ever lists the sampled token; echoed prompt tokens have no logprob (null).
- Weights: `POST /update_weights` {"path": dir} loads a safetensors checkpoint from the server's disk; a chunked
  upload (`/update_weights/begin`, `/update_weights/chunk?update_id=` with a safetensors body,
  `/update_weights/commit?update_id=`, `/update_weights/abort?update_id=`) streams tensors of any size of model.
  Every chunk is validated on arrival; commit applies all of them atomically at a step boundary or nothing (400 with
  the reason), then bumps the weight version. `GET /weight_version`, `POST /reset_prefix_cache`, `POST /pause`,
  `POST /resume` (while paused, requests queue and weight updates still apply).

These endpoints load files from the server's disk and replace its weights: bind to localhost (the default) or put
the server behind something that authenticates.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.config import SCHEDULER_TYPES, ContinuousBatchingConfig
from rollout.engine.request import RequestOutput, RequestStatus
from rollout.manager import ManagerError
from rollout.rl.weights import WeightUpdateError
from rollout.sampling_params import SamplingParams, resolve_sampling
from rollout.server.backend import BackendClosed, ServerBackend
from rollout.server.metrics import render_metrics
from rollout.server.protocol import (
    ChatCompletionRequest, CompletionRequest, OpenAIError, UpdateFromPathRequest, error_body, error_type,
)
from rollout.server.text import CompletionText

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
_GEN_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json_floats(values: Sequence[float]) -> list[float | None]:
    """JSON has no infinities: -inf becomes -9999.0 (as vLLM reports it), NaN becomes null."""
    return [None if v != v else max(min(v, 9999.0), -9999.0) for v in values]


def prompt_seed(seed: int, index: int) -> int:
    """Seed of prompt `index` of a multi-prompt request: prompt 0 keeps `seed` (same result as sent alone)."""
    return hash((seed, index, 0x9E)) & 0x7FFF_FFFF_FFFF_FFFF


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class _Prompt:
    """One prompt after tokenization: its ids and, when it came as text, the text (echo returns it verbatim)."""

    __slots__ = ("ids", "text")

    def __init__(self, ids: list[int], text: str | None) -> None:
        self.ids = ids
        self.text = text


class _Job:
    """What one HTTP generation request asked for, resolved once and shared by the response builders."""

    def __init__(self, prompts: list[_Prompt], params: SamplingParams, stop_ids: set[int], logprobs: bool,
                 top_logprobs: int, return_token_ids: bool, echo: bool = False) -> None:
        self.prompts = prompts
        self.params = params
        self.n = params.n
        self.stop_ids = stop_ids
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.return_token_ids = return_token_ids
        self.echo = echo

    def prompt_of(self, choice: int) -> _Prompt:
        return self.prompts[choice // self.n]


class RolloutServer:
    """Request validation, submission and response shaping; the engine side lives in ServerBackend."""

    def __init__(self, backend: ServerBackend, tokenizer, model_name: str, model_aliases: Sequence[str] = ()) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        engine = backend.engine
        gen_config = engine.generation_config
        try:
            diff = gen_config.to_diff_dict()
        except Exception:  # an unusual config object: use OpenAI's defaults
            diff = {}
        # Only what the model's generation_config.json sets explicitly overrides OpenAI's defaults (as vLLM does).
        self.defaults = {k: diff[k] for k in _GEN_CONFIG_DEFAULTS if diff.get(k) is not None}
        eos: set[int] = set()
        for source in (getattr(gen_config, "eos_token_id", None), engine.model_eos,
                       getattr(tokenizer, "eos_token_id", None)):
            if _is_int(source):
                eos.add(source)
            elif isinstance(source, (list, tuple)):
                eos.update(int(t) for t in source)
        self.eos_ids = sorted(eos)

    # ------------------------------------------------------------- validation
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                              param="model", code="model_not_found")

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _check_ids(self, ids: list[int], max_tokens: int, param: str) -> None:
        if not ids:
            raise OpenAIError("The prompt is empty; pass at least one token.", param=param, code="empty_prompt")
        vocab = self.backend.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is outside the model's vocabulary [0, {vocab}).", param=param,
                              code="invalid_token_id")
        limit = self.backend.max_positions
        if limit is not None and len(ids) + max_tokens > limit:
            raise OpenAIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                              "completion). Please reduce the prompt or max_tokens.", param=param,
                              code="context_length_exceeded")
        capacity = self.backend.kv_capacity_tokens
        if len(ids) + max_tokens > capacity:
            raise OpenAIError(f"The request needs {len(ids) + max_tokens} tokens of KV cache but the server has "
                              f"{capacity}. Reduce the prompt or max_tokens.", param=param,
                              code="context_length_exceeded")

    def completion_prompts(self, prompt: Any) -> list[_Prompt]:
        """Text, list of texts, token ids, or list of token-id lists -> prompts (lists may mix texts and ids)."""
        if prompt is None:
            raise OpenAIError("'prompt' is required.", param="prompt")
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt, list):
            if not prompt:
                raise OpenAIError("The prompt is empty; pass at least one token.", param="prompt",
                                  code="empty_prompt")
            items = [prompt] if all(_is_int(x) for x in prompt) else prompt
        else:
            items = [None]
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(_Prompt(self._tokenize(item), item))
            elif isinstance(item, list) and all(_is_int(x) for x in item):
                out.append(_Prompt([int(x) for x in item], None))
            else:
                raise OpenAIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                                  "token-id lists.", param="prompt")
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        if not req.messages:
            raise OpenAIError("'messages' must be a non-empty list.", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            if not isinstance(m.get("role"), str):
                raise OpenAIError(f"messages[{i}] has no 'role'.", param=f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content):
                    raise OpenAIError("Only text content parts are supported.", param=f"messages[{i}].content")
                m = {**m, "content": "".join(texts)}
            elif content is not None and not isinstance(content, str):
                raise OpenAIError("Message content must be a string or a list of text parts.",
                                  param=f"messages[{i}].content")
            messages.append(m)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("This model's tokenizer has no chat template; use /v1/completions.",
                              param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as err:  # a template error is the caller's input problem
            raise OpenAIError(f"The chat template could not render these messages: {err}",
                              param="messages") from err
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return _Prompt([int(t) for t in ids], None)

    def sampling(self, req, max_tokens: int | None, logprobs: int | None = None) -> tuple[SamplingParams, set[int]]:
        """OpenAI fields -> SamplingParams, every bad value a 400 naming its field."""
        def bad(param: str, message: str) -> OpenAIError:
            return OpenAIError(f"Invalid value for '{param}': {message}", param=param)

        if req.n is None or req.n < 1:
            raise bad("n", f"must be >= 1, got {req.n}.")
        if max_tokens is not None and max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1, got {max_tokens}.")
        if req.temperature is not None and req.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {req.temperature}.")
        if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {req.top_p}.")
        if req.top_k is not None and req.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {req.top_k}.")
        if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {req.min_p}.")
        if req.repetition_penalty is not None and req.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {req.repetition_penalty}.")
        if req.min_tokens is not None and req.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {req.min_tokens}.")
        if logprobs is not None and logprobs < 0:
            raise bad("logprobs", f"must be >= 0, got {logprobs}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad(name, "is not supported by this server (use repetition_penalty).")
        if req.logit_bias:
            raise bad("logit_bias", "is not supported by this server.")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad("stop", "stop strings must be non-empty.")
        vocab = self.backend.vocab_size
        stop_token_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_token_ids):
            raise bad("stop_token_ids", f"ids must be in [0, {vocab}).")
        temperature = req.temperature if req.temperature is not None else self.defaults.get("temperature", 1.0)
        params = SamplingParams(
            temperature=temperature,
            do_sample=temperature > 0,
            top_p=req.top_p if req.top_p is not None else self.defaults.get("top_p", 1.0),
            top_k=req.top_k if req.top_k is not None else self.defaults.get("top_k", 0),
            min_p=req.min_p if req.min_p is not None else self.defaults.get("min_p", 0.0),
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None
            else self.defaults.get("repetition_penalty"),
            seed=req.seed,
            max_new_tokens=max_tokens,
            min_new_tokens=req.min_tokens,
            stop_token_ids=stop_token_ids or None,
            stop_strings=stop or None,
            ignore_eos=req.ignore_eos or None,
            eos_token_id=None if req.ignore_eos else (self.eos_ids or None),
            n=req.n,
        )
        try:  # the engine's own validation, so nothing that passes here fails later in the engine
            resolve_sampling(params, self.backend.engine.generation_config, self.backend.engine.model_eos)
        except ValueError as err:
            raise OpenAIError(str(err)) from err
        stop_ids = set(stop_token_ids) | (set() if req.ignore_eos else set(self.eos_ids))
        return params, stop_ids

    def _default_max_tokens(self, prompt_len: int) -> int:
        """Chat's default: the rest of the context (and of the KV cache), as OpenAI and vLLM do."""
        room = self.backend.kv_capacity_tokens - prompt_len
        if self.backend.max_positions is not None:
            room = min(room, self.backend.max_positions - prompt_len)
        return max(room, 1)

    # -------------------------------------------------------------- requests
    def completion_job(self, req: CompletionRequest) -> _Job:
        self.check_model(req.model)
        if req.suffix:
            raise OpenAIError("'suffix' is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("'best_of' other than n is not supported by this server.", param="best_of")
        prompts = self.completion_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params, stop_ids = self.sampling(req, max_tokens, req.logprobs)
        for p in prompts:
            self._check_ids(p.ids, max_tokens, "prompt")
        return _Job(prompts, params, stop_ids, logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                    return_token_ids=req.return_token_ids, echo=req.echo)

    def chat_job(self, req: ChatCompletionRequest) -> _Job:
        self.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise OpenAIError("Invalid value for 'top_logprobs': must be in [0, 20].", param="top_logprobs")
        prompt = self.chat_prompt(req)
        if not prompt.ids:
            raise OpenAIError("The rendered chat prompt is empty.", param="messages", code="empty_prompt")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(prompt.ids))
        params, stop_ids = self.sampling(req, max_tokens)
        self._check_ids(prompt.ids, max_tokens, "messages")
        return _Job([prompt], params, stop_ids, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                    return_token_ids=req.return_token_ids)

    def submit(self, job: _Job, request_id: str, streaming: bool) -> list[str]:
        """Queue every prompt of the job; returns the sequence ids in choice order (prompt-major)."""
        seq_ids: list[str] = []
        try:
            for j, prompt in enumerate(job.prompts):
                params = job.params
                if params.seed is not None and j:  # the same seed for every prompt would correlate their samples
                    params = params.with_overrides(seed=prompt_seed(params.seed, j))
                seq_ids += self.backend.submit(f"{request_id}-{j}", prompt.ids, params, streaming)
        except BaseException:
            if streaming:
                self.backend._control_nowait(self.backend._cancel_all, seq_ids)
            else:
                self.backend.abandon(seq_ids)
            raise
        return seq_ids

    # ------------------------------------------------------------- responses
    def text_tracker(self, job: _Job, choice: int, chat: bool) -> CompletionText:
        """Completions decode after some prompt context (it continues the prompt's text); chat content stands alone."""
        context = () if chat else job.prompt_of(choice).ids
        return CompletionText(self.tokenizer, job.params.stop_strings or (), job.stop_ids, context)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def rollout_field(self, out: RequestOutput, start: int = 0) -> dict:
        return {"token_ids": out.generated_tokens[start:], "logprobs": _json_floats(out.logprobs[start:]),
                "policy_logprobs": _json_floats(out.policy_logprobs[start:]),
                "kept_logmass": _json_floats(out.kept_logmass[start:]),
                "weight_versions": out.weight_versions[start:]}

    def completion_logprobs(self, out: RequestOutput, job: _Job, start: int, offset: int,
                            prompt: _Prompt | None = None) -> dict:
        """OpenAI's legacy logprobs object for generated tokens [start:], text offsets counted from `offset`.

        Tokens are decoded one by one, so `text_offset` ignores separators a tokenizer adds between tokens (an
        approximation; decoding every prefix would be quadratic in the completion length).
        """
        tokens, logprobs = [], []
        if prompt is not None:  # echo: prompt tokens first, without logprobs (the engine computes none for them)
            tokens += [self._token_text(t) for t in prompt.ids]
            logprobs += [None] * len(prompt.ids)
        new = out.generated_tokens[start:]
        tokens += [self._token_text(t) for t in new]
        logprobs += _json_floats(out.logprobs[start:start + len(new)])
        offsets, pos = [], offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top = [None if lp is None else ({tok: lp} if job.top_logprobs > 0 else {})
               for tok, lp in zip(tokens, logprobs)]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat_logprobs(self, out: RequestOutput, job: _Job, start: int = 0) -> dict:
        content = []
        for tok_id, lp in zip(out.generated_tokens[start:], _json_floats(out.logprobs[start:])):
            tok = self._token_text(tok_id)
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            entry["top_logprobs"] = [dict(entry)] if job.top_logprobs > 0 else []
            content.append(entry)
        return {"content": content}

    @staticmethod
    def raise_failure(outputs: Sequence[RequestOutput]) -> None:
        """A failed sequence fails the HTTP request: bad input -> 400, a broken forward or manager -> 500."""
        for out in outputs:
            if out.status == RequestStatus.FAILED:
                message = out.error or "generation failed"
                server_side = "forward failed" in message or "manager" in message or "hard-stopped" in message
                raise OpenAIError(message, status_code=500 if server_side else 400)

    def usage(self, job: _Job, outputs: Sequence[RequestOutput]) -> dict:
        prompt_tokens = sum(len(p.ids) for p in job.prompts)
        completion_tokens = sum(len(o.generated_tokens) for o in outputs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def completion_response(self, job: _Job, outputs: list[RequestOutput], response_id: str, created: int) -> dict:
        choices = []
        for index, out in enumerate(outputs):
            prompt = job.prompt_of(index)
            text = self.text_tracker(job, index, chat=False).full_text(out.generated_tokens, out.finish_reason)
            prefix = ""
            if job.echo:
                prefix = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)
            choice: dict[str, Any] = {"index": index, "text": prefix + text, "logprobs": None,
                                      "finish_reason": out.finish_reason}
            if job.logprobs:
                choice["logprobs"] = self.completion_logprobs(out, job, 0, 0, prompt if job.echo else None)
                choice["rollout"] = self.rollout_field(out)
            if job.return_token_ids:
                choice["prompt_token_ids"] = prompt.ids
                choice["token_ids"] = out.generated_tokens
            choices.append(choice)
        return {"id": response_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self.usage(job, outputs),
                "system_fingerprint": f"weights-v{self.backend.weight_version}"}

    def chat_response(self, job: _Job, outputs: list[RequestOutput], response_id: str, created: int) -> dict:
        choices = []
        for index, out in enumerate(outputs):
            text = self.text_tracker(job, index, chat=True).full_text(out.generated_tokens, out.finish_reason)
            choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": out.finish_reason}
            if job.logprobs:
                choice["logprobs"] = self.chat_logprobs(out, job)
                choice["rollout"] = self.rollout_field(out)
            if job.return_token_ids:
                choice["prompt_token_ids"] = job.prompt_of(index).ids
                choice["token_ids"] = out.generated_tokens
            choices.append(choice)
        return {"id": response_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": self.usage(job, outputs),
                "system_fingerprint": f"weights-v{self.backend.weight_version}"}

    async def stream(self, job: _Job, seq_ids: list[str], outputs: AsyncIterator[tuple[int, RequestOutput]],
                     response_id: str, created: int, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: one chunk per new piece of text (or tokens), a final chunk per choice, usage, [DONE].

        `outputs` is the already started `ServerBackend.open_stream`; closing it early (client gone) cancels.
        """
        obj = "chat.completion.chunk" if chat else "text_completion"
        texts = [self.text_tracker(job, i, chat) for i in range(len(seq_ids))]
        emitted = [0] * len(seq_ids)  # generated tokens already reported per choice
        offsets = [0] * len(seq_ids)  # text offset for legacy logprobs
        finals: dict[int, RequestOutput] = {}

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict[str, Any] = {"id": response_id, "object": obj, "created": created, "model": self.model_name,
                                    "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return _sse(body)

        try:
            async with aclosing(outputs) as pending:  # however this generator ends, unfinished sequences are cancelled
                for i in range(len(seq_ids)):  # opening chunk: the role (chat) or the echoed prompt (completions)
                    if chat:
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}])
                    elif job.echo:
                        prompt = job.prompt_of(i)
                        prefix = prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)
                        offsets[i] = len(prefix)
                        yield chunk([{"index": i, "text": prefix, "logprobs": None, "finish_reason": None}])
                async for i, out in pending:
                    if out.status == RequestStatus.FAILED:
                        self.raise_failure([out])
                    finished = out.is_finished()
                    delta = texts[i].delta(out.generated_tokens, finished, out.finish_reason)
                    start, end = emitted[i], len(out.generated_tokens)
                    if not delta and start == end and not finished:
                        continue
                    emitted[i] = end
                    if chat:
                        choice: dict[str, Any] = {"index": i, "delta": {"content": delta} if delta else {},
                                                  "logprobs": self.chat_logprobs(out, job, start)
                                                  if job.logprobs and end > start else None}
                    else:
                        choice = {"index": i, "text": delta,
                                  "logprobs": self.completion_logprobs(out, job, start, offsets[i])
                                  if job.logprobs and end > start else None}
                        offsets[i] += len(delta)
                    choice["finish_reason"] = out.finish_reason if finished else None
                    if job.logprobs and end > start:
                        choice["rollout"] = self.rollout_field(out, start)
                    if job.return_token_ids:
                        choice["token_ids"] = out.generated_tokens[start:]
                        if start == 0:
                            choice["prompt_token_ids"] = job.prompt_of(i).ids
                    if finished:
                        finals[i] = out
                    yield chunk([choice])
        except OpenAIError as err:
            yield _sse(err.body())
        except (BackendClosed, ManagerError) as err:
            yield _sse(error_body(str(err), error_type(503)))
        else:
            if include_usage:
                yield chunk([], self.usage(job, [finals[i] for i in sorted(finals)]))
        yield _sse("[DONE]")


# ---------------------------------------------------------------------------------------------------- the app
def create_app(model, tokenizer, model_name: str, continuous_batching_config: ContinuousBatchingConfig | None = None,
               model_aliases: Sequence[str] = (), max_streams: int = 512) -> FastAPI:
    """A FastAPI app serving `model` through one continuous-batching manager (started now, stopped at shutdown).

    `app.state.backend` is the ServerBackend (its `.manager` and `.engine` are there for inspection; generate through
    HTTP, since the backend collects every result of the manager).
    """
    backend = ServerBackend(model, tokenizer, continuous_batching_config, max_streams=max_streams)
    server = RolloutServer(backend, tokenizer, model_name, model_aliases)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        backend.close()

    app = FastAPI(title="rollout", lifespan=lifespan)
    app.state.backend = backend
    app.state.server = server

    # ------------------------------------------------------------- errors
    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, err: OpenAIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            loc = []  # the location is a character offset, not a field
        else:
            message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                                f"{e.get('msg')}" for e in errors) or "invalid request"
        return JSONResponse(error_body(message, param=".".join(loc) or None, code=first.get("type")),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail), error_type(err.status_code)), status_code=err.status_code)

    @app.exception_handler(WeightUpdateError)
    async def _weight_error(_request: Request, err: WeightUpdateError) -> JSONResponse:
        logger.warning("weight update rejected: %s", err)
        return JSONResponse(error_body(str(err), code="weight_update_rejected"), status_code=400)

    @app.exception_handler(BackendClosed)
    @app.exception_handler(ManagerError)
    async def _unavailable(_request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(str(err), error_type(503)), status_code=503)

    # ----------------------------------------------------------- OpenAI API
    async def _generate(request: Request, job: _Job, stream: bool, include_usage: bool, chat: bool):
        prefix = "chatcmpl" if chat else "cmpl"
        response_id, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        seq_ids = server.submit(job, response_id, streaming=stream)
        if stream:
            outputs = backend.open_stream(seq_ids)  # pumps start now, even if the client never reads
            return StreamingResponse(server.stream(job, seq_ids, outputs, response_id, created, chat, include_usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        outputs = await backend.results(seq_ids, disconnected=request.is_disconnected)
        if outputs is None:  # the client left; nobody reads this
            return JSONResponse(error_body("client disconnected"), status_code=499)
        server.raise_failure(outputs)
        build = server.chat_response if chat else server.completion_response
        return JSONResponse(build(job, outputs, response_id, created))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        job = server.completion_job(body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _generate(request, job, body.stream, include_usage, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        job = server.chat_job(body)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _generate(request, job, body.stream, include_usage, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": int(backend.started),
                                            "owned_by": "rollout", "root": server.model_name,
                                            "max_model_len": backend.max_positions}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if backend.healthy() else "unavailable", "paused": backend.paused,
                "weight_version": backend.weight_version}
        return JSONResponse(body, status_code=200 if backend.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await backend.stats()
        return PlainTextResponse(render_metrics(stats, backend.finished, backend.counters, server.model_name),
                                 media_type="text/plain; version=0.0.4")

    # --------------------------------------------------------------- RL API
    @app.get("/weight_version")
    async def weight_version() -> dict:
        return {"weight_version": backend.weight_version}

    @app.post("/update_weights")
    async def update_weights(body: UpdateFromPathRequest) -> dict:
        return {"weight_version": await backend.update_from_path(body.path, body.on_update)}

    @app.post("/update_weights/begin")
    async def update_begin() -> dict:
        return {"update_id": backend.begin_update()}

    @app.post("/update_weights/chunk")
    async def update_chunk(request: Request, update_id: str | None = None) -> dict:
        body = await request.body()
        return {"update_id": update_id, "num_tensors": await backend.add_chunk(update_id, body)}

    @app.post("/update_weights/commit")
    async def update_commit(update_id: str | None = None, on_update: str = "keep",
                            num_tensors: int | None = None) -> dict:
        return {"weight_version": await backend.commit_update(update_id, on_update, num_tensors)}

    @app.post("/update_weights/abort")
    async def update_abort(update_id: str | None = None) -> dict:
        backend.abort_update(update_id)
        return {"aborted": True}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        return {"dropped_blocks": await backend.reset_prefix_cache()}

    @app.post("/pause")
    async def pause() -> dict:
        return {"paused": await backend.pause()}

    @app.post("/resume")
    async def resume() -> dict:
        return {"paused": await backend.resume()}

    return app


# ------------------------------------------------------------------------------------------------ command line
_DTYPES = ("auto", "float32", "float16", "bfloat16")


def build_parser_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` options to `parser` (rollout/cli.py mounts them on its sub-command)."""
    parser.add_argument("--model", required=True, help="local model directory (config, weights, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: --model)")
    parser.add_argument("--dtype", choices=_DTYPES, default="auto", help="weights dtype (auto: the checkpoint's)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV block")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: fill the memory budget)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="token budget per forward pass")
    parser.add_argument("--max-requests-per-batch", type=int, default=None)
    parser.add_argument("--scheduler-type", choices=SCHEDULER_TYPES, default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed for requests that bring none")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def continuous_batching_config_from_args(args: argparse.Namespace) -> ContinuousBatchingConfig:
    kwargs = {name: getattr(args, name, None) for name in ("page_size", "num_blocks", "max_batch_tokens",
                                                           "max_requests_per_batch", "scheduler_type", "seed")}
    return ContinuousBatchingConfig(**{k: v for k, v in kwargs.items() if v is not None})


def load_model(path: str, dtype: str = "auto", device: str | None = None):
    """Model and tokenizer from a local directory; nothing is downloaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def serve(args: argparse.Namespace) -> None:
    """Load the model named by `args.model`, build the app and run uvicorn until interrupted."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, tokenizer = load_model(args.model, args.dtype, getattr(args, "device", None))
    name = args.served_model_name or args.model
    app = create_app(model, tokenizer, name, continuous_batching_config_from_args(args), model_aliases=[args.model])
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


__all__ = ["RolloutServer", "build_parser_args", "create_app", "load_model", "serve"]
