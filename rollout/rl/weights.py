"""Weight updates for the generation model: name mapping, validation, then an in-place copy.

Trainers hand weights over in many shapes: a module, a state dict, or a stream of `(name, tensor)` pairs yielded one
at a time (TRL gathers ZeRO-3 / FSDP shards and merges PEFT adapters before yielding). Names may carry wrapper
prefixes and PEFT suffixes; tied weights may come once. We validate everything first (names, shapes, dtypes,
finiteness) into a staging copy, and only then copy into the live parameters, so a bad stream never leaves a
half-updated model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from rollout.engine.cpu.kernel import all_finite
from rollout.engine.tensor_parallel import local_shard, local_tensor

ON_UPDATE_MODES = ("keep", "recompute")  # what running requests do with their KV when new weights arrive
_PREFIXES = ("base_model.model.", "module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_SKIP = re.compile(r"(lora_|\.original_module\.|\.adapter_|prompt_encoder)")


class WeightUpdateError(ValueError):
    """An update was rejected; the generation model still holds its previous weights."""


StagedPairs = list[tuple[torch.Tensor, torch.Tensor]]  # (live tensor, validated new value), ready for apply_staged


def check_on_update(on_update: str) -> None:
    """Reject an unknown `on_update` mode before anything is staged."""
    if on_update not in ON_UPDATE_MODES:
        raise WeightUpdateError(f"on_update must be one of {ON_UPDATE_MODES}, got {on_update!r}")


def normalize_name(name: str) -> str | None:
    """The HF checkpoint name for a trainer-side name, or None for adapter-only tensors that must be skipped."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    if _SKIP.search(name):
        return None
    name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
    return name


