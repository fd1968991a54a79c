"""`rollout::packed_linear`: the engine's prepacked linear (packed_linear.py) as an opaque op for torch.compile.

Why an op: the eager forward swaps each `nn.Linear.forward` for a closure over a weakref and a thread-local, which
dynamo cannot trace without a graph break per layer, and inductor's own CPU matmul on the unpacked weight is slower than
the packed one (benchmarks/RESULTS.md, "Compile levels"). The compiled forward's backend (compiled_forward.py) rewrites
every `F.linear` of the traced graph into this op, so inductor fuses the norms, RoPE and residual adds around it while
the matmul itself stays packed. A SiLU-gated MLP's `silu(gate(x)) * up(x)` becomes one `rollout::packed_silu_gate` where
this CPU fuses the dtype (silu_gate.py): its SiLU and product run as oneDNN post-ops of the two matmuls, or after MKL's
one matmul over the two weights stacked (mkl_packed.py). Linears of one input (a layer's q, k and v projections) become
one `rollout::packed_linears`: one matmul over their weights stacked (a pass over W1's linears takes less time at 8-512
rows: benchmarks/results-history.md, "Serving"). The weight stays a graph input (no inductor `freezing`): a weight
update in place changes what the next call computes, with no recompilation.

The op finds the engine's PackedLinears through `active_linears`, set around the compiled call on the stepping
thread: a graph holds no reference to an engine, so compiled graphs stay shareable and cacheable across engines and
processes. Without an active PackedLinears (prepack_weights=False, or a dtype this CPU cannot pack) it is `F.linear`.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rollout.engine.cpu.packed_linear import PackedLinears

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
    if linears is None:
        return F.linear(x, weight, bias)
    packed = linears.packed_for(x, weight)
    if packed is None:
        return linears.unpacked_linear(x, weight, bias)
    return linears.run(x, packed, bias)


def packed_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> torch.Tensor:
    """`cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`: one matmul over the stacked packed copy of
    the weights where this thread's engine packs them (PackedLinears.stacked_for), else the linears apart."""
    linears: PackedLinears | None = getattr(_active, "linears", None)
    packed = linears.stacked_for(x, tuple(weights)) if linears is not None else None
    if packed is None:
        return torch.cat([packed_linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)
    return linears.run(x, packed, None if biases[0] is None else torch.cat(biases))


def packed_silu_gate(x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: torch.Tensor | None,
                     up_weight: torch.Tensor, up_bias: torch.Tensor | None) -> torch.Tensor:
    """`silu(F.linear(x, gate...)) * F.linear(x, up...)`: one fused pair of packed matmuls where this thread's engine
    packs both weights and this CPU fuses the dtype (PackedLinears.run_silu_gate), else the two linears apart."""
    linears: PackedLinears | None = getattr(_active, "linears", None)
    packed = linears.silu_gate_for(x, gate_weight, up_weight) if linears is not None else None
    if packed is None:
        return F.silu(packed_linear(x, gate_weight, gate_bias)) * packed_linear(x, up_weight, up_bias)
    return linears.run_silu_gate(x, packed, gate_bias, up_bias)


def _fake(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fake_linears(x, weights, biases):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))


def _fake_silu_gate(x, gate_weight, gate_bias, up_weight, up_bias):
    return x.new_empty(*x.shape[:-1], gate_weight.shape[0])


