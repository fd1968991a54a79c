"""Turns a StepPlan into tensors, runs one packed forward with the engine's attention, returns sampled-row logits.

The forward runs eagerly, or through the compiled callables of compiled_forward.py (default_compile_level > 0), which
take the same step as padded tensors (`build_step`). A step's metadata is built on the host and reaches an
accelerator in one copy (`_send`); on the CPU it is used where it was built."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from rollout.engine.core.kv_groups import KVGroups
from rollout.engine.core.request import Request
from rollout.engine.core.step import StepPlan
from rollout.engine.cpu.features import cpu_features, require_packing
from rollout.engine.cpu.kernel import KernelBatch, kernel_usable, load_kernel
from rollout.engine.cpu.packed_linear import PackedLinears, packing_available
from rollout.engine.cpu.packed_linear_op import active_linears
from rollout.engine.cpu.rms_norm import FusedNorms
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.worker.attention import (
    AttentionBatch,
    DecodeBucket,
    GatherScratch,
    PrefillGroup,
    PrefillSegment,
    StepTensors,
    engine_attention,
)
from rollout.engine.worker.compiled_forward import MIN_DIM, CompiledForward, CompiledPath, pad_to
from rollout.engine.worker.flash_backend import (
    FLASH_HOST_TENSORS,
    build_flash_batch,
    flash_host_tensors,
    flash_usable,
)
from rollout.engine.worker.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

# Families whose greedy tokens match transformers' own generate: the first five in
# tests/engine/test_greedy_equivalence.py, the others checked once with tiny random configs under transformers 5.x.
KNOWN_GOOD_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "GPT-2", "Gemma 2", "Phi-3", "GPT-NeoX", "OPT", "OLMo 2")


class UnsupportedModelError(ValueError):
    """The model's attention does not go through transformers' attention interface, so the engine cannot page it."""


def _unsupported_message(model: torch.nn.Module, problem: str) -> str:
    name = type(model).__name__
    return (f"{name} cannot run in rollout's engine: {problem}. The engine plugs its paged KV cache in through "
            f"transformers' AttentionInterface (the model must honour attn_implementation and pass its keyword "
            f"arguments down to every attention layer); transformers marks such model classes with "
            f"`_supports_attention_backend = True`, and {name} does not set it. Use a model whose attention goes "
            f"through that interface, e.g. {', '.join(KNOWN_GOOD_FAMILIES)}.")


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run without dropout even if a trainer left the (shared) module in train mode; restore every flag after."""
    if not model.training:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


MAX_DECODE_BUCKETS = 4
MIN_BUCKET_ROWS = 8


