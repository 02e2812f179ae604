"""The router's front ends: the OpenAI-compatible HTTP server (and its protocol,
OpenAPI document, body parsing), the gRPC server, API keys, the admin API, and
RouterServer, which runs a Router with its front ends on an event loop of its own.

    http_server.py      the OpenAI-compatible HTTP server (FastAPI): completions, chat
                        completions, tokenize, detokenize, models, health, ready, live,
                        metrics; errors as OpenAI-shaped JSON (400 naming the field, 429,
                        503)
    openai_protocol.py  the OpenAI request bodies, their sampling fields derived from
                        SamplingParams, structured outputs (response_format,
                        structured_outputs, guided_*), and the error body
    tool_calls.py       tools and tool_choice: the constraint a forced call puts on the
                        output, Hermes <tool_call> blocks read back, whole or streamed
    openapi.py          the OpenAPI document, made to tell the truth: every status a
                        route answers, the served model's limits in the schemas
    body_parser.py      request bodies parsed and validated off the event loop (large
                        ones in a process of their own)
    grpc_server.py      the gRPC server: pdserve.v1.GenerateService, health, reflection
    auth.py             API keys on HTTP and gRPC; a request's owner, who may abort it
    admin_http.py       the admin API under /admin (with --admin-api-key): list, add,
                        drain, resume, change role, remove
    server.py           RouterServer: a Router and its front ends on an event loop in a
                        background thread; stop closes both to new requests at once and
                        gives in-flight streams the drain's grace
"""
