"""The prompt cache's own logic (clients/prompt_cache.py): lookup by longest common prefix, the RAM and disk bounds,
the file format and what it refuses. Payloads are plain bytes here; tests/integration/test_prompt_cache_gateway.py
restores real llama.cpp states."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from clients.prompt_cache import (
    MAGIC,
    CacheIdentity,
    PromptCache,
    PromptCacheOptions,
    StoreRefused,
    as_tokens,
    common_prefix_len,
    encode_header,
    read_header,
    state_name,
)

IDENTITY = CacheIdentity("a" * 64, "b" * 64, 4096, "k=1 v=1 flash_attn=0", "llama-cpp-python test")
CHUNK = 32


def tokens(seed: int, n: int, head: list[int] | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rest = rng.integers(1000, 50_000, size=n - len(head or [])).tolist()
    return as_tokens([*(head or []), *rest])


def payload(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes())


def ram_cache(mb: int = 1) -> PromptCache:
    return PromptCache(IDENTITY, PromptCacheOptions(ram_mb=mb, disk_mb=0))


def disk_cache(folder, ram_mb: int = 1, disk_mb: int = 1, min_tokens: int = 64, identity=IDENTITY) -> PromptCache:
    return PromptCache(identity, PromptCacheOptions(ram_mb, disk_mb, folder, min_tokens))


def test_common_prefix_len():
    a = as_tokens([1, 2, 3, 4])
    assert common_prefix_len(a, as_tokens([1, 2, 3, 4, 5])) == 4
    assert common_prefix_len(a, as_tokens([1, 2, 9])) == 2
    assert common_prefix_len(a, as_tokens([7])) == 0
    assert common_prefix_len(a, as_tokens([1, 2, 3, 4]), limit=3) == 3
    assert common_prefix_len(a, as_tokens([])) == 0


def test_lookup_takes_the_longest_common_prefix_and_two_sessions_keep_theirs():
    cache = ram_cache()
    system = tokens(0, 200).tolist()
    a = tokens(1, 300, system)
    b = tokens(2, 260, system)
    cache.put(a, 0, CHUNK, payload(1000, 1))
    cache.put(b, 0, CHUNK, payload(1000, 2))
    next_a = as_tokens([*a.tolist(), 5, 6, 7])
    entry, served = cache.best(next_a, len(next_a) - 1, reproducible=False, chunk=CHUNK)
    assert entry is not None and entry.name == state_name(a) and served == 300
    next_b = as_tokens([*b.tolist(), 8])
    entry, served = cache.best(next_b, len(next_b) - 1, reproducible=False, chunk=CHUNK)
    assert entry.name == state_name(b) and served == 260
    # A third conversation on the same system prompt is served its shared part.
    entry, served = cache.best(tokens(3, 400, system), 399, reproducible=False, chunk=CHUNK)
    assert served == 200
    # The limit caps what is served (llama.cpp evaluates at least the input's last token).
    entry, served = cache.best(a, len(a) - 1, reproducible=False, chunk=CHUNK)
    assert served == 299


def test_reproducible_lookup_serves_whole_canonical_chunks_of_its_own_chunk_size_only():
    cache = ram_cache()
    canonical = tokens(4, 160)
    cache.put(canonical, 160, CHUNK, payload(1000))
    ids = as_tokens([*canonical[:150].tolist(), *tokens(5, 50).tolist()])  # diverges at 150
    _, served = cache.best(ids, 192, reproducible=True, chunk=CHUNK)
    assert served == 128  # 150 rounded down to whole chunks
    assert cache.best(ids, 192, reproducible=True, chunk=64)[1] == 0  # another chunk size: another path
    fast_only = tokens(6, 160)
    cache.put(fast_only, 0, CHUNK, payload(1000, 6))  # a fast-path state: no canonical chunks
    assert cache.best(fast_only, 159, reproducible=True, chunk=CHUNK)[1] == 0
    assert cache.best(fast_only, 159, reproducible=False, chunk=CHUNK)[1] == 159


def test_a_state_replaces_those_it_contains_and_covers_its_own_prefixes():
    cache = ram_cache()
    turn1 = tokens(7, 100)
    turn2 = as_tokens([*turn1.tolist(), *tokens(8, 50).tolist()])
    cache.put(turn1, 0, CHUNK, payload(500))
    cache.put(turn2, 0, CHUNK, payload(700))
    d = cache.describe()
    assert d["entries"] == 1 and d["bytes"] == 700
    assert cache.covers(turn1, 0) and cache.covers(turn2, 0)
    assert not cache.covers(as_tokens([*turn2.tolist(), 1]), 0)


def test_ram_stays_within_its_bound_under_a_flood_of_distinct_prompts():
    cache = ram_cache(mb=1)
    for i in range(60):
        cache.put(tokens(100 + i, 64), 0, CHUNK, payload(100_000, i))
        assert cache.ram_bytes <= 1 << 20
    d = cache.describe()
    assert d["bytes"] == cache.ram_bytes <= 1 << 20 and d["entries"] == 10 and d["ram_evictions"] == 50
    # Least recently used out: the last ten are here, a used one survives the next put.
    recent = [tokens(100 + i, 64) for i in range(50, 60)]
    assert all(cache.covers(t, 0) for t in recent)
    oldest, _ = cache.best(recent[0], 63, reproducible=False, chunk=CHUNK)
    assert cache.load(oldest) is not None  # used: now the most recent
    cache.put(tokens(999, 64), 0, CHUNK, payload(100_000))
    assert cache.covers(recent[0], 0) and not cache.covers(recent[1], 0)
    assert cache.put(tokens(1000, 64), 0, CHUNK, payload(2 << 20)) is None  # larger than the bound: kept nowhere


def test_short_prefixes_are_not_kept():
    cache = ram_cache()
    assert cache.put(tokens(9, 10), 0, CHUNK, payload(100)) is None


def test_a_state_restarts_from_disk_with_its_bytes(tmp_path):
    cache = disk_cache(tmp_path)
    long = tokens(10, 300)
    data = payload(50_000, 10)
    cache.put(long, 288, CHUNK, data)
    cache.put(tokens(11, 40), 0, CHUNK, payload(1000))  # below disk_min_tokens: RAM only
    cache.flush()
    cache.close()
    files = list((tmp_path / IDENTITY.key()).glob("*.kv"))
    assert [f.name for f in files] == [state_name(long) + ".kv"]
    assert not [f for f in (tmp_path / IDENTITY.key()).iterdir() if f.name.startswith(".tmp")]

    again = disk_cache(tmp_path)
    d = again.describe()
    assert d["entries"] == 0 and d["disk_entries"] == 1 and d["disk_bytes"] == files[0].stat().st_size
    entry, served = again.best(long, 299, reproducible=True, chunk=CHUNK)
    assert served == 288 and entry.canonical_end == 288 and entry.payload is None
    assert again.load(entry) == data
    assert again.describe()["entries"] == 1  # now in RAM too
    again.close()


def test_a_corrupt_payload_is_refused_at_load_and_removed(tmp_path):
    cache = disk_cache(tmp_path)
    long = tokens(12, 200)
    cache.put(long, 0, CHUNK, payload(20_000))
    cache.close()
    path = tmp_path / IDENTITY.key() / (state_name(long) + ".kv")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in the payload
    path.write_bytes(raw)
    again = disk_cache(tmp_path)
    entry, _ = again.best(long, 199, reproducible=False, chunk=CHUNK)
    assert entry is not None  # its header is sound: it is indexed, its payload checked when loaded
    assert again.load(entry) is None
    assert not path.exists()
    assert again.describe()["disk_refused"] == 1 and again.best(long, 199, False, CHUNK)[0] is None


def _written(tmp_path, long) -> bytes:
    cache = disk_cache(tmp_path)
    cache.put(long, 0, CHUNK, payload(20_000))
    cache.close()
    return (tmp_path / IDENTITY.key() / (state_name(long) + ".kv")).read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "foreign model", "other build", "not ours", "tokens", "renamed"])
def test_a_file_that_does_not_match_is_removed_unloaded(tmp_path, damage):
    long = tokens(13, 200)
    raw = _written(tmp_path, long)
    folder = tmp_path / IDENTITY.key()
    path = folder / (state_name(long) + ".kv")
    (length,) = struct.unpack("<I", raw[8:12])
    header = json.loads(raw[12 : 12 + length])
    rest = raw[12 + length :]
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage in ("foreign model", "other build"):
        header["model_sha256" if damage == "foreign model" else "build"] = "something else"
        text = json.dumps(header, sort_keys=True).encode()
        raw = MAGIC + struct.pack("<I", len(text)) + text + rest
    elif damage == "not ours":
        raw = b"\x80\x04\x95" + raw[3:]  # a pickle's opening bytes: never unpickled, refused as not this format
    elif damage == "tokens":
        raw = bytearray(raw)
        raw[12 + length] ^= 0x01  # the first token id
        raw = bytes(raw)
    elif damage == "renamed":
        path.rename(folder / ("0" * 32 + ".kv"))
        path = folder / ("0" * 32 + ".kv")
    path.write_bytes(raw)
    again = disk_cache(tmp_path)
    assert again.describe()["disk_entries"] == 0 and again.describe()["disk_refused"] == 1
    assert not path.exists()
    again.close()


def test_another_identity_neither_loads_nor_removes_these_files(tmp_path):
    long = tokens(14, 200)
    _written(tmp_path, long)
    other = CacheIdentity("c" * 64, "b" * 64, 4096, "k=1 v=1 flash_attn=0", "llama-cpp-python test")
    cache = disk_cache(tmp_path, identity=other)
    assert cache.best(long, 199, False, CHUNK)[0] is None
    assert (tmp_path / IDENTITY.key() / (state_name(long) + ".kv")).exists()
    cache.close()


def test_a_half_written_file_never_loads(tmp_path):
    """A crash mid-write leaves a temporary name only (the rename is the write's last step): not indexed, and
    removed once it is older than any live write."""
    long = tokens(15, 200)
    raw = _written(tmp_path, long)
    folder = tmp_path / IDENTITY.key()
    (folder / (state_name(long) + ".kv")).unlink()
    tmp = folder / f".tmp-{state_name(long)}.12345"
    tmp.write_bytes(raw[: len(raw) // 2])
    assert disk_cache(tmp_path).describe()["disk_entries"] == 0
    assert tmp.exists()  # it may be another gateway's write in progress
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    disk_cache(tmp_path).close()
    assert not tmp.exists()


def test_the_disk_stays_within_its_bound_oldest_out_across_identities(tmp_path):
    other = CacheIdentity("d" * 64, "b" * 64, 4096, "k=1 v=1 flash_attn=0", "llama-cpp-python test")
    old = disk_cache(tmp_path, identity=other)
    old.put(tokens(16, 100), 0, CHUNK, payload(300_000))
    old.close()
    cache = disk_cache(tmp_path, ram_mb=0, disk_mb=1)
    for i in range(8):
        cache.put(tokens(200 + i, 100), 0, CHUNK, payload(300_000, i))
        cache.flush()
        total = sum(p.stat().st_size for p in tmp_path.glob("*/*.kv"))
        assert total <= 1 << 20
    assert not list((tmp_path / other.key()).glob("*.kv"))  # the oldest file went first, whoever's it was
    d = cache.describe()
    assert d["disk_entries"] == 3 and d["disk_evictions"] >= 5 and d["entries"] == 0
    # RAM off: a state is restored straight from its file.
    entry, served = cache.best(tokens(207, 100), 99, False, CHUNK)
    assert served == 99 and cache.load(entry) == payload(300_000, 7)
    cache.close()


def test_the_header_names_what_the_bytes_are_valid_for(tmp_path):
    long = tokens(17, 64)
    data = payload(1000)
    head = encode_header(IDENTITY, long, 64, CHUNK, data)
    path = tmp_path / "x.kv"
    path.write_bytes(head + data)
    with open(path, "rb") as f:
        header, read = read_header(f, IDENTITY, path.stat().st_size)
    assert np.array_equal(read, long)
    for field in ("model_sha256", "tokenizer_sha256", "n_ctx", "kv_type", "build", "payload_sha256"):
        assert field in header
    with open(path, "rb") as f, pytest.raises(StoreRefused, match="n ctx"):
        read_header(f, CacheIdentity("a" * 64, "b" * 64, 2048, IDENTITY.kv_type, IDENTITY.build), path.stat().st_size)


def test_hit_rates_count_lookups_and_tokens():
    cache = ram_cache()
    cache.record_lookup(100, 0, None)
    cache.record_lookup(100, 90, "ram", 90)
    cache.record_lookup(200, 50, None)
    d = cache.describe()
    assert d["lookups"] == 3 and d["hits"] == 2 and d["hit_rate"] == pytest.approx(2 / 3)
    assert d["token_hit_rate"] == pytest.approx(140 / 400) and d["restores_ram"] == 1 and d["tokens_restored"] == 90


DEVICE_ONLY = "[gateway]\npolicy = 'device'\n[device]\n"


def test_the_device_settings_name_a_bad_bound_and_default_to_the_xdg_cache(tmp_path, monkeypatch):
    from app.config import ConfigError, load_settings

    path = tmp_path / "c.toml"
    path.write_text(DEVICE_ONLY + "prompt_cache_mb = -1\n")
    with pytest.raises(ConfigError, match=r"device\.prompt_cache_mb"):
        load_settings(path)
    path.write_text(DEVICE_ONLY + "prompt_cache_disk_min_tokens = 0\n")
    with pytest.raises(ConfigError, match=r"device\.prompt_cache_disk_min_tokens"):
        load_settings(path)
    path.write_text(DEVICE_ONLY + "prompt_cache_dir = '~/kv'\n")
    device = load_settings(path).device
    defaults = (device.prompt_cache_mb, device.prompt_cache_disk_mb, device.prompt_cache_disk_min_tokens)
    assert defaults == (1024, 2048, 1024)
    assert PromptCacheOptions(directory=device.prompt_cache_dir).folder == Path("~/kv").expanduser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert PromptCacheOptions().folder == tmp_path / "xdg" / "tandem" / "kv"
