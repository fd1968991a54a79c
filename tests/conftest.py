import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tiny models: one thread is fastest and steadiest


@pytest.fixture(scope="session")
def qwen3():
    from models import tiny_model

    return tiny_model("qwen3")
