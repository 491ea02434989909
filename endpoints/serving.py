"""The seam between HTTP and the serving core.

Routes reach the core through one typed protocol, `Serving` (app/serving/core.py's ServingCore), injected with
FastAPI's dependencies (`ServingDep`); the gateway's composition root (app/serving/gateway.py) sets it on the app.
Turning an HTTP body into what the core prepares a job from lives here too (`chat_input`, `completion_input`, as
vLLM's serving_chat does), so the core never sees a pydantic model; a refusal comes back as app/serving/errors.py's
types, which endpoints/errors.py maps to the envelope of the API asked (OpenAI's, or Anthropic's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Annotated, NamedTuple, Protocol

import numpy as np
from fastapi import Depends, Request

from app.serving.core import Readiness
from app.serving.events import EventBus
from app.serving.job import Job
from app.serving.limits import KeyLimits
from app.serving.relay import Delta
from app.serving.requests import ChatInput, CompletionInput
from endpoints.schemas import ChatCompletionRequest, CompletionRequest, TandemOptions


class Serving(Protocol):
    """What the gateway's endpoints ask of the serving core."""

    created: int  # when the gateway started: the models' `created`
    events: EventBus  # the live feed endpoints/events.py streams

    async def prepare(self, request: ChatInput | CompletionInput) -> Job:
        """The request's job: routed, rendered, tokenised, checked. Raises app/serving/errors.py's refusals."""

    async def count_tokens(self, request: ChatInput) -> int:
        """The prompt `prepare` would render for it, in the device model's tokens; nothing admitted or run."""

    def answer(self, job: Job) -> AsyncIterator[Delta]: ...

    async def trace(self, request_id: str) -> dict | None:
        """A recent request's trace (one per choice for n > 1), from any replica sharing the store; None when
        unknown or too old."""

    def models(self) -> list[dict]:
        """Each model id a request may name, with its context window, capabilities, locality and price."""

    async def readiness(self) -> Readiness: ...

    async def embed(self, model: str, texts: list[str]) -> tuple[np.ndarray, int]:
        """Unit-length vectors and the tokens embedded; NotFound when embeddings are off or `model` is not theirs."""

    async def budget_snapshot(self) -> dict: ...

    async def key_spend(self, keys: Sequence[KeyLimits]) -> list[dict]:
        """Each of `keys`' spend this period, in flight and this minute, by its name (app/serving/limits.py)."""

    async def update_budget(self, patch: dict) -> None:
        """Raises BudgetValidationError naming the field, LedgerStateError, or Unavailable (the shared store)."""

    async def reset_budget(self) -> None: ...

    def health(self) -> dict:
        """GET /health's body: "ok", or "degraded" with the shared store's state and problems."""

    def render_metrics(self) -> bytes: ...

    def endpoints(self) -> list[dict]:
        """Each endpoint's name, role, model, locality and live counters (the dashboard's health panel)."""


async def serving(request: Request) -> Serving:
    # async: a plain function dependency would run on FastAPI's thread pool, a hop on every request's path.
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(serving)]


def routing_fields(model: str, tandem: TandemOptions | None, key: KeyAccess | None) -> dict:
    """What every front door passes the core alike: the model, the key's privacy and limits, Tandem's own options
    (`tandem`: policy, cloud, privacy, decoding, a forced migration, the quality policy's τ)."""
    key = key or KeyAccess()
    return {
        "model": model,
        "key_privacy": key.privacy,
        "key_limits": key.limits,
        "policy": tandem.policy if tandem else None,
        "cloud": tandem.cloud if tandem else None,
        "privacy": tandem.privacy if tandem else None,
        "decoding": tandem.decoding if tandem else None,
        "migrate_after_tokens": tandem.migrate_after_tokens if tandem else None,
        "quality_threshold": tandem.quality_threshold if tandem else None,
    }


def _common(body: ChatCompletionRequest | CompletionRequest, key: KeyAccess | None) -> dict:
    return {
        **routing_fields(body.model, body.tandem, key),
        "streamed": bool(body.stream),
        "max_tokens": body.token_limit,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stop": body.stop_sequences,
        "seed": body.seed,
        "logprobs": body.logprobs_top,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "logit_bias": body.logit_bias_pairs,
        "choices": body.choices,
        "top_k": body.top_k,
        "extras": body.extras(),
    }


class KeyAccess(NamedTuple):
    """What the request's API key brings (endpoints/auth.py sets it on `request.state.key`)."""

    privacy: str | None = None  # its privacy level
    limits: KeyLimits | None = None  # its caps and rate limits


def chat_input(body: ChatCompletionRequest, key: KeyAccess | None, id_prefix: str = "chatcmpl-") -> ChatInput:
    """A chat body as the core takes it; `key` is what its API key brings (None: no key)."""
    choice = body.tool_choice
    fmt = body.response_format
    return ChatInput(
        **_common(body, key),
        messages=tuple(
            {
                **m.model_dump(exclude_none=True, exclude={"prefix", "refusal"}),
                "role": "system" if m.role == "developer" else m.role,
            }
            for m in body.messages
        ),
        continue_final=body.continues_final,
        tools=tuple(t.model_dump(exclude_none=True) for t in body.tools or ()),
        tool_choice=choice.model_dump() if hasattr(choice, "model_dump") else choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=fmt.model_dump(exclude_none=True, by_alias=True) if fmt is not None else None,
        id_prefix=id_prefix,
    )


def completion_input(body: CompletionRequest, key: KeyAccess | None) -> CompletionInput:
    prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
    return CompletionInput(**_common(body, key), prompt=prompt)
