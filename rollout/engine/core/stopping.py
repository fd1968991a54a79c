"""When a sequence stops: the one rule, applied after every sampled token."""

from __future__ import annotations

from rollout.engine.core.request import Request


class StopChecker:
    """Decides whether a sequence is done after its newest token: "stop" (EOS, a stop token or a stop string, once
    `min_new_tokens` are out; or a structured output whose grammar is complete with only a stop token left to
    follow), "length" (`max_new_tokens`, or the model's last position), or None to go on."""

    def __init__(self, max_positions: int | None = None, tokenizer=None) -> None:
        self.max_positions = max_positions
        self.tokenizer = tokenizer  # only needed for stop strings (validated at submission)

    def __call__(self, req: Request) -> str | None:
        p = req.sampling
        if req.num_generated >= p.min_new_tokens:
            token = req.tokens[-1]
            if token in p.eos_token_ids or token in p.stop_token_ids:
                return "stop"
            if p.stop_strings and self._hit_stop_string(req):
                return "stop"
        if req.grammar is not None and req.grammar.done:
            return "stop"
        if req.num_generated >= p.max_new_tokens:
            return "length"
        if self.max_positions is not None and len(req.tokens) >= self.max_positions:
            return "length"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        """Decode just enough of the tail to see a stop string that ends at the newest token."""
        window = max(len(s) for s in req.sampling.stop_strings) + 2
        tail = self.tokenizer.decode(req.generated_tokens[-window:], skip_special_tokens=False)
        return any(s in tail for s in req.sampling.stop_strings)
