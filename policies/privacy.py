"""Where a request's text may go: privacy levels and what each allows.

An endpoint's locality says what leaves the device when it serves: "device" (nothing), "split" (HAT: hidden
states after the first layers, never token ids or text — though a worker can largely invert them; docs/hat.md),
"cloud" (the prompt's text). A request's level allows localities up to its own: "device" only the device,
"split" the device and HAT, "any" everything.
"""

from __future__ import annotations

LEVELS = ("device", "split", "any")
_RANK = {"device": 0, "split": 1, "any": 2, "cloud": 2}


def allows(level: str, locality: str) -> bool:
    """Whether a request at `level` may be served by an endpoint of `locality`."""
    return _RANK[locality] <= _RANK[level]


def effective_level(gateway_default: str, key_level: str | None, requested: str | None) -> str:
    """The request's level: its own when it asks for one, else its API key's, else the gateway's. A key's level is
    a floor the request can tighten but not loosen (the stricter of the two applies)."""
    if key_level is None:
        return requested or gateway_default
    if requested is None:
        return key_level
    return min(key_level, requested, key=_RANK.__getitem__)
