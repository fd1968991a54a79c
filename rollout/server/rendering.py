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

from rollout.engine.request import RequestOutput, RequestStatus
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
    return [None if v != v else max(min(v, 9999.0), -9999.0) for v in values]


class ResponseRenderer:
    """Builds response bodies for one served model; `weight_version` is read when a body is built."""

    def __init__(self, tokenizer, model_name: str, weight_version: Callable[[], int]) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._weight_version = weight_version

    # ------------------------------------------------------------ pieces
    def text_tracker(self, job: Job, choice: int) -> CompletionText:
        """Completions decode after some prompt context (it continues the prompt's text); chat content stands alone."""
        context = () if job.chat else job.prompt_of(choice).ids
        return CompletionText(self.tokenizer, job.params.stop_strings or (), job.stop_ids, context)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def echo_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.ids)

    @staticmethod
    def rollout_tokens(out: RequestOutput, start: int = 0) -> RolloutTokens:
        return RolloutTokens(token_ids=out.generated_tokens[start:], logprobs=json_floats(out.logprobs[start:]),
                             policy_logprobs=json_floats(out.policy_logprobs[start:]),
                             kept_logmass=json_floats(out.kept_logmass[start:]),
                             weight_versions=out.weight_versions[start:])

    def completion_logprobs(self, out: RequestOutput, job: Job, start: int, offset: int,
                            prompt: Prompt | None = None) -> CompletionLogprobs:
        """OpenAI's legacy logprobs object for generated tokens [start:], text offsets counted from `offset`.

        Tokens are decoded one by one, so `text_offset` ignores separators a tokenizer adds between tokens (an
        approximation; decoding every prefix would be quadratic in the completion length).
        """
        tokens: list[str] = []
        logprobs: list[float | None] = []
        if prompt is not None:  # echo: prompt tokens first, without logprobs (the engine computes none for them)
            tokens += [self._token_text(t) for t in prompt.ids]
            logprobs += [None] * len(prompt.ids)
        new = out.generated_tokens[start:]
        tokens += [self._token_text(t) for t in new]
        logprobs += json_floats(out.logprobs[start:start + len(new)])
        offsets, pos = [], offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top = [None if lp is None else ({tok: lp} if job.top_logprobs > 0 else {}) for tok, lp in zip(tokens, logprobs)]
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)

    def chat_logprobs(self, out: RequestOutput, job: Job, start: int = 0) -> ChatLogprobs:
        content = []
        for tok_id, lp in zip(out.generated_tokens[start:], json_floats(out.logprobs[start:])):
            tok = self._token_text(tok_id)
            top = ChatTopLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")))
            content.append(ChatTokenLogprob(**top.model_dump(), top_logprobs=[top] if job.top_logprobs > 0 else []))
        return ChatLogprobs(content=content)

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
        logprobs = self.completion_logprobs(out, job, 0, 0, prompt if job.echo else None) if job.logprobs else None
        return CompletionChoice(index=index, text=prefix + text, logprobs=logprobs, finish_reason=out.finish_reason,
                                **self.extras(job, index, out, 0, rollout=job.logprobs))

    def _chat_choice(self, job: Job, index: int, out: RequestOutput) -> ChatChoice:
        text = self.text_tracker(job, index).full_text(out.generated_tokens, out.finish_reason)
        return ChatChoice(index=index, message=ChatMessage(content=text),
                          logprobs=self.chat_logprobs(out, job) if job.logprobs else None,
                          finish_reason=out.finish_reason, **self.extras(job, index, out, 0, rollout=job.logprobs))

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
        new_logprobs = job.logprobs and end > start
        common = dict(index=i, finish_reason=out.finish_reason if finished else None,
                      **renderer.extras(job, i, out, start, rollout=new_logprobs))
        if job.chat:
            logprobs = renderer.chat_logprobs(out, job, start) if new_logprobs else None
            return self.wrap([ChatStreamChoice(delta=ChatDelta(content=delta or None), logprobs=logprobs, **common)])
        logprobs = renderer.completion_logprobs(out, job, start, self.offsets[i]) if new_logprobs else None
        self.offsets[i] += len(delta)
        return self.wrap([CompletionChoice(text=delta, logprobs=logprobs, **common)])
