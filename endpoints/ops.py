"""Liveness, readiness and metrics: open without an API key, for orchestrators and scrapers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/health/ready")
async def ready(request: Request):
    gw = request.app.state.gateway
    backends = await gw.readiness()
    ok = bool(backends) and all(backends.values())
    body = {"status": "ready" if ok else "loading", "backends": backends}
    if gw.startup_error:
        body["status"], body["error"] = "failed", gw.startup_error
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)
