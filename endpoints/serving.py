"""The seam between HTTP and the serving core.

Routes reach the core through one typed protocol, `Serving` (app/serving/core.py's ServingCore), injected with
FastAPI's dependencies (`ServingDep`); the gateway's composition root (app/serving/gateway.py) sets it on the app.
Turning an HTTP body into what the core prepares a job from lives here too (`chat_input`, `completion_input`, as
vLLM's serving_chat does), so the core never sees a pydantic model; a refusal comes back as app/serving/errors.py's
types, which endpoints/errors.py maps to the OpenAI envelope.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Protocol

import numpy as np
from fastapi import Depends, Request

from app.serving.core import Readiness
from app.serving.job import Job
from app.serving.ledger import Ledger
from app.serving.relay import Delta
from app.serving.requests import ChatInput, CompletionInput
from endpoints.schemas import ChatCompletionRequest, CompletionRequest


class Serving(Protocol):
    """What the gateway's endpoints ask of the serving core."""

    created: int  # when the gateway started: the models' `created`
    ledger: Ledger  # the budget, which endpoints/budget.py reads and changes

    async def prepare(self, request: ChatInput | CompletionInput) -> Job:
        """The request's job: routed, rendered, tokenised, checked. Raises app/serving/errors.py's refusals."""

    def answer(self, job: Job) -> AsyncIterator[Delta]: ...

    def trace(self, request_id: str) -> dict | None:
        """A recent request's trace (one per choice for n > 1); None when unknown or too old."""

    def models(self) -> list[str]: ...

    async def readiness(self) -> Readiness: ...

    async def embed(self, model: str, texts: list[str]) -> tuple[np.ndarray, int]:
        """Unit-length vectors and the tokens embedded; NotFound when embeddings are off or `model` is not theirs."""

    def budget_snapshot(self) -> dict: ...

    def render_metrics(self) -> bytes: ...


async def serving(request: Request) -> Serving:
    # async: a plain function dependency would run on FastAPI's thread pool, a hop on every request's path.
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(serving)]


def _common(body: ChatCompletionRequest | CompletionRequest, key_privacy: str | None) -> dict:
    tandem = body.tandem
    return {
        "model": body.model,
        "key_privacy": key_privacy,
        "policy": tandem.policy if tandem else None,
        "cloud": tandem.cloud if tandem else None,
        "privacy": tandem.privacy if tandem else None,
        "decoding": tandem.decoding if tandem else None,
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
    }


def chat_input(body: ChatCompletionRequest, key_privacy: str | None, id_prefix: str = "chatcmpl-") -> ChatInput:
    """A chat body as the core takes it; `key_privacy` is its API key's privacy level."""
    choice = body.tool_choice
    fmt = body.response_format
    return ChatInput(
        **_common(body, key_privacy),
        messages=tuple(
            {
                **m.model_dump(exclude_none=True, exclude={"prefix"}),
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


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def completion_input(body: CompletionRequest, key_privacy: str | None) -> CompletionInput:
    prompt = body.prompt if isinstance(body.prompt, str) else tuple(body.prompt)
    return CompletionInput(**_common(body, key_privacy), prompt=prompt)
