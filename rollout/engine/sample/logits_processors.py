"""Per-request logits processors: everything that shapes a request's distribution before temperature and truncation.

Order, as transformers' `generate` applies them: repetition penalty, logit bias, the masks (allowed token ids, bad
words, the min-new-tokens stop mask), the request's own `logits_processors`, and last the structured-output grammar
(so nothing re-enables a token the grammar forbids). Built-ins are a few tensor operations over all the rows that use
them; rows whose requests use none are never touched, and a batch where no request uses any skips this module.

A request's own processor that raises, returns something that is not a logits row, or leaves no token to sample fails
that request alone (the error names the processor), never the step.

Index tensors are built on the host, where the requests' token ids are, and copied to the logits' device without
waiting on it; masks are scattered there, so no rows x vocab tensor is ever built on the host. Which rows a mask left
nothing to sample is only read with the step's results (`ProcessedLogits.dead`): no sync of its own.

The logprob identity `logprobs = policy_logprobs - kept_logmass` holds under masking processors (allowed ids, bad
words, min new tokens, grammars, or a processor of your own that only sets -inf): the sampled distribution is then the
policy restricted to the kept tokens, renormalised. Repetition penalty, logit bias and processors that change values
break it (the sampler still reports the log of the kept policy mass as `kept_logmass`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor

from rollout.engine.sample.processor_specs import PAD_ID, processor_name
from rollout.engine.sample.rows import SampleRow
from rollout.engine.sample.structured_output import GrammarMasker

_NEG_INF = float("-inf")
_DEAD_ROW = ("its logits processors left no token to sample (every token was masked, or a processor produced NaN or "
             "+inf); loosen allowed_token_ids / bad_words_ids / min_new_tokens or the structured-output spec")


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`. The copy is queued without waiting: a blocking host-to-device copy
    synchronises with the device's stream (the source is pageable memory, which the driver stages before returning,
    so it may be freed at once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

# ------------------------------------------------------------------------------------------------- applying


@dataclass
class ProcessedLogits:
    """The logits after every row's processors, and what the sampler must know about the rows."""

    logits: torch.Tensor  # the input tensor itself when no row was touched
    touched: list[int] = field(default_factory=list)  # rows any processor ran on (the others are the input's)
    narrowed: list[int] = field(default_factory=list)  # rows a mask may have narrowed: kept_logmass covers them
    errors: dict[int, str] = field(default_factory=dict)  # rows whose request fails, with why
    checked: list[int] = field(default_factory=list)  # rows `dead` flags
    dead: torch.Tensor | None = None  # on the device, per checked row: nothing left to sample (see _fail_dead_rows)

    def fail_dead(self, dead: Sequence[bool]) -> None:
        """Fail the checked rows whose flag in `dead` (the flags, read on the host) is set."""
        for row, is_dead in zip(self.checked, dead):
            if is_dead:
                self.errors[row] = _DEAD_ROW


def apply_processors(logits: torch.Tensor, rows: Sequence[SampleRow],
                     grammar: GrammarMasker | None = None) -> ProcessedLogits:
    """Every row's processors, in transformers' order. The input is left untouched (a copy is processed). `grammar`
    fills and applies the structured-output bitmasks (the sampler passes its own, which keeps its buffer)."""
    active = [i for i, r in enumerate(rows) if r.processed]
    if not active:
        return ProcessedLogits(logits)
    result = ProcessedLogits(logits.clone(), touched=active)
    _repetition_penalty(result.logits, rows, active)
    _add_logit_bias(result.logits, rows, active)
    _apply_masks(result, rows, active)
    _apply_custom(result, rows, active)
    constrained = [i for i in active if rows[i].grammar is not None]
    if constrained:
        states = [rows[i].grammar for i in constrained]
        (grammar or GrammarMasker()).apply(result.logits, states, constrained,
                                           [rows[i].num_generated for i in constrained])
        result.narrowed.extend(constrained)
    _fail_dead_rows(result, logits)
    return result


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.long, device)


