"""GET /dashboard: one page, served from the package (endpoints/static/), with no build step and nothing fetched from
outside: plain HTML, CSS and JavaScript, no library. Its Content-Security-Policy allows this origin only, so a browser
refuses anything else even if the page asked.

The page itself holds no data and needs no key; it reads the API with the key the user types (kept in the tab's
sessionStorage): GET /v1/events (the live feed), /v1/requests/{id} (a request's timeline), /v1/budget (read, and
PUT with an admin key), /v1/endpoints, /health/ready and /metrics (endpoint health). docs/dashboard.md tells what it
shows.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from endpoints.errors import ApiError

router = APIRouter()

_STATIC = Path(__file__).parent / "static"
_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


@cache
def _read(name: str) -> bytes:
    return (_STATIC / name).read_bytes()


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> Response:
    return Response(_read("dashboard.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)


@router.get("/dashboard/{asset}", include_in_schema=False)
async def dashboard_asset(asset: str) -> Response:
    media = _TYPES.get(asset)
    if media is None:
        raise ApiError(404, f"No dashboard file named {asset!r}.", code="not_found")
    return Response(_read(asset), media_type=f"{media}; charset=utf-8", headers=_HEADERS)
