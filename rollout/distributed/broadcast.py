"""Weight broadcast to many engines: gather once, publish once, then validate everywhere before applying anywhere.

One update reaches every worker or none. Phase one stages it on every worker (the same validation as an in-process
`update_weights`: names, shapes, dtypes, finiteness) without touching live weights; only when every worker accepted
does phase two commit it (the in-place copy and the version bump). A rejection anywhere drops what the others staged
and raises one WeightUpdateError that names each refusing worker and its reason.

How the tensors travel is a `WeightTransport`. The default puts them into the Ray object store once, as raw bytes
(numpy arrays are zero-copy there), so each worker on a node maps the same shared memory and copies straight into its
live parameters. For GPU workers an NCCL transport fits the same seam: see docs/scaling.md.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch

from rollout.rl.weights import WeightUpdateError, cpu_tensors

logger = logging.getLogger(__name__)

Packed = dict[str, tuple[str, tuple[int, ...], np.ndarray]]  # name -> (torch dtype name, shape, raw bytes)


def collect_weights(source, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole update gathered once (see `cpu_tensors`), ready to publish."""
    return dict(cpu_tensors(source, dtype))


def pack(state: Mapping[str, torch.Tensor]) -> Packed:
    """Tensors as raw byte arrays (any dtype, bfloat16 and float8 included), which the object store shares
    without copying."""
    packed: Packed = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        packed[name] = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw)
    return packed


def unpack(packed: Packed) -> dict[str, torch.Tensor]:
    """The tensors of `pack`, as read-only views of the arrays (nothing is copied until the update is applied)."""
    out = {}
    with warnings.catch_warnings():  # the object store's arrays are read-only; we only ever read them
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name, (dtype, shape, raw) in packed.items():
            if raw.size == 0:  # an empty array has no strides to view through
                out[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                continue
            out[name] = torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return out


class WeightTransport(Protocol):
    """How an update's tensors get from the trainer to every worker; the pool calls, in this order:

    `publish(state)` in the trainer's process, once per update: what each worker's `receive` is given (Ray resolves an
    ObjectRef argument before the worker sees it); then every worker's `receive(payload)`, inside its staging call;
    then `send(state)` in the trainer's process, once every worker has been asked to stage. A collective transport
    (NCCL over a process group of the trainer and the workers: docs/scaling.md) publishes names, shapes and dtypes,
    has each worker receive into GPU buffers, and broadcasts in `send`; validation and the two-phase commit stay as
    they are.
    """

    def publish(self, state: dict[str, torch.Tensor]) -> Any: ...

    def send(self, state: dict[str, torch.Tensor]) -> None: ...

    def receive(self, payload: Any) -> Mapping[str, torch.Tensor]: ...


class ObjectStoreTransport:
    """The default: the update is put into the Ray object store once; every worker maps it and copies in place."""

    def publish(self, state: dict[str, torch.Tensor]) -> Any:
        import ray

        return ray.put(pack(state))

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing left to send: `publish` put everything into the object store."""

    def receive(self, payload: Packed) -> Mapping[str, torch.Tensor]:
        return unpack(payload)


def rejection(problems: Mapping[str, str], version: int, total: int) -> WeightUpdateError:
    """The one error of an update that some workers refused: who refused and why; nobody applied it."""
    listed = "; ".join(f"{who}: {why}" for who, why in problems.items())
    return WeightUpdateError(f"weight update rejected by {len(problems)} of {total} workers, so none applied it (all "
                             f"stay at weight version {version}): {listed}")
