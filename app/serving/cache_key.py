"""A conversation's prompt-cache key, for the clouds whose dialect takes one (`prompt_cache_key`).

A provider such as OpenAI routes requests with the same key to the same cache, so each turn of a conversation, and
a migration back onto the cloud mid-answer, finds the prefix it cached before. Where the client sends no key of its
own, the gateway derives one from what stays the same across a conversation's turns: its API key's name, the
messages before the first user message (the system prompt) and that first user message. The key is an HMAC under
the gateway's secret (`[gateway] prompt_cache_secret`, else one drawn at start-up): it tells a provider which
requests share a prefix and nothing of their text or of the API key it came with.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence

PREFIX = "tandem-"
_DIGEST_CHARS = 32  # 128 bits of the HMAC: no two conversations share a key by chance


class ConversationKeys:
    """Derives the prompt-cache key of a conversation under one gateway's secret."""

    def __init__(self, secret: bytes | None = None):
        self._secret = secret or secrets.token_bytes(32)

    def key(self, api_key_name: str, messages: Sequence[dict]) -> str | None:
        """The key of the conversation `messages` (OpenAI chat shapes) begins, sent with the API key named
        `api_key_name` ("" for a gateway without keys); None when it has no message to key it by."""
        stable = stable_prefix(messages)
        if not stable:
            return None
        material = json.dumps([api_key_name, stable], sort_keys=True, ensure_ascii=False, default=str)
        digest = hmac.new(self._secret, material.encode(), hashlib.sha256).hexdigest()
        return PREFIX + digest[:_DIGEST_CHARS]


def stable_prefix(messages: Sequence[dict]) -> list[list]:
    """The part of a conversation that every later turn sends again unchanged: each message up to and including the
    first user message, as (role, content)."""
    prefix: list[list] = []
    for message in messages:
        prefix.append([message["role"], message.get("content")])
        if message["role"] == "user":
            break
    return prefix
