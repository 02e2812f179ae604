"""The HTTP front end's OpenAPI document, made to tell the truth: every status and
content type a route can answer with is listed, validation errors are the 400s the
server sends (FastAPI would document 422), the API key is declared only when the
server requires one, and the limits that depend on the served model (vocabulary,
context) are written into the request schemas."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdserve.router.front.openai_protocol import ErrorResponse

MEANING = {
    400: "Invalid input: `error.param` names the field. Besides what the schema states: "
         "prompt tokens plus max_tokens must fit the model's context and its KV cache, "
         "chat's top_logprobs needs logprobs: true, a TTFT SLO must be one that a "
         "worker could meet when idle (slo_ttft_ms: a retry cannot help), min_tokens at "
         "most max_tokens, logit_bias' token ids within the vocabulary, a structured-"
         "output constraint (response_format, structured_outputs, guided_*, a forced "
         "tool_choice) one per request and one that compiles (a json_schema "
         "response_format with its json_schema), a named tool_choice one of "
         "the tools, a tool message with its tool_call_id, best_of at least n and "
         "not streamed when it exceeds n, n at most the workers' max_num_seqs.",
    401: "A valid API key is required (Authorization: Bearer <key>).",
    404: "The requested model is not served here (code model_not_found).",
    413: "The request body exceeds the server's --max-request-bytes.",
    415: "The body is not JSON (Content-Type must be application/json).",
    429: "Overloaded: retry after the Retry-After header's seconds.",
    500: "A step failed for this request alone; the server goes on serving.",
    503: "A worker failed, or no worker is in service.",
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                               "schema": {"type": "integer", "minimum": 1}}}


def errors(*statuses: int) -> dict:
    """FastAPI `responses=` for these error statuses, with OpenAI's error body."""
    return {status: {"model": ErrorResponse, "description": MEANING[status],
                     **({"headers": RETRY_AFTER} if status == 429 else {})}
            for status in statuses}


# One server-sent event: `data` is a JSON chunk (or an error body), or [DONE].
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
GENERATE = {200: {"description": "The completion (application/json), or with stream: "
                  "true its chunks as server-sent events, ending `data: [DONE]` (an error "
                  "after the first chunk is an `error` event before it).",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **errors(400, 401, 404, 413, 415, 429, 500, 503)}


def request_body(model: type[BaseModel]) -> dict:
    """openapi_extra for a route that reads and validates its body itself (off the
    event loop): the body's schema, by reference (install adds the component, given
    the model in `bodies`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def install(app: FastAPI, *, bodies: tuple[type[BaseModel], ...], model: str,
            vocab_size: int, max_model_len: int, max_prompt_chars: int,
            requires_key: bool) -> None:
    """Replaces app.openapi with the document described above (built once)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=app.description)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path in doc["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for body in bodies:
                _add_component(schemas, body)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            _model_limits(schemas, model, vocab_size, max_model_len, max_prompt_chars)
            if requires_key:
                _security(doc)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = openapi


def _add_component(schemas: dict, model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema


def _model_limits(schemas: dict, model: str, vocab_size: int, max_model_len: int,
                  max_prompt_chars: int) -> None:
    """Per-field limits of the served model: its name, token ids within the vocabulary,
    at most max_model_len - 1 prompt tokens and max_tokens (one of each must fit)."""
    room = max_model_len - 1
    for name in ("CompletionRequest", "ChatRequest", "TokenizeRequest", "DetokenizeRequest"):
        if name in schemas:
            schemas[name]["properties"]["model"]["anyOf"][0]["enum"] = [model]
    if "DetokenizeRequest" in schemas:
        tokens = schemas["DetokenizeRequest"]["properties"]["tokens"]
        tokens["items"]["maximum"], tokens["maxItems"] = vocab_size - 1, room
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if branch["type"] == "string":
            branch["maxLength"] = max_prompt_chars
        elif branch["items"]["type"] == "integer":
            branch["items"]["maximum"] = vocab_size - 1
            branch["maxItems"] = room
        else:
            branch["items"]["maxLength"] = max_prompt_chars
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatRequest", "max_tokens"),
                        ("ChatRequest", "max_completion_tokens")):
        for branch in schemas[name]["properties"][field]["anyOf"]:
            if branch["type"] == "integer":
                branch["maximum"] = room


def _security(doc: dict) -> None:
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        if path not in ("/health", "/ready"):
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
