"""Tool calls read out of generated text, token by token.

Text that is or may become a `<tool_call>` is held back, a whole token at a time, until its closing tag: a call
reaches the client only complete, with arguments that parse, never half. Because holding starts at a token
boundary, what was delivered is always exactly the first `committed` tokens, which is where another endpoint
regenerates from when the source fails inside a call (app/serving/relay.py). A held text that turns out
not to be a valid call is delivered as plain text. An answer that is a bare JSON object naming an offered tool
(`{"name": ..., "arguments": ...}`, as Qwen2.5-Coder often writes calls), or the same object in a code fence
(```` ```json ... ``` ````, as small models write them in agent loops), is held to its end and read as a call.
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass

from app.serving.structured import CLOSE, OPEN


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def _parse(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{secrets.token_hex(12)}", call["name"], json.dumps(arguments, ensure_ascii=False))


def _may_start_call(text: str) -> bool:
    """Whether `text` contains the opening tag or ends with the start of one."""
    if OPEN in text:
        return True
    return any(text.endswith(OPEN[:k]) for k in range(1, len(OPEN)))


# Qwen2.5-Coder often writes a call as a bare JSON object, without the tags, and sometimes in a code fence. An answer
# that *starts* with one, naming an offered tool, is read as a call (held to the end of the answer, then parsed whole).
_BARE = '{"name"'
_FENCE = "```"


def _unfenced(text: str) -> str | None:
    """What follows a leading code fence and its tag (none, or `json`): `text` itself when it opens no fence, ""
    while the fence or its tag is still being written, None when it opens a fence of another language."""
    if not text.startswith("`"):
        return text
    if not text.startswith(_FENCE):
        return "" if _FENCE.startswith(text) else None
    rest = text[len(_FENCE) :]
    tag = rest
    for end, char in enumerate(rest):
        if char.isspace() or char == "{":
            tag = rest[:end]
            break
    if not "json".startswith(tag.lower()):
        return None
    return rest[len(tag) :].lstrip() if len(tag) < len(rest) else ""


def _opening(body: str) -> str:
    """A would-be call's start with the whitespace after its brace dropped (`{\n  "name"` opens one too)."""
    return "{" + body[1:].lstrip() if body.startswith("{") else body


class ToolCallSplitter:
    """Splits an answer's tokens into content to deliver and complete tool calls."""

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self._names = names  # the offered tools
        self._held: list[str] = []  # texts of the held tokens
        self._bare = False  # what is held may be a bare JSON call
        self._spoke = False  # content other than whitespace went out
        self.committed = 0  # tokens whose text (or call) has been handed out
        self.calls = 0  # calls handed out so far

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """One token's text → (content to deliver now, calls completed by it)."""
        if not self._held:
            if self._may_start_bare(text):
                self._bare = True
            elif not (self.calls and not text.strip()):  # whitespace after a call may precede another
                if "<" not in text or not _may_start_call(text):
                    self.committed += 1
                    self._spoke = self._spoke or bool(text.strip())
                    return text, []
        self._held.append(text)
        return self._settle(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The answer ended: what is still held goes out (a call whose closing tag never came counts if its JSON
        is complete)."""
        return self._settle(final=True)

    def peek(self, text: str, final: bool) -> list[ToolCall]:
        """The calls one more token's `text` would complete (with the answer's end too, when `final`); nothing here
        changes, so a call can be looked at, and dropped, before it is handed out."""
        probe = copy.copy(self)
        probe._held = list(self._held)
        calls = probe.feed(text)[1]
        return calls + probe.finish()[1] if final else calls

    def discard(self) -> None:
        """Forget what is held (its tokens will be generated again elsewhere)."""
        self._held.clear()
        self._bare = False

    def _may_start_bare(self, text: str) -> bool:
        start = text.lstrip()
        if not (self._names and start) or self._spoke or self.calls:
            return False
        body = _unfenced(start)
        return body is not None and _BARE.startswith(_opening(body)[: len(_BARE)])

    def _bare_call(self, joined: str, final: bool) -> tuple[bool, ToolCall | None]:
        """(still undecided, the call) for held text that may be a bare JSON call, or one in a code fence."""
        candidate = joined.strip()
        body = _unfenced(candidate)
        opening = None if body is None else _opening(body)
        if opening is not None and not final and (_BARE.startswith(opening) or opening.startswith(_BARE)):
            return True, None
        self._bare = False
        if body is not None and body is not candidate:  # fenced: the call is what the fence holds
            body = body.removesuffix(_FENCE).rstrip()
        call = _parse(body) if final and opening is not None and opening.startswith(_BARE) else None
        return False, call if call is not None and call.name in self._names else None

    def _settle(self, final: bool) -> tuple[str, list[ToolCall]]:
        joined = "".join(self._held)
        if self._bare:
            undecided, call = self._bare_call(joined, final)
            if undecided:
                return "", []
            if call is not None:
                self.committed += len(self._held)
                self._held = []
                self.calls += 1
                return "", [call]
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = joined.find(OPEN)
            if start < 0:
                if final or not _may_start_call(joined):
                    content.append(joined)
                    joined = ""
                break
            end = joined.find(CLOSE, start)
            if end < 0:
                if final:
                    call = _parse(joined[start + len(OPEN) :].strip())
                    content.append(joined[:start] if call else joined)
                    calls += [call] if call else []
                    joined = ""
                break
            call = _parse(joined[start + len(OPEN) : end].strip())
            if call is None:  # not a valid call: it was text after all
                content.append(joined[: end + len(CLOSE)])
            else:
                content.append(joined[:start])
                calls.append(call)
            joined = joined[end + len(CLOSE) :]
        if joined:
            # Still undecided: keep holding, from the first held token (the tokens before it are all delivered).
            if content or calls:
                # Part of the held text went out; what remains stays held as one piece of the last token.
                self.committed += len(self._held) - 1
                self._held = [joined]
        else:
            self.committed += len(self._held)
            self._held = []
        self.calls += len(calls)
        text = "".join(content)
        if self.calls and not text.strip():
            text = ""  # the newlines around calls are the format's, not content
        self._spoke = self._spoke or bool(text.strip())
        return text, calls