def iter_named_tensors(source) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a module, a mapping, or any iterable of pairs."""
    if isinstance(source, nn.Module):
        yield from source.state_dict(keep_vars=False).items()
    elif isinstance(source, Mapping):
        yield from source.items()
    elif isinstance(source, Iterable):
        for item in source:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise WeightUpdateError(f"expected (name, tensor) pairs, got {type(item).__name__}")
            yield item
    else:
        raise WeightUpdateError(f"cannot read weights from {type(source).__name__}; pass an nn.Module, a state "
                                "dict or an iterable of (name, tensor) pairs")


def cpu_tensors(source, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """An update's (name, tensor) pairs as CPU tensors that own exactly their bytes, floating ones cast to `dtype`.

    `source` is what `update_weights` takes. A module's or a mapping's tensors live through the whole call, so tied
    weights (one storage) are given once. A stream may free or overwrite a tensor once the next one is asked for
    (ZeRO-3 gathers), so each of its tensors is copied and none is skipped: a freed tensor's address can come back
    for the next one, so addresses say nothing about ties there.
    """
    persistent = isinstance(source, (nn.Module, Mapping))
    seen: set[tuple] = set()
    for name, tensor in iter_named_tensors(source):
        tensor = tensor.detach()
        if persistent:
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                   tuple(tensor.stride()), tensor.dtype)
            if key in seen:
                continue
            seen.add(key)
        out = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
        out = out.to("cpu").contiguous()
        if (not persistent and out.data_ptr() == tensor.data_ptr()) or out.untyped_storage().nbytes() != out.nbytes:
            out = out.clone()
        yield name, out


def target_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a checkpoint may use for the model's parameters and persistent buffers (tied names included)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    for name, buf in model.named_buffers(remove_duplicate=False):
        targets.setdefault(name, buf)
    return targets


def _finite_within(value: torch.Tensor, bound: float) -> bool:
    """Every element finite and within [-bound, bound]. One pass, no mask allocation: the C kernel's scan for
    non-finite fp32/bf16 values where the dtype cannot exceed the bound, else min and max (NaN propagates into both).
    Only called on real floating tensors; 8-bit floats are widened first (torch has no aminmax for them)."""
    if value.numel() == 0:
        return True
    if torch.finfo(value.dtype).max <= bound:  # every finite value is within the bound: one check of exponent bits
        finite = all_finite(value)
        if finite is not None:
            return finite
    if value.element_size() < 2:
        value = value.float()
    low, high = (float(x) for x in torch.aminmax(value))
    return math.isfinite(low) and math.isfinite(high) and -bound <= low and high <= bound


def check_value(name: str, value: torch.Tensor, target: torch.Tensor) -> None:
    """WeightUpdateError unless `value` can replace `target` as it is: a floating weight takes only real floating
    values (an int, bool or complex tensor would be cast silently, and complex values escape the finiteness check),
    finite and within the weight dtype's range (a float64 value that would overflow a float16 weight is refused
    too); any other tensor (an integer buffer) takes only its own dtype."""
    if not target.is_floating_point():
        if value.dtype != target.dtype:
            raise WeightUpdateError(f"dtype mismatch for {name!r}: got {value.dtype}, the generation model has "
                                    f"{target.dtype}")
        return
    if not value.is_floating_point():
        raise WeightUpdateError(f"{name!r} must be a real floating-point tensor (the generation model's is "
                                f"{target.dtype}), got {value.dtype}; refusing the update")
    if not _finite_within(value, torch.finfo(target.dtype).max):
        raise WeightUpdateError(f"non-finite values (nan/inf, or beyond the range of {target.dtype}) in {name!r}; "
                                "refusing the update")


class StagedUpdate:
    """Validated new values for the generation model, gathered from one source or from several parts of one update
    (the chunks of an upload); nothing touches the live weights until `apply_staged(staged.pairs())`."""

    def __init__(self, model: nn.Module) -> None:
        self._targets = target_tensors(model)
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by storage: tied names are copied once

    def add(self, source) -> None:
        """Validate every tensor of `source` and stage it. Raises WeightUpdateError on the first bad one.

        A module or a mapping keeps its tensors alive and unchanged until we copy, so they are staged by reference
        (the dtype conversion happens in the final copy). A stream may hand out tensors that are freed or reused right
        after (ZeRO-3 gathers), so each is copied as it arrives, in the generation model's dtype and device.
        """
        transient = not isinstance(source, (nn.Module, Mapping))
        for raw_name, tensor in iter_named_tensors(source):
            name = normalize_name(raw_name)
            if name is None:
                continue
            target = self._targets.get(name)
            if target is None:
                raise WeightUpdateError(f"unknown weight name {raw_name!r} (as {name!r}); the generation model has "
                                        "no such parameter. Check that trainer and generator are the same "
                                        "architecture.")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(f"shape mismatch for {name!r}: got {tuple(tensor.shape)}, the generation "
                                        f"model has {tuple(target.shape)}")
            # Under tensor parallelism each rank stages the part its shard holds, cut from a full tensor or a DTensor.
            value, target = local_shard(tensor.detach(), target), local_tensor(target)
            check_value(name, value, target)
            if transient:
                value = value.to(device=target.device, dtype=target.dtype, copy=True)
            self._staged[target.data_ptr()] = (target, value)

    def pairs(self) -> StagedPairs:
        """What to copy; WeightUpdateError if nothing of the generation model was staged."""
        if not self._staged:
            raise WeightUpdateError("the update contained no weights of the generation model")
        return list(self._staged.values())


def stage_update(model: nn.Module, source) -> StagedPairs:
    """Validate the whole source and return (live tensor, new value) pairs ready to copy. Raises WeightUpdateError."""
    staged = StagedUpdate(model)
    staged.add(source)
    return staged.pairs()


@torch.no_grad()
def apply_staged(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy validated values into the live tensors in place: storage (and every pointer to it) stays the same."""
    for target, value in staged:
        target.data.copy_(value)


def load_safetensors_bytes(body: bytes, what: str) -> dict[str, torch.Tensor]:
    """The tensors of an in-memory safetensors file; WeightUpdateError naming `what` if it is not one."""
    from safetensors.torch import load

    try:
        return load(body)
    except Exception as err:  # safetensors raises its own error types for bad headers
        raise WeightUpdateError(f"{what} is not a safetensors file: {err}") from err


def safetensors_files(path: str | Path) -> list[Path]:
    """The *.safetensors files of a checkpoint directory (or the one file), or WeightUpdateError."""
    root = Path(path)
    if root.is_file() and root.suffix == ".safetensors":
        return [root]
    if not root.is_dir():
        raise WeightUpdateError(f"{str(path)!r} is neither a directory nor a .safetensors file on the server")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {str(path)!r} (save with save_pretrained(..., "
                                "safe_serialization=True))")
    return files


def iter_safetensors(path: str | Path | list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a checkpoint directory's *.safetensors files (or one file, or a list of files from
    `safetensors_files`), one tensor at a time."""
    from safetensors import safe_open

    files = path if isinstance(path, list) else safetensors_files(path)
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as err:
            raise WeightUpdateError(f"cannot read {file.name}: {err}") from err
        with handle as f:
            names = f.keys()
            for name in names:
                yield name, f.get_tensor(name)
