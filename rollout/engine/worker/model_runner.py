"""Turns a StepPlan into tensors, runs one packed forward with the engine's attention, returns sampled-row logits.

The forward runs eagerly, or through the compiled callables of compiled_forward.py (default_compile_level > 0), which
take the same step as padded tensors (`build_step`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from rollout.engine.core.request import Request
from rollout.engine.core.step import StepPlan
from rollout.engine.cpu.features import cpu_features
from rollout.engine.cpu.kernel import KernelBatch, kernel_usable
from rollout.engine.cpu.packed_linear import PackedLinears, packing_available, require_packing
from rollout.engine.cpu.packed_linear_op import active_linears
from rollout.engine.sample.resolve import resolve_sampling
from rollout.engine.worker.attention import (
    AttentionBatch,
    DecodeBucket,
    GatherScratch,
    PrefillSegment,
    StepTensors,
    engine_attention,
)
from rollout.engine.worker.compiled_forward import MIN_DIM, CompiledForward, CompiledPath, pad_to
from rollout.engine.worker.flash_backend import build_flash_batch, flash_usable
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


class ModelRunner:
    """Owns nothing but the forward: the model is whatever module it was given (possibly the trainer's own)."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, prepack_weights: bool | None = None,
                 attention_kernel: bool | None = None, compiled: CompiledForward | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.page_size = cache.page_size
        self.use_flash = flash_usable(cache.device, cache.dtype, cache.page_size)
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
        if prepack_weights is None:
            prepack_weights = cache.device.type == "cpu" and packing_available()
        elif prepack_weights:
            require_packing(model)  # ValueError naming what this torch build / CPU cannot pack
        self.linears = PackedLinears(model) if prepack_weights else contextlib.nullcontext()
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
        if sorted(calls) != list(range(num_layers)) or rows != 1:
            raise UnsupportedModelError(_unsupported_message(
                self.model, f"a one-token dry run called the engine's attention for layers {sorted(calls)} (expected "
                            f"each of its {num_layers} layers once) and returned {rows} logit rows (expected 1)"))
        logger.warning("%s does not declare transformers' attention-backend support, but a one-token dry run sent "
                       "all %d layers through the engine's attention; serving it (known to work: %s)",
                       type(self.model).__name__, num_layers, ", ".join(KNOWN_GOOD_FAMILIES))

    def _dry_run(self) -> tuple[list[int], int]:
        """One forward of one token written to slot 0 (no request owns a block yet): the layer indices that reached
        the paged attention, and how many logit rows came back."""
        probe = Request("attention-check", [0], resolve_sampling(None, None))
        probe.block_table = [0]
        plan = StepPlan()
        plan.add(probe, 1)
        inputs, keep = self.build_batch(plan)
        calls: list[int] = []
        inputs["rollout_batch"].calls = calls
        with torch.inference_mode(), engine_attention(self.model), eval_mode(self.model):
            out = self.model(**inputs, logits_to_keep=keep, use_cache=False)
        logits = getattr(out, "logits", None)
        return calls, (int(logits.shape[-2]) if isinstance(logits, torch.Tensor) and logits.dim() == 3 else -1)

    def weights_changed(self) -> None:
        """New weights are in place: drop packed copies (writes through `.data` do not bump version counters)."""
        if isinstance(self.linears, PackedLinears):
            self.linears.clear()

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
        dev, page = self.device, self.page_size
        query_lens, starts, offsets, row_of_token, positions = self._layout(plan)
        ends = starts + query_lens

        max_blocks = max(len(t) for t in plan.block_tables)
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in plan.block_tables], dtype=torch.long)
        slots = tables[row_of_token, positions // page] * page + positions % page
        if not (self.use_kernel or self.use_flash):  # only page gathers read slots no token has written yet
            self.cache.prepare(tables.flatten())

        batch = AttentionBatch(cache=self.cache, slots=slots.to(dev), scratch=self.scratch)
        if self.use_flash:
            batch.flash = build_flash_batch(tables, query_lens, ends, dev)
        elif self.use_kernel:
            batch.kernel = KernelBatch(positions, row_of_token, tables)
        else:
            self._add_sdpa_metadata(batch, tables, query_lens, ends, offsets)

        keep = self._keep(plan, query_lens, offsets).to(dev)
        inputs = {
            "input_ids": torch.tensor(plan.token_ids, dtype=torch.long, device=dev)[None],
            "position_ids": positions.to(dev)[None],
            "rollout_batch": batch,
        }
        return inputs, keep

    def build_step(self, plan: StepPlan, path: CompiledPath) -> tuple[dict, int]:
        """Inputs of a compiled forward, padded so shapes repeat, and how many of its logit rows are real.

        The T tokens are padded to `pad_to(T, q interval)` with tokens of one extra table row whose only block is the
        cache's scratch page (position 0, slot = the scratch page's first): they write their K/V where no request
        reads and attend only to that key, so they never touch a real token's result. The kept rows (a dynamic dim
        at every level) are padded to MIN_DIM with repeats, and the tables to MIN_DIM rows and the kv padding width.
        """
        dev, page = self.device, self.page_size
        query_lens, _, offsets, row_of_token, positions = self._layout(plan)
        tokens = plan.num_tokens
        padded = pad_to(tokens, path.q_interval)
        width = self.compiled.table_width(max(len(t) for t in plan.block_tables), page)
        rows = [t + [0] * (width - len(t)) for t in plan.block_tables]
        token_ids = plan.token_ids
        if padded > tokens:
            row_of_token = torch.cat([row_of_token, torch.full((padded - tokens,), len(rows), dtype=torch.long)])
            positions = torch.cat([positions, torch.zeros(padded - tokens, dtype=torch.long)])
            rows.append([self.cache.scratch_block] + [0] * (width - 1))
            token_ids = token_ids + [0] * (padded - tokens)
        rows += [[0] * width] * max(MIN_DIM - len(rows), 0)  # rows no token uses
        tables = torch.tensor(rows, dtype=torch.long)
        slots = tables[row_of_token, positions // page] * page + positions % page

        keep = self._keep(plan, query_lens, offsets)
        count = len(keep)
        extra = pad_to(count, 0) - count
        if extra:
            keep = torch.cat([keep, keep[-1:].expand(extra) if count else torch.zeros(extra, dtype=torch.long)])
        step = StepTensors(slots.to(dev), positions.to(dev), row_of_token.to(dev), tables.to(dev), self.cache.keys,
                           self.cache.values, page, self.use_kernel)
        inputs = {
            "input_ids": torch.tensor(token_ids, dtype=torch.long, device=dev)[None],
            "position_ids": positions.to(dev)[None],
            "keep": keep.to(dev),
            "step": step,
        }
        return inputs, count

    def _add_sdpa_metadata(self, batch: AttentionBatch, tables: torch.Tensor, query_lens: torch.Tensor,
                           ends: torch.Tensor, offsets: torch.Tensor) -> None:
        """Decode rows attend in length buckets over their gathered pages; each prefill chunk attends alone."""
        dev, page = self.device, self.page_size
        decode_rows = (query_lens == 1).nonzero().flatten()
        if len(decode_rows):
            lens = ends[decode_rows]
            order = torch.argsort(lens)
            for rows in _length_buckets(decode_rows[order], lens[order]):
                row_lens = ends[rows]
                num_blocks = -(-int(row_lens.max()) // page)
                batch.decode.append(DecodeBucket(offsets[rows].to(dev), tables[rows, :num_blocks].flatten().to(dev),
                                                 row_lens.to(dev)))
        for row in (query_lens > 1).nonzero().flatten().tolist():
            ctx = int(ends[row])
            start = int(offsets[row])
            batch.prefills.append(PrefillSegment(start, start + int(query_lens[row]),
                                                 tables[row, :-(-ctx // page)].to(dev), ctx))

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
            with engine_attention(self.model), eval_mode(self.model), self.linears:
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
