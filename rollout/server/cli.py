"""The `rollout serve` command: its options, the serve-extra check, and the launch.

Importing this module needs neither fastapi nor torch, so the options parse (and `--help` answers) in an install
without the serve extra; the extra is checked when the command runs, and the app module is only imported then.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rollout.loading import DTYPES, MissingExtraError, require_extra
from rollout.loading import load_model as _load

logger = logging.getLogger(__name__)

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
# rollout.config.SCHEDULER_TYPES, repeated here because rollout.config imports torch (a test keeps them equal)
SCHEDULER_CHOICES = ("fifo", "prefill_first")


def check_serve_extra() -> None:
    """Raise MissingExtraError (one line: what to install) unless every module of the serve extra imports."""
    require_extra("serve", "serve", SERVE_MODULES)


def build_parser_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` options to `parser` (rollout/cli.py mounts them on its sub-command)."""
    parser.add_argument("--model", required=True, help="local model directory (config.json, weights, tokenizer) or "
                        "hub id")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 exposes the server to the "
                        "network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: --model)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype (auto: the checkpoint's)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per KV block (default: per device)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: fill the memory budget)")
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="token budget per forward pass "
                        "(default: per device)")
    parser.add_argument("--max-requests-per-batch", type=int, default=None, help="requests per forward pass "
                        "(default: the engine's)")
    parser.add_argument("--scheduler-type", choices=SCHEDULER_CHOICES, default=None,
                        help="scheduling policy (default: the engine's)")
    parser.add_argument("--seed", type=int, default=None, help="seed for requests that bring none (default: none)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="server log level")
    return parser


def continuous_batching_config_from_args(args: argparse.Namespace):
    """The ContinuousBatchingConfig the serve options ask for (unset options keep the config's defaults)."""
    from rollout.config import ContinuousBatchingConfig

    kwargs = {name: getattr(args, name, None) for name in ("page_size", "num_blocks", "max_batch_tokens",
                                                           "max_requests_per_batch", "scheduler_type", "seed")}
    return ContinuousBatchingConfig(**{k: v for k, v in kwargs.items() if v is not None})


def load_model(path: str, dtype: str = "auto", device: str | None = None) -> tuple[Any, Any]:
    """Model and tokenizer for serving: `--model` checked (ModelLoadError otherwise), moved to `device` (default:
    cuda if available, else cpu) and frozen."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = _load(path, dtype, device)
    model.eval().requires_grad_(False)
    return model, tokenizer


def serve(args: argparse.Namespace) -> None:
    """Check the extra and `--model`, load the model, build the app and run uvicorn until interrupted.

    Raises MissingExtraError or ModelLoadError (one-line messages) before anything heavy happens.
    """
    check_serve_extra()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from rollout.server.app import create_app

    model, tokenizer = load_model(args.model, args.dtype, getattr(args, "device", None))
    name = args.served_model_name or args.model
    app = create_app(model, tokenizer, name, continuous_batching_config_from_args(args), model_aliases=[args.model])
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


__all__ = ["MissingExtraError", "build_parser_args", "check_serve_extra", "continuous_batching_config_from_args",
           "load_model", "serve"]
