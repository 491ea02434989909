"""Render chat messages with the model's own Jinja chat template (from its GGUF).

The gateway renders the template itself (instead of letting each server do it)
so that a prompt has one token sequence everywhere: its length l drives the
dispatch policy, and a continuation on another endpoint with the same
vocabulary starts from exactly the same token IDs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(
    template: str,
    messages: Sequence[dict],
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[dict] | None = None,
) -> str:
    try:
        return _compile(template).render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
