"""Sampling: a request's settings resolved once, logits processors and structured outputs, the sampler, and
the logprob records (top alternatives, prompt logprobs) as plain data."""
