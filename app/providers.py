"""Provider presets: `[clouds.x] provider = "..."` fills in how Tandem talks to a known kind of upstream.

Each preset gives the base URL and whether the upstream enforces tools and response_format itself; its dialect
(clients/dialects.py: the continuation, the request fields it takes, whether it is asked for streamed usage) is
declared there, under the same name, and fills in `continuation` and `stream_usage`; a field the cloud's
table sets wins over its preset (app/config.py applies them). `tandem check-cloud NAME` (app/check_cloud.py) checks a
preset against the upstream it is pointed at. Where each preset's dialect comes from: docs/configuration.md.
"""

from __future__ import annotations

from clients.dialects import PROVIDERS

# What each provider's dialect (clients/dialects.py: its continuation, the fields it takes, its usage) does not say:
# where it is, how it takes structured output, and its context window where one fits every current chat model it
# serves and its /v1/models does not say it (the others' is read from there: vLLM, llama-server, OpenRouter, Mistral).
_WHERE: dict[str, dict[str, object]] = {
    "openai": {"base_url": "https://api.openai.com/v1", "context_length": 128_000},  # gpt-4o's; gpt-4.1, gpt-5 more
    # The compatibility layer ignores response_format, so forced formats stay away from it.
    "anthropic-openai": {
        "base_url": "https://api.anthropic.com/v1",
        "structured_output": "none",
        "context_length": 200_000,
    },
    # Prefix completion on the beta base URL only. Its JSON mode takes json_object only: a json_schema format goes as
    # json_object, the schema in the prompt, checked here.
    "deepseek": {
        "base_url": "https://api.deepseek.com/beta",
        "structured_output": "json_object",
        "context_length": 128_000,
    },
    "mistral": {"base_url": "https://api.mistral.ai/v1"},
    "vllm": {"base_url": "http://127.0.0.1:8000/v1"},
    # llama.cpp's own server continues a final assistant message unless started with --no-prefill-assistant.
    "llama-server": {"base_url": "http://127.0.0.1:8080/v1"},
    "openrouter": {"base_url": "https://openrouter.ai/api/v1"},
    "ollama": {"base_url": "http://127.0.0.1:11434/v1"},
}

PRESETS: dict[str, dict[str, object]] = {
    name: {
        "continuation": PROVIDERS[name].continuation.name,
        **({} if PROVIDERS[name].stream_usage else {"stream_usage": False}),
        **where,
    }
    for name, where in _WHERE.items()
}


def with_preset(table: dict) -> dict:
    """A cloud's table with its provider's preset under it (the table's own fields win)."""
    preset = PRESETS.get(table.get("provider")) if isinstance(table.get("provider"), str) else None
    return {**preset, **table} if preset else table
