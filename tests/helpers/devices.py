"""Catching accelerator bugs without an accelerator.

On a machine with no GPU, `meta` plays the accelerator: a tensor on `meta` has a shape and a dtype but no data, so
every host sync (`.item()`, `.tolist()`, `bool()`, `int()`) on it raises, and so does most arithmetic that mixes it
with a CPU tensor. `DeviceMixChecker` closes the gaps where meta is more lenient than CUDA (indexing, `gather`,
`index_select` with a CPU index): inside it, any torch call whose tensor arguments (0-dim ones aside, which CUDA
accepts from the CPU) lie on more than one device raises `DeviceMixError`, naming the call.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ACCELERATOR = torch.device("meta")


class DeviceMixError(AssertionError):
    """A torch call combined tensors on different devices (it would raise on CUDA)."""


def _devices(args, kwargs) -> set[torch.device]:
    leaves, _ = tree_flatten((args, kwargs or {}))
    return {t.device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}


class DeviceMixChecker(TorchFunctionMode):
    """Raise on any torch call that mixes devices; `calls` counts the torch calls checked (a test can assert the
    code under test ran inside the mode at all)."""

    # Moving a tensor is the one legitimate way to combine devices.
    _MOVES = frozenset({"to", "copy_", "cpu", "cuda", "new_tensor", "__get__", "__set__", "device"})

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        name = getattr(func, "__name__", str(func))
        if name not in self._MOVES:
            devices = _devices(args, kwargs)
            if len(devices) > 1:
                raise DeviceMixError(f"{name} mixes tensors on {sorted(str(d) for d in devices)}")
        return func(*args, **(kwargs or {}))


class HostToDeviceCounter(TorchFunctionMode):
    """Record every copy of host data onto another device: `.to`/`.cuda` of a CPU tensor, `copy_` from one, and
    `torch.tensor`/`as_tensor`/`new_tensor` built off the CPU. On CUDA each is a transfer of its own (a blocking one
    from pageable memory), so a test can hold a step to a fixed number. `moves` lists `(call, shape)`."""

    _FROM_HOST = frozenset({"tensor", "as_tensor", "asarray", "new_tensor"})

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        source = args[1] if name == "copy_" else args[0] if args else None
        from_host = name in self._FROM_HOST or (
            name in ("to", "cuda", "copy_") and isinstance(source, torch.Tensor) and source.device.type == "cpu")
        if from_host and isinstance(out, torch.Tensor) and out.device.type != "cpu":
            self.moves.append((name, tuple(out.shape)))
        return out
