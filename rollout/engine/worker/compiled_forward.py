"""torch.compile of the engine's forward: `ContinuousBatchingConfig.default_compile_level` 1-3 and the padding that
lets shapes repeat.

Levels (as in transformers' continuous batching): 0 eager (the default); 1 inductor mode "default" with dynamic
shapes; 2 "max-autotune-no-cudagraphs", dynamic; 3 "max-autotune-no-cudagraphs" with static token counts, which relies
on query padding (`q_padding_interval_size`, 64 when left 0) so the same few shapes come back. `varlen_compile_config`
(mixed and prefill steps) and `decode_compile_config` (steps whose rows all run one token) override the level per
kind of step (dicts of torch.compile keywords: mode, dynamic, fullgraph, options, backend); a kind with no config
runs eagerly. Equal configs share one callable: a separate decode graph bought nothing measurable here (below) and
costs a second trace. Compiled callables are per process and config, shared by every engine (`generate_batch` builds
one per call): a new engine over the same model class reuses the graphs, with its own weights and cache as inputs.

What is traced: the unmodified transformers model, called with tensors only. The step's attention metadata arrives
as a StepTensors (attention.py) and every layer makes one call of the opaque op `rollout::paged_attention`; the
backend rewrites every `F.linear` into `rollout::packed_linear` (packed_linear_op.py), so the prepacked matmuls
survive and inductor fuses the RMSNorm, RoPE, SiLU*mul and residual adds between them. For Qwen3 and Llama that is
one graph per shape bucket with no graph break, and no guard on a per-step Python object. Weights stay graph inputs
(no `freezing`): a weight update in place needs no recompilation.

Shapes: the token count is padded to its bucket (`pad_to`: the next power of two up to `q_padding_interval_size`,
then a multiple of it; at least 2, as a size of 1 would get a specialized graph). Padding tokens form an extra table
row whose only block is the cache's scratch page: they write their K/V where no request reads, attend only to
themselves, and their logits are dropped. Kept logit rows, block-table rows and width, and the cache's slot count are
dynamic dims at every level (only the lm_head slice and the attention op read them), so none of them costs a
recompilation; `kv_padding_interval_size` (the table width rounded up to that many tokens) is accepted for
transformers compatibility and bounds the distinct widths, but on CPU changes no compile count.

Steady state without dynamo: dynamo evaluates a guard per tensor input on every call (139 inputs for W1), as costly as
all the graph's fused kernels on a small step. After a call through dynamo shows which graph serves a model
(`CompiledGraph`), the engine calls that graph itself with its inputs read through dynamo's own input sources, from the
live model and step; a step it no longer fits (its size asserts fail) goes back through dynamo.

What it buys (benchmarks/RESULTS.md, "Compile levels"): the first compiled step takes seconds, fewer with a warm cache
(a second process hits the FX graph and AOTAutograd caches; dynamo still traces). Small decode steps gain most, most of
it from the direct calls and the rest from defining both ops with torch.library.Library (the @custom_op wrapper adds a
cost per call); a one-row step is then mostly the packed matmuls. Prefill and the wide early steps gain less, so a whole
W1 run gains a few percent. Level 3 compiles a graph per bucket, which a fresh process pays inside its run.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config as fx_config
from torch._inductor import cpp_builder, exc
from transformers import PreTrainedModel

from rollout.config import ContinuousBatchingConfig
from rollout.engine.cpu.features import cpu_features
from rollout.engine.cpu.packed_linear_op import use_packed_linears, use_silu_gates, use_stacked_linears
from rollout.engine.worker.attention import StepTensors

logger = logging.getLogger(__name__)

STATIC_Q_INTERVAL = 64  # q padding of a static path when q_padding_interval_size is left 0 (transformers' preset)
MIN_DIM = 2  # no padded dim is ever 1: dynamo would specialize a graph for it
STATIC_RECOMPILE_LIMIT = 128  # graphs a static config may compile (one per token-count bucket) before running eager


def pad_to(n: int, interval: int) -> int:
    """The bucket of a size: at least MIN_DIM; with an interval, the next power of two up to it, then a multiple of
    it (a 3-row decode step pads to 4 tokens, not 64)."""
    n = max(n, MIN_DIM)
    if interval <= 0:
        return n
    if n <= interval:
        return min(1 << (n - 1).bit_length(), interval)
    return -(-n // interval) * interval


class InductorBackend:
    """A torch.compile backend: the graph's linears become `rollout::packed_linear`, then inductor (or another
    named backend) compiles it. Counts the graphs it compiled, so tests and logs can tell a recompilation."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.backend = config.get("backend", "inductor")
        # emulate_precision_casts: round low-precision intermediates where eager does, so a bf16 model's compiled
        # logprobs equal its eager ones (without it inductor keeps fused intermediates in fp32: other tokens)
        self.patches = {"emulate_precision_casts": True,
                        **torch._inductor.list_mode_options(config.get("mode") or "default", config.get("dynamic")),
                        **(config.get("options") or {})}
        self.compiles = 0
        self.seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        gates = use_silu_gates(gm, cpu_features().gate_dtypes)
        stacks = use_stacked_linears(gm)
        linears = use_packed_linears(gm)
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=self.patches)
        else:
            compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        self.compiles += 1  # only after success: dynamo may restart a trace and call the backend again
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        logger.info("compiled a forward graph (%s; %d so far, %d packed linears, %d stacks of linears of one input, "
                    "%d fused SiLU gates) in %.1fs", self.config, self.compiles, linears, stacks, gates, elapsed)
        return CompiledGraph(compiled, gm)


