"""Multi-turn agent episodes: the model generates, an environment answers with tokens to append, the model goes on.

Token in, token out: trainers get the exact sequence the model saw, a mask of the model's tokens and the per-token
RL contract for those tokens, and the engine keeps each conversation's KV from one turn to the next. Entry point:
`RolloutGenerator.run_episodes`.
"""

from rollout.rl.agents.environment import Environment, EnvResponse, EpisodeInfo, ModelTurn, per_episode
from rollout.rl.agents.episode import Episode, EpisodeBatch, TurnSpan

__all__ = ["EnvResponse", "Environment", "Episode", "EpisodeBatch", "EpisodeInfo", "ModelTurn", "TurnSpan",
           "per_episode"]
