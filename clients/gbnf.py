"""GBNF, llama.cpp's grammar format, for upstreams that enforce one themselves.

llama.cpp's `llama-server` and llama-cpp-python's server take a GBNF grammar in the `grammar` field of a request and
mask every token with it. The gateway sends them the same constraint the device applies with llguidance
(app/serving/structured.py builds both): JSON for a schema, written compactly as the device writes it
(`{"a": 1, "b": [2, 3]}`, so an answer can move between them mid-way), and the tool-call format.

A grammar on such an upstream reads only what the upstream generates, and a continuation's prompt ends with the
delivered prefix. So a continuation gets the grammar's *residual* over the prefix: the language of every text that
completes the prefix to a sentence of the grammar. `residual()` computes it the way llama.cpp runs a grammar (a set
of pushdown stacks over the rules, advanced character by character) and writes the stacks out as a grammar again.

Rules are kept in llama.cpp's parsed form: each a list of alternatives, each a sequence of elements, an element a
character set or a reference to a rule; string literals, groups and repetitions are desugared as llama.cpp does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

MAX_STACKS = 512  # an ambiguous grammar's stacks can multiply with every character: past this, give up


class GBNFError(ValueError):
    """A grammar that does not parse, or a prefix the grammar does not allow."""


@dataclass(frozen=True)
class Chars:
    """One character out of `ranges` (inclusive code point pairs), or, when `negated`, any character outside them."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False

    def matches(self, c: int) -> bool:
        inside = any(lo <= c <= hi for lo, hi in self.ranges)
        return inside != self.negated


@dataclass(frozen=True)
class Ref:
    name: str


Element = Chars | Ref
Sequence_ = tuple[Element, ...]
Rules = dict[str, list[Sequence_]]


