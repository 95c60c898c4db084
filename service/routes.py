"""The endpoints: each one takes its parsed body and hands it to ``Service``.

The ``service`` argument is the app's one ``Service``, injected by the app (see
``service.app``). Request bodies are msgspec Structs, so a malformed one is refused before the
handler runs; errors raised here become responses in ``service.errors``.
"""

from __future__ import annotations

from litestar import Response, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.types import ControllerRouterHandler

from calibration import CalibrationProfile
from service.auth import PUBLIC
from service.schemas import (
    BatchRequest,
    BatchResponse,
    FitRequest,
    JudgeRequest,
    JudgeResponse,
    ProfileSummary,
)
from service.serving import Service

__all__ = ["ROUTES"]

METRICS_TYPE = "text/plain; version=0.0.4"


@get("/health", summary="Liveness: the process is up (no API key needed)", opt={PUBLIC: True})
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", summary="Readiness: the model is loaded and has judged once")
async def ready(service: NamedDependency[Service]) -> Response[dict[str, str]]:
    if service.loaded is not None:
        engine = service.loaded
        return Response({"status": "ready", "model": engine.model_id, "dtype": engine.dtype})
    if service.failure:
        return Response({"status": "failed", "detail": service.failure}, status_code=503)
    return Response({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})


@get("/metrics", summary="Prometheus metrics", media_type=METRICS_TYPE)
async def metrics(service: NamedDependency[Service]) -> Response[bytes]:
    return Response(service.render_metrics(), media_type=METRICS_TYPE)


@post("/judge", summary="Judge one prompt between fixed choices", status_code=200)
async def judge_one(
    data: JSONBody[JudgeRequest], service: NamedDependency[Service]
) -> JudgeResponse:
    return await service.judge(data)


@post(
    "/judge/batch", summary="Judge many items, or many questions about one context", status_code=200
)
async def judge_batch(
    data: JSONBody[BatchRequest], service: NamedDependency[Service]
) -> BatchResponse:
    return await service.judge_batch(data)


@get("/profiles", summary="List calibration profiles")
async def list_profiles(service: NamedDependency[Service]) -> list[ProfileSummary]:
    return service.profile_summaries()


@get("/profiles/{name:str}", summary="One calibration profile")
async def get_profile(name: FromPath[str], service: NamedDependency[Service]) -> CalibrationProfile:
    return service.store.get(name)


@put("/profiles/{name:str}", summary="Upload a calibration profile", status_code=200)
async def put_profile(
    name: FromPath[str], data: JSONBody[CalibrationProfile], service: NamedDependency[Service]
) -> CalibrationProfile:
    return service.put_profile(name, data)


@post("/profiles/{name:str}/fit", summary="Fit a profile on labeled examples", status_code=200)
async def fit(
    name: FromPath[str], data: JSONBody[FitRequest], service: NamedDependency[Service]
) -> CalibrationProfile:
    return await service.fit(name, data)


@delete("/profiles/{name:str}", summary="Delete a calibration profile", status_code=204)
async def delete_profile(name: FromPath[str], service: NamedDependency[Service]) -> None:
    service.store.delete(name)


ROUTES: list[ControllerRouterHandler] = [
    health,
    ready,
    metrics,
    judge_one,
    judge_batch,
    list_profiles,
    get_profile,
    put_profile,
    fit,
    delete_profile,
]
