"""Weight updates over HTTP: a checkpoint on the server's disk, or a chunked upload staged as its chunks arrive.

Staging (reading files, validating, converting dtypes) runs on ordinary worker threads, so it never delays a cancel
or a metrics scrape. The commit is `RolloutGenerator.apply_staged_update`, the same step an in-process
`update_weights` ends with, run on the backend's control thread: the in-place copy and the version bump happen at a
step boundary, all at once or not at all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.rl.generator import RolloutGenerator
from rollout.rl.weights import (
    StagedPairs,
    StagedUpdate,
    WeightUpdateError,
    check_on_update,
    iter_safetensors,
    load_safetensors_bytes,
    stage_update,
)

logger = logging.getLogger(__name__)

UPLOAD_TTL_S = 3600.0  # an upload neither committed nor aborted for this long is dropped at the next begin


@dataclass
class Upload:
    """A chunked weight upload: each chunk is validated and staged on arrival; commit applies them all at once."""

    update_id: str
    staged: StagedUpdate
    created: float = field(default_factory=time.monotonic)
    num_tensors: int = 0
    num_chunks: int = 0
    error: str | None = None  # set by the first bad chunk: the upload can only be aborted then
    lock: threading.Lock = field(default_factory=threading.Lock)


class WeightUpdates:
    """The server's weight updates for one generator; `counters` holds weight_updates and weight_update_failures."""

    def __init__(self, generator: RolloutGenerator,
                 run_on_control: Callable[..., Awaitable[Any]]) -> None:
        self.generator = generator
        self._run_on_control = run_on_control
        self._uploads: dict[str, Upload] = {}
        self._uploads_lock = threading.Lock()
        self.counters: Counter[str] = Counter()

    async def from_path(self, path: str, on_update: str = "keep") -> int:
        """Load every *.safetensors file in `path` (or the one file), validate all, then apply atomically."""
        check_on_update(on_update)
        model = self.generator.model
        staged = await self._staging(lambda: stage_update(model, iter_safetensors(path)))
        return await self._commit(staged, on_update)

    def begin(self) -> str:
        """Open an upload; returns its id (uploads left open past UPLOAD_TTL_S are dropped now)."""
        now = time.monotonic()
        with self._uploads_lock:
            for uid in [u for u, up in self._uploads.items() if now - up.created > UPLOAD_TTL_S]:
                logger.warning("dropping weight upload %s: neither committed nor aborted within %.0fs", uid,
                               UPLOAD_TTL_S)
                del self._uploads[uid]
            update_id = uuid.uuid4().hex
            self._uploads[update_id] = Upload(update_id, StagedUpdate(self.generator.model))
        return update_id

    async def add_chunk(self, update_id: str | None, body: bytes) -> int:
        """Validate and stage one safetensors chunk; returns the tensors received so far."""
        upload = self._upload(update_id)
        return await self._staging(lambda: self._stage_chunk(upload, body))

    async def commit(self, update_id: str | None, on_update: str = "keep", num_tensors: int | None = None) -> int:
        """Apply every staged chunk at once, or nothing: returns the new weight version."""
        check_on_update(on_update)
        upload = self._upload(update_id, pop=True)
        with upload.lock:
            if upload.error is not None:
                raise WeightUpdateError(f"update {upload.update_id} was rejected: {upload.error}")
            if num_tensors is not None and num_tensors != upload.num_tensors:
                raise WeightUpdateError(f"the client sent {num_tensors} tensors but {upload.num_tensors} arrived in "
                                        f"{upload.num_chunks} chunks of update {upload.update_id}; refusing a "
                                        "partial update")
            staged = upload.staged.pairs()
        return await self._commit(staged, on_update)

    def abort(self, update_id: str | None) -> None:
        """Drop an upload and what it staged."""
        self._upload(update_id, pop=True)

    # ------------------------------------------------------------ helpers
    def _upload(self, update_id: str | None, pop: bool = False) -> Upload:
        with self._uploads_lock:
            upload = self._uploads.pop(update_id, None) if pop else self._uploads.get(update_id)
        if upload is None:
            raise WeightUpdateError(f"unknown weight update id {update_id!r}: begin one with POST "
                                    "/update_weights/begin (uploads end at commit or abort)")
        return upload

    @staticmethod
    def _stage_chunk(upload: Upload, body: bytes) -> int:
        with upload.lock:
            if upload.error is not None:
                raise WeightUpdateError(f"update {upload.update_id} already failed: {upload.error}; abort it and "
                                        "start again")
            try:
                tensors = load_safetensors_bytes(body, f"chunk {upload.num_chunks} of update {upload.update_id}")
                upload.staged.add(tensors)  # adapter-only chunks stage nothing, which is fine until commit
            except WeightUpdateError as err:
                upload.error = str(err)  # poisoned: commit will refuse, the old weights stay
                raise
            upload.num_tensors += len(tensors)
            upload.num_chunks += 1
            return upload.num_tensors

    async def _staging(self, stage: Callable[[], Any]) -> Any:
        """Run a staging step on a worker thread, counting its rejection."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, stage)
        except WeightUpdateError:
            self.counters["weight_update_failures"] += 1
            raise

    async def _commit(self, staged: StagedPairs, on_update: str) -> int:
        version = await self._run_on_control(self.generator.apply_staged_update, staged, on_update)
        self.counters["weight_updates"] += 1
        logger.info("weights updated to version %d (%d tensors)", version, len(staged))
        return version
