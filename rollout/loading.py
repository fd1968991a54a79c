"""`--model` for `rollout demo` and `rollout serve`: check it up front, then load the model and tokenizer.

Nothing heavy is imported at module import time (torch and transformers load inside `load_model`), so the CLI can
build its parser and answer `--help` without them. `check_model` runs the cheap checks first (an existing path must
be a directory with config.json), and only then asks huggingface_hub about a hub id, so that a wrong `--model` ends in
one line saying what was wrong and what to pass, not a traceback from deep inside a tokenizer.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = Path(__file__).resolve().parent / "assets" / "tiny-policy"
DTYPES = ("auto", "float32", "float16", "bfloat16")
_TRUE = {"1", "on", "yes", "true"}


class ModelLoadError(Exception):
    """`--model` cannot be used. The message is one line: what was wrong, and what to pass instead."""


class MissingExtraError(Exception):
    """A command's optional dependency group is not installed (or does not import); the message says what to run."""


def require_extra(command: str, extra: str, modules: Sequence[str]) -> None:
    """Raise MissingExtraError unless every module of `extra` is installed and imports.

    Runs when the command runs, not when the parser is built, so `--help` and argument errors work without the extra.
    A module that is installed but fails to import (a broken or incompatible install) counts as missing too.
    """
    problems = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{name} is not installed")
            continue
        try:
            importlib.import_module(name)
        except ImportError as err:
            problems.append(f"{name} does not import ({' '.join(str(err).split()) or type(err).__name__})")
    if problems:
        raise MissingExtraError(f"rollout {command} needs the {extra} extra: pip install 'rollout[{extra}]' (from a "
                                f"clone, CPU: pip install torch==2.13.0 -e '.[{extra}]'); {'; '.join(problems)}")


def _looks_like_path(name: str) -> bool:
    """A name no hub id can have: absolute, relative to ./ or ../ or ~, or with a Windows separator."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or "\\" in name


def _offline_switch() -> str | None:
    """The environment variable that turned offline mode on, or None when downloads are allowed."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE"
    return "TRANSFORMERS_OFFLINE" if os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in _TRUE else None


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _first_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _or(alternative: str) -> str:
    return f", or {alternative}" if alternative else ""


def check_model(name: str, alternative: str = "") -> str:
    """Return what to load for `--model name` (a local directory or a hub id), or raise ModelLoadError.

    `alternative` is one more thing the user can do, offered at the end of every message (e.g. "omit --model to use
    the embedded policy").
    """
    fix = f"pass a local model directory with config.json{_or(alternative)}"
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"--model {name!r} is a file, not a model directory; pass the directory that holds "
                                 f"its config.json{_or(alternative)}")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"--model {name!r} is a directory without config.json, so not a transformers model; "
                                 f"pass a directory written by save_pretrained (config.json, weights, tokenizer)"
                                 f"{_or(alternative)}")
        return str(path)
    if _looks_like_path(name):
        raise ModelLoadError(f"--model {name!r} does not exist; {fix}")

    from huggingface_hub import errors, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except errors.HFValidationError:
        raise ModelLoadError(f"--model {name!r} is neither an existing directory nor a valid hub id (name or "
                             f"owner/name); {fix}") from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name  # already downloaded: usable offline too
    switch = _offline_switch()
    if switch is not None:
        raise ModelLoadError(f"--model {name!r} is not a local directory, and as a hub id it cannot be fetched "
                             f"offline ({switch} is set) and is not in the local cache; {fix}, or unset {switch} to "
                             "download it")
    from huggingface_hub import model_info

    try:
        model_info(name, timeout=15)
    except errors.GatedRepoError:
        raise ModelLoadError(f"--model {name!r} is a gated hub model: accept its terms on "
                             f"https://huggingface.co/{name} and log in with `hf auth login`, or {fix}") from None
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(f"--model {name!r} is not a local directory, and the Hugging Face Hub has no model with "
                             f"that id (or it is private: log in with `hf auth login`); {fix}") from None
    except errors.HfHubHTTPError as err:
        if getattr(err.response, "status_code", None) == 404:  # a mirror (HF_ENDPOINT) may not say RepoNotFound
            raise ModelLoadError(f"--model {name!r} is not a local directory, and the hub at {_endpoint()} has no "
                                 f"model with that id; {fix}") from None
        raise ModelLoadError(f"--model {name!r} is not a local directory or a cached hub model, and the hub at "
                             f"{_endpoint()} did not answer ({_first_line(err)}); try again later, or {fix}") from None
    except Exception as err:  # the network: connection refused, DNS, timeout, proxy
        raise ModelLoadError(f"--model {name!r} is not a local directory or a cached hub model, and the hub at "
                             f"{_endpoint()} cannot be reached ({_first_line(err)}); check the network, or "
                             f"{fix}") from None
    return name


def load_model(name: str, dtype: Any = "auto", device: str | None = None, alternative: str = "") -> tuple[Any, Any]:
    """(model, tokenizer) for `--model name`, checked first with `check_model`; any failure is a ModelLoadError.

    dtype: "auto" (the checkpoint's), a name in DTYPES, or a torch.dtype. device: where to move the model (None
    leaves it where from_pretrained put it, the CPU). A hub id is downloaded unless it is cached or offline mode is on.
    """
    source = check_model(name, alternative)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError, ImportError, KeyError) as err:  # what transformers raises for a bad checkpoint
        logger.debug("loading %s failed", source, exc_info=True)
        raise ModelLoadError(f"--model {name!r} could not be loaded ({_first_line(err)}); check that it holds a "
                             f"complete checkpoint (config.json, weights, tokenizer files){_or(alternative)}") from err
    if device is not None:
        model.to(device)
    logger.info("loaded %s (%s, %.1fM parameters)", source, next(model.parameters()).dtype,
                sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tokenizer


__all__ = ["DEFAULT_MODEL", "DTYPES", "MissingExtraError", "ModelLoadError", "check_model", "load_model",
           "require_extra"]
