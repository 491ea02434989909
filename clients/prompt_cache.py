"""The device's prompt cache: KV states of evaluated prefixes, kept past the request, the session and the restart.

llama.cpp's context holds one KV cache (the live one, clients/llamacpp.py). This module keeps more: the states of
earlier prefixes as llama.cpp's per-sequence state bytes (`llama_state_seq_get_data`), looked up by the longest
common token prefix with a new input. In RAM they form a least-recently-used list bounded by `ram_bytes`; states of
long prefixes (at least `disk_min_tokens` usable tokens) are also written to disk, bounded by `disk_bytes` (least
recently used by mtime out), so a restarted gateway finds them again.

The disk format is our own (never pickle): a fixed preamble, a JSON header and the prefix's token ids, then the
payload (llama.cpp's state bytes as they came):

    b"TNDMKV01" | u32 header length | header (JSON) | n_tokens × int32 (LE) | payload

The header names what the bytes are only valid for (`CacheIdentity`: the model's sha256, a hash of its tokenizer,
n_ctx, the KV cache's type, the llama.cpp build), the reproducible path's facts (`canonical_end`, `chunk`), and the
sha256 of the token ids and of the payload. A file that does not match, or is cut short, or whose bytes do not
hash to its header's, is removed and never handed to llama.cpp. Files are written on a thread of their own (never on
the request's), to a temporary name, fsync'd, then renamed: a crash mid-write leaves no file that loads.

Each identity has its folder under the cache directory (`<dir>/<identity key>/`), so gateways on other models or
builds neither load nor delete each other's files; the disk bound counts every folder, and the oldest file goes
first whichever folder holds it (a stale build's files age out).

Pure Python and numpy: the backend takes and restores the state bytes; this module decides which to keep.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"TNDMKV01"
FORMAT = 1
_PREAMBLE = struct.Struct("<8sI")  # magic, header length
_MAX_HEADER = 1 << 16  # a header is a few hundred bytes; anything longer is not ours
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 600.0  # a temporary file this old was left by a crash (a live writer renames within seconds)
_DEFAULT_RAM_MIN_TOKENS = 32  # a shorter prefix costs less to evaluate again than to keep


def default_directory() -> Path:
    """Where states persist by default: $XDG_CACHE_HOME/tandem/kv (~/.cache/tandem/kv), beside the models."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tandem" / "kv"


def common_prefix_len(a: np.ndarray, b: np.ndarray, limit: int | None = None) -> int:
    """How many leading tokens two int32 arrays share (at most `limit`): vectorised, a 15k-token prompt in µs."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), max(limit, 0))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def as_tokens(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


@dataclass(frozen=True)
class PromptCacheOptions:
    """[device]'s prompt-cache settings (app/config.py), resolved."""

    ram_mb: int = 1024  # states in RAM, least recently used out past this; 0: none kept in RAM
    disk_mb: int = 2048  # states on disk, all identities together, oldest out past this; 0: nothing persists
    directory: Path | None = None  # None: default_directory()
    disk_min_tokens: int = 1024  # only states of at least this many usable tokens go to disk

    @property
    def folder(self) -> Path:
        return Path(self.directory).expanduser() if self.directory is not None else default_directory()

    @property
    def persists(self) -> bool:
        return self.disk_mb > 0

    @property
    def enabled(self) -> bool:
        return self.ram_mb > 0 or self.persists