# -- parsing ---------------------------------------------------------------------------------------------------------
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-"}  # llama.cpp's
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.rules: Rules = {}
        self.defined: set[str] = set()

    def fail(self, pos: int, what: str) -> GBNFError:
        line = self.text.count("\n", 0, pos) + 1
        return GBNFError(f"GBNF: {what} at line {line}: {self.text[pos : pos + 30]!r}")

    def space(self, pos: int, newline_ok: bool) -> int:
        text = self.text
        while pos < len(text):
            c = text[pos]
            if c == "#":
                while pos < len(text) and text[pos] not in "\r\n":
                    pos += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                pos += 1
            else:
                break
        return pos

    def name(self, pos: int) -> tuple[str, int]:
        end = pos
        while end < len(self.text) and self.text[end] in _NAME_CHARS:
            end += 1
        if end == pos:
            raise self.fail(pos, "expected a rule name")
        return self.text[pos:end], end

    def char(self, pos: int) -> tuple[int, int]:
        """One (possibly escaped) character of a literal or a set, as a code point."""
        text = self.text
        if pos >= len(text):
            raise self.fail(pos, "unexpected end")
        if text[pos] != "\\":
            return ord(text[pos]), pos + 1
        kind = text[pos + 1 : pos + 2]
        width = {"x": 2, "u": 4, "U": 8}.get(kind)
        if width is not None:
            digits = text[pos + 2 : pos + 2 + width]
            try:
                return int(digits, 16), pos + 2 + width
            except ValueError:
                raise self.fail(pos, "bad escape") from None
        if kind in _ESCAPES:
            return ord(_ESCAPES[kind]), pos + 2
        raise self.fail(pos, "unknown escape")

    def fresh(self, base: str) -> str:
        """A new rule's name (a group's or a repetition's), reserved at once."""
        name = _fresh_name(self.rules, base)
        self.rules[name] = []
        return name

    def alternatives(self, pos: int, rule: str, nested: bool) -> tuple[list[Sequence_], int]:
        alts = []
        seq, pos = self.sequence(pos, rule, nested)
        alts.append(seq)
        while pos < len(self.text) and self.text[pos] == "|":
            seq, pos = self.sequence(self.space(pos + 1, True), rule, nested)
            alts.append(seq)
        return alts, pos

    def sequence(self, pos: int, rule: str, nested: bool) -> tuple[Sequence_, int]:
        out: list[Element] = []
        last: list[Element] = []  # the last symbol (a repetition applies to it)
        text = self.text
        while pos < len(text):
            c = text[pos]
            if c == '"':
                pos += 1
                last = []
                while pos < len(text) and text[pos] != '"':
                    cp, pos = self.char(pos)
                    last.append(Chars(((cp, cp),)))
                if pos >= len(text):
                    raise self.fail(pos, "unterminated string")
                pos += 1
                out += last
            elif c == "[":
                pos += 1
                negated = text[pos : pos + 1] == "^"
                pos += negated
                ranges = []
                while pos < len(text) and text[pos] != "]":
                    lo, pos = self.char(pos)
                    hi = lo
                    if text[pos : pos + 1] == "-" and text[pos + 1 : pos + 2] not in ("]", ""):
                        hi, pos = self.char(pos + 1)
                    ranges.append((lo, hi))
                if pos >= len(text):
                    raise self.fail(pos, "unterminated character set")
                pos += 1
                last = [Chars(tuple(ranges), negated)]
                out += last
            elif c == ".":
                pos += 1
                last = [Chars((), True)]
                out += last
            elif c in _NAME_CHARS:
                name, pos = self.name(pos)
                last = [Ref(name)]
                out += last
            elif c == "(":
                sub = self.fresh(rule)
                alts, pos = self.alternatives(self.space(pos + 1, True), rule, True)
                if text[pos : pos + 1] != ")":
                    raise self.fail(pos, "expected ')'")
                self.rules[sub] = alts
                pos += 1
                last = [Ref(sub)]
                out += last
            elif c in "*+?{":
                if not last:
                    raise self.fail(pos, "a repetition follows nothing")
                lo, hi, pos = self.bounds(pos)
                del out[len(out) - len(last) :]
                out += self.repeat(tuple(last), lo, hi, rule)
                last = []
            elif c == "<":
                raise self.fail(pos, "token references are not supported")
            else:
                break
            pos = self.space(pos, nested)
        return tuple(out), pos

    def bounds(self, pos: int) -> tuple[int, int | None, int]:
        c = self.text[pos]
        if c == "*":
            return 0, None, pos + 1
        if c == "+":
            return 1, None, pos + 1
        if c == "?":
            return 0, 1, pos + 1
        end = self.text.find("}", pos)
        if end < 0:
            raise self.fail(pos, "unterminated repetition")
        lo_text, comma, hi_text = self.text[pos + 1 : end].partition(",")
        try:
            lo = int(lo_text)
            hi = (int(hi_text) if hi_text.strip() else None) if comma else lo
        except ValueError:
            raise self.fail(pos, "bad repetition bounds") from None
        return lo, hi, end + 1

    def repeat(self, symbol: Sequence_, lo: int, hi: int | None, rule: str) -> list[Element]:
        """`symbol` lo..hi times (hi None: unbounded): lo copies, then a right-recursive rule for the rest."""
        out = list(symbol) * lo
        if hi is None:
            more = self.fresh(rule)
            self.rules[more] = [(*symbol, Ref(more)), ()]
            return [*out, Ref(more)]
        tail: Ref | None = None
        for _ in range(hi - lo):
            optional = self.fresh(rule)
            self.rules[optional] = [(*symbol, *((tail,) if tail else ())), ()]
            tail = Ref(optional)
        return out + ([tail] if tail else [])

    def parse(self) -> Rules:
        pos = self.space(0, True)
        while pos < len(self.text):
            name, pos = self.name(pos)
            pos = self.space(pos, False)
            if self.text[pos : pos + 3] != "::=":
                raise self.fail(pos, "expected '::='")
            alts, pos = self.alternatives(self.space(pos + 3, True), name, False)
            if name in self.defined:
                raise self.fail(pos, f"rule {name!r} defined twice")
            self.defined.add(name)
            self.rules[name] = alts
            if pos < len(self.text) and self.text[pos] not in "\r\n":
                raise self.fail(pos, "expected the end of the rule")
            pos = self.space(pos, True)
        for alts in self.rules.values():
            for seq in alts:
                for el in seq:
                    if isinstance(el, Ref) and el.name not in self.rules:
                        raise GBNFError(f"GBNF: rule {el.name!r} is used but not defined")
        if "root" not in self.rules:
            raise GBNFError("GBNF: no root rule")
        return self.rules


@lru_cache(maxsize=64)
def parse(text: str) -> Rules:
    """A GBNF grammar's rules (llama.cpp's parsed form). Cached: treat the result as read-only."""
    return _Parser(text).parse()


