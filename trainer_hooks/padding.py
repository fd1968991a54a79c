"""The loss forward without most of its padding: rows of similar length scored together on trimmed columns.

TRL scores a generation batch in one forward over the batch padded to its longest row; with long-tailed completion
lengths most of that forward is padding. Here rows are sorted by their real span and grouped into chunks whose shared
padding stays small, each chunk runs on its own columns with the padded batch's position ids, and the results are put
back in TRL's layout, so per-token logprobs, entropies and gradients match TRL's single forward up to float rounding.
"""

from __future__ import annotations

import torch

# Padding trim: a chunk of rows takes up to this much padding (as a fraction of its real tokens) before a new chunk
# starts, and chunks below MIN_CHUNK_TOKENS are always grown (tiny forwards waste more than padding does). GRPO groups
# share a prompt, so rows come in a few distinct lengths and a tight slack cuts nearly all padding in a few chunks
# (benchmarks/RESULTS.md, "GRPO step": slack 0.02 against 0.15).
TRIM_SLACK = 0.02
MIN_CHUNK_TOKENS = 512


def unpadded_logps(trainer, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                    batch_size: int | None, compute_entropy: bool):
    """TRL's (logps, entropies, None) for a text batch, computed chunk by chunk on trimmed columns; None to let TRL
    do it (nothing to trim, or a row with no prompt token before its completion).

    Like TRL's forward: labels are the input ids where the attention mask is 1, only the last `logits_to_keep`
    columns are scored, masked positions score 0, and position ids are the column indices of the padded batch.
    """
    rows, width = input_ids.shape
    start = width - logits_to_keep  # TRL scores label columns start..width-1
    real = attention_mask.bool()
    cols = torch.arange(width, device=input_ids.device).expand(rows, width)
    first = torch.where(real, cols, width).min(1).values.tolist()
    last = torch.where(real, cols, -1).max(1).values.tolist()
    scored = [i for i in range(rows) if last[i] >= start]
    if not scored or any(first[i] >= start for i in scored):
        return None
    limit = batch_size or rows
    chunks, cur, lo, hi, useful = [], [], 0, 0, 0
    for i in sorted(scored, key=lambda i: last[i] - first[i], reverse=True):
        new_lo, new_hi = (min(lo, first[i]), max(hi, last[i] + 1)) if cur else (first[i], last[i] + 1)
        span = last[i] + 1 - first[i]
        padded = (len(cur) + 1) * (new_hi - new_lo)
        if cur and (len(cur) >= limit or (padded > MIN_CHUNK_TOKENS and padded > (1 + TRIM_SLACK) * (useful + span))):
            chunks.append((cur, lo, hi))
            cur, new_lo, new_hi, useful = [], first[i], last[i] + 1, 0
        cur, lo, hi, useful = cur + [i], new_lo, new_hi, useful + span
    chunks.append((cur, lo, hi))
    if len(chunks) == 1 and lo == 0 and hi == width and len(cur) == rows:
        return None  # nothing to trim
    kept = sum(len(members) * (hi - lo) for members, lo, hi in chunks)
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["rollout/trimmed_padding_fraction"].append(1.0 - kept / (rows * width))
    logps, entropies, order = [], [], []
    for members, lo, hi in chunks:
        index = torch.tensor(members, device=input_ids.device)
        ids, mask = input_ids[index, lo:hi], attention_mask[index, lo:hi]
        keep = hi - start
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-keep] = -100
        positions = torch.arange(lo, hi, device=ids.device).expand(len(members), hi - lo)
        with trainer.accelerator.autocast():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels, fused_lm_head=True)
        logps.append(torch.nn.functional.pad(out.log_probs[:, -keep:], (0, width - hi)))
        if compute_entropy:
            entropies.append(torch.nn.functional.pad(out.entropy[:, -keep:], (0, width - hi)))
        order += members
    unscored = [i for i in range(rows) if last[i] < start]
    if unscored:  # rows whose completion is fully masked score 0 everywhere, as in TRL's forward
        zeros = logps[0].new_zeros(len(unscored), logits_to_keep)
        logps.append(zeros)
        if compute_entropy:
            entropies.append(zeros)
        order += unscored
    inverse = torch.empty(rows, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(rows)
    inverse = inverse.to(input_ids.device)
    entropy = torch.cat(entropies).index_select(0, inverse) if compute_entropy else None
    return torch.cat(logps).index_select(0, inverse), entropy, None
