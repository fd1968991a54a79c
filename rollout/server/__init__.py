"""OpenAI-compatible HTTP serving and RL control endpoints on one ContinuousBatchingManager.

`create_app(model, tokenizer, model_name, settings=ServerSettings(...))` builds the FastAPI app; `serve(args)` loads a
checkpoint and runs uvicorn (options from `build_parser_args`). Talk to it with any OpenAI client, or with
`rollout.client.RolloutClient` for rollouts with the full logprob contract and weight updates.

Names are imported on first use, so `rollout.server.cli` (the command's options) works without fastapi installed.
"""

from __future__ import annotations

from rollout.lazy_exports import lazy_exports

_EXPORTS = {
    "create_app": "rollout.server.app",
    "OpenAIServing": "rollout.server.serving",
    "ServerBackend": "rollout.server.backend",
    "ServerSettings": "rollout.server.settings",
    "build_parser_args": "rollout.server.cli",
    "load_model": "rollout.server.cli",
    "serve": "rollout.server.cli",
}


__getattr__, __dir__ = lazy_exports("rollout.server", _EXPORTS, globals())


__all__ = ["OpenAIServing", "ServerBackend", "ServerSettings", "build_parser_args", "create_app", "load_model", "serve"]
