"""The HTTP surface's own settings, injected into the routes with FastAPI's dependencies (`Depends(api_options)`).

The gateway's composition root (app/serving/gateway.py) sets them on the app from the `[gateway]` settings; the
serving core knows nothing of keys or keep-alives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request


@dataclass(frozen=True)
class ApiOptions:
    api_keys: tuple = ()  # SecretStr, or key entries with a privacy level of their own (`.key`, `.privacy`)
    key_limits: tuple = ()  # app/serving/limits.py's KeyLimits (its name, any limits) of each of `api_keys`, in order
    admin_keys: tuple = ()  # SecretStr: the keys that may change the budget
    ping_seconds: float = 15.0  # the keep-alive comment's interval on a streamed answer


async def api_options(request: Request) -> ApiOptions:
    # async: a plain function dependency would run on FastAPI's thread pool, a hop on every request's path.
    return request.app.state.api_options


ApiOptionsDep = Annotated[ApiOptions, Depends(api_options)]