# -- writing ---------------------------------------------------------------------------------------------------------
def _escape(cp: int, in_set: bool) -> str:
    c = chr(cp)
    if c in ('"\\' if not in_set else "]\\-["):
        return "\\" + c
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    if cp < 0x20 or cp == 0x7F or 0xD800 <= cp <= 0xDFFF or (in_set and c == "^"):  # llama.cpp has no \^
        return f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}"
    return c


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + "".join(_escape(ord(c), False) for c in text) + '"'


def _sequence_text(seq: Sequence_) -> str:
    parts: list[str] = []
    run: list[int] = []  # single characters, written as one literal
    for el in (*seq, None):
        if isinstance(el, Chars) and not el.negated and len(el.ranges) == 1 and el.ranges[0][0] == el.ranges[0][1]:
            run.append(el.ranges[0][0])
            continue
        if run:
            parts.append(literal("".join(map(chr, run))))
            run = []
        if isinstance(el, Ref):
            parts.append(el.name)
        elif el == Chars((), True):
            parts.append(".")
        elif isinstance(el, Chars):
            body = "".join(_escape(lo, True) + ("" if lo == hi else "-" + _escape(hi, True)) for lo, hi in el.ranges)
            parts.append(f"[{'^' if el.negated else ''}{body}]")
    return " ".join(parts) or '""'


def write(rules: Rules) -> str:
    """GBNF text for `rules` (root first)."""
    order = sorted(rules, key=lambda n: (n != "root", n))
    return "\n".join(f"{name} ::= {' | '.join(_sequence_text(s) for s in rules[name])}" for name in order) + "\n"


def _reachable(rules: Rules) -> Rules:
    seen, todo = {"root"}, ["root"]
    while todo:
        for seq in rules[todo.pop()]:
            for el in seq:
                if isinstance(el, Ref) and el.name not in seen:
                    seen.add(el.name)
                    todo.append(el.name)
    return {n: rules[n] for n in rules if n in seen}


# -- the residual over a prefix --------------------------------------------------------------------------------------
Frame = tuple[str, int, int]  # (rule, alternative, position in it)
Stack = tuple[Frame, ...]  # the top is the last frame


def _expand(rules: Rules, stack: Stack, out: set[Stack], depth: int = 0) -> None:
    """Every stack `stack` can reach without reading a character whose top is a character set, and the empty
    stack when the grammar can end here. A frame at the end of its sequence is dropped as soon as it is pushed
    (a tail call), so right-recursive repetitions keep stacks short."""
    if depth > 200:
        raise GBNFError("GBNF: the grammar recurses without reading a character (left recursion)")
    if len(out) > MAX_STACKS:
        raise GBNFError("GBNF: the grammar is too ambiguous to continue from a prefix")
    if not stack:
        out.add(stack)
        return
    rule, alt, pos = stack[-1]
    element = rules[rule][alt][pos]
    if isinstance(element, Chars):
        out.add(stack)
        return
    below = _advanced(rules, stack)
    for i, seq in enumerate(rules[element.name]):
        _expand(rules, (*below, (element.name, i, 0)) if seq else below, out, depth + 1)


def _advanced(rules: Rules, stack: Stack) -> Stack:
    """`stack` with its top frame moved past its current element (dropped when that was its last: no frame on a
    stack is ever at the end of its sequence)."""
    rule, alt, pos = stack[-1]
    if pos + 1 < len(rules[rule][alt]):
        return (*stack[:-1], (rule, alt, pos + 1))
    return stack[:-1]


def _start(rules: Rules) -> set[Stack]:
    stacks: set[Stack] = set()
    for i, seq in enumerate(rules["root"]):
        _expand(rules, (("root", i, 0),) if seq else (), stacks)
    return stacks


def _accept(rules: Rules, stacks: set[Stack], c: int) -> set[Stack]:
    out: set[Stack] = set()
    for stack in stacks:
        if not stack:
            continue
        rule, alt, pos = stack[-1]
        element = rules[rule][alt][pos]
        if isinstance(element, Chars) and element.matches(c):
            _expand(rules, _advanced(rules, stack), out)
    return out


