"""`rollout::packed_linear`: the engine's oneDNN-packed linear (packed_linear.py) as an opaque op for torch.compile.

Why an op: the eager forward swaps each `nn.Linear.forward` for a closure over a weakref and a thread-local, which
dynamo cannot trace without a graph break per layer, and inductor's own CPU matmul on the unpacked weight is 1.3-2x
slower than the packed one. The compiled forward's backend (compiled_forward.py) rewrites every `F.linear` of the
traced graph into this op, so inductor fuses the norms, RoPE, SiLU*mul and residual adds around it while the matmul
itself stays packed. The weight stays a graph input (no inductor `freezing`): a weight update in place changes what
the next call computes, with no recompilation.

The op finds the engine's PackedLinears through `active_linears`, set around the compiled call on the stepping
thread: a graph holds no reference to an engine, so compiled graphs stay shareable and cacheable across engines and
processes. Without an active PackedLinears (prepack_weights=False, or a dtype this CPU cannot pack) it is `F.linear`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rollout.engine.packed_linear import PackedLinears

_active = threading.local()


@contextlib.contextmanager
def active_linears(linears: PackedLinears | None) -> Iterator[None]:
    """Serve `rollout::packed_linear` calls on this thread from `linears` (None: plain F.linear)."""
    previous = getattr(_active, "linears", None)
    _active.linears = linears
    try:
        if linears is None:
            yield
        else:
            with linears.serving():
                yield
    finally:
        _active.linears = previous


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the packed copy of `weight` when this thread's engine packs it."""
    linears: PackedLinears | None = getattr(_active, "linears", None)
    packed = linears.packed_for(x, weight) if linears is not None else None
    if packed is None:
        return F.linear(x, weight, bias)
    return linears.run(x, packed, bias)


def _fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Defined with torch.library.Library rather than @custom_op: the op runs ~60 times per forward, and the custom_op
# wrapper's per-call checks cost about twice the dispatcher's own overhead.
_LIBRARY = torch.library.Library("rollout", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("rollout::packed_linear", _fake, lib=_LIBRARY)


LINEAR_TARGETS = (torch._C._nn.linear, F.linear)


def use_packed_linears(gm: torch.fx.GraphModule) -> int:
    """Rewrite the `F.linear` calls of a dynamo graph into `rollout::packed_linear`; returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in LINEAR_TARGETS:
            continue
        args = list(node.args) + [None] * (3 - len(node.args))
        x = node.kwargs.get("input", args[0])
        weight = node.kwargs.get("weight", args[1])
        bias = node.kwargs.get("bias", args[2])
        node.target = torch.ops.rollout.packed_linear.default
        node.args, node.kwargs = (x, weight, bias), {}
        count += 1
    if count:
        gm.recompile()
    return count
