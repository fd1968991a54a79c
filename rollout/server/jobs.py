"""OpenAI requests translated into what the engine runs: checked prompts and one SamplingParams.

Every rule that the engine also applies is the engine's own (`rollout.validation` for prompts and ranges, through
`check_prompt`, `check_fits` and the engine's `validate_sampling`), so a request that passes here is not failed later,
and a bad one gets a 400 naming its OpenAI field. What is checked here only is what the OpenAI surface adds (model
name, prompt shapes, chat messages, fields this server refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollout.openai_params import sampling_name
from rollout.sampling_params import SamplingParams
from rollout.seeding import SeedStream, derive_seed
from rollout.server.backend import ServerBackend
from rollout.server.errors import OpenAIError, from_invalid_request
from rollout.server.protocol import ChatCompletionRequest, CompletionRequest
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
        self.eos_ids = sorted(_eos_ids(gen_config, engine.model_eos, tokenizer))

    # ------------------------------------------------------------------ jobs
    def completion_job(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        if req.suffix:
            raise OpenAIError("'suffix' is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise OpenAIError("'best_of' other than n is not supported by this server.", param="best_of")
        if req.logprobs is not None and req.logprobs < 0:
            raise OpenAIError(f"Invalid value for 'logprobs': must be >= 0, got {req.logprobs}.", param="logprobs")
        prompts = self.completion_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        params, stop_ids = self.sampling(req, max_tokens)
        for prompt in prompts:
            self.check_prompt(prompt.ids, max_tokens, "prompt")
        return Job(prompts, params, stop_ids, chat=False, logprobs=req.logprobs is not None,
                   top_logprobs=req.logprobs or 0, return_token_ids=req.return_token_ids, echo=req.echo)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise OpenAIError("Invalid value for 'top_logprobs': must be in [0, 20].", param="top_logprobs")
        prompt = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self._default_max_tokens(len(prompt.ids))
        params, stop_ids = self.sampling(req, max_tokens)
        self.check_prompt(prompt.ids, max_tokens, "messages")
        return Job([prompt], params, stop_ids, chat=True, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                   return_token_ids=req.return_token_ids)

    # --------------------------------------------------------------- checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise OpenAIError(f"The model {name!r} does not exist; this server serves {self.model_name!r}.",
                              param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        """The engine's prompt rule, plus the server's promise that the whole completion fits the context and the
        KV cache (the engine alone would cut it short at the context end or fail it later)."""
        backend = self.backend
        try:
            check_prompt(ids, backend.vocab_size, backend.max_positions)
            check_fits(len(ids), max_tokens, backend.max_positions, backend.kv_capacity_tokens)
        except InvalidRequestError as err:
            raise from_invalid_request(err, param) from err

    def sampling(self, req: CompletionRequest | ChatCompletionRequest,
                 max_tokens: int | None) -> tuple[SamplingParams, set[int]]:
        """OpenAI fields -> SamplingParams (validated by the engine's rule), and the stop ids of the text."""
        for name in _UNSUPPORTED_PENALTIES:
            if getattr(req, name):
                raise OpenAIError(f"Invalid value for '{name}': is not supported by this server (use "
                                  "repetition_penalty).", param=name)
        if req.logit_bias:
            raise OpenAIError("Invalid value for 'logit_bias': is not supported by this server.", param="logit_bias")
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
        }
        params = SamplingParams(do_sample=temperature > 0, eos_token_id=None if req.ignore_eos else
                                (self.eos_ids or None), **{sampling_name(k): v for k, v in openai_fields.items()})
        try:  # the engine's own validation, so nothing that passes here fails later in the engine
            self.backend.engine.validate_sampling(params)
        except InvalidRequestError as err:
            raise from_invalid_request(err, "prompt") from err
        stop_ids = set(stop_token_ids) | (set() if req.ignore_eos else set(self.eos_ids))
        return params, stop_ids

    def _default_max_tokens(self, prompt_len: int) -> int:
        """Chat's default: the rest of the context (and of the KV cache), as OpenAI and vLLM do."""
        room = self.backend.kv_capacity_tokens - prompt_len
        if self.backend.max_positions is not None:
            room = min(room, self.backend.max_positions - prompt_len)
        return max(room, 1)

    # -------------------------------------------------------------- prompts
    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def completion_prompts(self, prompt: Any) -> list[Prompt]:
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
                out.append(Prompt(self._tokenize(item), item))
            elif isinstance(item, list) and all(_is_int(x) for x in item):
                out.append(Prompt([int(x) for x in item]))
            else:
                raise OpenAIError("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                                  "token-id lists.", param="prompt")
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        """The messages rendered by the tokenizer's chat template, ending with the assistant turn's opening."""
        if not req.messages:
            raise OpenAIError("'messages' must be a non-empty list.", param="messages")
        messages = [_text_message(i, m) for i, m in enumerate(req.messages)]
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
        return Prompt([int(t) for t in ids])


def _text_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """Message `i` with its content as one string (OpenAI content parts: only text ones are supported)."""
    if not isinstance(message.get("role"), str):
        raise OpenAIError(f"messages[{i}] has no 'role'.", param=f"messages[{i}].role")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content):
            raise OpenAIError("Only text content parts are supported.", param=f"messages[{i}].content")
        return {**message, "content": "".join(texts)}
    if content is not None and not isinstance(content, str):
        raise OpenAIError("Message content must be a string or a list of text parts.",
                          param=f"messages[{i}].content")
    return message


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
