"""GET/PUT /v1/budget: a thin HTTP view over the ledger (app/serving/ledger.py), the one source of truth (with a
shared store, app/serving/state.py, every replica's: a PUT is a compare-and-set there, seen by the others).

Why the handlers hold no state and do no arithmetic: dispatch, booking and this
API all read the same `Ledger`, so what an operator sets here is what the next
request is dispatched under, and what GET shows is what was booked.

Auth: changing the budget is an operator action, and an ordinary API key must
not be able to lift the budget it is spending against. So PUT and DELETE need an
admin key (`gateway.admin_keys`) whenever the gateway has any key at all: a valid
API key gets a 403 saying so, a missing or wrong key a 401. Only a keyless gateway
(loopback, single user) lets anyone change it. GET needs an admin key when admin
keys are configured, else a gateway API key if any are configured, else nothing.
Keys are compared in constant time against every key.

Spend per API key (`keys`: each key's name, limits, this period's spend, what it has in flight): every key's to an
admin key (and in PUT's and DELETE's answers), only its own to an API key reading GET on a gateway without admin
keys. A key shows by its name, or a short hash of it (app/config.py's `key_label`), never the key itself.

PUT is a partial update (only the fields sent change; prices merge per backend),
answered with the new snapshot, or 400 in the OpenAI error envelope whose
`param` names the offending field. DELETE goes back to the config's settings
(the state file is deleted), answered with the snapshot.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from app.serving.budget import BudgetValidationError
from app.serving.errors import Refused
from app.serving.ledger import LedgerStateError
from app.serving.limits import KeyLimits
from endpoints.api_options import ApiOptionsDep
from endpoints.auth import bearer, matches_any, matching, secret
from endpoints.errors import ApiError
from endpoints.serving import ServingDep


async def require_reader_key(request: Request, options: ApiOptionsDep) -> tuple[KeyLimits, ...]:
    """GET: admin keys if configured, else the gateway's API keys if configured, else open. Answers the API keys
    whose spend the caller may see: every key to an admin key, its own to an API key (as only an admin key may
    change the budget, only an admin key sees what the other keys spend)."""
    admin = list(options.admin_keys)
    keys = admin or list(options.api_keys)
    if not keys:
        return tuple(options.key_limits)
    given = bearer(request.headers.get("authorization"))
    if admin and matches_any(given, (secret(key) for key in admin)):
        return tuple(options.key_limits)
    found = matching(given, (secret(key) for key in options.api_keys))
    if not admin and found is not None:
        return (options.key_limits[found],)
    what = "admin key" if admin else "API key"
    raise _unauthorized(what, given)


async def require_admin_key(request: Request, options: ApiOptionsDep) -> None:
    """PUT and DELETE: an admin key whenever the gateway has any key; open only on a keyless gateway."""
    admin, api = list(options.admin_keys), list(options.api_keys)
    if not admin and not api:
        return
    given = bearer(request.headers.get("authorization"))
    admin_match = matches_any(given, (secret(key) for key in admin))
    api_match = matches_any(given, (secret(key) for key in api))
    if admin_match:
        return
    if api_match:
        how = "" if admin else " This gateway has none: set gateway.admin_keys."
        raise ApiError(
            403,
            f"Changing the budget needs an admin key; an API key may only spend against it.{how}",
            code="admin_key_required",
            type="permission_error",
        )
    raise _unauthorized("admin key", given)


def _unauthorized(what: str, given: bytes) -> ApiError:
    message = f"Missing {what}: send 'Authorization: Bearer <key>'." if not given else f"Incorrect {what} provided."
    return ApiError(401, message, code="invalid_api_key", type="authentication_error")


router = APIRouter(prefix="/v1", tags=["budget"])


@router.get("/budget")
async def get_budget(serving: ServingDep, visible: Annotated[tuple, Depends(require_reader_key)]) -> dict[str, Any]:
    return await _snapshot(serving, visible)


async def _snapshot(serving: ServingDep, keys: Sequence[KeyLimits]) -> dict[str, Any]:
    """The ledger's snapshot and the spend of the API keys the caller may see (`keys`: by name, never the key)."""
    return {**await serving.budget_snapshot(), "keys": await serving.key_spend(keys)}


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


@router.delete("/budget", dependencies=[Depends(require_admin_key)])
async def reset_budget(serving: ServingDep, options: ApiOptionsDep) -> dict[str, Any]:
    try:
        await serving.reset_budget()
    except Refused:
        raise  # the shared store is away: a 503 (endpoints/errors.py)
    except LedgerStateError as exc:
        raise ApiError(500, f"The budget was not reset: {exc}", code="state_write_failed", retry=True) from None
    except Exception as exc:
        raise ApiError(500, f"The budget was reset but applying it failed: {exc}", code="apply_failed") from exc
    return await _snapshot(serving, options.key_limits)


@router.put("/budget", dependencies=[Depends(require_admin_key)])
async def put_budget(request: Request, serving: ServingDep, options: ApiOptionsDep) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "The request body is missing; send a JSON object of budget fields.", code="invalid_request")
    try:
        # Python's json accepts NaN/Infinity; JSON does not, and neither may a budget.
        patch = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "The JSON body of your request is nested too deeply.", code="invalid_json") from None
    if not isinstance(patch, dict):
        raise ApiError(
            400,
            f"The request body must be a JSON object of budget fields, got a JSON {_JSON_TYPES[type(patch)]}.",
            code="invalid_request",
        )
    try:
        # On the loop on purpose: the ledger tells DiSCo's runtime, which recomputes state the loop owns;
        # the fsync of a few hundred bytes is a rare, admin-only cost.
        await serving.update_budget(patch)
    except BudgetValidationError as exc:
        raise ApiError(400, exc.message, param=exc.field, code="invalid_value") from None
    except Refused:
        raise
    except LedgerStateError as exc:
        raise ApiError(500, f"The budget was not changed: {exc}", code="state_write_failed", retry=True) from None
    except Exception as exc:
        # Saved and current, but a listener (DiSCo's recompute) failed: say so, don't retry.
        raise ApiError(
            500, f"The budget was saved but applying it failed: {exc}", code="apply_failed", retry=False
        ) from exc
    return await _snapshot(serving, options.key_limits)