def _length_buckets(rows: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    """Split rows sorted by context length into a few buckets, so padding to each bucket's longest row wastes
    little gather and attention work while keeping the number of attention calls per layer small."""
    count = min(MAX_DECODE_BUCKETS, max(1, len(rows) // MIN_BUCKET_ROWS))
    if count == 1 or int(lens[-1]) <= 2 * int(lens[0]):
        return [rows]
    return list(rows.tensor_split(count))


@dataclass
class _GroupHost:
    """What `build_batch` keeps of one KV group between building its host tensors and receiving them on the
    device: its block tables, whether fresh pages travel to be zeroed, and the PyTorch path's attention parts."""

    tables: torch.Tensor
    fresh: bool = False
    parts: tuple[list[DecodeBucket], list[PrefillSegment], list[PrefillGroup]] | None = None


PREFILL_PADDING = 2  # a group of prefill chunks may do this many times its chunks' own work, padding included


def _prefill_groups(chunks: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Prefill chunks `(row, query_len, context_len)` in groups attended by one call each, shortest contexts first:
    a group grows while padding its chunks to its longest query and context keeps the work (queries x keys) within
    PREFILL_PADDING of theirs. One call per group instead of per chunk saves each layer a few kernel launches per
    request."""
    groups: list[list[tuple[int, int, int]]] = []
    work = max_q = max_ctx = 0
    for chunk in sorted(chunks, key=lambda c: (c[2], c[1])):
        _, q, ctx = chunk
        size = len(groups[-1]) + 1 if groups else 1
        if groups and size * max(max_q, q) * max(max_ctx, ctx) <= PREFILL_PADDING * (work + q * ctx):
            groups[-1].append(chunk)
            work, max_q, max_ctx = work + q * ctx, max(max_q, q), max(max_ctx, ctx)
        else:
            groups.append([chunk])
            work, max_q, max_ctx = q * ctx, q, ctx
    return groups


class ModelRunner:
    """Owns nothing but the forward: the model is whatever module it was given (possibly the trainer's own)."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, prepack_weights: bool | None = None,
                 attention_kernel: bool | None = None, compiled: CompiledForward | None = None,
                 groups: KVGroups | None = None) -> None:
        self.model = model
        self.cache = cache
        self.groups = groups or KVGroups.single(cache.shape.num_layers)  # which block table each layer reads
        self.device = cache.device
        self.page_size = cache.page_size
        self.use_flash = flash_usable(cache.device, cache.dtype, cache.page_size)
        self.fast_path_blocks: int | None = None  # flash only: max_blocks_per_request, as the engine resolved it
        if cache.device.type == "cpu":
            cpu_features()  # the one-line CPU summary, logged by the first CPU engine
        self.use_kernel = attention_kernel is not False and not self.use_flash \
            and kernel_usable(cache.device, cache.dtype)
        if attention_kernel and not self.use_kernel:
            raise ValueError(f"cpu_attention_kernel=True but the CPU attention kernel cannot serve this cache "
                             f"({cache.device}, {cache.dtype}): it needs a CPU fp32/bf16 cache, a C compiler and a "
                             f"library built for this CPU (see the log for the reason); leave it None to fall back "
                             "automatically")
        self.scratch = GatherScratch()
        # one padded call for several prefill chunks saves kernel launches on an accelerator; on the CPU the calls
        # cost little and the padding more
        self.group_prefills = cache.device.type != "cpu"
        if prepack_weights is None:
            prepack_weights = cache.device.type == "cpu" and packing_available()
        elif prepack_weights:
            require_packing(model)  # ValueError naming what this torch build / CPU cannot pack
        self.linears = PackedLinears(model) if prepack_weights else contextlib.nullcontext()
        # RMSNorms as one C call each in the eager forward (cpu/rms_norm.py); without the kernel library, their own
        self.norms = FusedNorms(model) if cache.device.type == "cpu" and load_kernel() is not None \
            else contextlib.nullcontext()
        self.compiled = compiled  # None: every step eager
        if compiled is not None:
            if cache.scratch_block is None:
                raise ValueError("the compiled forward needs a cache with a scratch page for its padding tokens")
            compiled.prepare_cache(cache.keys + cache.values)

    def check_attention(self) -> None:
        """Raise UnsupportedModelError unless every layer's attention runs through the engine's paged function.

        Otherwise every request would fail at its first forward (or, worse, attend over the packed batch without the
        cache). Classes that declare transformers' attention-backend support pass at once; for any other class a
        one-token dry run must call the paged function exactly once per KV-cache layer.
        """
        if getattr(self.model, "_supports_attention_backend", False):  # wrappers (PEFT) forward the attribute
            return
        num_layers = self.cache.shape.num_layers
        try:
            calls, rows = self._dry_run()
        except Exception as err:
            raise UnsupportedModelError(_unsupported_message(
                self.model, f"a one-token dry run with the engine's attention raised {err!r}")) from err
        layers = sorted(layer for layer, _ in calls)
        if layers != list(range(num_layers)) or rows != 1:
            raise UnsupportedModelError(_unsupported_message(
                self.model, f"a one-token dry run called the engine's attention for layers {layers} (expected "
                            f"each of its {num_layers} layers once) and returned {rows} logit rows (expected 1)"))
        logger.warning("%s does not declare transformers' attention-backend support, but a one-token dry run sent "
                       "all %d layers through the engine's attention; serving it (known to work: %s)",
                       type(self.model).__name__, num_layers, ", ".join(KNOWN_GOOD_FAMILIES))

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it attends to every key) as the model itself passes it to the paged
        attention in a one-token dry run: what the layers really do, whatever the config's fields are called."""
        calls, _ = self._dry_run()
        windows = dict(calls)
        return [windows.get(layer) for layer in range(self.cache.shape.num_layers)]

    def _dry_run(self) -> tuple[list[tuple[int, int | None]], int]:
        """One forward of one token written to slot 0 (no request owns a block yet): (layer index, sliding window)
        of each call that reached the paged attention, and how many logit rows came back."""
        probe = Request("attention-check", [0], resolve_sampling(None, None))
        probe.block_tables = [[0] for _ in range(self.groups.num_groups)]
        plan = StepPlan()
        plan.add(probe, 1)
        inputs, keep = self.build_batch(plan)
        calls: list[tuple[int, int | None]] = []
        inputs["rollout_batch"].calls = calls
        with torch.inference_mode(), engine_attention(self.model), eval_mode(self.model):
            out = self.model(**inputs, logits_to_keep=keep, use_cache=False)
        logits = getattr(out, "logits", None)
        return calls, (int(logits.shape[-2]) if isinstance(logits, torch.Tensor) and logits.dim() == 3 else -1)

    @torch.no_grad()
    def load_weights(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> frozenset[int]:
        """Copy new values into the live tensors in place (through `.data`; any dtype converted); a linear weight with
        a packed copy gets both written from the value in one pass. Returns the ids of those weights, for
        `weights_changed`."""
        fresh = set()
        for target, value in pairs:
            if isinstance(self.linears, PackedLinears) and self.linears.load(target, value):
                fresh.add(id(target))
            else:
                target.data.copy_(value)
        return frozenset(fresh)

    def weights_changed(self, fresh: Collection[int] = ()) -> None:
        """New weights are in place: mark packed copies stale (writes through `.data` do not bump version counters),
        but those `load_weights` wrote (`fresh`)."""
        if isinstance(self.linears, PackedLinears):
            self.linears.clear(fresh)

    def _layout(self, plan: StepPlan) -> tuple[torch.Tensor, ...]:
        """Per entry: query lengths, start positions, packed offsets; per token: entry (row) and position."""
        query_lens = torch.tensor(plan.query_lens, dtype=torch.long)
        starts = torch.tensor(plan.start_positions, dtype=torch.long)
        if plan.decode_only:  # token i is entry i, at its start position
            entries = torch.arange(len(plan))
            return query_lens, starts, entries, entries, starts
        offsets = torch.cumsum(query_lens, 0) - query_lens  # packed index of each entry's first token
        row_of_token = torch.repeat_interleave(torch.arange(len(plan)), query_lens)
        positions = torch.arange(plan.num_tokens) - offsets[row_of_token] + starts[row_of_token]
        return query_lens, starts, offsets, row_of_token, positions

    @staticmethod
    def _keep(plan: StepPlan, query_lens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Packed indices whose logits are needed: each sampling entry's last token, then the prompt_rows."""
        sample_rows = torch.tensor(plan.sample_rows, dtype=torch.long)
        keep = offsets[sample_rows] + query_lens[sample_rows] - 1
        if plan.prompt_rows:  # then the rows prompt logprobs need, in plan.prompt_rows order
            keep = torch.cat([keep, *(torch.arange(count) + int(offsets[entry]) + first - plan.start_positions[entry]
                                      for entry, first, count in plan.prompt_rows)])
        return keep

    def build_batch(self, plan: StepPlan) -> tuple[dict, torch.Tensor]:
        """Model inputs for the packed varlen batch, and the packed indices whose logits are needed."""
        query_lens, starts, offsets, row_of_token, positions = self._layout(plan)
        ends = starts + query_lens
        keep = self._keep(plan, query_lens, offsets)
        host = [torch.tensor(plan.token_ids, dtype=torch.long), positions, keep]
        layouts = [self._group_host(plan, group, host, query_lens, ends, offsets, row_of_token, positions)
                   for group in range(self.groups.num_groups)]
        moved = self._send(host)  # one copy; the device tensors in the order of `host`
        rest = iter(moved[3:])
        batches = [self._group_batch(layout, rest, query_lens, ends, row_of_token, positions) for layout in layouts]
        batch = batches[0]
        if len(batches) > 1:
            batch.by_layer = [batches[group] for group in self.groups.layer_group]
        inputs = {"input_ids": moved[0][None], "position_ids": moved[1][None], "rollout_batch": batch}
        return inputs, moved[2]

    def _slots(self, tables: torch.Tensor, row_of_token: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Where each token's K/V is written: its position's page in its row of `tables`, and the offset there."""
        page = self.page_size
        return tables[row_of_token, positions // page] * page + positions % page

    def _group_host(self, plan: StepPlan, group: int, host: list[torch.Tensor], query_lens: torch.Tensor,
                    ends: torch.Tensor, offsets: torch.Tensor, row_of_token: torch.Tensor,
                    positions: torch.Tensor) -> _GroupHost:
        """One KV group's metadata on the host: its block tables, and the tensors appended to `host` (the slots its
        layers write, then what the attention path needs) for `_group_batch` to take back in the same order."""
        rows = [tables[group] for tables in plan.block_tables]
        width = max(len(t) for t in rows)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.long)
        host.append(self._slots(tables, row_of_token, positions))
        layout = _GroupHost(tables)
        if self.use_flash:
            host += flash_host_tensors(tables, query_lens, ends)
        elif not self.use_kernel:
            fresh = self.cache.take_fresh(tables.flatten())  # only page gathers read slots no token wrote yet
            layout.fresh = fresh is not None
            host += [] if fresh is None else [fresh]
            layout.parts = self._sdpa_parts(tables, query_lens, ends, offsets)
            host += [getattr(part, name) for kind in layout.parts for part in kind for name in part.TENSORS]
        return layout

    def _group_batch(self, layout: _GroupHost, moved: Iterator[torch.Tensor], query_lens: torch.Tensor,
                     ends: torch.Tensor, row_of_token: torch.Tensor, positions: torch.Tensor) -> AttentionBatch:
        """The AttentionBatch of one group, from its tensors as they arrived on the device (`moved`, in the order
        `_group_host` appended them)."""
        batch = AttentionBatch(cache=self.cache, slots=next(moved), scratch=self.scratch)
        if self.use_flash:
            batch.flash = build_flash_batch([next(moved) for _ in range(FLASH_HOST_TENSORS)], query_lens, ends,
                                            self.fast_path_blocks)
        elif self.use_kernel:
            batch.kernel = KernelBatch(positions, row_of_token, layout.tables)
        else:
            if layout.fresh:
                self.cache.zero_blocks(next(moved))
            for part in (part for kind in layout.parts for part in kind):
                for name in part.TENSORS:
                    setattr(part, name, next(moved))
            batch.decode, batch.prefills, batch.prefill_groups = layout.parts
        return batch

    def _send(self, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's int64 host tensors on the runner's device, through one copy: each `.to(device)` of its own
        would be a blocking host-to-device transfer on CUDA, several per step. On the CPU: `host` itself."""
        if self.device.type == "cpu":
            return host
        sizes = [t.numel() for t in host]
        pinned = self.device.type == "cuda" and torch.cuda.is_available()  # pageable memory would block the copy
        buffer = torch.empty(sum(sizes), dtype=torch.long, pin_memory=pinned)
        torch.cat([t.reshape(-1) for t in host], out=buffer)
        moved = buffer.to(self.device, non_blocking=pinned).split(sizes)
        return [m.view(t.shape) for m, t in zip(moved, host)]

    def build_step(self, plan: StepPlan, path: CompiledPath) -> tuple[dict, int]:
        """Inputs of a compiled forward, padded so shapes repeat, and how many of its logit rows are real.

        The T tokens are padded to `pad_to(T, q interval)` with tokens of one extra table row whose only block is the
        cache's scratch page (position 0, slot = the scratch page's first): they write their K/V where no request
        reads and attend only to that key, so they never touch a real token's result. The kept rows (a dynamic dim
        at every level) are padded to MIN_DIM with repeats, and the tables to MIN_DIM rows and the kv padding width.
        """
        page = self.page_size
        query_lens, _, offsets, row_of_token, positions = self._layout(plan)
        tokens = plan.num_tokens
        padded = pad_to(tokens, path.q_interval)
        width = self.compiled.table_width(max(len(tables[0]) for tables in plan.block_tables), page)
        token_ids = plan.token_ids
        if padded > tokens:
            row_of_token = torch.cat([row_of_token, torch.full((padded - tokens,), len(plan), dtype=torch.long)])
            positions = torch.cat([positions, torch.zeros(padded - tokens, dtype=torch.long)])
            token_ids = token_ids + [0] * (padded - tokens)
        group_tables = []
        for group in range(self.groups.num_groups):
            rows = [tables[group] + [0] * (width - len(tables[group])) for tables in plan.block_tables]
            if padded > tokens:
                rows.append([self.cache.scratch_block] + [0] * (width - 1))
            rows += [[0] * width] * max(MIN_DIM - len(rows), 0)  # rows no token uses
            group_tables.append(torch.tensor(rows, dtype=torch.long))
        group_slots = [self._slots(tables, row_of_token, positions) for tables in group_tables]

        keep = self._keep(plan, query_lens, offsets)
        count = len(keep)
        extra = pad_to(count, 0) - count
        if extra:
            keep = torch.cat([keep, keep[-1:].expand(extra) if count else torch.zeros(extra, dtype=torch.long)])
        groups = len(group_tables)
        token_ids, positions, row_of_token, keep, *moved = self._send(
            [torch.tensor(token_ids, dtype=torch.long), positions, row_of_token, keep, *group_slots, *group_tables])
        step = StepTensors(tuple(moved[:groups]), positions, row_of_token, tuple(moved[groups:]),
                           self.groups.layer_group, self.cache.keys, self.cache.values, page, self.use_kernel)
        inputs = {"input_ids": token_ids[None], "position_ids": positions[None], "keep": keep, "step": step}
        return inputs, count

    def _sdpa_parts(self, tables: torch.Tensor, query_lens: torch.Tensor, ends: torch.Tensor,
                    offsets: torch.Tensor) -> tuple[list[DecodeBucket], list[PrefillSegment], list[PrefillGroup]]:
        """Decode rows attend in length buckets over their gathered pages, prefill chunks alone or in groups of
        similar size; built on the host (the caller sends their tensors to the device)."""
        page = self.page_size
        decode, prefills, groups = [], [], []
        decode_rows = (query_lens == 1).nonzero().flatten()
        if len(decode_rows):
            lens = ends[decode_rows]
            order = torch.argsort(lens)
            for rows in _length_buckets(decode_rows[order], lens[order]):
                row_lens = ends[rows]
                width = int(row_lens.max())
                decode.append(DecodeBucket(offsets[rows], tables[rows, :-(-width // page)].flatten(), row_lens, width))
        prefill_rows = (query_lens > 1).nonzero().flatten().tolist()
        chunks = [(row, int(query_lens[row]), int(ends[row])) for row in prefill_rows]
        for group in _prefill_groups(chunks) if self.group_prefills else [[chunk] for chunk in chunks]:
            if len(group) == 1:
                row, q, ctx = group[0]
                start = int(offsets[row])
                prefills.append(PrefillSegment(start, start + q, tables[row, :-(-ctx // page)], ctx))
            else:
                groups.append(self._prefill_group(group, tables, offsets))
        return decode, prefills, groups

    def _prefill_group(self, group: list[tuple[int, int, int]], tables: torch.Tensor,
                       offsets: torch.Tensor) -> PrefillGroup:
        """One padded call's metadata for the chunks `(row, query_len, context_len)` of `group`."""
        rows, q_lens, ctx = (torch.tensor(c, dtype=torch.long) for c in zip(*group))
        q_len, width = int(q_lens.max()), int(ctx.max())
        starts = offsets[rows][:, None]
        index = torch.arange(q_len)[None, :]
        real = index < q_lens[:, None]  # [S, q_len]
        queries = torch.where(real, starts + index, starts).flatten()
        positions = torch.where(real, (ctx - q_lens)[:, None] + index, 0)
        padded_rows = real.flatten().nonzero().flatten()
        blocks = tables[rows, :-(-width // self.page_size)].flatten()
        return PrefillGroup(queries, positions, blocks, padded_rows, queries[padded_rows], q_len, width)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor:
        """fp32 logits `[len(plan.sample_rows), vocab]` at the last token of every sampling entry.

        A plan with `prompt_rows` gets those rows after the sampling rows, all in the model's dtype (the sampler and
        prompt_logprobs.py convert what they use to fp32 in slices, so a long prefill chunk never holds its whole
        `[tokens, vocab]` block twice).
        """
        logits = None
        if self.compiled is not None:
            logits = self._run_compiled(plan)
        if logits is None:
            inputs, keep = self.build_batch(plan)
            with engine_attention(self.model), eval_mode(self.model), self.linears, self.norms:
                logits = self.model(**inputs, logits_to_keep=keep, use_cache=False).logits[0]
        return logits if plan.prompt_rows else logits.float()

    def _run_compiled(self, plan: StepPlan) -> torch.Tensor | None:
        """The step through its compiled callable; None when its kind of step runs eagerly. A callable that fails to
        compile (dynamo or the backend raised before anything ran) is dropped with the error logged, and the engine
        serves that kind of step eagerly from then on instead of failing every request."""
        path = self.compiled.path_for(plan.decode_only)
        if path is None:
            return None
        inputs, count = self.build_step(plan, path)
        packed = self.linears if isinstance(self.linears, PackedLinears) else None
        try:
            with engine_attention(self.model), eval_mode(self.model), active_linears(packed):
                return self.compiled(path, self.model, **inputs)[0, :count]
        except torch._dynamo.exc.TorchDynamoException:
            logger.exception("compiling the forward of %s failed (%s); those steps run eagerly from now on",
                             type(self.model).__name__, path.config)
            self.compiled.drop(path)
            return None
