"""Schema fuzzing of every operation in /openapi.json (schemathesis, in process through ASGI, derandomized).

Every response must be documented (status code, content type, body schema, headers), no input may produce a 5xx,
and input that violates the schema must be refused. The one check left out is "schema-valid input is accepted":
what the schema cannot express (the model's vocabulary and context, the server's --max-n) still earns a 400.

CI runs a bounded number of examples per operation; `ROLLOUT_FUZZ_EXAMPLES=300` makes the longer run described in
benchmarks/README.md.
"""

import os
from collections import Counter

import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from rollout import ContinuousBatchingConfig  # noqa: E402
from rollout.server import create_app  # noqa: E402
from rollout.server.settings import ServerSettings  # noqa: E402
from tests.helpers.models import tiny_model  # noqa: E402
from tests.helpers.tokenizers import tiny_tokenizer  # noqa: E402

EXAMPLES = int(os.environ.get("ROLLOUT_FUZZ_EXAMPLES", "25"))
ADMIN = {"Authorization": "Bearer fuzz-admin-key"}  # the admin key opens every route
# Fields whose generated values nearly always earn a 400 (refused unless left at their default, or keyed by token
# ids a generator cannot guess): dropped from positive cases, or the fuzzer would seldom reach generation.
MOSTLY_REFUSED = ("best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias")
MAX_FUZZ_TOKENS = 8  # keeps each generated completion short

torch.set_num_threads(1)
APP = create_app(tiny_model("qwen3"), tiny_tokenizer(), "tiny", ContinuousBatchingConfig(page_size=8, num_blocks=96),
                 settings=ServerSettings(api_key="fuzz-api-key", admin_key=ADMIN["Authorization"].split()[1],
                                         allowed_hosts=("testserver",), pause_timeout_s=0.5, max_uploads=2,
                                         max_upload_bytes=1 << 20))
STATUSES: Counter = Counter()


async def _app_without_lifespan(scope, receive, send):
    """The app, minus its lifespan: the ASGI transport runs one per request, and its shutdown would close the
    backend after the first call."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await APP(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app_without_lifespan)


@schema.hook
def map_case(context, case):
    """Positive generation cases: drop the fields that are nearly always refused and keep the completion short."""
    positive = case.meta is not None and case.meta.generation.mode.value == "positive"
    if positive and isinstance(case.body, dict) and case.operation.path.startswith("/v1/"):
        for name in MOSTLY_REFUSED:
            case.body.pop(name, None)
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                case.body[name] = max(1, min(case.body[name], MAX_FUZZ_TOKENS))
        if case.operation.path == "/v1/chat/completions" and "max_tokens" not in case.body:
            case.body["max_tokens"] = MAX_FUZZ_TOKENS
    return case


def teardown_module():
    APP.state.backend.close()
    print(f"\nfuzzed {STATUSES.total()} requests; statuses: {dict(sorted(STATUSES.items()))}")


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_every_operation_conforms_and_never_fails(case):
    response = case.call_and_validate(headers=ADMIN, excluded_checks=[positive_data_acceptance])
    STATUSES[response.status_code] += 1
    assert response.status_code < 500, response.text
