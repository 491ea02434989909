"""Build llama.cpp's own `llama-server` from the llama.cpp source the pinned llama-cpp-python ships.

The tests and `tandem bench device` run it as a real peer (a cloud that takes GBNF grammars, a different
tokenizer, the server most users would pick). No binary is downloaded: the set-up (`make test`) fetches the pinned
llama-cpp-python sdist from PyPI with pip (MIT; its `vendor/llama.cpp` is llama.cpp at the commit the Python
package was built from), verifies its sha256 against the table below, and builds only the server target
(Release, no examples, tests, web UI or network features). The binary is cached outside the repository, like the
models, in a folder whose name carries the version and a hash of the build flags (and, for a linked build, of the
libraries it links), so a changed flag or a rebuilt package builds a new one and clones share it. Like the package,
it is built for this CPU less what the CPU advertises and cannot run (deploy/cpu_features.py).

The cold set-up has minutes, not tens of minutes, to spare: when the installed llama-cpp-python is the pinned
version (the set-up installs it first), the server links the libllama and libggml that package already built from
this very source (copied beside the binary, found through its $ORIGIN run path) instead of compiling them again,
and what it compiles itself (the server, its common library, the multimodal library it links) at -O1: the
kernels that decide its speed are the package's. Otherwise it compiles all of llama.cpp into one static binary.

Usage: python -m deploy.llama_server build   (a no-op when the cached binary exists)
       python -m deploy.llama_server path
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from deploy.cpu_features import llama_cmake_args
from deploy.models import sha256_of

_CONSTRAINTS = Path(__file__).with_name("constraints.txt")

# The sdist of each llama-cpp-python version we pin (deploy/constraints.txt), by its sha256 on PyPI.
SDIST_SHA256 = {
    "0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
}

# Only what the server needs: no examples, tests, tools other than the server, web UI (it would be downloaded),
# TLS or curl (the server fetches no models), and one static binary that depends on no shared library of ours.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
# Linked against the installed package's libraries: only the server's own code is compiled, at -O1.
LINKED_FLAGS = (
    *CMAKE_FLAGS,
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_BUILD_RPATH=$ORIGIN",
)
TARGET = "llama-server"
LIBRARIES = ("libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0")


class BuildError(RuntimeError):
    pass


def _progress(msg: str) -> None:
    print(f"[llama-server] {msg}", file=sys.stderr, flush=True)


def pinned_version() -> str:
    """llama-cpp-python's version as deploy/constraints.txt pins it."""
    for line in _CONSTRAINTS.read_text().splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip().lower().replace("_", "-") == "llama-cpp-python":
            return version.strip()
    raise BuildError(f"{_CONSTRAINTS} pins no llama-cpp-python")


def bin_dir() -> Path:
    root = os.environ.get("TANDEM_BIN_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "bin"
    )
    return Path(root)


def _folder(version: str, identity: tuple[str, ...]) -> Path:
    return bin_dir() / f"llama-server-{version}-{hashlib.sha256(' '.join(identity).encode()).hexdigest()[:12]}"


def _whole_flags() -> tuple[str, ...]:
    return (*CMAKE_FLAGS, *llama_cmake_args())


def _linked_identity(libraries: Path) -> tuple[str, ...]:
    """A linked build's flags and the bytes of the libraries it copies: a package rebuilt with other flags (the
    same version) gets a server of its own."""
    return (*LINKED_FLAGS, *(sha256_of(libraries / name) for name in LIBRARIES))


def binary_path() -> Path:
    """Where the llama-server binary is (the linked build's, else the whole one's), or would be built."""
    version = pinned_version()
    whole = _folder(version, _whole_flags()) / TARGET
    libraries = installed_libraries()
    if libraries is None:
        return whole
    linked = _folder(version, _linked_identity(libraries)) / TARGET
    return whole if whole.is_file() and not linked.is_file() else linked


def installed_libraries() -> Path | None:
    """The folder of the installed llama-cpp-python's libllama and libggml, when it is the pinned version."""
    try:
        if importlib.metadata.version("llama_cpp_python") != pinned_version():
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("llama_cpp")  # finds the package without importing it (no native library load)
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "lib"
    return folder if all((folder / name).is_file() for name in LIBRARIES) else None


