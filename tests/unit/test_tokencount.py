"""tiktoken works offline: the shipped cl100k_base seeds tiktoken's own cache."""

from __future__ import annotations

import subprocess
import sys


def test_cl100k_works_offline_from_an_empty_cache(tmp_path):
    # A fresh process with an empty cache dir and no way out (proxy to nowhere): any
    # download attempt would fail, so success proves nothing is fetched.
    code = (
        "import tiktoken; from clients.tokencount import estimate_tokens, seed_tiktoken_cache;"
        "seed_tiktoken_cache();"
        "assert estimate_tokens('hello world') == 2;"
        "assert tiktoken.get_encoding('cl100k_base').encode('hello world') == [15339, 1917]"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "tiktoken"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "PYTHONPATH": ".",
    }
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert any((tmp_path / "tiktoken").iterdir())