def residual(grammar: str, prefix: str) -> str:
    """A GBNF grammar for what may follow `prefix` under `grammar` (the grammar itself for an empty prefix);
    GBNFError when the prefix does not fit it. An empty alternative of the new root means the answer may end
    right after the prefix."""
    if not prefix:
        return grammar
    rules = parse(grammar)
    stacks = _start(rules)
    for i, ch in enumerate(prefix):
        stacks = _accept(rules, stacks, ord(ch))
        if not stacks:
            raise GBNFError(f"GBNF: the delivered prefix leaves the grammar at character {i}: {prefix[: i + 1]!r}")
    # The grammar's rules stay as they are (its root renamed); the new root is one alternative per stack, each the
    # rest of every frame's sequence from the top of the stack down.
    renamed = _fresh_name(rules, "root-grammar")

    def name_of(rule: str) -> str:
        return renamed if rule == "root" else rule

    out: Rules = {
        name_of(n): [tuple(Ref(name_of(el.name)) if isinstance(el, Ref) else el for el in seq) for seq in alts]
        for n, alts in rules.items()
    }
    rests: dict[Frame, str] = {}
    root: list[Sequence_] = []
    for stack in sorted(stacks):
        for frame in stack:
            if frame not in rests:
                rule, alt, pos = frame
                rests[frame] = _fresh_name(out, f"{name_of(rule)}-rest")
                out[rests[frame]] = [out[name_of(rule)][alt][pos:]]
        root.append(tuple(Ref(rests[frame]) for frame in reversed(stack)))
    out["root"] = root
    return write(_reachable(out))


def _fresh_name(rules: Rules, base: str) -> str:
    n = 0
    while f"{base}-{n}" in rules:
        n += 1
    return f"{base}-{n}"


# -- the gateway's constraints ---------------------------------------------------------------------------------------
def _compact(rules: Rules) -> Rules:
    """llama.cpp's JSON-schema grammar with its optional spaces (`space`) made the device's compact JSON: one space
    after a ',' or ':' separator, none anywhere else."""
    out: Rules = {}
    for name, alts in rules.items():
        if name == "space":
            continue
        new_alts = []
        for seq in alts:
            new: list[Element] = []
            for el in seq:
                if el == Ref("space"):
                    if new and new[-1] in (Chars(((44, 44),)), Chars(((58, 58),))):
                        new.append(Chars(((32, 32),)))
                    continue
                new.append(el)
            new_alts.append(tuple(new))
        out[name] = new_alts
    return out


def _prefixed(rules: Rules, prefix: str) -> Rules:
    def rename(el: Element) -> Element:
        return Ref(prefix + el.name) if isinstance(el, Ref) else el

    return {prefix + n: [tuple(rename(el) for el in seq) for seq in alts] for n, alts in rules.items()}


@lru_cache(maxsize=64)
def _schema_rules(schema_json: str) -> Rules:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = json_schema_to_gbnf(schema_json)
    except Exception as exc:  # the converter raises whatever its schema walk hits
        raise GBNFError(f"GBNF: the JSON schema has no GBNF form: {exc}") from exc
    return _reachable(_compact(parse(text)))


def json_grammar(schema: dict) -> str:
    """Compact JSON valid for `schema` (llama.cpp's JSON-schema converter, with the device's spacing)."""
    return write(_schema_rules(json.dumps(schema)))


def tool_calls_grammar(tools, names, parallel: bool, open_tag: str, close_tag: str) -> str:
    """One call of the named functions (with `parallel`, one or more, a newline apart), each
    `open_tag\\n{"name": NAME, "arguments": ARGS}\\nclose_tag` with ARGS valid for the function's `parameters`."""
    return _tool_calls(json.dumps(list(tools)), tuple(names), parallel, open_tag, close_tag)


@lru_cache(maxsize=64)
def _tool_calls(tools_json: str, names: tuple[str, ...], parallel: bool, open_tag: str, close_tag: str) -> str:
    by_name = {t["function"]["name"]: t["function"] for t in json.loads(tools_json)}
    arguments: Rules = {}
    lines = [
        f"root ::= call{' more' if parallel else ''}",
        f"call ::= {literal(open_tag + chr(10))} ({' | '.join(f'f{i}' for i in range(len(names)))}) "
        f"{literal(chr(10) + close_tag)}",
        *(['more ::= ("\\n" call)*'] if parallel else []),
    ]
    for i, name in enumerate(names):
        schema = by_name[name].get("parameters") or {"type": "object"}
        arguments.update(_prefixed(_schema_rules(json.dumps(schema)), f"a{i}-"))
        head = literal('{"name": ' + json.dumps(name) + ', "arguments": ')
        lines.append(f'f{i} ::= {head} a{i}-root "}}"')
    return write(parse("\n".join(lines) + "\n" + write(arguments)))
