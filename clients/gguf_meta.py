"""Read a device model's architecture from its GGUF metadata.

Why: DiSCo prices device tokens by the FLOPs of the model actually loaded
(App. E.2), so the gateway reads the shape from the file it serves instead of a
hand-kept table. Uses the `gguf` package's GGUFReader (memory-maps the file,
reads no tensor data).

GGUFReader parses every metadata array (the tokenizer's ~150K tokens and merges)
in Python, which takes seconds for a Qwen file; results are cached per
(path, size, mtime) so a process pays that once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from policies.cost import ModelArch


class GGUFMetaError(ValueError):
    """The file is not a GGUF model we can read the architecture of."""


def _scalar(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    if isinstance(value, list):  # per-layer arrays (some archs): the widest layer bounds the cost
        return max(value) if value else None
    return value


def _array_len(reader: Any, key: str) -> int | None:
    field = reader.get_field(key)
    return None if field is None else len(field.data)


@functools.lru_cache(maxsize=16)
def _read(path: str, size: int, mtime_ns: int) -> ModelArch:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFMetaError(f"{path}: not a readable GGUF file ({exc})") from exc
    arch = _scalar(reader, "general.architecture")
    if not arch:
        raise GGUFMetaError(f"{path}: no general.architecture in the GGUF metadata")

    def need(suffix: str) -> int:
        value = _scalar(reader, f"{arch}.{suffix}")
        if value is None:
            raise GGUFMetaError(f"{path}: missing {arch}.{suffix} in the GGUF metadata")
        return int(value)

    n_heads = need("attention.head_count")
    n_kv = _scalar(reader, f"{arch}.attention.head_count_kv")
    head_dim = _scalar(reader, f"{arch}.attention.key_length")
    # The tokenizer's token list is the vocabulary the LM head projects onto.
    vocab = _array_len(reader, "tokenizer.ggml.tokens") or _scalar(reader, f"{arch}.vocab_size")
    if not vocab:
        raise GGUFMetaError(f"{path}: no tokenizer.ggml.tokens or {arch}.vocab_size")
    hidden = need("embedding_length")
    return ModelArch(
        n_layers=need("block_count"),
        hidden=hidden,
        intermediate=need("feed_forward_length"),
        n_heads=n_heads,
        n_kv_heads=int(n_kv) if n_kv else n_heads,
        vocab=int(vocab),
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // n_heads else None,
        gated_ffn=ModelArch.gated_for(arch),
        name=str(arch),
    )


def read_arch(gguf_path: str | os.PathLike[str]) -> ModelArch:
    """The `ModelArch` of a GGUF model file (raises GGUFMetaError when it cannot)."""
    path = Path(gguf_path)
    try:
        st = path.stat()
    except OSError as exc:
        raise GGUFMetaError(f"{path}: {exc.strerror or exc}") from exc
    return _read(str(path.resolve()), st.st_size, st.st_mtime_ns)
