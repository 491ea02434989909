"""A request the serving core refuses, and why: the core's own error type, free of HTTP.

endpoints/errors.py maps each kind to its status and the API's envelope. `param` names the field of the request
the refusal concerns, as the chat API names it; `code` is a stable machine-readable reason.
"""

from __future__ import annotations


class Refused(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(Refused):
    """The request asks for something this gateway cannot serve as asked (an HTTP 400)."""


class NotFound(Refused):
    """It names a model, or a service, this gateway does not have (a 404)."""


class NotReady(Refused):
    """The gateway is still loading its models: worth retrying after `retry_after` seconds (a 503)."""

    def __init__(self, message: str, retry_after: int = 2):
        super().__init__(message, code="not_ready")
        self.retry_after = retry_after


class RateLimited(Refused):
    """The request's API key is at one of its limits (a 429): retry after `retry_after` seconds. `headers` are the
    key's `x-ratelimit-*` counts."""

    def __init__(self, message: str, *, code: str, retry_after: int, headers: dict[str, str]):
        super().__init__(message, code=code)
        self.retry_after = retry_after
        self.headers = headers


class Unavailable(Refused):
    """Something the request needs is away for now (the shared store): a 503, worth retrying."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, code="store_unavailable")
        self.retry_after = retry_after