def _owners(rows: list[int], parts: list[torch.Tensor]) -> torch.Tensor:
    """The row each element of `torch.cat(parts)` belongs to (on the host, like the parts)."""
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor([len(p) for p in parts]))


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def _repetition_penalty(out: torch.Tensor, rows: Sequence[SampleRow], active: list[int]) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor over prompt + generated tokens, for all penalised rows at once:
    the scores of the tokens each row has seen are read, penalised and written back, never a rows x vocab mask. A
    token seen twice is written twice with the same value."""
    sel = [i for i in active if rows[i].sampling.repetition_penalty != 1.0]
    if not sel:
        return
    history = [torch.as_tensor(rows[i].tokens, dtype=torch.long) for i in sel]
    local = _owners(list(range(len(sel))), history)  # each history token's place in `sel`
    penalty = torch.tensor([rows[i].sampling.repetition_penalty for i in sel], dtype=out.dtype)[local]
    at = (_moved(torch.tensor(sel, dtype=torch.long)[local], out.device), _moved(torch.cat(history), out.device))
    penalty, scores = _moved(penalty, out.device), out[at]
    out[at] = torch.where(scores > 0, scores / penalty, scores * penalty)


def _add_logit_bias(out: torch.Tensor, rows: Sequence[SampleRow], active: list[int]) -> None:
    sel = [i for i in active if rows[i].sampling.processors is not None
           and rows[i].sampling.processors.bias_ids is not None]
    if not sel:
        return
    ids = [rows[i].sampling.processors.bias_ids for i in sel]
    values = _moved(torch.cat([rows[i].sampling.processors.bias_values for i in sel]).to(out.dtype), out.device)
    out.index_put_((_moved(_owners(sel, ids), out.device), _moved(torch.cat(ids), out.device)), values,
                   accumulate=True)


def _apply_masks(result: ProcessedLogits, rows: Sequence[SampleRow], active: list[int]) -> None:
    """Allowed ids, one-token bad words, completed multi-token bad words and the min-new-tokens stop mask: the
    allow-listed rows rebuilt from -inf and their allowed scores, and one index_put of -inf for everything banned."""
    out = result.logits
    banned_rows: list[int] = []
    banned: list[torch.Tensor] = []
    allow_rows: list[int] = []
    allowed: list[torch.Tensor] = []
    sequence_rows: list[int] = []
    for i in active:
        s, row = rows[i].sampling, rows[i]
        if row.num_generated < s.min_new_tokens and s.stop_ids:
            banned_rows.append(i)
            banned.append(torch.tensor(sorted(s.stop_ids), dtype=torch.long))
        pr = s.processors
        if pr is None:
            continue
        if pr.banned_ids is not None:
            banned_rows.append(i)
            banned.append(pr.banned_ids)
        if pr.allowed_ids is not None:
            allow_rows.append(i)
            allowed.append(pr.allowed_ids)
        if pr.bad_prefixes is not None:
            sequence_rows.append(i)
    if sequence_rows:
        owners, targets = _completed_bad_words(rows, sequence_rows)
        if len(targets):
            banned_rows.extend(owners)
            banned.extend(t[None] for t in targets)
    if allow_rows:
        local = _owners(list(range(len(allow_rows))), allowed)
        ids = _moved(torch.cat(allowed), out.device)
        scores = out[_moved(torch.tensor(allow_rows, dtype=torch.long)[local], out.device), ids]
        masked = torch.full((len(allow_rows), out.shape[1]), _NEG_INF, dtype=out.dtype, device=out.device)
        masked[_moved(local, out.device), ids] = scores
        out[_index(allow_rows, out.device)] = masked
    if banned:
        out[_moved(_owners(banned_rows, banned), out.device), _moved(torch.cat(banned), out.device)] = _NEG_INF
    result.narrowed.extend(sorted(set(banned_rows) | set(allow_rows)))


def _completed_bad_words(rows: Sequence[SampleRow], sel: list[int]) -> tuple[list[int], torch.Tensor]:
    """(row, token) for each multi-token bad word whose prefix ends the row's tokens (prompt included, as in
    transformers' NoBadWordsLogitsProcessor): every word of every row compared in one tensor operation, on the host,
    where the words and the tokens are (on the device, reading the hits back would be a sync)."""
    tables = [rows[i].sampling.processors.bad_prefixes for i in sel]
    longest = max(t.shape[1] for t in tables)
    prefixes = torch.cat([F.pad(t, (longest - t.shape[1], 0), value=PAD_ID) for t in tables])
    targets = torch.cat([rows[i].sampling.processors.bad_targets for i in sel])
    tails = torch.tensor([[PAD_ID] * (longest - len(tail)) + tail
                          for tail in (rows[i].tokens[-longest:] for i in sel)], dtype=torch.long)
    owner = _owners(list(range(len(sel))), tables)
    hit = ((prefixes == tails[owner]) | (prefixes == PAD_ID)).all(dim=-1)
    return [sel[j] for j in owner[hit].tolist()], targets[hit]


def _apply_custom(result: ProcessedLogits, rows: Sequence[SampleRow], active: list[int]) -> None:
    """The requests' own processors, position by position. A transformers LogitsProcessor shared by several rows of
    the same length (an n-sample group, or requests built from one SamplingParams) runs once on all of them."""
    sel = [i for i in active if rows[i].sampling.processors is not None and rows[i].sampling.processors.custom]
    if not sel:
        return
    for k in range(max(len(rows[i].sampling.processors.custom) for i in sel)):
        groups: dict[tuple[int, int], list[int]] = {}
        for i in sel:
            procs = rows[i].sampling.processors.custom
            if k < len(procs) and i not in result.errors:
                proc = procs[k]
                key = (id(proc), len(rows[i].tokens)) if isinstance(proc, LogitsProcessor) else (id(proc), ~i)
                groups.setdefault(key, []).append(i)
        for members in groups.values():
            _run_custom(result, rows, members, k)
    result.narrowed.extend(sel)


def _run_custom(result: ProcessedLogits, rows: Sequence[SampleRow], members: list[int], k: int) -> None:
    """Run processor k of `members` (one call for a batchable group); if it fails, each row alone, so only the rows
    it fails on fail."""
    out = result.logits
    proc = rows[members[0]].sampling.processors.custom[k]
    try:
        if isinstance(proc, LogitsProcessor):
            idx = _index(members, out.device)
            ids = to_device([rows[i].tokens for i in members], torch.long, out.device)
            out[idx] = _checked(proc(ids, out[idx]), (len(members), out.shape[1]))
        else:
            (i,) = members
            out[i] = _checked(proc(rows[i].generated, out[i]), (out.shape[1],))
    except Exception as err:
        if len(members) > 1:
            for i in members:
                _run_custom(result, rows, [i], k)
            return
        result.errors[members[0]] = (f"logits processor {processor_name(proc)} failed: {type(err).__name__}: {err} "
                                     "(fix it or drop it from logits_processors)")


def _checked(value, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"returned {got}; a processor must return the logits as a tensor of shape {shape}")
    return value


def _fail_dead_rows(result: ProcessedLogits, logits: torch.Tensor) -> None:
    """Rows whose own processor failed get their raw logits back, so the draw that follows stays well defined (its
    token is discarded). Rows a mask or a processor left with nothing to sample (or with NaN / +inf) are flagged on
    the device (`result.dead`, one max per row: -inf for a fully masked row, NaN if any entry is, +inf if any entry
    is) and fail once the sampler reads the flags with the step's results; they are sampled as they are, which
    disturbs no other row (every operation of the sampler is row by row), and their token is discarded."""
    if result.errors:
        failed = _index(sorted(result.errors), logits.device)
        result.logits[failed] = logits[failed]
    checked = sorted(set(result.narrowed) - set(result.errors))
    if checked:
        top = result.logits[_index(checked, logits.device)].amax(dim=-1)
        result.checked, result.dead = checked, ~(top > _NEG_INF) | (top == float("inf"))
