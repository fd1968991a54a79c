"""The `rollout serve` command: its options, the serve-extra check, and the launch.

Importing this module needs neither fastapi nor torch, so the options parse (and `--help` answers) in an install
without the serve extra; the extra is checked when the command runs, and the app module is only imported then.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from rollout.loading import DTYPES, MissingExtraError, check_model, require_extra
from rollout.loading import load_model as _load
from rollout.server.settings import ServerSettings

logger = logging.getLogger(__name__)

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")
# rollout.config.SCHEDULER_TYPES, repeated here because rollout.config imports torch (a test keeps them equal)
SCHEDULER_CHOICES = ("fifo", "prefill_first")
API_KEY_ENV = "ROLLOUT_API_KEY"
ADMIN_KEY_ENV = "ROLLOUT_ADMIN_KEY"
DEFAULT_WARMUP_TOKENS = 512  # what it costs on W1: benchmarks/RESULTS.md, "Serving"
# `rollout serve` compiles the forward on CPU unless told otherwise: measured against vLLM's server at both defaults,
# eager fell behind at 64 streams and level 1 did not, and its start-up stayed shorter than vLLM's
# (benchmarks/RESULTS.md, "Serving"). Other devices keep the engine's default.
SERVE_CPU_COMPILE_LEVEL = 1


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
    parser.add_argument("--served-model-name", default=None, help="name clients pass as `model` and /v1/models shows "
                        "(default: the model directory's name, or the hub id); --model is accepted too")
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
    parser.add_argument("--cpu-threads", type=_cpu_threads, default="auto",
                        help="CPU: intra-op threads per engine step, an integer or 'auto' (at most OMP_NUM_THREADS / "
                        "torch's default, fewer while other processes keep the cores busy)")
    parser.add_argument("--compile-level", type=int, choices=(0, 1, 2, 3), default=None,
                        help=f"CPU: torch.compile level of the engine's forward (default {SERVE_CPU_COMPILE_LEVEL}: "
                        "the warm-up compiles before the server listens, seconds to a minute with inductor's cache "
                        "cold, less when warm; 0: eager, a faster start; see docs/serving.md)")
    parser.add_argument("--warmup-tokens", type=_non_negative_int, default=DEFAULT_WARMUP_TOKENS,
                        help="before listening, run one throwaway step per step size up to this many prompt tokens, "
                        "so the first requests do not pay kernel generation or compilation; 0 skips it")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="server log level")
    _add_security_args(parser.add_argument_group("access (see the README's Security section)"))
    _add_limit_args(parser.add_argument_group("limits per request and per connection"))
    return parser


def _add_security_args(group) -> None:
    group.add_argument("--api-key", default=None, help=f"key of the OpenAI routes and /metrics (Authorization: Bearer; "
                       f"default: ${API_KEY_ENV}; prefer the variable: arguments show in the process list)")
    group.add_argument("--admin-key", default=None, help="key of the RL control routes (weight updates, pause, resume, "
                       f"reset_prefix_cache; default: ${ADMIN_KEY_ENV}); without one they answer on a loopback "
                       "--host only")
    group.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="Host header name accepted when no API key is set, besides the loopback names "
                       "(repeatable; '*' accepts any)")
    group.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="web origin whose pages may call the server, e.g. https://app.example (repeatable; none "
                       "by default)")
    group.add_argument("--weights-dir", action="append", default=[], metavar="DIR",
                       help="directory POST /update_weights {path} may load checkpoints from (repeatable; none by "
                       "default: path loads are refused, uploads still work)")


def _add_limit_args(group) -> None:
    d = ServerSettings()
    group.add_argument("--max-n", type=int, default=d.max_n, help="samples per prompt (default: %(default)s)")
    group.add_argument("--max-choices", type=int, default=d.max_choices,
                       help="sequences per request, prompts x n (default: %(default)s)")
    group.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help="size of a JSON request body (default: %(default)s)")
    group.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                       help="seconds a request body may stall between two pieces (default: %(default)s)")
    group.add_argument("--max-upload-bytes", type=int, default=None,
                       help="bytes of one chunked weight upload (default: the model's size in float64)")
    group.add_argument("--max-uploads", type=int, default=d.max_uploads,
                       help="chunked weight uploads open at once (default: %(default)s)")
    group.add_argument("--upload-ttl", type=float, default=d.upload_ttl_s,
                       help="seconds an upload may stay idle before it is dropped (default: %(default)s)")
    group.add_argument("--pause-timeout", type=float, default=d.pause_timeout_s,
                       help="seconds a request may wait behind POST /pause before it is answered 503 "
                       "(default: %(default)s)")
    group.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                       help="size of a request's line and headers (default: %(default)s)")
    group.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a client may take to send a request's line and headers (default: %(default)s)")
    group.add_argument("--timeout-keep-alive", type=int, default=5,
                       help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    group.add_argument("--limit-concurrency", type=int, default=1024,
                       help="connections and requests at once; more are answered 503 (default: %(default)s)")
    group.add_argument("--shutdown-timeout", type=int, default=10,
                       help="seconds SIGTERM waits for open requests before closing them (default: %(default)s)")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The ServerSettings the serve options ask for; keys default to $ROLLOUT_API_KEY and $ROLLOUT_ADMIN_KEY."""
    return ServerSettings(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        admin_key=args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None,
        host=args.host, allowed_hosts=tuple(args.allowed_host), cors_origins=tuple(args.cors_origin),
        weights_dirs=tuple(args.weights_dir), max_n=args.max_n, max_choices=args.max_choices,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout, max_upload_bytes=args.max_upload_bytes,
        max_uploads=args.max_uploads, upload_ttl_s=args.upload_ttl, pause_timeout_s=args.pause_timeout)


