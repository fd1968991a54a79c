"""RolloutClient: a trainer's handle on a remote rollout server (generation with the RL logprob contract, weight sync).

OpenAI clients cover plain generation; this client adds what a training loop needs and they lack: per-token
`policy_logprobs`, `kept_logmass` and `weight_versions`, and weight updates streamed from the trainer's model in
safetensors chunks (so no request body has to hold the whole model, and the server applies all or nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from rollout.openai_params import to_openai
from rollout.rl.weights import WeightUpdateError

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * 1024**2


class RolloutServerError(RuntimeError):
    """The server answered with an error (its OpenAI-style error body is in `body`)."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class RolloutClient:
    """Synchronous client for `rollout.server`. Thread-safe (httpx.Client is); use as a context manager."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float | None = 600.0,
                 model: str | None = None, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
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

    # ----------------------------------------------------------------- weights
    def weight_version(self) -> int:
        return int(self._request("GET", "/weight_version")["weight_version"])

    def update_weights_from_path(self, path: str, on_update: str = "keep") -> int:
        """Make the server load a safetensors checkpoint directory from its own disk; returns the new version."""
        return int(self._request("POST", "/update_weights", error=WeightUpdateError,
                                 json={"path": str(path), "on_update": on_update})["weight_version"])

    def update_weights_from_model(self, model, chunk_bytes: int = DEFAULT_CHUNK_BYTES, on_update: str = "keep",
                                  dtype=None) -> int:
        """Stream `model`'s weights to the server in safetensors chunks and apply them atomically.

        `model`: an nn.Module, a state dict or an iterable of (name, tensor) pairs (HF names; wrapper prefixes and
        PEFT names are mapped by the server). Each chunk holds about `chunk_bytes` (a larger tensor goes alone).
        `dtype` casts before sending (e.g. torch.bfloat16 to halve the traffic; the server casts to its own dtype).
        Raises WeightUpdateError if the server rejects the update; its weights and version are then unchanged.
        """
        from safetensors.torch import save

        update_id = self._request("POST", "/update_weights/begin")["update_id"]
        sent = 0
        try:
            for chunk in _chunks(model, chunk_bytes, dtype):
                self._request("POST", "/update_weights/chunk", error=WeightUpdateError,
                              params={"update_id": update_id}, content=save(chunk),
                              headers={"Content-Type": "application/octet-stream"})
                sent += len(chunk)
            version = self._request("POST", "/update_weights/commit", error=WeightUpdateError,
                                    params={"update_id": update_id, "on_update": on_update, "num_tensors": sent})
        except BaseException:
            try:  # best effort: free the server's staged copy (a failed commit already dropped it)
                self._http.post("/update_weights/abort", params={"update_id": update_id})
            except httpx.HTTPError:
                logger.debug("abort of weight update %s failed", update_id, exc_info=True)
            raise
        return int(version["weight_version"])

    # ----------------------------------------------------------------- control
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return int(self._request("POST", "/reset_prefix_cache")["dropped_blocks"])

    def pause(self) -> None:
        """Park generation at a step boundary: running requests wait, new ones queue."""
        self._request("POST", "/pause")

    def resume(self) -> None:
        self._request("POST", "/resume")


def _chunks(source, chunk_bytes: int, dtype=None) -> Iterator[dict]:
    """Dicts of CPU tensors of about `chunk_bytes` each, ready for safetensors.

    Tensors sharing storage (tied weights) are sent once: the server copies into shared storage once anyway, and
    safetensors refuses shared tensors in one file. Views are cloned so each tensor owns exactly its bytes.
    """
    from rollout.rl.weights import iter_named_tensors

    seen: set[tuple] = set()
    chunk: dict = {}
    size = 0
    for name, tensor in iter_named_tensors(source):
        tensor = tensor.detach()
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))
        if key in seen:
            continue
        seen.add(key)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk


__all__ = ["RolloutClient", "RolloutServerError"]
