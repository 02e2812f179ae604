"""The router's front ends: the OpenAI-compatible HTTP server (and its protocol,
OpenAPI document, body parsing), the gRPC server, API keys, the admin API, and
RouterServer, which runs a Router with its front ends on an event loop of its own."""
