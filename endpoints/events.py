"""GET /v1/events: the gateway's live event feed (app/serving/events.py) as server-sent events, and
GET /v1/endpoints: each endpoint's live state, for the dashboard.

Same API keys as the rest of /v1. Each event is `id: <n>`, `event: <type>`, `data: <JSON>`; a reconnecting viewer
sends `Last-Event-ID` (as browsers' EventSource do, or as a header of its own) and resumes after it while the bus
still holds it. A viewer that reads too slowly loses events, never the gateway's time: they are dropped for it
alone and the next thing it reads is a `dropped` event (no id) with how many and from which id.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request

from app.serving.events import Event, EventBus
from endpoints.api_options import ApiOptionsDep
from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.serving import ServingDep
from endpoints.sse import SSEResponse

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def encode(event: Event) -> bytes:
    head = f"id: {event['id']}\n" if event["id"] is not None else ""
    return f"{head}event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


async def _feed(bus: EventBus, last_id: int | None) -> AsyncIterator[bytes]:
    # Subscribed only once the body runs (a response never started leaves no viewer behind), before its first byte
    # goes out (a viewer that saw it connected sees every event after).
    viewer = bus.subscribe(last_id)
    try:
        yield b": tandem events\n\n"
        async for batch in viewer.events():
            yield b"".join(bus.rendered(e, encode) for e in batch)
    finally:
        bus.unsubscribe(viewer)


@router.get("/events")
async def events(request: Request, serving: ServingDep, api: ApiOptionsDep):
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    try:
        last_id = int(last) if last else None
    except ValueError:
        message = f"Last-Event-ID must be an event id (an integer), got {last!r}."
        raise ApiError(400, message, param="Last-Event-ID") from None
    return SSEResponse(_feed(serving.events, last_id), {}, api.ping_seconds, last=lambda chunk: False)


@router.get("/endpoints")
async def endpoints(serving: ServingDep) -> dict:
    return {"object": "list", "data": serving.endpoints()}
