"""RolloutClient: a trainer's handle on a remote rollout server (generation with the RL logprob contract, weight sync).

OpenAI clients cover plain generation; this client adds what a training loop needs and they lack: per-token
`policy_logprobs`, `kept_logmass` and `weight_versions`, and weight updates streamed from the trainer's model in
safetensors chunks (so no request body has to hold the whole model, and the server applies all or nothing).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from rollout.openai_params import to_openai
from rollout.rl.weights import WeightUpdateError, cpu_tensors

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * 1024**2
API_KEY_ENV = "ROLLOUT_API_KEY"  # the same variables `rollout serve` reads its keys from
ADMIN_KEY_ENV = "ROLLOUT_ADMIN_KEY"


class RolloutServerError(RuntimeError):
    """The server answered with an error (its OpenAI-style error body is in `body`)."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class RolloutClient:
    """Synchronous client for `rollout.server`. Thread-safe (httpx.Client is); use as a context manager.

    `api_key` (default: $ROLLOUT_API_KEY) goes with generation and metrics requests, `admin_key` (default:
    $ROLLOUT_ADMIN_KEY) with the RL control requests (weight updates, pause, resume, prefix-cache reset).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float | None = 600.0,
                 model: str | None = None, api_key: str | None = None, admin_key: str | None = None) -> None:
        api_key = api_key or os.environ.get(API_KEY_ENV) or None
        admin_key = admin_key or os.environ.get(ADMIN_KEY_ENV) or None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        self._model = model

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ basics
    def _request(self, method: str, path: str, error: type[Exception] | None = None, **kwargs) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                body = response.json()
                message = body.get("error", {}).get("message") or response.text
            except ValueError:
                body, message = None, response.text
            if error is not None and response.status_code == 400:
                raise error(message)
            raise RolloutServerError(response.status_code, message, body)
        return response.json()

    def _control(self, path: str, error: type[Exception] | None = None, body: dict | None = None, **kwargs) -> Any:
        """POST to an RL control route: the admin key, and a JSON body (the server refuses any other)."""
        headers = {**self._admin_headers, **kwargs.pop("headers", {})}
        if "content" not in kwargs:
            kwargs["json"] = body or {}
        return self._request("POST", path, error=error, headers=headers, **kwargs)

    def health(self) -> dict:
        """The server's /health body; raises RolloutServerError when it is unhealthy."""
        return self._request("GET", "/health")

    def model(self) -> str:
        """The served model name (fetched once)."""
        if self._model is None:
            self._model = self._request("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def metrics(self) -> str:
        response = self._http.get("/metrics")
        response.raise_for_status()
        return response.text

    # -------------------------------------------------------------- generation
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], n: int = 1,
                 **sampling: Any) -> list[dict]:
        """n completions per prompt, prompt-major, each a dict with the RL contract per token.

        `prompts`: one prompt or a list; each is text or token ids. `sampling`: OpenAI completion fields
        (max_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, ...); the
        SamplingParams names max_new_tokens, stop_strings and min_new_tokens are accepted too (see
        `rollout.openai_params`).
        Returns dicts with prompt_index, prompt_ids, completion_ids, text, logprobs, policy_logprobs, kept_logmass,
        weight_versions, finish_reason.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        body = to_openai(sampling)
        body.update(model=self.model(), prompt=[p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                    n=n, logprobs=0, return_token_ids=True, stream=False)
        response = self._request("POST", "/v1/completions", json=body)
        samples = []
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            rollout = choice["rollout"]
            samples.append({
                "prompt_index": choice["index"] // n,
                "prompt_ids": choice["prompt_token_ids"],
                "completion_ids": choice["token_ids"],
                "text": choice["text"],
                "logprobs": rollout["logprobs"],
                "policy_logprobs": rollout["policy_logprobs"],
                "kept_logmass": rollout["kept_logmass"],
                "weight_versions": rollout["weight_versions"],
                "finish_reason": choice["finish_reason"],
            })
        return samples

    def score(self, prompts: Sequence[str | Sequence[int]], completions: Sequence[str | Sequence[int]],
              temperature: float = 1.0, top_logprobs: int = 0) -> dict:
        """Per-token logprobs of given completions under the server's current weights (POST /score_completions):
        `completions[j]` follows `prompts[j]`; each is text or token ids. Returns the response body: `data` (per
        pair: index, prompt_token_ids, token_ids, logprobs and, with top_logprobs, {token id: logprob} per position)
        and the `weight_version` they were computed under."""
        body = {"model": self.model(), "temperature": temperature, "top_logprobs": top_logprobs,
                "prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
                "completions": [c if isinstance(c, str) else [int(t) for t in c] for c in completions]}
        return self._request("POST", "/score_completions", json=body)

    # ----------------------------------------------------------------- weights
    def weight_version(self) -> int:
        return int(self._request("GET", "/weight_version")["weight_version"])

    def update_weights_from_path(self, path: str, on_update: str = "keep") -> int:
        """Make the server load a safetensors checkpoint directory from its own disk; returns the new version."""
        return int(self._control("/update_weights", WeightUpdateError,
                                 {"path": str(path), "on_update": on_update})["weight_version"])

    def update_weights_from_model(self, model, chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_update: str = "keep",
                                  dtype=None) -> int:
        """Stream `model`'s weights to the server in safetensors chunks and apply them atomically.

        `model`: an nn.Module, a state dict or an iterable of (name, tensor) pairs (HF names; wrapper prefixes and
        PEFT names are mapped by the server). Each chunk holds about `chunk_bytes` (a larger tensor goes alone).
        `dtype` casts before sending (e.g. torch.bfloat16 to halve the traffic; the server casts to its own dtype).
        Raises WeightUpdateError if the server rejects the update; its weights and version are then unchanged.
        """
        from safetensors.torch import save

        update_id = self.begin_weight_update()
        sent = 0
        try:
            for chunk in weight_chunks(model, chunk_bytes, dtype):
                self.send_weight_chunk(update_id, save(chunk))
                sent += len(chunk)
            return self.commit_weight_update(update_id, sent, on_update)
        except BaseException:
            self.abort_weight_update(update_id)
            raise

    # The steps of `update_weights_from_model`, for callers that stage one update on several servers before
    # committing it on any (rollout.distributed.RolloutServerPool).
    def begin_weight_update(self) -> str:
        """Open a chunked upload on the server; returns its update id."""
        return self._control("/update_weights/begin")["update_id"]

    def send_weight_chunk(self, update_id: str, body: bytes) -> int:
        """Stage one safetensors file (`safetensors.torch.save` of a `weight_chunks` chunk); WeightUpdateError if
        the server refuses it (the upload is then failed as a whole)."""
        return int(self._control("/update_weights/chunk", WeightUpdateError, params={"update_id": update_id},
                                 content=body, headers={"Content-Type": "application/octet-stream"})["num_tensors"])

    def commit_weight_update(self, update_id: str, num_tensors: int, on_update: str = "keep") -> int:
        """Apply everything the upload staged at once; returns the new weight version."""
        version = self._control("/update_weights/commit", WeightUpdateError,
                                {"update_id": update_id, "on_update": on_update, "num_tensors": num_tensors})
        return int(version["weight_version"])

    def abort_weight_update(self, update_id: str) -> None:
        """Best effort: free what the server staged for the upload (a failed commit already dropped it)."""
        try:
            self._http.post("/update_weights/abort", json={"update_id": update_id}, headers=self._admin_headers)
        except httpx.HTTPError:
            logger.debug("abort of weight update %s failed", update_id, exc_info=True)

    # ----------------------------------------------------------------- control
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return int(self._control("/reset_prefix_cache")["dropped_blocks"])

    def pause(self) -> None:
        """Park generation at a step boundary: running requests wait, new ones queue (and get a 503 once the pause
        outlasts the server's --pause-timeout)."""
        self._control("/pause")

    def resume(self) -> None:
        self._control("/resume")


def weight_chunks(source, chunk_bytes: int = DEFAULT_CHUNK_BYTES, dtype=None) -> Iterator[dict]:
    """Dicts of CPU tensors of about `chunk_bytes` each, ready for safetensors.

    Tensors come from `rollout.rl.weights.cpu_tensors`: each owns exactly its bytes, a stream's are
    copies (it may overwrite them once the next is read), and a module's tied weights come once (the server copies
    into shared storage once anyway, and safetensors refuses shared tensors in one file).
    """
    chunk: dict = {}
    size = 0
    for name, tensor in cpu_tensors(source, dtype):
        if chunk and size + tensor.nbytes > chunk_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += tensor.nbytes
    if chunk:
        yield chunk


__all__ = ["RolloutClient", "RolloutServerError", "weight_chunks"]
