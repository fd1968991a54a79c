"""ModelSpec: what a rollout worker needs to build its own generation model, without pickling a live module.

A live module is tied to the trainer's process (hooks, a TRL-patched `forward`, DDP/FSDP wrappers, its device), and
pickling it would also pickle its weights once per worker. So a worker gets the architecture (the model class and
its config, a few kilobytes) and builds the model itself, and the weights travel separately: put into the object
store once and read by every worker (see `broadcast`). A checkpoint path that every node can read works too; each
worker then loads it with `from_pretrained`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from rollout.rl.weights import apply_staged, stage_update


@dataclass(frozen=True)
class ModelSpec:
    """An architecture whose weights come separately (`from_model`), or a checkpoint path (`from_pretrained`)."""

    model_class: type | None = None
    config: PretrainedConfig | None = None
    path: str | None = None
    dtype: torch.dtype | None = None
    generation_config: GenerationConfig | None = None

    @classmethod
    def from_model(cls, model: PreTrainedModel, dtype: torch.dtype | None = None) -> ModelSpec:
        """The spec of `model`'s architecture (its weights are not part of it); `dtype` defaults to the model's."""
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}; pass the "
                            "unwrapped model (not a DDP/accelerate wrapper) or a checkpoint path")
        return cls(model_class=type(model), config=model.config, dtype=dtype or model.dtype,
                   generation_config=getattr(model, "generation_config", None))

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype | None = None) -> ModelSpec:
        """A checkpoint directory (or hub id) that every worker's node can read."""
        return cls(path=str(path), dtype=dtype)

    def build(self, weights: Mapping[str, torch.Tensor] | None = None, device: str | torch.device = "cpu"):
        """The generation model on `device`, in eval mode and without gradients.

        `weights` must cover every parameter of a `from_model` spec (a ValueError names what is missing); for a path
        they are optional and override what was loaded.
        """
        if self.path is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype or "auto")
        else:
            if weights is None:
                raise ValueError("a ModelSpec built from a model needs its weights (the pool ships them)")
            with _skip_init():
                model = self.model_class(self.config)
            model.tie_weights()  # skipping initialization skips tying too
            if self.generation_config is not None:
                model.generation_config = self.generation_config
            if self.dtype is not None:
                model.to(self.dtype)
        model.to(device)
        if weights is not None:
            load_weights(model, weights, complete=self.path is None)
        model.eval()
        model.requires_grad_(False)
        return model


def load_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], complete: bool) -> None:
    """Copy `weights` into `model` through the weight-update validation; with `complete`, every parameter must be
    covered (a freshly built model's other parameters are random)."""
    staged = stage_update(model, weights)
    if complete:
        covered = {target.data_ptr() for target, _ in staged}
        missing = [name for name, p in model.named_parameters() if p.data_ptr() not in covered]
        if missing:
            raise ValueError(f"the shipped weights lack {len(missing)} parameter(s) of {type(model).__name__}, e.g. "
                             f"{missing[:3]}; pass the full model (or its full state dict)")
    apply_staged(staged)


def _skip_init():
    """Skip random initialization (the weights are overwritten right after); a no-op where transformers lacks it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        return contextlib.nullcontext()
    return no_init_weights()