@dataclass(frozen=True)
class CacheIdentity:
    """What a state's bytes are valid for: loaded only where every field matches."""

    model_sha256: str
    tokenizer_sha256: str
    n_ctx: int
    kv_type: str  # the KV cache's element types (and layout): "k=f16 v=f16 flash_attn=..."
    build: str  # llama-cpp-python's version and llama.cpp's system info (its CPU backend's features)

    def key(self) -> str:
        """The folder these states live in: a hash of the identity."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class StoreRefused(Exception):
    """A stored file that must not be loaded (another model or build, cut short, its bytes not its header's)."""


def encode_header(identity: CacheIdentity, tokens: np.ndarray, canonical_end: int, chunk: int, payload) -> bytes:
    """The preamble, header and token ids of a state file whose payload follows."""
    token_bytes = tokens.astype("<i4").tobytes()
    header = {
        "format": FORMAT,
        **asdict(identity),
        "n_tokens": len(tokens),
        "canonical_end": canonical_end,
        "chunk": chunk,
        "tokens_sha256": hashlib.sha256(token_bytes).hexdigest(),
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    text = json.dumps(header, sort_keys=True).encode()
    return _PREAMBLE.pack(MAGIC, len(text)) + text + token_bytes


def read_header(f, identity: CacheIdentity, file_size: int) -> tuple[dict, np.ndarray]:
    """The header and token ids of a state file open at its start; StoreRefused unless it is whole and ours."""
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) != _PREAMBLE.size:
        raise StoreRefused("cut short before its header")
    magic, length = _PREAMBLE.unpack(preamble)
    if magic != MAGIC or not 0 < length <= _MAX_HEADER:
        raise StoreRefused("not a prompt-cache file of this format")
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise StoreRefused(f"unreadable header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise StoreRefused("another format version")
    for name, value in asdict(identity).items():
        if header.get(name) != value:
            raise StoreRefused(f"made for another {name.replace('_', ' ')}")
    try:
        n_tokens, payload_bytes = int(header["n_tokens"]), int(header["payload_bytes"])
        int(header["canonical_end"]), int(header["chunk"])
        str(header["payload_sha256"])
    except (KeyError, TypeError, ValueError):
        raise StoreRefused("a header field is missing") from None
    if n_tokens <= 0 or file_size != _PREAMBLE.size + length + 4 * n_tokens + payload_bytes:
        raise StoreRefused("cut short (or longer than its header says)")
    token_bytes = f.read(4 * n_tokens)
    if hashlib.sha256(token_bytes).hexdigest() != header.get("tokens_sha256"):
        raise StoreRefused("its token ids do not match their checksum")
    return header, np.frombuffer(token_bytes, dtype="<i4").astype(np.int32)


@dataclass(eq=False)
class StoredState:
    """One prefix's KV state: in RAM (`payload`), on disk (`path`), or both."""

    name: str  # a hash of its token ids: its file's name
    tokens: np.ndarray  # int32: the positions the state holds, in order
    canonical_end: int  # leading positions evaluated as whole canonical chunks (the reproducible path); 0 otherwise
    chunk: int  # the reproducible path's chunk those were evaluated in
    payload: bytearray | None = None
    payload_bytes: int = 0
    path: Path | None = None
    file_bytes: int = 0
    writing: bool = False  # queued for the disk, not written yet
    used: float = field(default_factory=time.monotonic)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def usable(self, reproducible: bool, chunk: int) -> int:
        """Positions a request may take from it: all of them, or on the reproducible path its canonical chunks."""
        if not reproducible:
            return self.n_tokens
        return self.canonical_end if self.chunk == chunk else 0


def state_name(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()[:32]


class PromptCache:
    """States by longest common token prefix: an LRU in RAM bounded by `ram_bytes`, long ones also on disk.

    Thread use: the model thread looks up, puts and loads; the event loop may look up (`best`, a snapshot); the
    writer thread writes and removes files. One lock guards the index."""

    def __init__(
        self, identity: CacheIdentity, options: PromptCacheOptions, ram_min_tokens: int = _DEFAULT_RAM_MIN_TOKENS
    ) -> None:
        self.identity = identity
        self.ram_limit = max(options.ram_mb, 0) << 20
        self.disk_limit = max(options.disk_mb, 0) << 20
        self.root = options.folder if options.persists else None
        self.folder = self.root / identity.key() if self.root is not None else None
        self.disk_min_tokens = options.disk_min_tokens
        self.ram_min_tokens = ram_min_tokens
        self._entries: OrderedDict[str, StoredState] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.ram_bytes = 0
        self.disk_bytes = 0
        self.changes = 0  # moves when a state leaves the index (what the planner's probe may have counted)
        self.stats = {
            "lookups": 0,
            "hits": 0,  # lookups that took at least one token from a cache (the live KV or a stored state)
            "tokens_looked_up": 0,
            "tokens_cached": 0,
            "restores_ram": 0,
            "restores_disk": 0,
            "tokens_restored": 0,
            "saves": 0,
            "ram_evictions": 0,
            "disk_writes": 0,
            "disk_evictions": 0,
            "disk_refused": 0,  # files removed unloaded: another identity, cut short, bytes not their checksum's
        }
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        if self.disk_limit > 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="prompt-cache-writer", daemon=True)
            self._writer.start()

    @property
    def persists(self) -> bool:
        return self._writer is not None

    # -- lookup ------------------------------------------------------------------------------------------------------
    def best(self, ids: np.ndarray, limit: int, reproducible: bool, chunk: int) -> tuple[StoredState | None, int]:
        """The state that serves the most leading positions of `ids` (at most `limit`; on the reproducible path whole
        chunks only), and how many; ties go to the shorter state (less to restore), then to one in RAM."""
        with self._lock:
            entries = list(self._entries.values())
        best, best_n = None, 0
        for entry in entries:
            usable = entry.usable(reproducible, chunk)
            if usable <= best_n:
                continue
            n = common_prefix_len(entry.tokens[:usable], ids, limit)
            if reproducible:
                n -= n % chunk
            if n > best_n or (n == best_n and best is not None and _cheaper(entry, best)):
                best, best_n = entry, n
        return best, best_n

    def covers(self, tokens: np.ndarray, canonical_end: int) -> bool:
        """Whether a stored state already holds `tokens` (as a prefix of its own, as canonical): no need to save."""
        with self._lock:
            entries = list(self._entries.values())
        return any(_contains(e, tokens, canonical_end) for e in entries)

    def record_lookup(self, prompt_tokens: int, cached: int, source: str | None, restored: int = 0) -> None:
        """One generation's input: `cached` of its `prompt_tokens` taken from a cache; `source` "ram" / "disk" where
        a stored state was restored for it (`restored` positions)."""
        s = self.stats
        s["lookups"] += 1
        s["tokens_looked_up"] += prompt_tokens
        s["tokens_cached"] += cached
        s["hits"] += cached > 0
        if source is not None:
            s[f"restores_{source}"] += 1
            s["tokens_restored"] += restored

    # -- storing -----------------------------------------------------------------------------------------------------
    def put(self, tokens: np.ndarray, canonical_end: int, chunk: int, payload: bytearray) -> StoredState | None:
        """Keep a state: it replaces the states it contains; RAM's least recently used go past the bound; a long one
        is queued for the disk. None when it is kept nowhere (too short, or larger than both bounds)."""
        usable = canonical_end if canonical_end else len(tokens)
        for_disk = self.persists and usable >= self.disk_min_tokens and len(payload) <= self.disk_limit
        in_ram = len(payload) <= self.ram_limit and len(tokens) >= self.ram_min_tokens
        if not (in_ram or for_disk):
            return None
        entry = StoredState(state_name(tokens), tokens.copy(), canonical_end, chunk)
        with self._lock:
            replaced = [e for e in self._entries.values() if e.name == entry.name or _contains(entry, e.tokens, 0)]
            for old in replaced:
                if old.name != entry.name and old.canonical_end > canonical_end:
                    continue  # it holds canonical chunks this one lacks
                if (old.path is not None or old.writing) and not for_disk:
                    continue  # it persists and this one will not
                self._drop(old)
                if old.path is not None and old.name != entry.name:
                    self._writes.put(("remove", old.path))
            self._entries[entry.name] = entry
            if in_ram:
                entry.payload, entry.payload_bytes = payload, len(payload)
                self.ram_bytes += len(payload)
                self._trim_ram(keep=entry)
            entry.writing = for_disk
            self.stats["saves"] += 1
        if for_disk:
            self._writes.put(("write", entry, payload))
        return entry

    def load(self, entry: StoredState) -> bytearray | None:
        """A state's bytes, from RAM or read from disk and verified against its header (then kept in RAM too); None
        (the file removed) where they are not what the header says."""
        with self._lock:
            if entry.payload is not None:
                entry.used = time.monotonic()
                self._entries.move_to_end(entry.name)
                return entry.payload
            path = entry.path
        if path is None:
            return None  # its write is still queued: not there yet
        try:
            payload = self._read_verified(path)
        except (OSError, StoreRefused) as exc:
            log.warning("prompt cache: %s refused (%s); removed", path.name, exc)
            self.stats["disk_refused"] += 1
            self.forget(entry)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # the disk's LRU goes by mtime
        with self._lock:
            if entry.name in self._entries and entry.payload is None and len(payload) <= self.ram_limit:
                entry.payload, entry.payload_bytes = payload, len(payload)
                self.ram_bytes += len(payload)
                self._entries.move_to_end(entry.name)
                self._trim_ram(keep=entry)
        return payload

    def forget(self, entry: StoredState) -> None:
        """Drop a state whose bytes llama.cpp refused, or whose file did not verify: from RAM and from disk."""
        with self._lock:
            if self._entries.get(entry.name) is entry:
                self._drop(entry)
        if entry.path is not None:
            with contextlib.suppress(OSError):
                entry.path.unlink()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is on disk (tests, shutdown)."""
        if self._writer is None:
            return
        done = threading.Event()
        self._writes.put(("flush", done))
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes, then stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout)
            self._writer = None

    # -- what it holds -----------------------------------------------------------------------------------------------
    def describe(self) -> dict:
        s = dict(self.stats)
        with self._lock:
            entries = list(self._entries.values())
        ram = [e for e in entries if e.payload is not None]
        disk = [e for e in entries if e.path is not None]
        return {
            "entries": len(ram),
            "bytes": self.ram_bytes,
            "limit_bytes": self.ram_limit,
            "tokens": sum(e.n_tokens for e in ram),
            "disk_entries": len(disk),
            "disk_bytes": self.disk_bytes,
            "disk_limit_bytes": self.disk_limit,
            "disk_min_tokens": self.disk_min_tokens if self.persists else None,
            "directory": str(self.folder) if self.persists else None,
            "hit_rate": s["hits"] / s["lookups"] if s["lookups"] else 0.0,
            "token_hit_rate": s["tokens_cached"] / s["tokens_looked_up"] if s["tokens_looked_up"] else 0.0,
            **s,
        }

    # -- inside (the lock held where a name says so) ------------------------------------------------------------------
    def _drop(self, entry: StoredState) -> None:
        """Out of the index (lock held); its file, if any, is the caller's to remove."""
        del self._entries[entry.name]
        if entry.payload is not None:
            self.ram_bytes -= entry.payload_bytes
            entry.payload = None
        if entry.path is not None:
            self.disk_bytes -= entry.file_bytes
        self.changes += 1

    def _trim_ram(self, keep: StoredState) -> None:
        """RAM's least recently used out until the bound holds (lock held); one on disk stays there."""
        for entry in list(self._entries.values()):
            if self.ram_bytes <= self.ram_limit:
                return
            if entry is keep or entry.payload is None:
                continue
            self.ram_bytes -= entry.payload_bytes
            entry.payload = None
            self.stats["ram_evictions"] += 1
            if entry.path is None and not entry.writing:  # (one being written stays: its file is about to exist)
                del self._entries[entry.name]
                self.changes += 1

    def _read_verified(self, path: Path) -> bytearray:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header, _ = read_header(f, self.identity, size)
            payload = bytearray(int(header["payload_bytes"]))
            if f.readinto(payload) != len(payload):
                raise StoreRefused("cut short")
        if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise StoreRefused("its payload does not match its checksum")
        return payload

    def _scan(self) -> None:
        """Index this identity's files (headers only: their payloads are verified when loaded); remove what does not
        match and what a crash left half-written."""
        found = []
        for path in self.folder.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > _STALE_TMP_SECONDS:
                        path.unlink()
                continue
            if path.suffix != ".kv":
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    header, tokens = read_header(f, self.identity, st.st_size)
                if state_name(tokens) + ".kv" != path.name:
                    raise StoreRefused("its name is not its tokens'")
            except (OSError, StoreRefused) as exc:
                log.warning("prompt cache: %s refused (%s); removed", path.name, exc)
                self.stats["disk_refused"] += 1
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            entry = StoredState(path.stem, tokens, int(header["canonical_end"]), int(header["chunk"]))
            entry.path, entry.file_bytes = path, st.st_size
            found.append((st.st_mtime, entry))
        for _, entry in sorted(found, key=lambda item: item[0]):
            self._entries[entry.name] = entry
            self.disk_bytes += entry.file_bytes
        if found:
            log.info("prompt cache: %d states on disk (%d MB) in %s", len(found), self.disk_bytes >> 20, self.folder)

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            try:
                if job[0] == "write":
                    self._write(job[1], job[2])
                elif job[0] == "remove":
                    with contextlib.suppress(OSError):
                        job[1].unlink()
                elif job[0] == "flush":
                    job[1].set()
            except Exception:  # a full disk, a removed folder: the state stays in RAM only
                log.exception("prompt cache: writing a state failed")

    def _write(self, entry: StoredState, payload: bytearray) -> None:
        with self._lock:
            if self._entries.get(entry.name) is not entry:
                entry.writing = False
                return  # replaced or dropped while queued
        path = self.folder / f"{entry.name}.kv"
        tmp = self.folder / f"{_TMP_PREFIX}{entry.name}.{os.getpid()}"
        try:
            head = encode_header(self.identity, entry.tokens, entry.canonical_end, entry.chunk, payload)
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_folder(self.folder)
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self._lock:
                entry.writing = False
                if self._entries.get(entry.name) is entry and entry.payload is None:
                    self._drop(entry)  # neither in RAM nor on disk: nothing left to restore
            raise
        size = len(head) + len(payload)
        with self._lock:
            entry.writing = False
            if self._entries.get(entry.name) is entry:
                entry.path, entry.file_bytes = path, size
                self.disk_bytes += size
            else:  # dropped while being written
                path.unlink(missing_ok=True)
                return
        self.stats["disk_writes"] += 1
        self._trim_disk()

    def _trim_disk(self) -> None:
        """The oldest files (by mtime) out until every identity's files together fit the disk bound."""
        files = []
        for path in self.root.glob("*/*.kv"):
            with contextlib.suppress(OSError):
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda item: item[0]):
            if total <= self.disk_limit:
                return
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
            self.stats["disk_evictions"] += 1
            with self._lock:
                entry = self._entries.get(path.stem)
                if entry is not None and entry.path == path:
                    self.disk_bytes -= entry.file_bytes
                    entry.path, entry.file_bytes = None, 0
                    if entry.payload is None:
                        del self._entries[entry.name]
                        self.changes += 1


def _contains(entry: StoredState, tokens: np.ndarray, canonical_end: int) -> bool:
    """Whether `entry` holds `tokens` as a prefix of its own, with at least `canonical_end` canonical positions."""
    return (
        entry.n_tokens >= len(tokens)
        and entry.canonical_end >= canonical_end
        and common_prefix_len(entry.tokens, tokens) == len(tokens)
    )


def _cheaper(a: StoredState, b: StoredState) -> bool:
    if a.n_tokens != b.n_tokens:
        return a.n_tokens < b.n_tokens
    return a.payload is not None and b.payload is None


def _fsync_folder(folder: Path) -> None:
    """The rename itself durable (POSIX: the directory's entry is data of the directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
