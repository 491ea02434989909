"""Load a Hugging Face causal LM + tokenizer offline from a bundled GGUF file.

Why a converted cache: transformers can read GGUF directly, but it dequantises
every tensor on each load (~55 s for Qwen 0.5B, ~10 s for SmolLM2). We do that
once and keep an fp32 safetensors folder (model + tokenizer); later loads read
the folder in a few seconds. The folder is written into a temporary directory
next to its final place and renamed, so a crash or a concurrent loader never
sees a half-written cache.

No model hub is reachable from these machines, so everything here runs with
the Hugging Face offline switches set and `local_files_only=True`.

Beside the loader, what its backends (clients/torch_local.py, clients/hat/device.py) share of the tokenizer: the
HFTokenizerMixin and the IncrementalDetokenizer their tokens' text goes out through (clients/token_emitter.py).
"""

from __future__ import annotations

import logging
import os

# Must be set before huggingface_hub / transformers read them at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import copy
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clients.base import BackendError, GenerationRequest
from clients.gguf_meta import GGUFMetaError, read_context_length

log = logging.getLogger(__name__)

_MARKER = "tandem-converted.txt"
# Chat-turn and document end markers of the supported model families: generation stops at any of them.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<end_of_turn>")


def default_cache_root() -> Path:
    """Where converted folders live: $TANDEM_HF_CACHE, else ~/.cache/tandem/hf (outside the repo)."""
    env = os.environ.get("TANDEM_HF_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tandem" / "hf"


def _fingerprint(gguf: Path) -> str:
    """Identify the weights: the verified sha256 (from deploy.models' stamp) when it is current, else the size.

    The stamp `<file>.sha256` holds "sha256 size mtime_ns"; it only counts if size and mtime still match,
    so a replaced file does not reuse a stale conversion.
    """
    st = gguf.stat()
    stamp = gguf.with_suffix(gguf.suffix + ".sha256")
    try:
        parts = stamp.read_text().split()
        if len(parts) == 3 and int(parts[1]) == st.st_size and int(parts[2]) == st.st_mtime_ns and len(parts[0]) == 64:
            return parts[0][:12]
    except (OSError, ValueError):
        pass
    return str(st.st_size)


def converted_dir(gguf_path: str | os.PathLike[str], cache_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder a GGUF file converts into (it may not exist yet)."""
    gguf = Path(gguf_path)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{gguf.stem}-{_fingerprint(gguf)}"


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _strip_quantization_config(folder: Path) -> None:
    """Older conversions kept the GGUF quantization_config, which makes transformers attach a GGUF quantizer
    (and cast fp64 loads back to fp32). Remove it in place, atomically, instead of converting again."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if "quantization_config" not in cfg:
        return
    del cfg["quantization_config"]
    tmp = path.with_name(f".config.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def convert_gguf(gguf_path: str | os.PathLike[str], target: Path) -> Path:
    """Dequantise `gguf_path` into an fp32 safetensors folder at `target` (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    log.info("converting %s (dequantising; this happens once)", gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    # save_pretrained refuses a GGUF-loaded model, so copy the weights into a plain model first. Drop the GGUF
    # quantization_config: the folder holds plain fp32 weights and must load as an ordinary model.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not loaded.config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch converting {gguf.name}: missing={missing} unexpected={unexpected}")
    if loaded.generation_config is not None:
        fresh.generation_config = loaded.generation_config
    del loaded

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(f"source={gguf}\nconverted_in_s={time.monotonic() - t0:.1f}\n")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; its folder is as good as ours.
            if not _is_complete(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s -> %s", gguf.name, time.monotonic() - t0, target)
    return target


def load_hf_model(
    gguf_path: str | os.PathLike[str],
    cache_root: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, Any]:
    """Return `(model, tokenizer)` for a GGUF file, converting it into the cache on first use.

    The model is in eval mode on CPU. `dtype` applies when reading the converted (fp32) folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_dir(gguf_path, cache_root)
    if not _is_complete(folder):
        convert_gguf(gguf_path, folder)
    _strip_quantization_config(folder)
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    log.info("loaded %s in %.1f s", folder.name, time.monotonic() - t0)
    return model, tokenizer


def find_eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every token that ends a generation: the tokenizer's and generation config's EOS ids plus known end markers."""
    ids: set[int] = set()
    for v in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in _END_TOKENS if t in vocab)
    return frozenset(ids)


# The window of a model that declares no context of its own: nothing is kept from it for want of one.
UNKNOWN_CONTEXT = 1 << 30


def declared_context(gguf_path: str | os.PathLike[str] | None, model: Any = None) -> int | None:
    """The context a model declares before it is loaded: a given model's max_position_embeddings, else its GGUF's
    context_length (what `open_token_source` reads from the loaded model); None when neither says."""
    if model is not None:
        return getattr(getattr(model, "config", None), "max_position_embeddings", None)
    try:
        return read_context_length(gguf_path) if gguf_path is not None else None
    except GGUFMetaError:
        return None  # not readable as a GGUF: loading it will say why


@dataclass
class TokenSource:
    """A loaded causal LM as a token source needs it: model (eval mode), tokenizer, end tokens, context length."""

    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    max_context: int | None


def open_token_source(
    gguf_path: str | os.PathLike[str] | None,
    cache_root: str | os.PathLike[str] | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
    num_threads: int | None = None,
) -> TokenSource:
    """Load `gguf_path` (through the converted cache) unless `model` and `tokenizer` are given; runs on the thread
    that will call the model, since `num_threads` sets torch's intra-op threads."""
    if num_threads:
        torch.set_num_threads(num_threads)
    if model is None:
        if gguf_path is None:
            raise ValueError("need a GGUF path or both a model and its tokenizer")
        model, tokenizer = load_hf_model(gguf_path, cache_root, dtype)
    model.eval()
    max_context = getattr(model.config, "max_position_embeddings", None)
    return TokenSource(model, tokenizer, find_eos_ids(model, tokenizer), max_context)


class HFTokenizerMixin:
    """The tokenizer side of a backend built on a Hugging Face tokenizer (torch device backend,
    HAT device half). Needs `self.name`, `self.tokenizer` (None until loaded) and
    `self._tok_lock`: the Rust tokenizer is shared by the event loop and the model thread."""

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise BackendError(f"{self.name}: model not loaded", status=503, backend=self.name)
        return self.tokenizer

    def tokenize(self, text: str) -> list[int]:
        """Exact token ids of `text`, adding no special tokens beyond those the text spells out."""
        tok = self._require_tokenizer()
        with self._tok_lock:
            return list(tok.encode(text, add_special_tokens=False))

    def context_ids(self, request: GenerationRequest) -> list[int]:
        """What generation continues from: the prompt's ids, then those of the prefix being continued (a
        migration's). Either may come as ids or text; a 400 when both are empty."""
        prompt = list(request.prompt_ids) if request.prompt_ids is not None else self.tokenize(request.prompt_text)
        if request.prefix_ids is not None:
            prefix = list(request.prefix_ids)
        else:
            prefix = self.tokenize(request.prefix_text) if request.prefix_text else []
        context = prompt + prefix
        if not context:
            raise BackendError(f"{self.name}: empty prompt", status=400, backend=self.name)
        return context

    def answer_prefix_ids(self, request: GenerationRequest) -> list[int]:
        """The ids of the delivered prefix a continuation starts after (what penalties count as answered)."""
        if request.prefix_ids is not None:
            return list(request.prefix_ids)
        return self.tokenize(request.prefix_text) if request.prefix_text else []

    def token_bytes(self, token: int) -> bytes:
        """One token's text as bytes (special tokens spelled out), for logprobs."""
        tok = self._require_tokenizer()
        with self._tok_lock:
            return tok.decode([token], skip_special_tokens=False).encode("utf-8")

    # A rendered chat prompt spells out its special tokens (e.g. <|im_start|>): the same call.
    tokenize_prompt = tokenize

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids`, dropping special tokens such as <|im_end|>."""
        tok = self._require_tokenizer()
        with self._tok_lock:
            return tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict]) -> str:
        tok = self._require_tokenizer()
        with self._tok_lock:
            return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def count_tokens(self, text: str) -> tuple[int, bool]:
        return len(self.tokenize(text)), True


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a multi-byte UTF-8 character.

    Byte-level BPE pieces can end mid-character; decoding them alone yields U+FFFD. We decode a short window
    (a few tokens of context + the unread tokens) and emit only the part that extends the window's already-read
    text and does not end in U+FFFD. The context (the prompt's or prefix's last tokens) keeps decoding of the
    first generated tokens identical to decoding them in place (leading spaces, merges).
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = (), context_len: int = 6):
        self._decode = decode
        self.ids: list[int] = list(context[-context_len:])
        self._prefix_offset = 0
        self._read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
