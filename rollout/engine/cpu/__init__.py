"""CPU execution: what this CPU and torch can run fast (probed once), the C kernels, prepacked linear weights
and the thread budget."""
