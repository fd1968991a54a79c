"""Shared fixtures: one thread for tiny models, offline W&B and hub, CPU-capability simulation."""

import os

import pytest
import torch

from rollout.engine.cpu.features import clear_detection
from tests.helpers.cpu import BF16_ERROR

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest and steadiest


@pytest.fixture(scope="session")
def qwen3():
    from tests.helpers.models import tiny_model

    return tiny_model("qwen3")


@pytest.fixture
def fresh_detection():
    """Detection (and the bf16 route's timing) runs again in the test, and again (for real) after it."""
    clear_detection()
    yield
    clear_detection()


@pytest.fixture
def avx2_machine(monkeypatch, fresh_detection):
    """oneDNN as on an AVX2-only CPU: fp32 packs, bf16 raises torch's own error, and torch's bf16 check says no."""
    real = torch.ops.mkldnn._reorder_linear_weight

    def reorder(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(BF16_ERROR)
        return real(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
