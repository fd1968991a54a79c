"""Weight updates over HTTP: a checkpoint under the server's weights directories, or a chunked upload staged as its
chunks arrive.

Staging (reading files, validating, converting dtypes) runs on ordinary worker threads, so it never delays a cancel
or a metrics scrape. The commit is `RolloutGenerator.apply_staged_update`, the same step an in-process
`update_weights` ends with, run on the backend's control thread: the in-place copy and the version bump happen at a
step boundary, all at once or not at all.

An upload is all-or-nothing too: any failure in any chunk (a bad tensor, an unreadable body, a body over the size
left, even an unexpected exception) fails the whole upload, frees what it staged, and its commit is refused. Uploads
are bounded in number (`max_uploads` open at once), in bytes (`max_upload_bytes` each) and in idle time
(`upload_ttl_s`); a chunk for an unknown upload is refused before its body is read.
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
from pathlib import Path
from typing import Any, NoReturn

from starlette.exceptions import HTTPException
from starlette.requests import Request

from rollout.rl.generator import RolloutGenerator
from rollout.rl.weights import (
    StagedPairs,
    StagedUpdate,
    WeightUpdateError,
    check_on_update,
    iter_safetensors,
    load_safetensors_bytes,
    safetensors_files,
    stage_update,
    target_tensors,
)
from rollout.server.errors import OpenAIError
from rollout.server.limits import read_body
from rollout.server.settings import ServerSettings

logger = logging.getLogger(__name__)

CHUNK_PATH = "/update_weights/chunk"  # the one POST route with a binary body
FAILED_KEPT = 16  # failed uploads remembered (to explain a refused commit) before the oldest is forgotten


@dataclass
class Upload:
    """A chunked weight upload: each chunk is validated and staged on arrival; commit applies them all at once."""

    update_id: str
    staged: StagedUpdate | None  # None once the upload failed: what it staged is freed
    touched: float  # last activity (WeightUpdates.clock), for the idle limit
    num_tensors: int = 0
    num_chunks: int = 0
    num_bytes: int = 0
    error: str | None = None  # set by the first failure: the upload can only be aborted (or committed, refused)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.staged = None


class WeightUpdates:
    """The server's weight updates for one generator; `counters` holds weight_updates and weight_update_failures."""

    def __init__(self, generator: RolloutGenerator, run_on_control: Callable[..., Awaitable[Any]],
                 settings: ServerSettings | None = None) -> None:
        self.generator = generator
        self.settings = settings or ServerSettings()
        self._run_on_control = run_on_control
        self._uploads: dict[str, Upload] = {}
        self.clock: Callable[[], float] = time.monotonic  # the time source of the upload TTL (tests drive it)
        self._uploads_lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.max_upload_bytes = self.settings.max_upload_bytes or _float64_size(generator.model)
        self.roots = [Path(root).resolve() for root in self.settings.weights_dirs]

    # ---------------------------------------------------------------- from a path
    async def from_path(self, path: str, on_update: str = "keep") -> int:
        """Load every *.safetensors file of `path` (under a weights directory), validate all, then apply atomically."""
        check_on_update(on_update)
        files = self._checkpoint_files(path)
        model = self.generator.model
        try:
            staged = await self._staging(lambda: stage_update(model, iter_safetensors(files)))
        except WeightUpdateError:
            self.counters["weight_update_failures"] += 1
            raise
        return await self._commit(staged, on_update)

    def _checkpoint_files(self, path: str) -> list[Path]:
        """The checkpoint's files if `path` (absolute, or relative to a weights directory) lies under a weights
        directory, symlinks resolved. Every refused path gets the same answer: it says nothing about the disk."""
        if not self.roots:
            self._fail("loading weights from a server path is disabled: start the server with --weights-dir DIR, or "
                       "upload the weights (/update_weights/begin, /chunk, /commit)")
        for root in self.roots:
            try:
                candidate = (root / path).resolve()
                found = candidate.is_relative_to(root) and candidate.exists()
            except (OSError, ValueError):  # a name too long, a NUL byte: refused like any other path
                continue
            if found:
                try:
                    files = safetensors_files(candidate)  # inside a root, "no safetensors files here" may be said
                except WeightUpdateError as err:
                    self._fail(str(err))
                if all(f.resolve().is_relative_to(root) for f in files):
                    return files
        self._fail(f"{path!r} is not a checkpoint under the server's weights directories")

    # ---------------------------------------------------------------- uploads
    def begin(self) -> str:
        """Open an upload; returns its id. 429 when `max_uploads` are already open (expired ones are dropped now)."""
        with self._uploads_lock:
            self._drop_expired()
            open_now = sum(up.error is None for up in self._uploads.values())
            if open_now >= self.settings.max_uploads:
                raise OpenAIError(f"{open_now} weight uploads are already open (the limit is "
                                  f"{self.settings.max_uploads}); commit or abort one first",
                                  status_code=429, code="too_many_uploads")
            update_id = uuid.uuid4().hex
            self._uploads[update_id] = Upload(update_id, StagedUpdate(self.generator.model), touched=self.clock())
        return update_id

    async def add_chunk(self, update_id: str, request: Request) -> int:
        """Read, validate and stage one safetensors chunk; returns the tensors received so far. The upload is
        looked up before the body is read, and the body may not exceed what is left of the upload's byte limit."""
        upload = self._upload(update_id)
        if upload.error is not None:
            raise WeightUpdateError(f"update {update_id} already failed: {upload.error}; abort it and start again")
        what = f"chunk {upload.num_chunks} of update {update_id}"
        left = self.max_upload_bytes - upload.num_bytes
        try:
            body = await read_body(request, left, what)
        except HTTPException as err:
            reason = (f"{what} is over the {left} bytes left of the {self.max_upload_bytes} one upload may hold "
                      "(--max-upload-bytes)")
            self._poison(upload, reason)
            raise HTTPException(err.status_code, reason, headers=err.headers) from err
        return await self._staging(lambda: self._stage_chunk(upload, body, what))

    async def commit(self, update_id: str, on_update: str = "keep", num_tensors: int | None = None) -> int:
        """Apply every staged chunk at once, or nothing: returns the new weight version."""
        check_on_update(on_update)
        upload = self._upload(update_id, pop=True)
        with upload.lock:
            if upload.error is not None:
                raise WeightUpdateError(f"update {upload.update_id} was rejected: {upload.error}")
            if num_tensors is not None and num_tensors != upload.num_tensors:
                self.counters["weight_update_failures"] += 1
                raise WeightUpdateError(f"the client sent {num_tensors} tensors but {upload.num_tensors} arrived in "
                                        f"{upload.num_chunks} chunks of update {upload.update_id}; refusing a "
                                        "partial update")
            staged = upload.staged.pairs()
        return await self._commit(staged, on_update)

    def abort(self, update_id: str) -> None:
        """Drop an upload and what it staged."""
        self._upload(update_id, pop=True)

    @property
    def num_open(self) -> int:
        """Uploads that may still be committed (failed ones are kept only to explain the refusal)."""
        with self._uploads_lock:
            return sum(up.error is None for up in self._uploads.values())

    # ---------------------------------------------------------------- helpers
    def _upload(self, update_id: str, pop: bool = False) -> Upload:
        with self._uploads_lock:
            self._drop_expired()
            upload = self._uploads.pop(update_id, None) if pop else self._uploads.get(update_id)
        if upload is None:
            raise WeightUpdateError(f"unknown weight update id {update_id!r}: begin one with POST "
                                    "/update_weights/begin (uploads end at commit or abort, or after "
                                    f"{self.settings.upload_ttl_s:g} s without a chunk)")
        upload.touched = self.clock()
        return upload

    def _drop_expired(self) -> None:
        """Forget uploads idle past the TTL, and failed ones beyond FAILED_KEPT, oldest first (caller holds the
        uploads lock)."""
        now, ttl = self.clock(), self.settings.upload_ttl_s
        for uid in [uid for uid, up in self._uploads.items() if now - up.touched > ttl]:
            logger.warning("dropping weight upload %s: no chunk, commit or abort within %gs", uid, ttl)
            self._uploads.pop(uid).fail("expired")
        failed = [uid for uid, up in self._uploads.items() if up.error is not None]
        for uid in failed[:max(0, len(failed) - FAILED_KEPT)]:
            del self._uploads[uid]

    def _stage_chunk(self, upload: Upload, body: bytes, what: str) -> int:
        """Stage one chunk; any failure fails the whole upload (the old weights stay, commit will refuse)."""
        with upload.lock:
            if upload.error is not None:
                raise WeightUpdateError(f"update {upload.update_id} already failed: {upload.error}; abort it and "
                                        "start again")
            try:
                if upload.num_bytes + len(body) > self.max_upload_bytes:
                    raise WeightUpdateError(f"{what} brings update {upload.update_id} past "
                                            f"{self.max_upload_bytes} bytes, the most one upload may hold")
                tensors = load_safetensors_bytes(body, what)
                upload.staged.add(tensors)  # adapter-only chunks stage nothing, which is fine until commit
            except Exception as err:
                reason = str(err) if isinstance(err, WeightUpdateError) else f"{what} could not be staged: {err!r}"
                self._poison(upload, reason)
                raise WeightUpdateError(reason) from err
            upload.num_tensors += len(tensors)
            upload.num_chunks += 1
            upload.num_bytes += len(body)
            return upload.num_tensors

    def _poison(self, upload: Upload, reason: str) -> None:
        if upload.error is None:
            logger.warning("weight upload %s failed: %s", upload.update_id, reason)
            self.counters["weight_update_failures"] += 1
        upload.fail(reason)

    def _fail(self, reason: str) -> NoReturn:
        self.counters["weight_update_failures"] += 1
        raise WeightUpdateError(reason)

    @staticmethod
    async def _staging(stage: Callable[[], Any]) -> Any:
        """Run a staging step on a worker thread; any failure is a rejected update (400), never a half-applied one."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, stage)
        except WeightUpdateError:
            raise
        except Exception as err:  # a corrupt file that safetensors fails to read half-way, say
            logger.exception("staging a weight update failed")
            raise WeightUpdateError(f"the update could not be staged: {err!r}") from err

    async def _commit(self, staged: StagedPairs, on_update: str) -> int:
        version = await self._run_on_control(self.generator.apply_staged_update, staged, on_update)
        self.counters["weight_updates"] += 1
        logger.info("weights updated to version %d (%d tensors)", version, len(staged))
        return version


def _float64_size(model) -> int:
    """Bytes of the model's tensors at 8 bytes each (tied tensors once): the default upload limit, which any full
    update in any floating dtype fits."""
    return 8 * sum({t.data_ptr(): t.numel() for t in target_tensors(model).values()}.values())


__all__ = ["CHUNK_PATH", "Upload", "WeightUpdates"]
