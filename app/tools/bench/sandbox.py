"""Run an untrusted Python program (a model's answer with its tests) in a separate, limited process.

Each program runs in a fresh interpreter (`python -I -B`), never in the calling process, with:
- a wall-clock limit (the process group is killed) and a CPU-time limit (RLIMIT_CPU);
- a memory limit (RLIMIT_AS) and a limit on the size of any file it writes (RLIMIT_FSIZE); no child processes
  (RLIMIT_NPROC = 0 where it binds: not for root, whom the kernel exempts);
- a scratch directory of its own as its working directory, HOME and TMPDIR, removed afterwards;
- no network: a network namespace of its own (`unshare -n`) where this platform lets us make one, and always an
  audit hook (PEP 578) installed before the program's first line that refuses socket connects and binds, writes
  and file-system changes outside the scratch directory, subprocesses, forks, signals and ctypes.

The audit hook contains a program's mistakes, not an adversary who sets out to escape it (from inside the process
it cannot be removed, but native code can step around it); the limits and the namespace are the kernel's. A
program passes only if it runs to its end and says so with a token it was handed on stdin, so a program that
exits early with status 0 (sys.exit(0), os._exit(0)) does not pass.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    wall_s: float = 30.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 1 << 20


@dataclass(frozen=True)
class Outcome:
    passed: bool
    verdict: str  # "passed", or why not: "AssertionError", "MemoryError", "wall-clock limit", "CPU limit", ...
    seconds: float
    detail: str = ""  # the last lines of its stderr


_BOOTSTRAP = r"""
import os, resource, sys, traceback
token = sys.stdin.readline().strip()
result_fd, scratch, script = int(sys.argv[1]), os.path.realpath(sys.argv[2]), sys.argv[3]
cpu_s, memory, file_bytes = (int(v) for v in sys.argv[4:7])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if os.geteuid() != 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
source = open(script).read()
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATHS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
         "os.utime": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
         "shutil.rmtree": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.copyfile": 2,
         "shutil.copytree": 2, "shutil.move": 2}
REFUSED = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "subprocess.Popen", "os.system",
           "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "os.chroot")

def inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == scratch or real.startswith(scratch + os.sep)

def guard(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (flags or 0) & WRITE or any(c in (mode or "") for c in "wax+")
        if writes and not inside(path):
            raise PermissionError(f"sandbox: no writing outside the scratch directory ({path!r})")
    elif event in PATHS:
        for path in args[:PATHS[event]]:
            if not inside(path):
                raise PermissionError(f"sandbox: {event} outside the scratch directory ({path!r})")
    elif event in REFUSED:
        raise PermissionError(f"sandbox: {event} is not allowed")

code = compile(source, "program.py", "exec")
sys.addaudithook(guard)
try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except BaseException as exc:
    status = f"{token} {type(exc).__name__}"
    try:
        traceback.print_exception(exc, limit=-3)
    except BaseException:
        pass
else:
    status = f"{token} passed"
os.write(result_fd, status.encode())
os._exit(0)
"""


@functools.cache
def network_isolation() -> str:
    """How programs are kept off the network here: "namespace" (`unshare -n` works: no interface but a down
    loopback) or "audit hook" (the socket guard alone)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "audit hook"
    try:
        ok = subprocess.run([unshare, "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "namespace" if ok else "audit hook"


def run(source: str, limits: Limits = Limits(), scratch_root: str | None = None) -> Outcome:
    """Run `source` as a program in a sandboxed process; it passes if it runs to its end without an exception."""
    scratch = Path(tempfile.mkdtemp(prefix="tandem-sandbox-", dir=scratch_root))
    token = secrets.token_hex(16)
    script = scratch / "program.py"
    script.write_text(source)
    read_fd, write_fd = os.pipe()
    command = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(write_fd), str(scratch), str(script)]
    command += [str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes)]
    if network_isolation() == "namespace":
        command = [shutil.which("unshare") or "unshare", "-n", *command]
    env = {"PATH": os.defpath, "LC_ALL": "C.UTF-8", "HOME": str(scratch), "TMPDIR": str(scratch)}
    started = time.monotonic()
    try:
        with open(scratch / "stdout", "wb") as out, open(scratch / "stderr", "wb") as err:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=scratch,
                env=env,
                pass_fds=(write_fd,),
                start_new_session=True,  # its own process group: the wall-clock limit kills everything in it
            )
        os.close(write_fd)
        write_fd = -1
        try:
            process.stdin.write(token.encode() + b"\n")
            process.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = False
        try:
            process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        seconds = time.monotonic() - started
        status = _read_all(read_fd)
        detail = _tail(scratch / "stderr")
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(scratch, ignore_errors=True)
    return Outcome(*_verdict(status, token, process.returncode, timed_out), seconds, detail)


def _verdict(status: str, token: str, returncode: int, timed_out: bool) -> tuple[bool, str]:
    if timed_out:
        return False, "wall-clock limit"
    if status.startswith(token + " "):
        verdict = status[len(token) + 1 :]
        return verdict == "passed", verdict
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return False, "CPU limit" if returncode == -signal.SIGXCPU else "killed"
    if returncode < 0:
        return False, f"killed by {signal.Signals(-returncode).name}"
    return False, f"ended without finishing (exit status {returncode})"


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if sum(map(len, chunks)) > 4096:
            break
    return b"".join(chunks).decode(errors="replace")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 2000))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])
