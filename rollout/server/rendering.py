"""Engine outputs rendered as OpenAI responses: whole completion and chat bodies, and SSE streams of chunks.

Every body is a `protocol` response model; the RL extensions (`rollout`, `token_ids`, `prompt_token_ids`) are added
by one helper for all three shapes, so a non-streamed choice and the chunks of a streamed one always agree.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel

from rollout.engine.core.request import RequestOutput, RequestStatus
from rollout.server.errors import OpenAIError, from_failed_output
from rollout.server.jobs import Job, Prompt
from rollout.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
    RolloutTokens,
    Usage,
)
from rollout.server.routing import RoutedRequest
from rollout.server.text import CompletionText

SSE_DONE = "data: [DONE]\n\n"
StreamChunk = CompletionStreamResponse | ChatCompletionStreamResponse


def sse(body: BaseModel | dict) -> str:
    """One server-sent event carrying `body` as compact JSON."""
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body, separators=(",", ":"))
    return f"data: {data}\n\n"


def json_floats(values: Sequence[float]) -> list[float | None]:
    """JSON has no infinities: -inf becomes -9999.0 (as vLLM reports it), NaN becomes null."""
    return [json_float(v) for v in values]


def json_float(value: float) -> float | None:
    return None if value != value else max(min(value, 9999.0), -9999.0)


def api_logprobs(out: RequestOutput) -> tuple[list[float], list[dict[int, float]]]:
    """What the OpenAI `logprobs` fields report per generated token: the model's own fp32 log_softmax(logits), at
    temperature 1 and before any logits processor (vLLM's default), and its top alternatives. Not the sampled
    distribution's logprob, which is 0 for a greedy token: that one, with the rest of the RL contract, is in the
    `rollout` extension."""
    if out.raw_logprobs is None:  # the request did not ask for logprobs
        return list(out.logprobs), [{} for _ in out.logprobs]
    return out.raw_logprobs, out.raw_top_logprobs or [{} for _ in out.raw_logprobs]


class ResponseRenderer:
    """Builds response bodies for one served model; `weight_version` is read when a body is built."""

    def __init__(self, tokenizer, model_name: str, weight_version: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._weight_version = weight_version
        self._texts: dict[int, str] = {}  # token id -> its text decoded alone (bounded by the vocabulary)

    # ------------------------------------------------------------ pieces
    def text_tracker(self, job: Job, choice: int) -> CompletionText:
        """Completions decode after some prompt context (it continues the prompt's text); chat content stands alone."""
        context = () if job.chat else job.prompt_of(choice).ids
        return CompletionText(self.tokenizer, job.params.stop_strings or (), job.stop_ids, context)

    def _token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def echo_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)

    @staticmethod
    def rollout_tokens(out: RequestOutput, start: int = 0) -> RolloutTokens:
        return RolloutTokens(token_ids=out.generated_tokens[start:], logprobs=json_floats(out.logprobs[start:]),
                             policy_logprobs=json_floats(out.policy_logprobs[start:]),
                             kept_logmass=json_floats(out.kept_logmass[start:]),
                             weight_versions=out.weight_versions[start:])

    def completion_logprobs(self, out: RequestOutput, job: Job, start: int, offset: int | None,
                            prompt: Prompt | None = None) -> CompletionLogprobs:
        """OpenAI's legacy logprobs object: with `prompt` (echo) the prompt's tokens first, from text offset 0, then
        the generated tokens [start:] from text offset `offset` (None: right after the prompt's tokens).

        Values are the model's own log_softmax(logits) (see `api_logprobs`). `top_logprobs` has the `logprobs` most
        likely tokens plus the token itself (so up to logprobs + 1 entries, as OpenAI says); the first prompt token
        has no logprob (null). Tokens are decoded one by one and `text_offset` adds up their lengths, as vLLM does
        (exact for byte-level tokenizers; one that joins tokens with separators has offsets that ignore them).
        """
        body = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        pos = 0
        if prompt is not None:
            pos = self._add_legacy(body, prompt.ids, out.prompt_logprobs or [], out.prompt_top_logprobs, 0)
        new = out.generated_tokens[start:]
        values, alternatives = api_logprobs(out)
        self._add_legacy(body, new, values[start:start + len(new)], alternatives[start:start + len(new)],
                         pos if offset is None else offset)
        return body

    def _add_legacy(self, body: CompletionLogprobs, ids: Sequence[int], values: Sequence[float | None],
                    alternatives: Sequence[dict[int, float] | None] | None, pos: int) -> int:
        """Append tokens `ids` with their logprobs to a legacy logprobs object; returns the text offset after them."""
        for i, token in enumerate(ids):
            text = self._token_text(token)
            value = values[i] if i < len(values) else None
            top = None
            if value is not None:
                top = {}
                for alt, alt_value in ((alternatives[i] if alternatives else None) or {}).items():
                    top.setdefault(self._token_text(alt), json_float(alt_value))  # the likelier of equal texts
                top.setdefault(text, json_float(value))
            body.tokens.append(text)
            body.token_logprobs.append(None if value is None else json_float(value))
            body.top_logprobs.append(top)
            body.text_offset.append(pos)
            pos += len(text)
        return pos

    def chat_logprobs(self, out: RequestOutput, job: Job, start: int = 0) -> ChatLogprobs:
        """Chat's logprobs: per generated token the model's own logprob (see `api_logprobs`) and its `top_logprobs`
        most likely tokens, most likely first."""
        values, alternatives = api_logprobs(out)
        content = []
        for i, token in enumerate(out.generated_tokens[start:], start):
            text = self._token_text(token)
            top = [self._chat_entry(alt, value) for alt, value in list(alternatives[i].items())[:job.top_logprobs]]
            content.append(ChatTokenLogprob(token=text, logprob=json_float(values[i]), bytes=list(text.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chat_entry(self, token: int, value: float) -> ChatTopLogprob:
        text = self._token_text(token)
        return ChatTopLogprob(token=text, logprob=json_float(value), bytes=list(text.encode()))

    def extras(self, job: Job, choice: int, out: RequestOutput, start: int, rollout: bool) -> dict[str, Any]:
        """The RL extensions of a choice (or of a chunk covering tokens [start:]) that the request asked for."""
        extras: dict[str, Any] = {}
        if rollout:
            extras["rollout"] = self.rollout_tokens(out, start)
        if job.return_token_ids:
            extras["token_ids"] = out.generated_tokens[start:]
            if start == 0:
                extras["prompt_token_ids"] = job.prompt_of(choice).ids
        return extras

    @staticmethod
    def usage(job: Job, outputs: Sequence[RequestOutput]) -> Usage:
        prompt_tokens = sum(len(p.ids) for p in job.prompts)
        completion_tokens = sum(len(o.generated_tokens) for o in outputs)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    # ----------------------------------------------------------- whole bodies
    def response(self, job: Job, outputs: list[RequestOutput], response_id: str,
                 created: int) -> CompletionResponse | ChatCompletionResponse:
        """The non-streamed body of a finished job (every output FINISHED or CANCELLED)."""
        head = dict(id=response_id, created=created, model=self.model_name, usage=self.usage(job, outputs),
                    system_fingerprint=f"weights-v{self._weight_version()}")
        if job.chat:
            return ChatCompletionResponse(**head, choices=[self._chat_choice(job, i, out)
                                                           for i, out in enumerate(outputs)])
        return CompletionResponse(**head, choices=[self._completion_choice(job, i, out)
                                                   for i, out in enumerate(outputs)])

    def _completion_choice(self, job: Job, index: int, out: RequestOutput) -> CompletionChoice:
        prompt = job.prompt_of(index)
        text = self.text_tracker(job, index).full_text(out.generated_tokens, out.finish_reason)
        prefix = self.echo_text(prompt) if job.echo else ""
        logprobs = self.completion_logprobs(out, job, 0, None if job.echo else 0,
                                            prompt if job.echo else None) if job.logprobs else None
        return CompletionChoice(index=index, text=prefix + text, logprobs=logprobs, finish_reason=out.finish_reason,
                                **self.extras(job, index, out, 0, rollout=job.logprobs))

    def _chat_choice(self, job: Job, index: int, out: RequestOutput) -> ChatChoice:
        text = self.text_tracker(job, index).full_text(out.generated_tokens, out.finish_reason)
        message, finish_reason = ChatMessage(content=text), out.finish_reason
        if job.tool_call is not None:  # a forced tool call comes back as tool_calls
            message, finish_reason = job.tool_call.message(text, out.finish_reason)
        return ChatChoice(index=index, message=message,
                          logprobs=self.chat_logprobs(out, job) if job.logprobs else None,
                          finish_reason=finish_reason, **self.extras(job, index, out, 0, rollout=job.logprobs))

    # --------------------------------------------------------------- streams
    async def stream(self, job: Job, routed: RoutedRequest, response_id: str, created: int,
                     include_usage: bool) -> AsyncIterator[str]:
        """SSE events: an opening chunk per choice, one chunk per new piece of text (or tokens), the final chunk of
        each choice, usage if asked, then [DONE]. A failed sequence ends the stream with an error event.

        However this generator ends (the client went away included), unfinished sequences are cancelled.
        """
        chunks = _StreamState(self, job, response_id, created)
        try:
            async with aclosing(routed) as outputs:
                for i in range(routed.num_choices):
                    opening = chunks.opening(i)
                    if opening is not None:
                        yield sse(opening)
                async for i, out in outputs:
                    if out.status == RequestStatus.FAILED:
                        raise from_failed_output(out)
                    chunk = chunks.update(i, out)
                    if chunk is not None:
                        yield sse(chunk)
        except OpenAIError as err:
            yield sse(err.body())
        else:
            if include_usage:
                yield sse(chunks.wrap([], self.usage(job, chunks.finals())))
        yield SSE_DONE


class _StreamState:
    """What one stream has sent so far per choice, and the chunk each new output adds to it."""

    def __init__(self, renderer: ResponseRenderer, job: Job, response_id: str, created: int) -> None:
        self.renderer = renderer
        self.job = job
        self.head = dict(id=response_id, created=created, model=renderer.model_name)
        self.texts: dict[int, CompletionText] = {}
        self.emitted: dict[int, int] = {}  # generated tokens already reported, per choice
        self.offsets: dict[int, int] = {}  # text offset for legacy logprobs, per choice
        self.echo_logprobs: set[int] = set()  # choices whose echoed prompt's logprobs are still to send
        self._finals: dict[int, RequestOutput] = {}

    def wrap(self, choices: list, usage: Usage | None = None) -> StreamChunk:
        if self.job.chat:
            return ChatCompletionStreamResponse(**self.head, choices=choices, usage=usage)
        return CompletionStreamResponse(**self.head, choices=choices, usage=usage)

    def finals(self) -> list[RequestOutput]:
        return [self._finals[i] for i in sorted(self._finals)]

    def opening(self, i: int) -> StreamChunk | None:
        """The role (chat) or the echoed prompt (completions with echo) before any token; None if neither."""
        self.texts[i] = self.renderer.text_tracker(self.job, i)
        self.emitted[i] = self.offsets[i] = 0
        if self.job.chat:
            return self.wrap([ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
        if self.job.echo:
            prefix = self.renderer.echo_text(self.job.prompt_of(i))
            self.offsets[i] = len(prefix)
            if self.job.logprobs:  # they come with the first chunk after the prefill
                self.echo_logprobs.add(i)
            return self.wrap([CompletionChoice(index=i, text=prefix)])
        return None

    def update(self, i: int, out: RequestOutput) -> StreamChunk | None:
        """The chunk for choice i's new output, or None when it adds nothing yet (text held back, no new token)."""
        job, renderer = self.job, self.renderer
        finished = out.is_finished()
        delta = self.texts[i].delta(out.generated_tokens, finished, out.finish_reason)
        start, end = self.emitted[i], len(out.generated_tokens)
        if not delta and start == end and not finished:
            return None
        self.emitted[i] = end
        if finished:
            self._finals[i] = out
        prompt = job.prompt_of(i) if i in self.echo_logprobs else None
        self.echo_logprobs.discard(i)
        new_logprobs = job.logprobs and (end > start or prompt is not None)
        common = dict(index=i, finish_reason=out.finish_reason if finished else None,
                      **renderer.extras(job, i, out, start, rollout=new_logprobs))
        if job.chat:
            logprobs = renderer.chat_logprobs(out, job, start) if new_logprobs else None
            return self.wrap([ChatStreamChoice(delta=ChatDelta(content=delta or None), logprobs=logprobs, **common)])
        logprobs = renderer.completion_logprobs(out, job, start, self.offsets[i], prompt) if new_logprobs else None
        self.offsets[i] += len(delta)
        return self.wrap([CompletionChoice(text=delta, logprobs=logprobs, **common)])
