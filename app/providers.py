"""Provider presets: `[clouds.x] provider = "..."` fills in how Tandem talks to a known kind of upstream.

Each preset gives the base URL, the continuation dialect (clients/continuation.py), the tokenizer, whether the
upstream enforces tools and response_format itself, and whether it is asked for streamed usage; a field the cloud's
table sets wins over its preset (app/config.py applies them). `tandem check-cloud NAME` (app/check_cloud.py) checks a
preset against the upstream it is pointed at. Where each preset's dialect comes from: docs/configuration.md.
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, object]] = {
    # A trailing assistant message is history to OpenAI, never a prefix: fresh answers only.
    "openai": {"base_url": "https://api.openai.com/v1", "continuation": "chat"},
    # Claude continues a final assistant turn (and rejects one ending in whitespace: Tandem moves it out); the
    # compatibility layer ignores response_format, so forced formats stay away from it.
    "anthropic-openai": {
        "base_url": "https://api.anthropic.com/v1",
        "continuation": "prefill",
        "structured_output": "none",
    },
    # Prefix completion: `"prefix": true` on the last assistant message, on the beta base URL only. Its JSON mode
    # takes json_object only: a json_schema format goes as json_object, the schema in the prompt, checked here.
    "deepseek": {
        "base_url": "https://api.deepseek.com/beta",
        "continuation": "prefix-flag",
        "structured_output": "json_object",
    },
    # `"prefix": true` too; its API refuses fields it does not know (stream_options) and sends usage unasked.
    "mistral": {"base_url": "https://api.mistral.ai/v1", "continuation": "prefix-flag", "stream_usage": False},
    "vllm": {"base_url": "http://127.0.0.1:8000/v1", "continuation": "continue-final-message"},
    # llama.cpp's own server continues a final assistant message unless started with --no-prefill-assistant.
    "llama-server": {"base_url": "http://127.0.0.1:8080/v1", "continuation": "prefill"},
    "openrouter": {"base_url": "https://openrouter.ai/api/v1", "continuation": "prefill"},
    "ollama": {"base_url": "http://127.0.0.1:11434/v1", "continuation": "prefill"},
}


def with_preset(table: dict) -> dict:
    """A cloud's table with its provider's preset under it (the table's own fields win)."""
    preset = PRESETS.get(table.get("provider")) if isinstance(table.get("provider"), str) else None
    return {**preset, **table} if preset else table
