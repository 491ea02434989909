"""Liveness, readiness and metrics: open without an API key, for orchestrators and scrapers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from endpoints.serving import ServingDep

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(serving: ServingDep):
    backends, error = await serving.readiness()
    ok = bool(backends) and all(backends.values())
    body = {"status": "ready" if ok else "loading", "backends": backends}
    if error:
        body["status"], body["error"] = "failed", error
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(serving: ServingDep):
    return Response(serving.render_metrics(), media_type=CONTENT_TYPE_LATEST)
