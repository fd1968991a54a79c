"""Fixtures of the scale-out tests: one tiny model and tokenizer per module."""

import pytest

from tests.helpers.models import tiny_model
from tests.helpers.tokenizers import tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()
