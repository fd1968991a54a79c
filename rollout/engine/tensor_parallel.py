"""Tensor parallelism: a model transformers sharded over ranks (`DistributedConfig(tp_size=N)`, `tp_plan="auto"`)
runs one engine per rank, in lock step.

Every rank schedules the same requests in the same order and steps together: the model's own collectives (the
row-parallel all-reduces, the gathered logits) make each rank's logits equal, so the same sampler with the same seed
draws the same tokens on every rank, and no per-step plan has to travel. What would let ranks drift apart is kept
out: the engine's choices never depend on timings under TP (no swap-or-recompute by cost, no compiled forward), the
sampler's seed is rank 0's, and requests reach the engines only through rank 0 (the manager broadcasts them over the
CPU group below; `generate_batch` checks that every rank was given the same inputs).

The CPU (gloo) group is bounded by `cpu_group_timeout`: a rank that hangs or dies ends the others with an error
rather than a hang.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import random
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

# Projections whose outputs hold the keys: when the plan splits them by columns, each rank holds 1/tp of the KV heads.
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


def tp_size(model: nn.Module) -> int:
    """How many ranks share the model's weights (1: not sharded)."""
    return int(getattr(model, "tp_size", None) or 1)


def kv_heads_per_rank(model: nn.Module, num_kv_heads: int) -> int:
    """The KV heads one rank's attention layers produce: all of them unless the plan shards the key projection."""
    size = tp_size(model)
    plan = getattr(model, "tp_plan", None) or {}
    sharded = any(key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and str(style).startswith("colwise")
                  for key, style in plan.items())
    if size == 1 or not sharded:
        return num_kv_heads
    if num_kv_heads % size:
        raise ValueError(f"tensor parallelism over {size} ranks cannot split the model's {num_kv_heads} KV heads "
                         f"evenly (num_key_value_heads % tp_size = {num_kv_heads % size}): launch with a number of "
                         f"ranks that divides {num_kv_heads} (torchrun --nproc-per-node)")
    return num_kv_heads // size


def check_tp_config(config, size: int):
    """The engine config as tensor parallelism runs it: errors for what cannot run in lock step, and packing off
    (the weights are DTensors that transformers' hooks compute with)."""
    refused = []
    if config.cpu_offload_space != 0:
        refused.append("cpu_offload_space (the swap-or-recompute choice is timed per rank; set it to 0)")
    if config.default_compile_level or config.varlen_compile_config or config.decode_compile_config:
        refused.append("a compiled forward (default_compile_level / *_compile_config; leave them unset)")
    if config.prepack_weights:
        refused.append("prepack_weights=True (the shards are DTensors; leave it None)")
    if refused:
        raise ValueError(f"tensor parallelism over {size} ranks does not support " + "; ".join(refused))
    return dataclasses.replace(config, prepack_weights=False)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (the tensor itself if it is not a DTensor); shares its storage."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) and hasattr(tensor, "placements") else tensor


def local_shard(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of `value` (the full tensor, or a DTensor laid out in any way) that this rank's shard of `target`
    holds; `value` itself when `target` is not sharded. Cuts locally: no rank sends anything."""
    placements = getattr(target, "placements", None)
    if placements is None:
        return value.full_tensor() if hasattr(value, "placements") else value
    if hasattr(value, "placements"):
        return value.redistribute(target.device_mesh, placements).to_local()
    return distribute_tensor(value, target.device_mesh, placements, src_data_rank=None).to_local()


class TensorParallelGroup:
    """The ranks of one sharded model, and the CPU collectives the engines coordinate with. Rank 0 drives."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.driver = dist.get_global_rank(self.group, 0)
        self._state = torch.zeros(4, dtype=torch.long)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (any picklable object)."""
        holder = [obj if self.is_driver else None]
        dist.broadcast_object_list(holder, src=self.driver, group=self.group)
        return holder[0]

    def max_state(self, *values: int) -> list[int]:
        """The elementwise maximum of up to four small ints over the ranks (one all-reduce)."""
        self._state.zero_()
        self._state[:len(values)] = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(self._state, op=dist.ReduceOp.MAX, group=self.group)
        return self._state.tolist()[:len(values)]

    def min_ints(self, *values: int) -> list[int]:
        """The elementwise minimum of up to four small ints over the ranks."""
        return [-v for v in self.max_state(*(-v for v in values))]

    def shared_seed(self, seed: int | None) -> int:
        """Rank 0's seed (drawn there when None), so sampled tokens agree on every rank."""
        return int(self.broadcast(seed if seed is not None else random.getrandbits(63)))

    def check_same(self, what: str, obj) -> None:
        """ValueError on every rank unless every rank passed an equal `obj` (compared by digest)."""
        try:
            data = pickle.dumps(obj)
        except Exception:  # an input the engine will refuse anyway: compare what it looks like
            data = repr(obj).encode()
        digest = hashlib.sha256(data).hexdigest()
        digests: list[str | None] = [None] * self.size
        dist.all_gather_object(digests, digest, group=self.group)
        differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ValueError(f"under tensor parallelism every rank must pass the same {what}, but rank(s) {differ} "
                             f"passed different ones than rank 0: run the same calls on every rank")
