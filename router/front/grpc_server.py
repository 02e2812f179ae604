"""The gRPC front end (grpc.aio): pdserve.v1.GenerateService, grpc.health.v1 and
server reflection. A thin translation between proto messages and the router."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.engine.errors import InvalidRequestError, RequestFailedError
from pdserve.router.config import TLSConfig
from pdserve.router.errors import OverloadedError, WorkerError
from pdserve.router.front.auth import ApiKeys, owner
from pdserve.router.router import Router
from pdserve.router.slo import Slo
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc
from pdserve.v1.sampling import from_proto

_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
           "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    def __init__(self, router: Router, keys: ApiKeys):
        self.router, self.keys = router, keys

    async def _owner(self, context) -> str:
        """The caller's identity, or the call ends UNAUTHENTICATED."""
        metadata = dict(context.invocation_metadata() or ())
        key = self.keys.check(metadata.get("authorization"))
        if key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is "
                                "required (metadata authorization: Bearer <key>)")
        return owner(key, metadata.get("pdserve-session"), context.peer())

    async def Generate(self, request: pb.GenerateRequest, context):
        caller = await self._owner(context)
        try:
            if request.WhichOneof("prompt") == "text":
                prompt = request.text
            elif request.WhichOneof("prompt") == "token_ids":
                # Sized before copying: 2M ids take 0.2 s to copy on the event loop.
                self.router.limits.check_ids("prompt", len(request.token_ids.ids))
                prompt = list(request.token_ids.ids)
            else:
                raise InvalidRequestError("prompt", "set text or token_ids")
            slo = Slo.from_ms(
                request.slo_ttft_ms if request.HasField("slo_ttft_ms") else None,
                request.slo_tpot_ms if request.HasField("slo_tpot_ms") else None)
            accepted = await self.router.accept(
                prompt, from_proto(request.sampling_params), request.request_id, caller, slo)
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        completion, first_at = 0, None
        # Closed on every exit, a client's cancel included: the request is released
        # then, not whenever the garbage collector finalizes the generator.
        stream = self.router.generate(accepted)
        try:
            async for delta in stream:
                if first_at is None and delta.token_ids:
                    first_at = time.time()
                completion += len(delta.token_ids)
                response = pb.GenerateResponse(
                    request_id=accepted.request_id, token_ids=delta.token_ids, text=delta.text,
                    logprobs=delta.logprobs, finish_reason=_FINISH[delta.finish_reason],
                    top_logprobs=[pb.TopLogprobs(token_ids=list(top), logprobs=list(top.values()))
                                  for top in delta.top_logprobs],
                    prompt_logprobs=[_prompt_logprob(entry)
                                     for entry in delta.prompt_logprobs or ()],
                    index=delta.index)
                if delta.finished:
                    response.usage.CopyFrom(pb.Usage(
                        prompt_tokens=len(accepted.prompt_token_ids),
                        completion_tokens=completion,
                        cached_prompt_tokens=delta.num_cached_tokens,
                        host_cached_prompt_tokens=delta.num_host_cached_tokens))
                    response.timings.CopyFrom(_timings(accepted, self.router, first_at))
                yield response
        except InvalidRequestError as err:  # found once workers were asked (KV capacity)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except OverloadedError as err:
            context.set_trailing_metadata((("retry-after", f"{err.retry_after_s:g}"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except WorkerError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except RequestFailedError as err:  # a step failed for this request alone
            await context.abort(grpc.StatusCode.INTERNAL, str(err))
        finally:
            await stream.aclose()

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        caller = await self._owner(context)
        return pb.AbortResponse(found=await self.router.abort(request.request_id, caller))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        await self._owner(context)
        m = self.router.model
        return pb.GetModelInfoResponse(model=m.name, max_model_len=m.max_model_len,
                                       vocab_size=m.vocab_size,
                                       has_chat_template=bool(self.router.tokenizer.chat_template))


def _prompt_logprob(entry) -> pb.PromptLogprob:
    if entry is None:  # the first prompt token
        return pb.PromptLogprob()
    logprob, rank, top = entry
    return pb.PromptLogprob(logprob=logprob, rank=rank, top=pb.TopLogprobs(
        token_ids=list(top), logprobs=list(top.values())))


def _timings(accepted, router: Router, first_at: float | None) -> pb.Timings:
    now = time.time()
    placed = router.forecast_of(accepted.request_id)
    return pb.Timings(ttft_seconds=(first_at or now) - accepted.arrival_time,
                      e2e_seconds=now - accepted.arrival_time,
                      predicted_ttft_seconds=getattr(placed, "ttft_s", None) or 0.0,
                      predicted_tpot_seconds=getattr(placed, "tpot_s", None) or 0.0)


async def start_grpc_server(router: Router, host: str = "127.0.0.1", port: int = 0,
                            keys: ApiKeys = ApiKeys(), tls: TLSConfig | None = None):
    """Starts the server; returns (server, bound port). Port 0 picks a free one.
    Health and reflection stay open to probes; the API needs a key when keys are set."""
    limit = router.config.max_request_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit)])
    pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(router, keys), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if tls is None
             else server.add_secure_port(address, tls.grpc_credentials()))
    await server.start()

    async def publish_health() -> None:  # SERVING while every pool has a live worker
        status = (health_pb2.HealthCheckResponse.SERVING if router.ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)
    await publish_health()
    router.on_change.append(lambda: asyncio.ensure_future(publish_health()))
    return server, bound
