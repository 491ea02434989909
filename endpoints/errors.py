"""The error envelopes, for every error the gateway answers before a stream starts.

Clients parse `{"error": {"message", "type", "param", "code"}}`; FastAPI's own
`{"detail": ...}` would surface in the SDK as an unhelpful generic error, so
validation errors, unknown routes, the serving core's refusals (app/serving/errors.py)
and our own failures all go through here. Another API's paths answer in that API's envelope (`ENVELOPES`): the
Anthropic Messages API's (/v1/messages...) `{"type": "error", "error": {"type", "message"}}` with its error types,
the Ollama API's (/api/...) `{"error": "<message>"}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.serving.errors import NotFound, NotReady, RateLimited, Refused, Unavailable

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
ANTHROPIC_PATH = "/v1/messages"  # the Anthropic Messages API's routes: its envelope for their errors
OLLAMA_PATH = "/api/"  # the Ollama API's routes (endpoints/ollama.py)
_ANTHROPIC_TYPES = {
    **_TYPES,
    413: "request_too_large",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict:
    """The Anthropic Messages API's error object (a response's body, or a stream's `error` event)."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry: bool | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        if retry is not None:
            # The OpenAI SDK retries 408/409/429/5xx unless told that retrying cannot help.
            self.headers["x-should-retry"] = "true" if retry else "false"

    def body(self, path: str = "") -> dict:
        """The envelope of the API `path` belongs to."""
        for envelope in ENVELOPES:
            if path.startswith(envelope.prefix):
                return envelope.body(self)
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def named_message(self) -> str:
        """The message, naming the field it is about: for the envelopes that have no `param`."""
        named = self.param and self.param not in self.message
        return f"{self.param}: {self.message}" if named else self.message

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


class Envelope(NamedTuple):
    """An API's error body for the errors under its paths (OpenAI's is the default)."""

    prefix: str
    body: Callable[[ApiError], dict]


ENVELOPES = (
    Envelope(ANTHROPIC_PATH, lambda error: anthropic_error(error.status, error.named_message())),
    Envelope(OLLAMA_PATH, lambda error: {"error": error.named_message()}),
)


def refusal(exc: Refused) -> ApiError:
    """The serving core's refusal as the HTTP error it is."""
    if isinstance(exc, NotReady | Unavailable):
        return ApiError(503, exc.message, code=exc.code, headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RateLimited):
        # OpenAI's envelopes: type "requests" at a rate limit, "insufficient_quota" at a dollar cap.
        return ApiError(
            429,
            exc.message,
            code=exc.code,
            type="insufficient_quota" if exc.code == "insufficient_quota" else "requests",
            headers={**exc.headers, "Retry-After": str(exc.retry_after)},
        )
    return ApiError(404 if isinstance(exc, NotFound) else 400, exc.message, param=exc.param, code=exc.code)


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    # A value that fails every member of a union (`prompt`: a string or a list of token ids) gets one error per
    # member; a member of the value's own kind says what is wrong, "should be a valid string" does not.
    errors = sorted(errors, key=lambda e: str(e.get("type", "")).endswith("_type"))
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_member(p)]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(
            400, "We could not parse the JSON body of your request: " + first.get("msg", ""), code="invalid_json"
        )
    if not loc and kind == "missing":
        return ApiError(400, "The request body is missing; send a JSON object.", code="invalid_request")
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return ApiError(400, "The request body must be a JSON object.", code="invalid_request")
    # The OpenAI style names the field as dotted/indexed path: messages[0].role
    param = ""
    for part in loc:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    param = param or None
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}. Tandem does not support it."
        return ApiError(400, message, param=param, code="unsupported_parameter")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    shown = first.get("input")
    got = f" (got {shown!r})" if isinstance(shown, str | int | float | bool) and len(repr(shown)) < 60 else ""
    return ApiError(400, f"Invalid value for '{param}': {msg}{got}.", param=param, code="invalid_value")


def _union_member(part) -> bool:
    """pydantic names the member of a union it tried in an error's location (`str`, `list[int]`): not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response(request.url.path)

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused):
        return refusal(exc).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)).response(request.url.path)
