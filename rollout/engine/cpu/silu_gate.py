"""Which modules of a model are SiLU-gated MLPs, `down(silu(gate(x)) * up(x))`, so their gate can run fused.

Why: in a prefill step most of a gated MLP's time outside the matmuls goes to reading its two `[tokens,
intermediate]` activations back for the SiLU and the product. On packed weights both fold into the matmuls as oneDNN
post-ops (`PackedLinears.run_silu_gate`). The model stays unmodified: around the engine's eager forward a recognized
module gets an instance-level `forward` next to the linears' (packed_linear.py), and the compiled forward's graph has
the same pattern rewritten into one op (packed_linear_op.py).

Recognized: a module with plain `nn.Linear` children `gate_proj`, `up_proj` and `down_proj` and an `act_fn`, the
names Llama, Qwen, Mistral and most transformers decoders use. The names alone prove nothing (an MLP could scale,
clamp or use another activation under them), so each module class is checked once by running its own forward on a
random input and comparing it with the formula; a class that differs keeps its own forward.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

PARTS = ("gate_proj", "up_proj", "down_proj")
_checked: dict[tuple, bool] = {}  # (module class, act_fn class, with biases) -> its forward is the formula


def silu_gate_parts(module: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear] | None:
    """(gate, up, down) of a module shaped like a gated MLP, before any check of what its forward computes."""
    parts = [getattr(module, name, None) for name in PARTS]
    if getattr(module, "act_fn", None) is None or not all(
            isinstance(p, torch.nn.Linear) and type(p).forward is torch.nn.Linear.forward for p in parts):
        return None
    return tuple(parts)


def reference(x: torch.Tensor, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Linear) -> torch.Tensor:
    """The formula, with plain `F.linear`s."""
    return F.linear(F.silu(F.linear(x, gate.weight, gate.bias)) * F.linear(x, up.weight, up.bias), down.weight,
                    down.bias)


def is_silu_gated_mlp(module: torch.nn.Module) -> bool:
    """Whether `module(x)` computes `down(silu(gate(x)) * up(x))`: checked once per module class (and activation
    class and bias layout) on a random input through the class's own forward."""
    parts = silu_gate_parts(module)
    if parts is None:
        return False
    key = (type(module), type(module.act_fn), tuple(p.bias is not None for p in parts))
    known = _checked.get(key)
    if known is None:
        known = _forward_matches(module, parts)
        if known is not None:
            _checked[key] = known
            if not known:
                logger.info("%s has gate_proj/up_proj/down_proj but its forward is not silu(gate(x)) * up(x) -> "
                            "down: it keeps its own forward", type(module).__name__)
    return bool(known)


def _forward_matches(module: torch.nn.Module, parts) -> bool | None:
    """True/False as the class's forward equals the formula on a random input; None when the check says nothing
    (weights on another device, or all-zero ones that make any forward agree)."""
    gate = parts[0]
    if gate.weight.device.type != "cpu" or not gate.weight.dtype.is_floating_point:
        return None
    x = torch.randn(3, gate.in_features, generator=torch.Generator().manual_seed(0)).to(gate.weight.dtype)
    with torch.no_grad():
        expected = reference(x, *parts)
        if not expected.abs().sum():
            return None
        try:
            out = type(module).forward(module, x)
        except Exception:  # a forward that needs more than x is not the formula
            return False
    return isinstance(out, torch.Tensor) and out.shape == expected.shape and torch.allclose(
        out.float(), expected.float(), rtol=1e-3, atol=1e-5)