_last_graph = threading.local()  # the CompiledGraph that the last compiled call on this thread ran


class CompiledGraph:
    """One compiled graph as dynamo calls it, plus how to call it without dynamo.

    Dynamo checks its guards (one per tensor input, 139 of them for W1) on every call, which on a small step costs as
    much as all the graph's fused kernels (benchmarks/RESULTS.md, "Compile levels"). Once a call through dynamo has
    shown which graph serves a model (`_last_graph`), the engine calls that graph itself (`direct`), with its inputs
    read from the live model and step by the accessors derived from dynamo's own input sources: a weight replaced by a
    new tensor is picked up, and a changed shape fails the graph's size asserts and goes back through dynamo."""

    def __init__(self, fn: Callable, gm: torch.fx.GraphModule) -> None:
        self.fn = fn
        self.accessors = _input_accessors(gm)
        outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        self.single_output = isinstance(outputs, (tuple, list)) and len(outputs) == 1

    def __call__(self, *args):
        _last_graph.value = self
        return self.fn(*args)

    def direct(self, frame: dict) -> torch.Tensor:
        """The graph's output for the compiled function's arguments `frame` (by parameter name)."""
        return self.fn(*[read(frame) for read in self.accessors])[0]


def _input_accessors(gm: torch.fx.GraphModule) -> list[Callable] | None:
    """Per graph input, a function of the traced frame's arguments that reads it (`L['model']._modules[...]`,
    `L['input_ids'].size()[1]`); None when a source is not such an expression (then the graph is only called by
    dynamo)."""
    accessors = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None)
        if not isinstance(source, str) or not source.startswith("L["):
            return None
        try:
            accessors.append(eval(f"lambda L: {source}", {}))  # dynamo's own source expression
        except SyntaxError:
            return None
    return accessors


def _step(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
          step: StepTensors) -> torch.Tensor:
    """The traced function: one packed forward, logits `[1, K, vocab]` at the `keep` rows."""
    return model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False,
                 rollout_step=step).logits


_callables: dict[str, tuple[InductorBackend, Callable]] = {}
_callables_lock = threading.Lock()


