"""Continuation dialects: how an OpenAI-compatible upstream is asked to go on with an answer that has already begun.

Each server documents its own way, and each is sent exactly as documented:

- "prefill": the answer so far as a final assistant message, which the server continues (llama.cpp's llama-server by
  default since 2025, Anthropic's API, OpenRouter, Ollama).
- "prefix-flag": the same message with `"prefix": true` on it (Mistral; DeepSeek on its beta base URL).
- "continue-final-message": the same message, and `continue_final_message: true` with `add_generation_prompt:
  false` at the top level (vLLM, SGLang, Aphrodite: transformers' chat templates).
- "completions": raw `/v1/completions` with the chat template applied here: the device's rendered prompt when the
  upstream shares the device's tokenizer, else the upstream's own template (from its GGUF, a template file or its
  `tokenizer_config.json`, named in config) over the messages, the answer so far appended as text.
- "chat": none; such an upstream only starts answers.

What the answer so far is, and where its seam lies (trailing whitespace moved out of it), is the orchestrator's
(app/serving/seam.py); here only the request each dialect sends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template

DIALECTS = ("chat", "prefill", "prefix-flag", "continue-final-message", "completions")
CHAT_DIALECTS = ("prefill", "prefix-flag", "continue-final-message")


def chat_continuation(dialect: str, messages: Sequence[dict], head: str) -> tuple[list[dict], dict]:
    """The messages, and the body's top-level fields, that ask a `dialect` server to continue an answer that begins
    with `head`."""
    final: dict = {"role": "assistant", "content": head}
    fields: dict = {}
    if dialect == "prefix-flag":
        final["prefix"] = True
    elif dialect == "continue-final-message":
        fields = {"continue_final_message": True, "add_generation_prompt": False}
    elif dialect != "prefill":
        raise ValueError(f"{dialect!r} is not a chat continuation dialect")
    return [*messages, final], fields


def completions_prompt(template: str, messages: Sequence[dict], head: str, tools: Sequence[dict] = ()) -> str:
    """The raw prompt that continues an answer beginning with `head` on a server whose chat template is `template`:
    the conversation rendered up to the assistant's turn (as the server itself renders a chat request), then the
    answer's text. No BOS text: the server adds its own BOS token when its vocabulary asks for one."""
    return render_chat(template, messages, tools=tools or None) + head


def load_chat_template(source: str | Path) -> str:
    """An upstream's chat template from a GGUF model file (its `tokenizer.chat_template`), a Hugging Face
    `tokenizer_config.json` (its `chat_template`), or a Jinja template file. Raises ValueError naming what is
    missing."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".gguf":
        template = read_chat_template(path)
        if not template:
            raise ValueError(f"{path}: the GGUF has no tokenizer.chat_template")
        return template
    if path.suffix == ".json":
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str) or not template:
            raise ValueError(f"{path}: no chat_template in it")
        return template
    return path.read_text(encoding="utf-8")
