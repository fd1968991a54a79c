"""Turns a StepPlan into tensors, runs one packed forward with the engine's attention, returns sampled-row logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from rollout.engine.attention import AttentionBatch, DecodeBucket, GatherScratch, PrefillSegment, engine_attention
from rollout.engine.cpu_kernel import KernelBatch, kernel_usable
from rollout.engine.flash_backend import build_flash_batch, flash_usable
from rollout.engine.kv_cache import PagedKVCache
from rollout.engine.packed_linear import PackedLinears, packing_available
from rollout.engine.step import StepPlan


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
                 attention_kernel: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.page_size = cache.page_size
        self.use_flash = flash_usable(cache.device, cache.dtype, cache.page_size)
        self.use_kernel = attention_kernel is not False and not self.use_flash \
            and kernel_usable(cache.device, cache.dtype)
        if attention_kernel and not self.use_kernel:
            raise ValueError(f"cpu_attention_kernel=True but the CPU attention kernel cannot serve this cache "
                             f"({cache.device}, {cache.dtype}): it needs a CPU fp32/bf16 cache and a C compiler with "
                             f"OpenMP (see the log for the build error); leave it None to fall back automatically")
        self.scratch = GatherScratch()
        if prepack_weights is None:
            prepack_weights = cache.device.type == "cpu" and packing_available()
        elif prepack_weights and not packing_available():
            raise ValueError("prepack_weights=True needs a torch build with oneDNN (torch.backends.mkldnn); "
                             "leave it None to use packing only where it is available")
        self.linears = PackedLinears(model) if prepack_weights else contextlib.nullcontext()

    def weights_changed(self) -> None:
        """New weights are in place: drop packed copies (writes through `.data` do not bump version counters)."""
        if isinstance(self.linears, PackedLinears):
            self.linears.clear()

    def build_batch(self, plan: StepPlan) -> tuple[dict, torch.Tensor]:
        """Model inputs for the packed varlen batch, and the packed indices whose logits are needed."""
        dev, page = self.device, self.page_size
        query_lens = torch.tensor(plan.query_lens, dtype=torch.long)
        starts = torch.tensor(plan.start_positions, dtype=torch.long)
        ends = starts + query_lens
        offsets = torch.cumsum(query_lens, 0) - query_lens  # packed index of each entry's first token
        row_of_token = torch.repeat_interleave(torch.arange(len(plan)), query_lens)
        positions = torch.arange(plan.num_tokens) - offsets[row_of_token] + starts[row_of_token]

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

        sample_rows = torch.tensor(plan.sample_rows, dtype=torch.long)
        keep = (offsets[sample_rows] + query_lens[sample_rows] - 1).to(dev)
        inputs = {
            "input_ids": torch.tensor(plan.token_ids, dtype=torch.long, device=dev)[None],
            "position_ids": positions.to(dev)[None],
            "rollout_batch": batch,
        }
        return inputs, keep

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
        """fp32 logits `[len(plan.sample_rows), vocab]` at the last token of every sampling entry."""
        inputs, keep = self.build_batch(plan)
        with engine_attention(self.model), eval_mode(self.model), self.linears:
            out = self.model(**inputs, logits_to_keep=keep, use_cache=False)
        return out.logits[0].float()
