"""The one bearer-key check: the gateway's API keys, its admin keys and the HAT worker's device token.

Every configured key is compared, with no early exit, each in constant time (`hmac.compare_digest`), so the
time an answer takes says nothing about which key, or how much of one, matched. Keys are never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable


def bearer(authorization: str | None) -> bytes:
    """The token of an `Authorization: Bearer <token>` header; b"" for none or another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def matches_any(given: bytes, keys: Iterable[bytes]) -> bool:
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok
