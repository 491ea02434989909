"""Continuing an answer on an upstream that takes a raw prompt, and where its chat template comes from.

Which dialect an endpoint continues in, and how a chat dialect's request looks, is clients/dialects.py's. Here only
what the "completions" dialect needs: the raw prompt that continues an answer (the upstream's own template over the
messages, the answer so far appended as text), and reading that template from a GGUF, a `tokenizer_config.json` or
a Jinja file. What the answer so far is, and where its seam lies (trailing whitespace moved out of it), is the
orchestrator's (app/serving/seam.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template


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
