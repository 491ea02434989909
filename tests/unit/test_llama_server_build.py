"""The set-up's llama-server build (deploy/llama_server.py): it builds only the llama.cpp of the llama-cpp-python
version deploy/constraints.txt pins, from an sdist whose sha256 it knows, into a cache path that changes with the
version and the build flags."""

from __future__ import annotations

import pytest

from deploy import llama_server


def test_the_pinned_version_has_a_known_sdist_checksum():
    version = llama_server.pinned_version()
    assert version in llama_server.SDIST_SHA256
    assert llama_server.binary_path().parent.name.startswith(f"llama-server-{version}-")


def test_a_tampered_sdist_is_refused(tmp_path):
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    sdist.write_bytes(b"not the sdist PyPI lists")
    with pytest.raises(llama_server.BuildError, match="checksum mismatch"):
        llama_server.verify_sdist(sdist, llama_server.pinned_version())
    with pytest.raises(llama_server.BuildError, match="no sha256"):
        llama_server.verify_sdist(sdist, "0.0.1")


def test_other_build_flags_build_another_binary(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_BIN_DIR", str(tmp_path))
    before = llama_server.binary_path()
    assert before.parent.parent == tmp_path
    for flags in ("CMAKE_FLAGS", "LINKED_FLAGS"):
        monkeypatch.setattr(llama_server, flags, (*getattr(llama_server, flags), "-DGGML_NATIVE=OFF"))
    assert llama_server.binary_path() != before


def test_the_installed_package_is_linked_only_when_it_is_the_pinned_version(monkeypatch):
    libraries = llama_server.installed_libraries()
    assert libraries is not None and (libraries / "libllama.so.0").is_file()  # the set-up installed it
    monkeypatch.setattr(llama_server, "pinned_version", lambda: "0.0.1")
    assert llama_server.installed_libraries() is None


def test_a_package_rebuilt_with_other_flags_gets_a_server_of_its_own(monkeypatch, tmp_path):
    """The linked server carries copies of the package's libraries: a package of the same version built again
    (deploy/cpu_features.py's flags) must not reuse a server holding the old ones."""
    monkeypatch.setenv("TANDEM_BIN_DIR", str(tmp_path / "bin"))
    libraries = tmp_path / "lib"
    libraries.mkdir()
    for name in llama_server.LIBRARIES:
        (libraries / name).write_bytes(b"built once")
    monkeypatch.setattr(llama_server, "installed_libraries", lambda: libraries)
    before = llama_server.binary_path()
    (libraries / "libggml-cpu.so.0").write_bytes(b"built again, without AMX")
    assert llama_server.binary_path() != before


def test_the_whole_build_takes_the_cpu_probes_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_BIN_DIR", str(tmp_path))
    monkeypatch.setattr(llama_server, "installed_libraries", lambda: None)
    monkeypatch.setattr(llama_server, "llama_cmake_args", lambda: [])
    native = llama_server.binary_path()
    monkeypatch.setattr(llama_server, "llama_cmake_args", lambda: ["-DCMAKE_C_FLAGS=-mno-amx-tile"])
    assert llama_server.binary_path() != native
