"""llama.cpp's side of the device's prompt cache (clients/prompt_cache.py): a context's sequence state taken out and
put back, and the identity those bytes are valid for.

The state is llama.cpp's per-sequence state (`llama_state_seq_get_data` / `_set_data`, sequence 0: the one
llama-cpp-python evaluates in): the KV cells of the positions the context holds, their positions and per-layer K and
V rows, without the logits. Put back, the context holds exactly the KV it held when the state was taken, so the next
evaluation computes what it would have computed then.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
from pathlib import Path

from clients.prompt_cache import CacheIdentity

_SEQ = 0  # llama-cpp-python evaluates every batch in sequence 0


def take_state(llm) -> bytearray:
    """The context's sequence state as bytes (a copy: the context goes on)."""
    import llama_cpp

    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, _SEQ)
    payload = bytearray(size)
    written = llama_cpp.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * size).from_buffer(payload), size, _SEQ)
    if written != size:
        del payload[written:]
    return payload


def restore_state(llm, payload: bytearray, tokens) -> bool:
    """Put a state back in place of the context's sequence and tell llama-cpp-python which tokens it holds; False
    (the context then holds nothing) where llama.cpp refuses the bytes (another shape of KV cache)."""
    import llama_cpp

    ctx = llm._ctx.ctx
    size = len(payload)
    read = llama_cpp.llama_state_seq_set_data(ctx, (ctypes.c_uint8 * size).from_buffer(payload), size, _SEQ)
    if read != size:
        llm._ctx.kv_cache_seq_rm(_SEQ, 0, -1)  # whatever it wrote before refusing is no state of ours
        llm.n_tokens = 0
        return False
    n = len(tokens)
    llm.input_ids[:n] = tokens
    llm.n_tokens = n
    llm._requires_eval = True  # logits are not part of the state: the next generate evaluates at least one token
    return True


def trim_state(llm, end: int) -> None:
    """Drop the context's positions from `end` on (the reproducible path keeps only its canonical chunks)."""
    if llm.n_tokens > end:
        llm._ctx.kv_cache_seq_rm(_SEQ, end, -1)
        llm.n_tokens = end


def identity_of(llm, model_path: Path, n_ctx: int, stamp_folder: Path) -> CacheIdentity:
    """What this context's states are valid for. The model's sha256 comes from deploy/models.py's stamp beside a
    bundled model's file, else from a stamp of our own in `stamp_folder`, else it is computed once (and stamped):
    a start never hashes the weights again while the file's size and mtime hold."""
    import llama_cpp

    params = llm.context_params
    kv_type = f"k={int(params.type_k)} v={int(params.type_v)} flash_attn={int(params.flash_attn_type)}"
    build = f"llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}"
    model_sha, tokenizer_sha = _fingerprints(llm, Path(model_path), stamp_folder)
    return CacheIdentity(model_sha, tokenizer_sha, n_ctx, kv_type, build)


def _fingerprints(llm, path: Path, stamp_folder: Path) -> tuple[str, str]:
    st = path.stat()
    stamp = stamp_folder / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(stamp.read_text())
        if saved["size"] == st.st_size and saved["mtime_ns"] == st.st_mtime_ns:
            return str(saved["model_sha256"]), str(saved["tokenizer_sha256"])
    model_sha = _bundled_sha256(path, st) or _sha256_of(path)
    tokenizer_sha = tokenizer_sha256(llm)
    stamp_folder.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "model_sha256": model_sha}
    tmp.write_text(json.dumps({**record, "tokenizer_sha256": tokenizer_sha}))
    os.replace(tmp, stamp)
    return model_sha, tokenizer_sha


def _bundled_sha256(path: Path, st: os.stat_result) -> str | None:
    """deploy/models.py's stamp `<file>.sha256` ("sha256 size mtime_ns"), written after a full check of this file."""
    with contextlib.suppress(OSError, ValueError):
        parts = path.with_suffix(path.suffix + ".sha256").read_text().split()
        if len(parts) == 3 and int(parts[1]) == st.st_size and int(parts[2]) == st.st_mtime_ns and len(parts[0]) == 64:
            return parts[0]
    return None


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_sha256(llm) -> str:
    """A hash of the vocabulary as llama.cpp reads it: every token's text and attributes, its special ids, and the
    tokenizer's metadata (model, pre-tokenizer, merges' presence)."""
    import llama_cpp

    vocab = llm._model.vocab
    digest = hashlib.sha256()
    meta = {k: v for k, v in llm.metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    digest.update(json.dumps(meta, sort_keys=True).encode())
    n = llama_cpp.llama_vocab_n_tokens(vocab)
    for tok in range(n):
        digest.update(llama_cpp.llama_vocab_get_text(vocab, tok) or b"")
        digest.update(int(llama_cpp.llama_vocab_get_attr(vocab, tok)).to_bytes(4, "little", signed=True))
        digest.update(b"\0")
    return digest.hexdigest()
