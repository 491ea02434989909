"""Context windows: the endpoints a request may start on, whether its prompt fits one of them, and the window a model
name reports.

Each backend declares its window (clients/base.py: `Backend.context_window`: the device's n_ctx, a cloud's from its
settings, its preset or its own /v1/models, a split model's context). A prompt fits when some endpoint the request
may start on can hold it and one token more: the endpoint its model names, else the device and its cloud within its
privacy level, or the one its policy starts every answer on (device-only, server-only). Else it is refused with
`context_length_exceeded`, naming the largest of those windows. Which endpoint starts, races, takes a fallback or a
migration is the orchestrator's, and it asks each endpoint's window there with the answer delivered so far
(`Orchestrator._serves`); the answer's max_tokens is clamped to what the window of the endpoint writing it leaves.
"""

from __future__ import annotations

from collections.abc import Mapping

from app.serving.errors import InvalidRequest
from clients.base import Backend
from policies.dispatch import declaration
from policies.privacy import allows


def starts_on(
    backends: Mapping[str, Backend], device: str, pinned: str | None, policy: str, cloud: str | None, privacy: str
) -> list[str]:
    """The endpoints a request may start on: the one its model names, else those of the device-cloud pair that its
    privacy level allows and its policy starts answers on."""
    if pinned is not None:
        return [pinned]
    roles = {"device": device, "cloud": cloud}
    only = declaration(policy).only_on
    names = [roles[only]] if only is not None else [device, cloud]
    return [n for n in names if n is not None and allows(privacy, backends[n].locality)]


def check_fits(
    backends: Mapping[str, Backend], device: str, route: tuple[str | None, str, str | None, str], prompt_tokens: int
) -> None:
    """Refuse a prompt that no endpoint the request may start on can hold with one token of answer (nothing to refuse
    where there is none at all: the request is refused for that elsewhere). `route`: (pinned endpoint, policy, cloud,
    privacy level), as the core routed the request."""
    pinned, policy, _, _ = route
    if pinned is not None:
        why = "the endpoint its model names"
    elif declaration(policy).only_on is not None:
        why = f"the one endpoint its routing policy '{policy}' answers on"
    else:
        why = "the largest of the endpoints it may start on"
    windows = {name: backends[name].context_window for name in starts_on(backends, device, *route)}
    if not windows or any(prompt_tokens < window for window in windows.values()):
        return
    largest = max(windows, key=windows.__getitem__)
    raise InvalidRequest(
        f"This prompt is {prompt_tokens} tokens, more than the context window of {windows[largest]} tokens of "
        f"{largest}, {why}: shorten it (the answer needs at least one token of the window too).",
        param="messages",
        code="context_length_exceeded",
    )


def largest_window(backends: Mapping[str, Backend], names: list[str]) -> int:
    """The window a model name that routes over `names` reports: the largest prompt it can take is held by one."""
    return max((backends[n].context_window for n in names), default=0)
