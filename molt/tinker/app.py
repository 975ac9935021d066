"""The HTTP routes of the Tinker API, as the pinned `tinker` SDK calls them, over a `Service`.

Requests and results are the SDK's own pydantic types (JSON) and protobuf messages (molt/tinker/wire.py).
A request that asks for something not served gets HTTP 400 with a message naming it; the SDK raises it.
Requests that take time return a request id at once; the SDK polls `/retrieve_future`, which waits up to
`POLL_WAIT_S` for the result before it answers "try again".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import zstandard
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from molt.tinker import Refused
from molt.tinker.service import Service
from molt.tinker.wire import read_forward_backward
from molt.trajectory import AgentError

POLL_WAIT_S = 30.0   # below the SDK's 45 s read timeout of a poll
PROTOBUF = "application/x-protobuf"
api = APIRouter(prefix="/api/v1")


def build_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.loop = asyncio.get_running_loop()   # the one loop all of the service runs on
        expiry = service.loop.create_task(service.expire_sessions())
        yield
        expiry.cancel()

    app = FastAPI(title="molt.tinker", lifespan=lifespan)
    app.state.service = service
    app.include_router(api)
    app.add_exception_handler(ValueError, _refused)   # Refused, and a body the SDK's types reject
    app.add_api_route("/{path:path}", _not_served, methods=["GET", "POST", "PUT", "DELETE"])
    return app


async def _refused(request: Request, err: Exception) -> JSONResponse:
    return JSONResponse(status_code=400, content={"error": str(err)})


async def _not_served(path: str) -> JSONResponse:
    return JSONResponse(status_code=404, content={"error": f"/{path} is not served by molt.tinker"})


def _json(model: Any) -> dict:
    return model.model_dump(mode="json", exclude_none=True)


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> dict:
    return _json(types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra))


async def _body(request: Request, kind: type) -> tuple[Service, Any]:
    return request.app.state.service, kind.model_validate(await request.json())


# -- the client's set-up, sessions, capabilities -----------------------------------------------------------
@api.post("/client/config")
async def client_config() -> dict:
    # The SDK's defaults, except what this service does not do: forward_backward bodies come plain, and
    # custom losses run client-side (a forward, then a cross_entropy backward with the loss's gradient).
    return _json(types.ClientConfigResponse(proto_compress_fwdbwd=False, custom_loss_server_side=False,
                                            sample_use_retrieve_futures=False,
                                            sample_join_sampling_session=False))


@api.post("/client/dynamic_config")
async def dynamic_config() -> dict:
    return _json(types.ClientDynamicConfigResponse())


@api.get("/healthz")
async def health() -> dict:
    return _json(types.HealthResponse(status="ok"))


@api.get("/get_server_capabilities")
async def capabilities(request: Request) -> dict:
    service = request.app.state.service
    return _json(types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
        model_name=service.base_model, max_context_length=service.spec.model.max_model_len, trainable=True,
        sampleable=True)]))


@api.post("/create_session")
async def create_session(request: Request) -> dict:
    service, _ = await _body(request, types.CreateSessionRequest)
    return _json(types.CreateSessionResponse(session_id=service.create_session()))


@api.post("/session_heartbeat")
async def heartbeat(request: Request) -> dict:
    service, parsed = await _body(request, types.SessionHeartbeatRequest)
    service.heartbeat(parsed.session_id)
    return _json(types.SessionHeartbeatResponse())


@api.post("/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request) -> dict:
    await request.app.state.service.finish(session_id)
    return {}


@api.post("/telemetry")
async def telemetry() -> dict:   # the SDK's usage reports: not kept
    return _json(types.TelemetryResponse(status="accepted"))


# -- training -------------------------------------------------------------------------------------------
@api.post("/get_info")
async def get_info(request: Request) -> dict:
    service, parsed = await _body(request, types.GetInfoRequest)
    return _json(service.info(parsed.model_id))


@api.post("/forward_backward")
async def forward_backward(request: Request) -> dict:
    raw = await request.body()
    if request.headers.get("content-encoding") == "zstd":
        raw = zstandard.ZstdDecompressor().decompress(raw)
    parsed = read_forward_backward(raw)
    return _future(request.app.state.service.forward_backward(parsed), parsed.model_id)


def _answered_by_future(kind: type, method: str) -> Callable[[Request], Awaitable[dict]]:
    async def route(request: Request) -> dict:
        service, parsed = await _body(request, kind)
        return _future(getattr(service, method)(parsed), getattr(parsed, "model_id", None))
    return route


# The JSON requests of a training model that answer with a future: the request type, the Service method.
FUTURE_ROUTES = {"/create_model": (types.CreateModelRequest, "create_model"),
                 "/optim_step": (types.OptimStepRequest, "optim_step"),
                 "/save_weights": (types.SaveWeightsRequest, "save_state"),
                 "/load_weights": (types.LoadWeightsRequest, "load_state"),
                 "/save_weights_for_sampler": (types.SaveWeightsForSamplerRequest, "save_for_sampler")}
for _path, (_kind, _method) in FUTURE_ROUTES.items():
    api.add_api_route(_path, _answered_by_future(_kind, _method), methods=["POST"])


# -- sampling -------------------------------------------------------------------------------------------
@api.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict:
    service, parsed = await _body(request, types.CreateSamplingSessionRequest)
    sampler = service.engines.create_sampler(parsed)
    return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampler))


@api.get("/samplers/{sampler_id}")
async def sampler(sampler_id: str, request: Request) -> dict:
    return _json(request.app.state.service.engines.info(sampler_id))


@api.post("/asample")
async def asample(request: Request) -> dict:
    service, parsed = await _body(request, types.SampleRequest)
    request_id, sequence_ids = service.engines.sample(parsed)
    return _future(request_id, sample_sequence_ids=sequence_ids)


# -- futures --------------------------------------------------------------------------------------------
@api.post("/retrieve_future")
async def retrieve(request: Request) -> Response:
    service, parsed = await _body(request, types.FutureRetrieveRequest)
    future = await service.futures.fetch(parsed.request_id, POLL_WAIT_S)
    if future is None:
        return JSONResponse(_json(TryAgainResponse(request_id=parsed.request_id, queue_state="active")))
    if future.exception() is not None:
        err = future.exception()
        user = isinstance(err, (Refused, AgentError))   # the client's fault, or the service's
        return JSONResponse(_json(types.RequestFailedResponse(
            error=str(err) if user else f"{type(err).__name__}: {err}",
            category="user" if user else "server")))
    result = future.result()
    if isinstance(result, bytes):   # the SDK reads forward/backward outputs and samples as protobuf
        return Response(content=result, media_type=PROTOBUF)
    return JSONResponse(_json(result))
