"""The scheduling core: requests, the step plan, the block pool and the KV bookkeeping, stopping and stats.

The scheduler decides who runs each step; nothing here touches the model."""
