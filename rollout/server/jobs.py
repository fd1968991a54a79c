"""OpenAI requests translated into what the engine runs: checked prompts and one SamplingParams.

Every rule that the engine also applies is the engine's own (`rollout.validation` for prompts and ranges, through
`check_prompt`, `check_fits` and the engine's `validate_sampling`), so a request that passes here is not failed later,
and a bad one gets a 400 naming its OpenAI field. What is checked here only is what the OpenAI surface adds (model
name, prompt shapes, chat messages, fields this server refuses) and the server's own bounds (`ServerSettings`: `n`
and the sequences of one request), checked before any prompt is tokenized.

Building a job tokenizes and renders templates: callers run it off the event loop (see `serving`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.openai_params import JSON_OBJECT_SCHEMA, sampling_name, structured_output_fields
from rollout.rl.agents.chat_turns import ChatTurns
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed
from rollout.server.backend import ServerBackend
from rollout.server.errors import OpenAIError, from_invalid_request
from rollout.server.protocol import ChatCompletionRequest, ChatMessageParam, CompletionRequest, valid_unicode
from rollout.server.settings import ServerSettings
from rollout.server.tools import ForcedToolCall, forced_tool_call
from rollout.validation import InvalidRequestError, check_fits, check_prompt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
_GEN_CONFIG_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_UNSUPPORTED_PENALTIES = ("presence_penalty", "frequency_penalty")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class Prompt:
    """One prompt after tokenization: its ids and, when it came as text, the text (echo returns it verbatim)."""

    ids: list[int]
    text: str | None = None


@dataclass
class Job:
    """What one HTTP generation request asked for, resolved once and shared by submission and rendering."""

    prompts: list[Prompt]
    params: SamplingParams
    stop_ids: set[int]  # token ids whose final occurrence is cut from the text
    chat: bool
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    echo: bool = False
    tool_call: ForcedToolCall | None = None  # the tool call tool_choice forces (chat), rendered as tool_calls

    @property
    def n(self) -> int:
        return self.params.n

    def prompt_of(self, choice: int) -> Prompt:
        """Choices are prompt-major: the n choices of prompt 0, then those of prompt 1, ..."""
        return self.prompts[choice // self.n]

    def submissions(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt ids, params) per prompt; each prompt gets its own seed, since one seed for all would correlate
        their samples (prompt 0 keeps the request's seed, so it samples as if sent alone)."""
        out = []
        for j, prompt in enumerate(self.prompts):
            params = self.params
            if params.seed is not None:
                params = params.with_overrides(seed=derive_seed(params.seed, j, SeedStream.PROMPT))
            out.append((prompt.ids, params))
        return out


