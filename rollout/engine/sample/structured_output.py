"""Structured outputs: a request's JSON schema, regex, EBNF grammar or list of choices, enforced token by token.

xgrammar (an optional dependency, imported on first use) compiles a spec against the engine's tokenizer once per
distinct spec (`GrammarCompiler` keeps an LRU cache, so n samples and repeated requests share one compilation). Each
sequence owns a matcher (`GrammarState`) that advances with every token the scheduler accepts. Each step the sampler
fills the token bitmasks of all constrained rows in one call and applies them to the logits in place
(`GrammarMasker`; on CUDA the bitmask is copied over from pinned memory and applied by xgrammar's kernel). A sequence
ends with "stop" as soon as its grammar is complete and nothing but a stop token may follow, without spending a step
on that token.

Preemption and recompute keep a sequence's tokens (only its KV is recomputed), so its matcher keeps its state; before
each fill the matcher is synced to the sequence's generated tokens, and rolled back if it is ahead of them.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rollout.validation import InvalidRequestError

if TYPE_CHECKING:
    from rollout.sampling_params import SamplingParams

KINDS = ("json_schema", "regex", "grammar", "choice")  # the SamplingParams fields that ask for a structured output
_CACHE_SIZE = 256  # compiled grammars kept per engine
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:94: " in its errors


def require_xgrammar():
    """The xgrammar module, or an ImportError that says how to install it."""
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError("structured outputs (json_schema, regex, grammar, choice) need xgrammar: "
                          "pip install 'rollout[structured]'") from err
    return xgrammar


@dataclass(frozen=True)
class StructuredOutput:
    """What a request asked its output to match: `kind` is one of KINDS, `spec` its canonical text."""

    kind: str
    spec: str


def structured_output(params: SamplingParams) -> StructuredOutput | None:
    """The structured output `params` asks for (at most one kind), checked for shape; None if none."""
    asked = [kind for kind in KINDS if getattr(params, kind) is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(f"Invalid sampling parameters: {' and '.join(asked)} are both set; a request can "
                                  "follow one structured output, so pass only one of them.", asked[1])
    kind = asked[0]
    value = getattr(params, kind)
    if kind == "json_schema":
        return StructuredOutput(kind, _schema_text(value))
    if kind == "choice":
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or not all(
                isinstance(c, str) and c for c in value):
            raise _invalid("choice", f"must be a non-empty list of non-empty strings, got {value!r}")
        return StructuredOutput(kind, json.dumps(list(value), ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise _invalid(kind, f"must be a non-empty string, got {value!r}")
    return StructuredOutput(kind, value)


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid sampling parameters: {param} {message}.", param)


def _schema_text(schema) -> str:
    if isinstance(schema, Mapping):
        return json.dumps(schema, ensure_ascii=False)  # key order kept: it is the order properties are generated in
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as err:
            raise _invalid("json_schema", f"is not valid JSON ({err})") from None
        if isinstance(parsed, dict):
            return schema
    raise _invalid("json_schema", f"must be a JSON schema object (a dict or its JSON text), got {schema!r:.80}")


# ------------------------------------------------------------------------------------------------ compiling


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A compiled spec and the ids that end the request's text; each sequence gets its own matcher from it."""

    grammar: Any  # xgrammar.CompiledGrammar
    stop_ids: tuple[int, ...]
    vocab_size: int

    def new_state(self) -> GrammarState:
        return GrammarState(self)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary; one per engine, safe to use from several threads."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = require_xgrammar()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # our cache bounds the count
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # compilations actually run (cache misses)

    def compile(self, spec: StructuredOutput, stop_ids: Iterable[int]) -> CompiledConstraint:
        """The spec compiled (or taken from the cache), ending on `stop_ids` (the tokenizer's EOS if empty).
        InvalidRequestError naming the field when the spec does not compile."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
        if grammar is None:
            grammar = self._compile(spec)
            with self._lock:
                self._cache[spec] = grammar
                self.num_compiled += 1
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        stops = tuple(sorted(set(stop_ids))) or tuple(self.info.stop_token_ids)
        if not stops:
            raise _invalid(spec.kind, "needs a token that ends the output, but the request has no EOS or stop token "
                                      "ids and the tokenizer defines no EOS; pass eos_token_id or stop_token_ids")
        return CompiledConstraint(grammar, stops, self.vocab_size)

    def _compile(self, spec: StructuredOutput):
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                # Compact JSON (", " and ": " separators, no free whitespace): a model cannot stall in whitespace.
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                          for c in choices))
            return compiler.compile_grammar(spec.spec)
        except Exception as err:  # xgrammar reports a spec it cannot take as RuntimeError (and a few ValueErrors)
            reason = _XGRAMMAR_LOCATION.sub("", str(err).strip())
            raise _invalid(spec.kind, f"could not be compiled: {reason}") from None


# -------------------------------------------------------------------------------------------------- matching


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool [vocab_size] tensor from one row of an xgrammar bitmask (bit j of word w is token 32 w + j)."""
    bits = (bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].bool()


