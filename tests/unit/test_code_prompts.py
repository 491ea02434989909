"""Code-reading prompts for the adapter's corpus: built from the installed standard library's source, never from
this repository, reproducibly, within the asked token range, one file per prompt."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from app.tools.training.code_prompts import CODE_INDEX_BASE, build_code_prompts, is_code_index, stdlib_files
from app.tools.training.corpus import is_held_out

ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """A stand-in tokenizer: one token per whitespace-separated word."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": text.split()}


def test_prompts_come_from_the_standard_library_reproducibly_and_fit_the_range() -> None:
    tok = WordTokenizer()
    prompts = build_code_prompts(tok, 8, seed=3, min_tokens=64, max_tokens=400)
    assert prompts == build_code_prompts(tok, 8, seed=3, min_tokens=64, max_tokens=400)
    assert prompts[:2] != build_code_prompts(tok, 2, seed=4, min_tokens=64, max_tokens=400)
    assert len(prompts) == 8 and len(set(prompts)) == 8
    for p in prompts:
        _, _, rest = p.partition("\n```python\n")
        assert rest.endswith("```") and ("def " in rest or "class " in rest)
        assert len(tok(rest)["input_ids"]) <= 400
    files = stdlib_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert files and all(f.resolve().is_relative_to(stdlib) for f in files)
    assert not any(f.resolve().is_relative_to(ROOT) for f in files)  # this repository stays held out
    assert not any({"test", "tests", "site-packages"} & set(f.relative_to(stdlib).parts) for f in files)


def test_code_indices_keep_the_held_out_rule_and_stay_apart_from_chat_prompts() -> None:
    assert CODE_INDEX_BASE % 8 == 0
    assert [j for j in range(24) if is_held_out(CODE_INDEX_BASE + j)] == [7, 15, 23]
    assert is_code_index(CODE_INDEX_BASE) and not is_code_index(602)