def compiled_step(config: dict) -> tuple[InductorBackend, Callable]:
    """The process's compiled `_step` for one compile config, shared by every engine that uses that config.

    Shared so that a new engine over the same model class (`generate_batch` builds one per call) finds the graphs
    already compiled: the model, its weights and the cache are graph inputs, and the guards check only their types,
    shapes and constants. Each config keeps its own entries and recompilation count (`isolate_recompiles`); a static
    config may compile one graph per token-count bucket.
    """
    key = repr(sorted((k, repr(v)) for k, v in config.items()))
    with _callables_lock:
        if key not in _callables:
            backend = InductorBackend(config)
            limit = STATIC_RECOMPILE_LIMIT if config.get("dynamic") is False else None
            _callables[key] = backend, torch.compile(_step, backend=backend, dynamic=config.get("dynamic"),
                                                     fullgraph=config.get("fullgraph", False), recompile_limit=limit,
                                                     isolate_recompiles=True)
        return _callables[key]


@dataclass
class CompiledPath:
    """One compiled callable (for decode-only or for mixed steps) and how its inputs are padded."""

    config: dict
    backend: InductorBackend
    fn: Callable
    static: bool  # the token count is a static dim: a graph per bucket
    q_interval: int


class CompiledForward:
    """An engine's compiled callables: `decode` serves steps whose rows all run one token, `varlen` the others."""

    def __init__(self, varlen_config: dict | None, decode_config: dict | None, q_interval: int, kv_interval: int,
                 max_batch_tokens: int) -> None:
        self.kv_interval = kv_interval
        self.paths: dict[str, CompiledPath] = {}
        # (path, model, static bucket) -> the graph that serves it, called without dynamo after its first call
        self._direct: dict[tuple, tuple[weakref.ref, CompiledGraph]] = {}
        for name, config in (("varlen", varlen_config), ("decode", decode_config)):
            if config is None:
                continue
            static = config.get("dynamic") is False
            interval = q_interval or (STATIC_Q_INTERVAL if static else 0)
            backend, fn = compiled_step(config)  # equal configs: one callable serves both kinds of step
            self.paths[name] = CompiledPath(config, backend, fn, static, interval)
            buckets = len({pad_to(n, interval) for n in range(1, max_batch_tokens + 1)}) if static else 1
            if buckets > STATIC_RECOMPILE_LIMIT:
                logger.warning("%s steps compile static shapes with q padding %d: up to %d graphs for %d batch "
                               "tokens, more than the %d torch.compile keeps (later buckets run eagerly); raise "
                               "q_padding_interval_size", name, interval, buckets, max_batch_tokens,
                               STATIC_RECOMPILE_LIMIT)
            logger.info("%s steps run compiled: %s, q padding %d", name, config, interval)
        self._compiles_at_start = self.num_compiles_in_process

    @staticmethod
    def prepare_cache(cache_tensors: list[torch.Tensor]) -> None:
        """Called once by the model runner: a cache's slot count is a dynamic dim (another engine's cache of another
        size reuses the graphs), its heads and head size static."""
        for t in cache_tensors:
            torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 2)

    def path_for(self, decode: bool) -> CompiledPath | None:
        return self.paths.get("decode" if decode else "varlen")

    def drop(self, path: CompiledPath) -> None:
        """Serve the steps of `path` eagerly from now on (its compilation failed)."""
        self.paths = {name: p for name, p in self.paths.items() if p is not path}

    @property
    def backends(self) -> list[InductorBackend]:
        return list({id(p.backend): p.backend for p in self.paths.values()}.values())

    @property
    def num_compiles_in_process(self) -> int:
        """Graphs compiled by this engine's backends, by any engine of the process (a recompilation adds one)."""
        return sum(b.compiles for b in self.backends)

    @property
    def num_compiles(self) -> int:
        """Graphs compiled by this engine's backends since it was built (by it, or another engine sharing them)."""
        return self.num_compiles_in_process - self._compiles_at_start

    @property
    def compile_seconds(self) -> float:
        """Seconds this engine's backends spent in inductor, process-wide (dynamo's tracing not counted)."""
        return sum(b.seconds for b in self.backends)

    def table_width(self, blocks: int, page_size: int) -> int:
        """The block-table width for `blocks` blocks: rounded up to kv_padding_interval_size tokens."""
        return pad_to(blocks, -(-self.kv_interval // page_size) if self.kv_interval else 0)

    def __call__(self, path: CompiledPath, model: PreTrainedModel, input_ids: torch.Tensor,
                 position_ids: torch.Tensor, keep: torch.Tensor, step: StepTensors) -> torch.Tensor:
        frame = {"model": model, "input_ids": input_ids, "position_ids": position_ids, "keep": keep, "step": step}
        key = (id(path), id(model), input_ids.shape[1] if path.static else None)
        entry = self._direct.get(key)
        if entry is not None and entry[0]() is model:
            try:
                return entry[1].direct(frame)
            except (AssertionError, RuntimeError, IndexError, TypeError) as err:  # shapes dynamo would recompile for
                logger.info("the compiled graph no longer fits this step (%s); going back through dynamo", err)
                del self._direct[key]
        torch._dynamo.mark_dynamic(keep, 0)
        for tables in step.tables:
            torch._dynamo.mark_dynamic(tables, 0)
            torch._dynamo.mark_dynamic(tables, 1)
        _last_graph.value = None
        with _DYNAMO_SETTINGS:
            logits = path.fn(model, input_ids, position_ids, keep, step)
        self._learn_direct(key, model, frame, logits)
        return logits

    def _learn_direct(self, key: tuple, model: PreTrainedModel, frame: dict, logits: torch.Tensor) -> None:
        """After a call through dynamo: if one graph ran and calling it directly gives the same logits (the forward
        is repeated once; its K/V writes are the same values to the same slots), call it directly from now on."""
        graph = getattr(_last_graph, "value", None)
        if graph is None or graph.accessors is None or not graph.single_output:
            return
        try:
            same = torch.equal(graph.direct(frame), logits)
        except Exception as err:  # any failure means: keep going through dynamo
            logger.info("calling the compiled graph directly failed (%r); it stays behind dynamo's guards", err)
            return
        if same:
            self._direct[key] = (weakref.ref(model), graph)
        else:
            logger.warning("the compiled graph called directly gave other logits than through dynamo; it stays "
                           "behind dynamo's guards")


class _DynamoSettings:
    """Dynamo settings while any engine runs a compiled forward (they matter only when dynamo traces): no duck
    sizing, so two dims equal in one step are not assumed equal in the next (one recompilation each time they
    differ), and Python floats of the modules (an embedding's norm_type) kept as constants: tracing them as tensors
    made dynamo restart every first trace, costing an AOTAutograd cache miss per process. Process-wide and
    reference-counted across threads: another torch.compile traced meanwhile in this process sees them too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: tuple[bool, bool] | None = None

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._saved = fx_config.use_duck_shape, torch._dynamo.config.specialize_float
                fx_config.use_duck_shape = False
                torch._dynamo.config.specialize_float = True
            self._depth += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                fx_config.use_duck_shape, torch._dynamo.config.specialize_float = self._saved


_DYNAMO_SETTINGS = _DynamoSettings()


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU graphs with (its own search of `torch._inductor.config.cpp.cxx`),
    or None: without one every compile fails at the first step, so a default that compiles should not be taken."""
    try:
        return cpp_builder.get_cpp_compiler()
    except (exc.InvalidCxxCompiler, OSError, RuntimeError):
        return None


def build_compiled_forward(config: ContinuousBatchingConfig, device: torch.device,
                           max_batch_tokens: int) -> CompiledForward | None:
    """The engine's compiled callables for `config` (None when every path is eager); ValueError off CPU."""
    varlen, decode = config.compile_configs()
    if varlen is None and decode is None:
        return None
    if device.type != "cpu":
        raise ValueError(f"default_compile_level / compile configs are implemented for CPU engines only (the model "
                         f"is on {device}; the compiled attention op has no flash-attn path): leave "
                         f"default_compile_level=0 and the compile configs None.")
    return CompiledForward(varlen, decode, config.q_padding_interval_size, config.kv_padding_interval_size,
                           max_batch_tokens)