# Defined with torch.library.Library rather than @custom_op: the op runs ~60 times per forward, and the custom_op
# wrapper's per-call checks cost about twice the dispatcher's own overhead.
_LIBRARY = torch.library.Library("rollout", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("rollout::packed_linear", _fake, lib=_LIBRARY)
_LIBRARY.define("packed_linears(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIBRARY.impl("packed_linears", packed_linears, "CompositeExplicitAutograd")
torch.library.register_fake("rollout::packed_linears", _fake_linears, lib=_LIBRARY)
_LIBRARY.define("packed_silu_gate(Tensor x, Tensor gate_weight, Tensor? gate_bias, Tensor up_weight, "
                "Tensor? up_bias) -> Tensor")
_LIBRARY.impl("packed_silu_gate", packed_silu_gate, "CompositeExplicitAutograd")
torch.library.register_fake("rollout::packed_silu_gate", _fake_silu_gate, lib=_LIBRARY)


LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
SILU_TARGETS = (F.silu, torch._C._nn.silu, torch.ops.aten.silu.default)
MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


def use_packed_linears(gm: torch.fx.GraphModule) -> int:
    """Rewrite the `F.linear` calls of a dynamo graph into `rollout::packed_linear` (after `use_silu_gates` has taken
    the gated MLPs' gate and up projections); returns how many."""
    count = 0
    for node in gm.graph.nodes:
        linear = _linear_args(node)
        if linear is None:
            continue
        node.target = torch.ops.rollout.packed_linear.default
        node.args, node.kwargs = linear, {}
        count += 1
    if count:
        gm.recompile()
    return count


def use_stacked_linears(gm: torch.fx.GraphModule) -> int:
    """Rewrite the `F.linear` calls of a dynamo graph that share one input (a layer's q, k and v projections) into
    one `rollout::packed_linears` whose columns are split back into their results; returns how many groups. Only
    linears whose weights have one dtype and biases all present or all absent are stacked."""
    groups: dict[torch.fx.Node, list[tuple[torch.fx.Node, tuple]]] = {}
    for node in gm.graph.nodes:
        linear = _linear_args(node)
        if linear is not None and isinstance(linear[0], torch.fx.Node):
            groups.setdefault(linear[0], []).append((node, linear))
    count = 0
    for x, members in groups.items():
        members = _stackable(members)
        if len(members) < 2:
            continue
        weights = [args[1] for _, args in members]
        biases = [args[2] for _, args in members]
        sizes = [_example(w).shape[0] for w in weights]
        with gm.graph.inserting_before(members[0][0]):
            stacked = gm.graph.call_function(torch.ops.rollout.packed_linears.default, (x, weights, biases))
            parts = gm.graph.call_function(torch.split, (stacked, sizes), {"dim": -1})
            for i, (node, _) in enumerate(members):
                part = gm.graph.call_function(operator.getitem, (parts, i))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
        for node, _ in members:
            gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _example(node) -> torch.Tensor | None:
    example = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return example if isinstance(example, torch.Tensor) else None


def _stackable(members: list[tuple[torch.fx.Node, tuple]]) -> list[tuple[torch.fx.Node, tuple]]:
    """The members of a group of linears of one input that can run as one stacked matmul: those with the first
    member's weight dtype and bias presence (all biases tensors, or all None). Only when every weight is a 2-D graph
    input, as are the biases: the stacked call goes where the first member was, before any node computed later, and
    the engine packs only the model's own weights (graph inputs) anyway."""
    weights = [_example(args[1]) for _, args in members]
    if len(members) < 2 or any(w is None or w.dim() != 2 for w in weights):
        return []
    if not all(_graph_input(args[1]) and (args[2] is None or _graph_input(args[2])) for _, args in members):
        return []
    first_bias = members[0][1][2] is None
    return [(node, args) for (node, args), w in zip(members, weights)
            if w.dtype == weights[0].dtype and (args[2] is None) == first_bias]


def _graph_input(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr")


def use_silu_gates(gm: torch.fx.GraphModule, dtypes: frozenset[torch.dtype]) -> int:
    """Rewrite each `silu(F.linear(x, Wg, bg)) * F.linear(x, Wu, bu)` of a dynamo graph whose weights have one of
    `dtypes` (those this CPU fuses, see cpu_features) into `rollout::packed_silu_gate`; returns how many. Only when the
    two linears and the SiLU feed nothing else: their values are never materialized."""
    count = 0
    for node in list(gm.graph.nodes):
        gate_up = _silu_gate_args(node, dtypes) if node.op == "call_function" and node.target in MUL_TARGETS else None
        if gate_up is None:
            continue
        silu_node, gate_node, up_node, args = gate_up
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.rollout.packed_silu_gate.default, args)
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        for dead in (node, silu_node, gate_node, up_node):
            gm.graph.erase_node(dead)
        count += 1
    if count:
        gm.recompile()
    return count


def _linear_args(node: torch.fx.Node) -> tuple | None:
    """(x, weight, bias) of an `F.linear` call node, else None."""
    if node.op != "call_function" or node.target not in LINEAR_TARGETS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    return node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])


def _silu_gate_args(mul: torch.fx.Node, dtypes: frozenset[torch.dtype]):
    """For `mul` = silu(linear(x, Wg, bg)) * linear(x, Wu, bu) (either order): (silu node, gate node, up node,
    (x, Wg, bg, Wu, bu)); else None."""
    if len(mul.args) != 2 or mul.kwargs:
        return None
    for silu_node, up_node in (mul.args, mul.args[::-1]):
        if not (isinstance(silu_node, torch.fx.Node) and silu_node.op == "call_function"
                and silu_node.target in SILU_TARGETS and not silu_node.kwargs.get("inplace", False)
                and isinstance(silu_node.args[0], torch.fx.Node) and isinstance(up_node, torch.fx.Node)):
            continue
        gate_node = silu_node.args[0]
        gate, up = _linear_args(gate_node), _linear_args(up_node)
        if gate is None or up is None or gate[0] is not up[0] or gate_node is up_node:
            continue
        if any(len(n.users) != 1 for n in (gate_node, silu_node, up_node)):
            continue
        example = gate_node.meta.get("example_value")
        if getattr(example, "dtype", None) not in dtypes:
            continue
        return silu_node, gate_node, up_node, (gate[0], gate[1], gate[2], up[1], up[2])
    return None