class JobBuilder:
    """Turns completion and chat requests into Jobs, or raises OpenAIError (400) naming the field at fault."""

    def __init__(self, backend: ServerBackend, tokenizer, model_name: str, model_aliases: Sequence[str] = (),
                 settings: ServerSettings | None = None) -> None:
        self.backend = backend
        self.settings = settings or ServerSettings()
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
        self.eos_ids = sorted(_eos_ids(gen_config, engine.model_eos, tokenizer))

    # ------------------------------------------------------------------ jobs
    def completion_job(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        if req.suffix:
            raise OpenAIError("'suffix' is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("'best_of' other than n is not supported by this server.", param="best_of")
        self.check_n(req.n)
        prompts = self.completion_prompts(req.prompt, req.n)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        if max_tokens == 0 and not req.echo:
            raise OpenAIError("Invalid value for 'max_tokens': 0 generates nothing, so it is only allowed with "
                              "echo=true (to get the prompt's logprobs).", param="max_tokens")
        params, stop_ids = self.sampling(req, max_tokens)
        if req.logprobs is not None:  # echo: the prompt's logprobs too, from the same prefill
            params = params.with_overrides(logprobs=req.logprobs, prompt_logprobs=req.logprobs if req.echo else None)
        for prompt in prompts:
            self.check_prompt(prompt.ids, max_tokens, "prompt")
        return Job(prompts, params, stop_ids, chat=False, logprobs=req.logprobs is not None,
                   top_logprobs=req.logprobs or 0, return_token_ids=req.return_token_ids, echo=req.echo)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        self.check_n(req.n)
        prompt = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(prompt.ids))
        tool_call = forced_tool_call(req.tools, req.tool_choice)
        if tool_call is not None and req.stream:
            raise OpenAIError("Streaming a forced tool call (tool_choice \"required\" or a named function) is not "
                              "supported yet; set stream to false.", param="stream")
        if max_tokens == 0:
            raise OpenAIError("Invalid value for max_tokens: must be at least 1.",
                              param="max_tokens" if req.max_completion_tokens is None else "max_completion_tokens")
        params, stop_ids = self.sampling(req, max_tokens, tool_call)
        if req.logprobs:
            params = params.with_overrides(logprobs=req.top_logprobs or 0)
        self.check_prompt(prompt.ids, max_tokens, "messages")
        return Job([prompt], params, stop_ids, chat=True, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                   return_token_ids=req.return_token_ids, tool_call=tool_call)

    # --------------------------------------------------------------- checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                              param="model", code="model_not_found")

    def check_n(self, n: int) -> None:
        """The server's cap on samples per prompt (`--max-n`), checked before any work is done."""
        if n > self.settings.max_n:
            raise OpenAIError(f"Invalid value for 'n': this server allows at most {self.settings.max_n} samples per "
                              f"prompt, got {n}.", param="n")

    def check_choices(self, num_prompts: int, n: int) -> None:
        """The server's cap on the sequences of one request (`--max-choices`): prompts x n."""
        if num_prompts * n > self.settings.max_choices:
            raise OpenAIError(f"This request asks for {num_prompts} prompts x n={n} = {num_prompts * n} sequences; "
                              f"this server allows at most {self.settings.max_choices} per request: split it.",
                              param="prompt")

    def check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        """The engine's prompt rule, plus the server's promise that the whole completion fits the context and the
        KV cache (the engine alone would cut it short at the context end or fail it later)."""
        backend = self.backend
        try:
            check_prompt(ids, backend.vocab_size, backend.max_positions, prefill_only=max_tokens == 0)
            check_fits(len(ids), max_tokens, backend.max_positions, backend.kv_capacity_tokens)
        except InvalidRequestError as err:
            raise from_invalid_request(err, param) from err

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                 tool_call: ForcedToolCall | None = None) -> tuple[SamplingParams, set[int]]:
        """OpenAI fields -> SamplingParams (validated by the engine's rule), and the stop ids of the text."""
        for name in _UNSUPPORTED_PENALTIES:
            if getattr(req, name):
                raise OpenAIError(f"Invalid value for '{name}': is not supported by this server (use "
                                  "repetition_penalty).", param=name)
        structured, source = self.structured_output(req, tool_call)
        vocab = self.backend.vocab_size
        stop_token_ids = list(req.stop_token_ids or [])
        if any(not 0 <= t < vocab for t in stop_token_ids):
            raise OpenAIError(f"Invalid value for 'stop_token_ids': ids must be in [0, {vocab}).",
                              param="stop_token_ids")
        temperature = _or_default(req.temperature, self.defaults.get("temperature", 1.0))
        openai_fields = {
            "temperature": temperature,
            "top_p": _or_default(req.top_p, self.defaults.get("top_p", 1.0)),
            "top_k": _or_default(req.top_k, self.defaults.get("top_k", 0)),
            "min_p": _or_default(req.min_p, self.defaults.get("min_p", 0.0)),
            "repetition_penalty": _or_default(req.repetition_penalty, self.defaults.get("repetition_penalty")),
            "seed": req.seed,
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "stop": ([req.stop] if isinstance(req.stop, str) else list(req.stop or [])) or None,
            "stop_token_ids": stop_token_ids or None,
            "ignore_eos": req.ignore_eos or None,
            "n": req.n,
            "logit_bias": req.logit_bias or None,
        }
        params = SamplingParams(do_sample=temperature > 0, eos_token_id=None if req.ignore_eos else
                                (self.eos_ids or None), **{sampling_name(k): v for k, v in openai_fields.items()},
                                **structured)
        try:  # the engine's own validation, so nothing that passes here fails later in the engine
            self.backend.engine.validate_sampling(params)
        except InvalidRequestError as err:
            if source is not None and err.param in structured:  # name the request field the spec came from
                raise OpenAIError(f"Invalid value for '{source}': {err}", param=source) from err
            raise from_invalid_request(err, "prompt") from err
        stop_ids = set(stop_token_ids) | (set() if req.ignore_eos else set(self.eos_ids))
        return params, stop_ids

    @staticmethod
    def structured_output(req: CompletionRequest | ChatCompletionRequest,
                          tool_call: ForcedToolCall | None) -> tuple[dict[str, Any], str | None]:
        """What the output must follow, as SamplingParams fields, and the request field that asked for it:
        `response_format`, vLLM's `structured_outputs`, or a forced tool call (at most one of them)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_schema": JSON_OBJECT_SCHEMA}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise OpenAIError("Invalid value for 'response_format': type json_schema needs "
                                  "json_schema.schema.", param="response_format")
            asked.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
        if req.structured_outputs is not None:
            spec = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            try:
                asked.append(("structured_outputs", structured_output_fields(spec)))
            except ValueError as err:
                raise OpenAIError(f"Invalid value for 'structured_outputs': {err}", param="structured_outputs") from err
        if tool_call is not None:
            asked.append(("tool_choice", {"json_schema": tool_call.schema}))
        if len(asked) > 1:
            names = " and ".join(f"'{name}'" for name, _ in asked)
            raise OpenAIError(f"{names} each constrain the output; pass only one of them.", param=asked[1][0])
        return (asked[0][1], asked[0][0]) if asked else ({}, None)

    def _default_max_tokens(self, prompt_len: int) -> int:
        """Chat's default: the rest of the context (and of the KV cache), as OpenAI and vLLM do."""
        room = self.backend.kv_capacity_tokens - prompt_len
        if self.backend.max_positions is not None:
            room = min(room, self.backend.max_positions - prompt_len)
        return max(room, 1)

    # -------------------------------------------------------------- prompts
    def _tokenize(self, text: str) -> list[int]:
        try:
            valid_unicode(text)
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        except Exception as err:  # the text is the caller's input: whatever the tokenizer refuses is a 400
            raise OpenAIError(f"The prompt could not be tokenized: {err}", param="prompt") from err

    def completion_prompts(self, prompt: Any, n: int = 1) -> list[Prompt]:
        """Text, list of texts, token ids, or list of token-id lists -> prompts (lists may mix texts and ids).
        Their number is checked (`check_choices`) before any is tokenized."""
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
        self.check_choices(len(items), n)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(Prompt(self._tokenize(item), item))
            elif isinstance(item, list) and all(_is_int(x) for x in item):
                out.append(Prompt([int(x) for x in item]))
            else:
                raise OpenAIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                                  "token-id lists.", param="prompt")
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        """The messages rendered by the tokenizer's chat template, ending with the assistant turn's opening."""
        messages = [_text_message(i, m) for i, m in enumerate(req.messages)]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError("This model's tokenizer has no chat template; use /v1/completions.",
                              param="messages")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:
            kwargs["tools"] = req.tools
        if req.prompt_token_ids is not None:
            return Prompt(list(req.prompt_token_ids) + self._appended(messages, kwargs))
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as err:  # a template error is the caller's input problem
            raise OpenAIError(f"The chat template could not render these messages: {err}",
                              param="messages") from err
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return Prompt([int(t) for t in ids])


    def _appended(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> list[int]:
        """Token in: the ids of messages that follow a conversation given as ids, rendered on their own (the
        conversation is never re-tokenized) and ending with the assistant turn's opening; [] for no messages."""
        if not messages:
            return []
        try:
            return ChatTurns(self.tokenizer, kwargs).render(messages)
        except Exception as err:  # a template error is the caller's input problem
            raise OpenAIError(f"The chat template could not render these messages after prompt_token_ids: {err}",
                              param="messages") from err


def _text_message(i: int, message: ChatMessageParam) -> dict[str, Any]:
    """Message `i` as the chat template takes it, its content as one string (OpenAI content parts: only text ones
    are supported; the protocol model has already checked every type)."""
    data = message.model_dump(exclude_unset=True)
    if isinstance(message.content, list):
        if any(part.type != "text" or part.text is None for part in message.content):
            raise OpenAIError("Only text content parts ({\"type\": \"text\", \"text\": \"...\"}) are supported.",
                              param=f"messages[{i}].content")
        data["content"] = "".join(part.text for part in message.content)
    return data


def _or_default(value: Any, default: Any) -> Any:
    return value if value is not None else default


def _eos_ids(gen_config, model_eos, tokenizer) -> set[int]:
    """Every end-of-sequence id the generation config, the model config and the tokenizer name."""
    eos: set[int] = set()
    for source in (getattr(gen_config, "eos_token_id", None), model_eos, getattr(tokenizer, "eos_token_id", None)):
        if _is_int(source):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(t) for t in source)
    return eos
