"""The one key check: the gateway's API keys (`require_api_key`, every /v1 route but the budget's, and
`require_messages_key`, the Anthropic Messages API's, which also takes its `x-api-key` header), its admin keys and
the HAT worker's device token.

Every configured key is compared, with no early exit, each in constant time (`hmac.compare_digest`), so the
time an answer takes says nothing about which key, or how much of one, matched. Keys are never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from fastapi import Request

from endpoints.api_options import ApiOptions, ApiOptionsDep
from endpoints.errors import ApiError
from endpoints.serving import KeyAccess


def bearer(authorization: str | None) -> bytes:
    """The token of an `Authorization: Bearer <token>` header; b"" for none or another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def secret(entry) -> bytes:
    """A configured key's bytes: a plain key, or a key entry with settings of its own (`.key`)."""
    return getattr(entry, "key", entry).get_secret_value().encode()


def matching(given: bytes, keys: Iterable[bytes]) -> int | None:
    """The index of the key `given` is, or None; every key is compared, each in constant time."""
    found = None
    for i, key in enumerate(keys):
        if hmac.compare_digest(given, key):
            found = i
    return found


def matches_any(given: bytes, keys: Iterable[bytes]) -> bool:
    return matching(given, keys) is not None


async def require_api_key(request: Request, options: ApiOptionsDep) -> None:
    """Every /v1 route but the budget's. Sets `request.state.key`: the matched key's privacy level and limits,
    where it has them."""
    _check_api_key(request, options, bearer(request.headers.get("authorization")), "'Authorization: Bearer <key>'")


async def require_messages_key(request: Request, options: ApiOptionsDep) -> None:
    """The Anthropic Messages API's routes: the same keys and privacy levels, sent as its SDKs send them
    (`x-api-key: <key>`) or as a bearer token."""
    given = request.headers.get("x-api-key", "").strip().encode() or bearer(request.headers.get("authorization"))
    _check_api_key(request, options, given, "'x-api-key: <key>' (or 'Authorization: Bearer <key>')")


def _check_api_key(request: Request, options: ApiOptions, given: bytes, how: str) -> None:
    request.state.key = KeyAccess()
    keys = options.api_keys
    if not keys:
        return
    found = matching(given, (secret(key) for key in keys))
    if found is None:
        message = f"Missing API key: send {how}." if not given else "Incorrect API key provided."
        raise ApiError(401, message, code="invalid_api_key", type="authentication_error")
    request.state.key = KeyAccess(getattr(keys[found], "privacy", None), options.key_limits[found])
