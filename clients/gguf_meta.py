"""Read a model's architecture and chat template from its GGUF metadata.

Why: DiSCo prices device tokens by the FLOPs of the model actually loaded
(App. E.2), so the gateway reads the shape from the file it serves instead of a
hand-kept table. Reads only the metadata key/value section at the head of the
file (GGUF v2/v3 layout, gguf-py's constants): scalars are decoded, arrays are
skipped by their lengths. (gguf-py's GGUFReader builds a numpy view for every
element of every array — the tokenizer's ~150K tokens and merges — which took
~9-13 s for the bundled Qwen file; this takes milliseconds.) Results are cached
per (path, size, mtime).
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from pathlib import Path
from typing import Any

from policies.cost import ModelArch


class GGUFMetaError(ValueError):
    """The file is not a GGUF model we can read the architecture of."""


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_PER_LAYER_MAX = 1024  # longer numeric arrays (token types, scores) are skipped


class _Metadata:
    """The GGUF metadata: scalars by key, and the element count of each array."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        (version,) = struct.unpack_from("<I", data, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} (only 2 and 3 are read)")
        (count,) = struct.unpack_from("<Q", data, 16)
        self.scalars: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        self._data, self._at = data, 24
        for _ in range(count):
            key = self._string()
            kind = self._unpack("<I")
            if kind == _ARRAY:
                element, n = self._unpack("<I"), self._unpack("<Q")
                self.array_lengths[key] = n
                if element in _SCALARS and n <= _PER_LAYER_MAX:
                    # a per-layer value (some archs give head counts per layer): the widest layer bounds the cost
                    values = [self._value(element) for _ in range(n)]
                    self.scalars[key] = max(values) if values else None
                else:
                    for _ in range(n):
                        self._skip(element)
            else:
                self.scalars[key] = self._value(kind)

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._data, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        raw = bytes(self._data[self._at : self._at + n])
        self._at += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack("<" + _SCALARS[kind])

    def _skip(self, kind: int) -> None:
        if kind == _STRING:
            self._at += 8 + struct.unpack_from("<Q", self._data, self._at)[0]
        elif kind in _SCALARS:
            self._at += struct.calcsize(_SCALARS[kind])
        else:
            raise ValueError(f"unsupported GGUF array element type {kind}")


def _metadata(path: str) -> _Metadata:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Metadata(data)
    except (ValueError, OSError, struct.error) as exc:
        raise GGUFMetaError(f"{path}: not a readable GGUF file ({exc})") from exc


@functools.lru_cache(maxsize=16)
def _read(path: str, size: int, mtime_ns: int) -> ModelArch:
    meta = _metadata(path)
    scalars = meta.scalars
    arch = scalars.get("general.architecture")
    if not arch:
        raise GGUFMetaError(f"{path}: no general.architecture in the GGUF metadata")

    def need(suffix: str) -> int:
        value = scalars.get(f"{arch}.{suffix}")
        if value is None:
            raise GGUFMetaError(f"{path}: missing {arch}.{suffix} in the GGUF metadata")
        return int(value)

    n_heads = need("attention.head_count")
    n_kv = scalars.get(f"{arch}.attention.head_count_kv")
    head_dim = scalars.get(f"{arch}.attention.key_length")
    # The tokenizer's token list is the vocabulary the LM head projects onto.
    vocab = meta.array_lengths.get("tokenizer.ggml.tokens") or scalars.get(f"{arch}.vocab_size")
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


def read_chat_template(gguf_path: str | os.PathLike[str]) -> str | None:
    """The model's own chat template (`tokenizer.chat_template`), None when the file has none."""
    template = _metadata(str(Path(gguf_path))).scalars.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


def read_context_length(gguf_path: str | os.PathLike[str]) -> int | None:
    """The context the model was trained for (`<arch>.context_length`), None when the file does not say."""
    scalars = _metadata(str(Path(gguf_path))).scalars
    value = scalars.get(f"{scalars.get('general.architecture')}.context_length")
    return int(value) if value else None
