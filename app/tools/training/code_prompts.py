"""Code-reading prompts for the adapter's corpus, built at run time from the Python standard library's own source.

Why the standard library: the default LLM is a coder model and HAT is slow on long "explain this code" prompts
(BENCHMARKS.md, Table 5), so the adapter should see such answers in training. The standard library's source ships
with every Python install (found through sysconfig here, nothing is downloaded or stored in the repository), and it
is not this repository's code, which `tandem bench hat`'s Table 5 reads and which must stay held out.

Each prompt is an instruction plus a slice of one standard-library file (consecutive top-level functions /
classes, the last one cut at a line boundary to fit) whose length in tokens is drawn log-uniformly from [min_tokens,
max_tokens] (128-2048 by default: Table 5's range). Every prompt comes from a different file, so a held-out prompt
(same rule as the chat prompts: j % 8 == 7) never shares a file with a training prompt. The selection is a pure
function of (seed, the installed standard library, the tokenizer): the same machine gives the same prompts.
"""

from __future__ import annotations

import ast
import math
import os
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Corpus indices of code prompt j: CODE_INDEX_BASE + j. A multiple of 8, so the held-out rule (index % 8 == 7)
# picks the same prompts as on j alone, and far above any chat prompt's index.
CODE_INDEX_BASE = 100_000


def is_code_index(index: int) -> bool:
    """Whether a corpus record's index is a code-reading prompt's (else a chat prompt's)."""
    return index >= CODE_INDEX_BASE


INSTRUCTIONS = (
    "Explain what this code does, briefly:",
    "Explain what this code does:",
    "What does this code from Python's `{module}` module do? Walk through it step by step.",
    "Summarise the purpose of this code and its main steps:",
    "Read this code and explain how it works:",
    "Explain this Python code to a junior developer:",
)

# Parts of the standard library that are not ordinary code to read: test suites, demos, data tables, vendored files.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo",
               "encodings", "_bundled", "lib2to3", "pydoc_data", "__phello__"}  # fmt: skip


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's .py files worth reading, sorted by path (relative order is stable across runs)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"the Python standard library's source is not at {base}")
    out = []
    for folder, dirs, names in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_PARTS]  # pruned, not walked: site-packages is large
        for name in names:
            p = Path(folder) / name
            if not name.endswith(".py") or name.startswith(("test_", "_test")) or p.stat().st_size < 2_000:
                continue
            out.append(p)
    return sorted(out)


def _units(source: str) -> list[tuple[int, int]]:
    """(first line, last line), 0-based inclusive, of each top-level function or class (decorators included)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    units = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.end_lineno:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            units.append((first, node.end_lineno - 1))
    return units


def _slice(lines: Sequence[str], units: list[tuple[int, int]], start: int, target: int, count: Any) -> str:
    """Consecutive units from `start` while they fit in `target` tokens; the unit that does not fit is cut at a
    line boundary to fill the rest (a reader is often shown the start of a long function)."""
    text = ""
    for first, last in units[start:]:
        piece = "".join(lines[first : last + 1]).rstrip() + "\n"
        candidate = text + ("\n" if text else "") + piece
        if count(candidate) <= target:
            text = candidate
            continue
        prefix = text + ("\n" if text else "")
        body = lines[first : last + 1]
        lo, hi = 0, len(body)  # the most lines that fit: binary search (a count is a tokenizer call)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(prefix + "".join(body[:mid])) <= target:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            text = prefix + "".join(body[:lo]).rstrip() + "\n"
        break
    return text


def build_code_prompts(
    tokenizer: Any,
    n: int,
    seed: int = 0,
    min_tokens: int = 128,
    max_tokens: int = 2048,
    root: str | Path | None = None,
) -> list[str]:
    """`n` code-reading prompts (see the module docstring); fewer only if the library has fewer usable files."""
    if n <= 0:
        return []
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"need 0 < min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    files = stdlib_files(root)
    rng.shuffle(files)
    base = Path(root or sysconfig.get_paths()["stdlib"])

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    prompts: list[str] = []
    for path in files:
        if len(prompts) >= n:
            break
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        units = _units(source)
        if not units:
            continue
        # The whole prompt's length, log-uniform; the code gets what the instruction and the template leave.
        total = round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
        code_budget = max(total - 48, 32)
        code = _slice(source.splitlines(keepends=True), units, rng.randrange(len(units)), code_budget, count)
        if count(code) < min(code_budget // 2, 64):
            continue  # too little code to be worth an explanation
        module = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")
        instruction = rng.choice(INSTRUCTIONS).format(module=module)
        prompts.append(f"{instruction}\n```python\n{code}```")
    return prompts