class GrammarState:
    """One sequence's matcher: the grammar state after the tokens it generated so far."""

    def __init__(self, constraint: CompiledConstraint) -> None:
        xgr = require_xgrammar()
        self.constraint = constraint
        self.matcher = xgr.GrammarMatcher(constraint.grammar, override_stop_tokens=list(constraint.stop_ids))
        self.num_accepted = 0
        self.done = False  # the grammar is complete and only a stop token (or nothing) may follow

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the matcher is then unchanged)."""
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        self.done = self.matcher.is_terminated() or (self.matcher.is_completed() and self._only_stops_remain())
        return True

    def sync(self, num_generated: int) -> None:
        """Match the sequence's generated tokens: roll back what it no longer has."""
        if self.num_accepted > num_generated:
            self.matcher.rollback(self.num_accepted - num_generated)
            self.num_accepted = num_generated
            self.done = False
        elif self.num_accepted < num_generated:
            raise RuntimeError(f"grammar matcher behind its sequence ({self.num_accepted} < {num_generated} tokens)")

    def _only_stops_remain(self) -> bool:
        xgr = require_xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.constraint.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        allowed = allowed_tokens(bitmask[0], self.constraint.vocab_size)
        allowed[list(self.constraint.stop_ids)] = False
        return not bool(allowed.any())


class GrammarMasker:
    """Fills and applies the bitmasks of a step's constrained rows; owned by the sampler (keeps one buffer)."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on the first step with several constrained rows
        self._pinned = False
        self._copied = None  # torch.cuda.Event: the last copy of the pinned buffer to the GPU

    def apply(self, logits: torch.Tensor, states: list[GrammarState], rows: list[int],
              num_generated: list[int]) -> None:
        """Mask `logits[rows[i]]` in place to what `states[i]` allows next: one fill call for all of them."""
        xgr = require_xgrammar()
        for state, count in zip(states, num_generated):
            state.sync(count)
        num_rows, vocab = logits.shape
        on_cuda = logits.device.type == "cuda"
        bitmask = self.buffer(num_rows, vocab, pinned=on_cuda)
        if len(states) == 1:
            states[0].matcher.fill_next_token_bitmask(bitmask, rows[0])
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, rows)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=on_cuda)
            if on_cuda:
                self._copied = torch.cuda.Event()
                self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)

    def buffer(self, num_rows: int, vocab: int, pinned: bool) -> torch.Tensor:
        """The host bitmask to fill, rows indexed like the logits, reused while it fits. For a GPU it is page-locked,
        so the copy over is a DMA queued behind the step's work (from pageable memory the driver first stages it in a
        buffer of its own); as that copy may still be in flight, a refill first waits for it (in practice long done:
        the step's results were read since). A buffer dropped mid-copy is safe: torch's pinned-memory cache keeps it
        until its copies finish."""
        xgr = require_xgrammar()
        words = -(-vocab // 32)
        b = self._bitmask
        if b is None or b.shape[0] < num_rows or b.shape[1] != words or self._pinned != pinned:
            b = xgr.allocate_token_bitmask(num_rows, vocab)
            self._bitmask, self._pinned, self._copied = (b.pin_memory() if pinned else b), pinned, None
        if self._copied is not None:
            self._copied.synchronize()
        return self._bitmask
