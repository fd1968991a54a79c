"""Which modules of a model are RMSNorms, `weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` with the mean in fp32,
so that the engine's eager forward runs each of them as one call of the C kernel (csrc/rms_norm.c) instead of its
eight small ops.

Why: a decode step of a real model runs one or two norms per layer over the hidden size, and Qwen3 two more over every
head (q_norm, k_norm), each on a few rows; in eager PyTorch their time is almost all per-op dispatch and allocation.
The model stays unmodified: around the engine's eager forward (ModelRunner.run) a recognized module gets an
instance-level `forward`, like the linears' (packed_linear.py), removed again right after. The compiled forward is
left alone (the compiler fuses the norm itself).

Recognized: a module without children whose only parameter is a 1-D `weight`, with a float epsilon attribute
(`variance_epsilon` as in Llama, Qwen, Mistral; or `eps`). Structure proves nothing (Gemma's norm multiplies by
`1 + weight`, others multiply by the weight in fp32 before the cast), so each module class is checked once per dtype
by running its own forward on a random input and weight and comparing it with the kernel. The kernel sums a row's
squares in the order of torch's CPU sum (kernel.norm_sum_order), so for the transformers norms its outputs are the
module's bit for bit; the check still leaves room for a torch that sums in another order, where a mean can differ in
its last bit: in fp32 within fp32 rounding, in bf16 bit for bit but for at most 0.1% of the elements, each at most two
bf16 ulps apart (one ulp of the rounded x * rstd, which the product with the weight can make two). A norm that
multiplies by the weight in fp32 before the cast differs in about a quarter of its bf16 elements, Gemma's `1 + weight`
in nearly all.

A class that differs keeps its own forward, and so does any call the kernel cannot serve: another dtype than fp32/bf16
or than the weight's, an input that needs autograd, extra arguments, or a call from another thread than the engine's
forward (a trainer running the same module). Without the kernel library (no C compiler, `ROLLOUT_CPU_KERNEL=0`) or off
the CPU, the engine does not install the overrides.
"""

from __future__ import annotations

import logging
import threading

import torch

from rollout.engine.cpu.kernel import DTYPES, rms_norm

logger = logging.getLogger(__name__)

EPS_NAMES = ("variance_epsilon", "eps")
PROBE_ELEMENTS = 1 << 16  # elements of the random input a class is checked on
MAX_ULPS, MAX_DIFFERING = 2, 1e-3  # bf16: how far, and what fraction of elements, may be off the class's own forward
_checked: dict[tuple[type, torch.dtype], bool] = {}  # (module class, dtype) -> its forward is the kernel's formula


def eps_name(module: torch.nn.Module) -> str | None:
    """The name of the epsilon attribute of a module shaped like an RMSNorm (no children, one 1-D parameter `weight`,
    a float epsilon), before any check of what its forward computes; None for any other module."""
    params = module._parameters
    weight = params.get("weight")
    if module._modules or len(params) != 1 or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 \
            or not weight.numel():
        return None
    return next((name for name in EPS_NAMES if type(getattr(module, name, None)) is float), None)


def is_rms_norm(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the kernel computes `module(x)` for inputs and weights of `dtype`: checked once per module class and
    dtype, on a random input and weight, through the class's own forward."""
    name = eps_name(module)
    if name is None or dtype not in DTYPES:
        return False
    key = (type(module), dtype)
    known = _checked.get(key)
    if known is None:
        known = _forward_matches(module, name, dtype)
        if known is not None:
            _checked[key] = known
            if not known:
                logger.info("%s looks like an RMSNorm but its forward in %s is not weight * (x * rsqrt(mean(x^2) + "
                            "eps)).to(dtype): it keeps its own forward", type(module).__name__, dtype)
    return bool(known)


def _forward_matches(module: torch.nn.Module, name: str, dtype: torch.dtype) -> bool | None:
    """True/False as the class's forward equals the kernel on a random input and weight of `dtype`; None when the
    check says nothing (a weight not on the CPU)."""
    if module.weight.device.type != "cpu":
        return None
    dim = module.weight.numel()
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(max(16, PROBE_ELEMENTS // dim), dim, generator=gen) * 3).to(dtype)
    weight = torch.nn.Parameter((torch.randn(dim, generator=gen) + 1).to(dtype), requires_grad=False)
    probe = module.__new__(type(module))  # the module's attributes, another weight: the module itself is not touched
    probe.__dict__.update(module.__dict__)
    probe.__dict__["_parameters"] = {"weight": weight}
    with torch.no_grad():
        expected = rms_norm(x, weight, getattr(module, name))
        try:
            out = type(module).forward(probe, x)
        except Exception:  # a forward that needs more than x is not the formula
            return False
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype:
        return False
    if dtype == torch.float32:
        return torch.allclose(out, expected, rtol=1e-5, atol=1e-6)
    return within_ulps(out, expected, MAX_ULPS, MAX_DIFFERING)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between each element of `a` and `b` (bf16 tensors of one shape); NaN pairs count 0,
    a NaN against a number a lot."""
    def ordered(t: torch.Tensor) -> torch.Tensor:  # the bit patterns as integers in the order of the values
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -32768 - bits, bits)
    ulps = (ordered(a) - ordered(b)).abs()
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.where(nan_a & nan_b, 0, torch.where(nan_a | nan_b, 1 << 16, ulps))


def within_ulps(a: torch.Tensor, b: torch.Tensor, max_ulps: int, fraction: float) -> bool:
    """Whether bf16 tensors `a` and `b` are equal (NaN where the other is NaN) but for at most `fraction` of their
    elements, which are at most `max_ulps` bf16 ulps apart."""
    ulps = bf16_ulps(a, b)
    return bool(ulps.max() <= max_ulps) and int(ulps.count_nonzero()) <= fraction * ulps.numel()


class FusedNorms:
    """`with FusedNorms(model):` every recognized RMSNorm of the model (found at the first use) runs the kernel in
    this thread's forward; each gets back its own forward on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._active = threading.local()  # .on: this thread is inside the engine's forward
        self._overrides: list[tuple[torch.nn.Module, object]] | None = None

    def _targets(self) -> list[tuple[torch.nn.Module, object]]:
        if self._overrides is None:
            self._overrides = [(m, self._override(m, name)) for m in self.model.modules()
                               if (name := eps_name(m)) is not None and "forward" not in m.__dict__
                               and m.weight.is_contiguous() and is_rms_norm(m, m.weight.dtype)]
        return self._overrides

    def _override(self, module: torch.nn.Module, name: str):
        """The kernel for the calls it serves (see the module docstring), the class's own forward for the rest."""
        own, cls, active, checked = type(module).forward, type(module), self._active, _checked
        params = module._parameters  # module.weight goes through nn.Module.__getattr__: 0.5 us a call

        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            weight = params["weight"]
            dtype = x.dtype
            if args or kwargs or not getattr(active, "on", False) or x.requires_grad or weight.dtype is not dtype \
                    or weight.shape[0] != x.shape[-1] or not (checked.get((cls, dtype)) or is_rms_norm(module, dtype)):
                return own(module, x, *args, **kwargs)
            return rms_norm(x, weight, getattr(module, name))
        return forward

    def __enter__(self) -> FusedNorms:
        for module, forward in self._targets():
            module.__dict__["forward"] = forward  # instance attribute: nn.Module.__call__ picks it up
        self._active.on = True
        return self

    def __exit__(self, *exc) -> None:
        self._active.on = False
        for module, _ in self._targets():
            module.__dict__.pop("forward", None)