def _link_installed(source: Path, libraries: Path) -> None:
    """Make llama.cpp's top CMakeLists take libllama and libggml as the prebuilt `libraries` (imported targets)
    instead of compiling ggml/ and src/, and drop its install rules (they name the library targets)."""
    top = source / "CMakeLists.txt"
    text = top.read_text()
    ggml_anchor, src_line, install = (
        "if (NOT TARGET ggml AND NOT LLAMA_USE_SYSTEM_GGML)",
        "add_subdirectory(src)\n",
        "\n#\n# install\n#\n",
    )
    if text.count(ggml_anchor) != 1 or text.count(src_line) != 1 or text.count(install) != 1:
        raise BuildError("llama.cpp's CMakeLists.txt is not laid out as deploy/llama_server.py expects")
    lib = libraries.as_posix()
    imported = f"""
add_library(ggml SHARED IMPORTED GLOBAL)
set_target_properties(ggml PROPERTIES IMPORTED_LOCATION "{lib}/libggml.so.0"
    INTERFACE_INCLUDE_DIRECTORIES "${{CMAKE_CURRENT_SOURCE_DIR}}/ggml/include"
    INTERFACE_LINK_LIBRARIES "{lib}/libggml-base.so.0;{lib}/libggml-cpu.so.0")
add_library(llama SHARED IMPORTED GLOBAL)
set_target_properties(llama PROPERTIES IMPORTED_LOCATION "{lib}/libllama.so.0"
    INTERFACE_INCLUDE_DIRECTORIES "${{CMAKE_CURRENT_SOURCE_DIR}}/include" INTERFACE_LINK_LIBRARIES ggml)
"""
    text = text.replace(ggml_anchor, imported + ggml_anchor).replace(src_line, "")
    top.write_text(text.split(install)[0] + "\n")


def verify_sdist(path: Path, version: str) -> None:
    """BuildError unless `path` is the llama-cpp-python `version` sdist PyPI lists (by its sha256)."""
    expected = SDIST_SHA256.get(version)
    if expected is None:
        raise BuildError(
            f"no sha256 for the llama-cpp-python {version} sdist in deploy/llama_server.py's SDIST_SHA256: add the "
            f"one PyPI lists for llama_cpp_python-{version}.tar.gz"
        )
    got = sha256_of(path)
    if got != expected:
        raise BuildError(
            f"checksum mismatch for {path.name}: expected sha256 {expected}, got {got}; refusing to build it"
        )


def _download_sdist(version: str, into: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "-d", str(into), f"llama-cpp-python=={version}",
    ]  # fmt: skip
    _progress(f"downloading the llama-cpp-python {version} sdist (pip)")
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    sdist = into / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        raise BuildError(f"pip did not produce {sdist.name}")
    verify_sdist(sdist, version)
    return sdist


def _extract_llama_cpp(sdist: Path, into: Path) -> Path:
    """Only vendor/llama.cpp, without its docs and model vocabularies (a third of the archive)."""
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        source = f"{top}/vendor/llama.cpp/"
        skip = (source + "models/", source + "docs/")
        members = [m for m in tar.getmembers() if m.name.startswith(source) and not m.name.startswith(skip)]
        tar.extractall(into, members=members, filter="data")
    return into / top / "vendor" / "llama.cpp"


def build(jobs: int | None = None, whole: bool = False) -> Path:
    """The cached llama-server for the pinned llama-cpp-python, built when missing (`whole`: all of llama.cpp,
    even where the installed package's libraries could be linked)."""
    out = binary_path()
    if out.is_file() and os.access(out, os.X_OK) and not whole:
        _progress(f"cached at {out}")
        return out
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed (the llama-cpp-python install needs it too)")
    version = pinned_version()
    libraries = None if whole else installed_libraries()
    flags = LINKED_FLAGS if libraries is not None else _whole_flags()
    out = _folder(version, _linked_identity(libraries) if libraries is not None else flags) / TARGET
    jobs = jobs or os.cpu_count() or 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-llama-server-") as tmp:
        sdist = _download_sdist(version, Path(tmp))
        source = _extract_llama_cpp(sdist, Path(tmp) / "src")
        if libraries is not None:
            _progress(f"linking the installed llama-cpp-python's libllama and libggml ({libraries})")
            _link_installed(source, libraries)
        build_dir = Path(tmp) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _progress(f"configuring llama.cpp ({source})")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *generator, *flags], check=True,
                       stdout=sys.stderr)  # fmt: skip
        _progress(f"building {TARGET} with {jobs} jobs (minutes)")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", TARGET, "-j", str(jobs)], check=True,
                       stdout=sys.stderr)  # fmt: skip
        partial = out.parent.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        shutil.copy2(build_dir / "bin" / TARGET, partial / TARGET)
        for name in LIBRARIES if libraries is not None else ():
            shutil.copy2(libraries / name, partial / name)
        subprocess.run([str(partial / TARGET), "--version"], check=True, capture_output=True)  # it loads and runs
        shutil.rmtree(out.parent, ignore_errors=True)
        os.replace(partial, out.parent)
    _progress(f"built in {time.monotonic() - started:.0f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.llama_server")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build llama-server into the cache unless it is there")
    b.add_argument("-j", "--jobs", type=int, default=None)
    b.add_argument("--whole", action="store_true", help="compile all of llama.cpp (no installed libraries linked)")
    sub.add_parser("path", help="print where the llama-server binary is cached")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            build(args.jobs, args.whole)
        else:
            print(binary_path())
    except (BuildError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
