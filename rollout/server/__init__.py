"""OpenAI-compatible HTTP serving and RL control endpoints on one ContinuousBatchingManager.

`create_app(model, tokenizer, model_name)` builds the FastAPI app; `serve(args)` loads a local checkpoint and runs
uvicorn (options from `build_parser_args`). Talk to it with any OpenAI client, or with `rollout.client.RolloutClient`
for rollouts with the full logprob contract and weight updates.
"""

from rollout.server.app import build_parser_args, create_app, load_model, serve
from rollout.server.backend import ServerBackend

__all__ = ["ServerBackend", "build_parser_args", "create_app", "load_model", "serve"]
