"""The OpenAPI document tells the truth, checked by schemathesis against a live server:
every status, content type and header it answers with is documented, schema-invalid
input is refused with a 4xx, schema-valid input is accepted (except the rules a
schema cannot state, which the document's 400 describes: prompt plus max_tokens must
fit the context, a TTFT SLO must be one an idle worker could meet), and nothing
answers 5xx."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from pdserve.engine.config import EngineConfig
from pdserve.router.config import PoolSpec
from pdserve.router.front.server import RouterServer
from pdserve.router.launch import launch
from tests.cluster.conftest import stop_cluster

MAX_MODEL_LEN = 48  # keeps every generated request short
# The 400s a schema cannot foresee, as the document's 400 lists them: (param, words).
CROSS_FIELD_RULES = [("prompt", "context"), ("max_tokens", "context"),
                     ("messages", "context"), ("top_logprobs", "needs logprobs"),
                     ("slo_ttft_ms", "even on an idle worker"),
                     ("min_tokens", "at most max_tokens"),
                     ("logit_bias", "token id"), ("logit_bias", "vocabulary"),
                     ("tools", "declared twice"), ("tool_choice", "tools"),
                     ("tool_choice", "cannot be combined"),
                     ("messages", "no content"), ("messages", "tool_call_id"),
                     ("messages", "chat template"), ("prompt", "not both"),
                     ("response_format", "needs json_schema"),
                     ("tools", "context"), ("tokens", "context"),
                     ("best_of", "at least n"), ("best_of", "cannot be streamed"),
                     ("n", "max_num_seqs"),
                     *((field, words) for field in (
                         "response_format", "structured_outputs", "guided_json",
                         "guided_regex", "guided_choice", "guided_grammar", "tool_choice")
                       for words in ("cannot be compiled", "only one constraint",
                                     "exactly one of"))]


@pytest.fixture(scope="module")
def api(ray_local, llama_dir):
    config = EngineConfig.from_kwargs(str(llama_dir), max_model_len=MAX_MODEL_LEN,
                                      num_kv_blocks=64)
    router = launch(config, PoolSpec(0, 1, mode="colocated"), served_model_name="test-llama")
    srv = RouterServer(router)
    yield srv
    stop_cluster(srv)


@schemathesis.check
def accepts_valid_input(ctx, response, case):
    """Schema-valid input gets a 2xx; a 400 only for a rule the schema cannot state
    (the model's context, an SLO no idle worker could meet), a 429 only for an SLO no
    placement can meet now."""
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code < 300:
        return None
    body = case.body if isinstance(case.body, dict) else {}
    if response.status_code == 429 and ("slo_ttft_ms" in body or "slo_tpot_ms" in body) \
            and "SLO" in response.json()["error"]["message"]:
        return None  # an SLO this cluster cannot meet: refused, as documented
    if response.status_code == 400:
        error = response.json()["error"]
        if any(error["param"] == param and words in error["message"]
               for param, words in CROSS_FIELD_RULES):
            return None
    raise AssertionError(f"schema-valid input refused: {response.status_code} "
                         f"{response.text[:300]}")


EXAMPLES = 60  # per operation and mode: about half a minute here


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_live_server_keeps_its_schema(api, mode):
    schema = schemathesis.openapi.from_url(f"{api.http_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # /health /ready /live /metrics /v1/models, completions, chat, tokenize, detokenize
    assert len(operations) == 9

    @given(case=st.one_of(*[op.as_strategy(generation_mode=mode) for op in operations]))
    @settings(max_examples=EXAMPLES * len(operations), deadline=None, database=None,
              derandomize=True,  # the same cases in every CI run; vary with a seed locally
              suppress_health_check=list(HealthCheck))
    def check(case):
        case.call_and_validate(excluded_checks=[positive_data_acceptance],
                               additional_checks=[accepts_valid_input], timeout=60)
    check()


def test_the_document_lists_400_not_422_and_the_model_limits(api):
    doc = httpx.get(f"{api.http_url}/openapi.json", timeout=30).json()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"400", "404", "413", "429", "500", "503"} <= set(
        completions)
    assert "Retry-After" in completions["429"]["headers"]
    assert "text/event-stream" in completions["200"]["content"]
    prompt = doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    ids = next(b for b in prompt["anyOf"] if b.get("items", {}).get("type") == "integer")
    assert ids["maxItems"] == MAX_MODEL_LEN - 1 and ids["items"]["maximum"] > 0
    assert "securitySchemes" not in doc["components"]  # no key required here


def test_the_document_lists_the_openai_fields_served(api):
    doc = httpx.get(f"{api.http_url}/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    chat = schemas["ChatRequest"]["properties"]
    for field in ("response_format", "structured_outputs", "guided_json", "logit_bias",
                  "min_tokens", "n", "best_of"):
        assert field in completion and field in chat
        assert "not supported" not in completion[field].get("description", "")
        assert "only 1" not in completion[field].get("description", "")
    for field in ("tools", "tool_choice"):
        assert "not supported" not in chat[field].get("description", "")
    assert {"/tokenize", "/detokenize"} <= set(doc["paths"])
