"""StepPlan: the one plain description of a step that the scheduler hands to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.engine.core.request import Request


@dataclass
class StepPlan:
    """Which tokens of which requests to run this step.

    Entry `i` runs `query_lens[i]` tokens of `requests[i]` starting at position `start_positions[i]`; its KV for
    positions `[0, start + query_len)` lives in the slots of `block_tables[i]` (one table per KV group).
    `sample_rows` lists the entries whose pending tokens are all covered by this step: their last position yields
    logits and a new token. `sampled[j]` draws a token from logits row `logit_rows[j]` (an index into `sample_rows`): a
    group's sequences that fork off a prefill all draw from their leader's row.

    Two kinds of entries ask for something else: `prefilled` lists those whose pending tokens are all covered but that
    sample nothing (`max_new_tokens=0`: they finish after this step, and need no logits), and each
    `prompt_rows` item `(entry, first, count)` asks for the logits at positions `[first, first + count)` of that entry
    (they give the logprobs of the prompt tokens that follow them: see prompt_logprobs.py).
    """

    requests: list[Request] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    registered_blocks: list[int] = field(default_factory=list)  # published in the prefix cache by this step
    prefilled: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def decode_only(self) -> bool:
        """Every entry runs one token (token i is entry i): the step a decode-only compiled path serves."""
        return all(n == 1 for n in self.query_lens)

    def add(self, request: Request, num_tokens: int) -> None:
        start = request.num_computed
        self.requests.append(request)
        self.token_ids.extend(request.tokens[start:start + num_tokens])
        self.query_lens.append(num_tokens)
        self.start_positions.append(start)
        self.block_tables.append(request.block_tables)
        entry = len(self.requests) - 1
        if start + num_tokens == len(request.tokens):
            (self.prefilled if request.sampling.max_new_tokens == 0 else self.sample_rows).append(entry)
        if request.needs_prompt_logprobs:
            first = max(start, len(request.prompt_logprobs) - 1)
            end = min(start + num_tokens, len(request.prompt_ids) - 1)
            if first < end:
                self.prompt_rows.append((entry, first, end - first))
