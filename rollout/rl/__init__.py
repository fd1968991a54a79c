"""The RL layer: rollout groups, the logprob contract, and versioned weight updates on top of the engine."""
