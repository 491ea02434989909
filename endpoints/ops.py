"""Liveness, readiness and metrics: open without an API key, for orchestrators and scrapers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from endpoints.serving import ServingDep

router = APIRouter()


@router.get("/health")
async def health(serving: ServingDep):
    """Liveness: 200 while the process serves, a degraded shared store included (its body says so)."""
    return serving.health()


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