def served_name(model: str) -> str:
    """The default served model name: a local directory's own name (the server's paths stay private), or the hub
    id as given."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    """`int(text)` when it is at least `minimum`; else an ArgumentTypeError saying what was `expected`."""
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _cpu_threads(text: str) -> int | str:
    return text if text == "auto" else _int_at_least(text, 1, "'auto' or an integer >= 1")


def continuous_batching_config_from_args(args: argparse.Namespace, device: str = "cpu"):
    """The ContinuousBatchingConfig the serve options ask for, for a model on `device` (unset options keep the
    config's defaults, but the compile level: default_cpu_compile_level() on CPU)."""
    from rollout.config import ContinuousBatchingConfig

    names = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type", "seed",
             "cpu_threads")
    kwargs = {name: getattr(args, name, None) for name in names}
    level = getattr(args, "compile_level", None)
    kwargs["default_compile_level"] = default_cpu_compile_level() if level is None and device == "cpu" else level
    return ContinuousBatchingConfig(**{k: v for k, v in kwargs.items() if v is not None})


def default_cpu_compile_level() -> int:
    """SERVE_CPU_COMPILE_LEVEL where inductor finds a C++ compiler; 0 (eager, said once) where it finds none, since
    every compile would fail at the first step and log an error before the engine fell back."""
    from rollout.engine.worker.compiled_forward import cpp_compiler

    if cpp_compiler() is not None:
        return SERVE_CPU_COMPILE_LEVEL
    logger.info("no C++ compiler for torch.compile (install g++, or set CXX): serving eagerly (--compile-level 0)")
    return 0


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
    check_model(args.model)  # a bad --model fails in a second, before torch is imported
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from rollout.server.app import create_app
    from rollout.server.limits import h11_protocol
    from rollout.thread_teams import run_in_fresh_thread

    settings = settings_from_args(args)  # bad option values fail here, before the model loads
    name = args.served_model_name or served_name(args.model)

    def build_app():
        model, tokenizer = load_model(args.model, args.dtype, getattr(args, "device", None))
        config = continuous_batching_config_from_args(args, model.device.type)
        app = create_app(model, tokenizer, name, config, model_aliases=[args.model], settings=settings)
        if args.warmup_tokens:
            if config.default_compile_level:  # the longest part of a start: say why, and how to skip it
                logger.info("warming up: the first steps compile the forward (--compile-level %d; 0 starts faster "
                            "and serves eagerly)", config.default_compile_level)
            app.state.backend.manager.warm_up(args.warmup_tokens)
        return app

    # Loading, packing and the warm-up run torch's parallel kernels: in a thread that ends with them, so the event
    # loop's thread never owns an OpenMP team beside the engine loop's (see rollout.thread_teams).
    app = run_in_fresh_thread(build_app, name="rollout-load")
    if settings.admin_key is None and not settings.control_open_without_key:
        logger.warning("listening on %s without an admin key: the RL control routes are disabled (set %s)",
                       args.host, ADMIN_KEY_ENV)
    if settings.api_key is None and not settings.control_open_without_key:
        logger.warning("listening on %s without an API key: anyone who can reach it can generate (set %s)",
                       args.host, API_KEY_ENV)
    loop = event_loop()
    logger.info("serving %s on http://%s:%d (event loop: %s)", name, args.host, args.port, loop)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop=loop,
                http=h11_protocol(args.header_timeout),
                h11_max_incomplete_event_size=args.max_header_bytes, timeout_keep_alive=args.timeout_keep_alive,
                limit_concurrency=args.limit_concurrency, timeout_graceful_shutdown=args.shutdown_timeout)


def event_loop() -> str:
    """uvicorn's `loop=`: uvloop where it is installed (the serve extra brings it on Linux and macOS), else asyncio.

    Every streamed token passes through the event loop, which shares the cores with the engine's OpenMP team: a
    cheaper loop leaves the team more of them (more tokens per second at 64 streams: benchmarks/RESULTS.md, "Serving").
    """
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


__all__ = ["MissingExtraError", "build_parser_args", "check_serve_extra", "continuous_batching_config_from_args",
           "event_loop", "load_model", "serve", "served_name", "settings_from_args"]
