"""Run an untrusted Python program (a model's answer with its tests, or a directory of files) in a sandbox.

The sandbox is Debian's bubblewrap (`bwrap`), the tool Flatpak uses; nothing here builds namespaces by hand. Each
program runs in a fresh interpreter (`python -I -B`) inside:
- a pid namespace of its own: when the program's main process ends, or the wall clock kills the sandbox, the kernel
  kills every process left in it (a daemon it forked, a `setsid` child), and the run waits for them to be gone;
- a network namespace of its own (a loopback of its own, no other interface): it cannot reach the host's loopback,
  the host's abstract Unix sockets or anything further;
- a mount namespace whose root is an empty read-only tmpfs holding only /usr, the interpreter and its virtual
  environment (read-only), a fresh /proc and a minimal /dev, its input (read-only) and /scratch, a size-limited
  tmpfs that is its working directory, HOME and TMPDIR and vanishes with it; nothing else of the host's file system
  (the repository, the gateway's state, /etc, /root, /tmp) exists in it, and nothing it writes survives the run;
- an ipc and a uts namespace of its own;
- a user that owns nothing outside: as root, bwrap drops every capability but those to change uid, and setpriv
  (util-linux) changes to a uid of this run's own, clears the groups, the bounding set and sets no_new_privs before
  the interpreter starts; as an ordinary user, bwrap maps the user into a user namespace of its own and forbids
  nested ones (`--disable-userns`). Its processes (fork, exec) are bounded by RLIMIT_NPROC counted for that uid
  (`Limits.processes` beside itself, none by default), and it can neither see nor ptrace nor signal a process
  outside (none exists in its pid namespace);
- rlimits: CPU seconds, address space, file size, no core files; and a wall-clock limit.

Where bubblewrap is missing or cannot make its namespaces here, `run` refuses with SandboxUnavailable, which names
what to install: model code never runs under a weaker fallback.

Inside, an audit hook (PEP 578) installed before the program's first line still refuses socket connects and
binds, writes outside /scratch, subprocesses and ctypes: it turns a program's mistakes into a clear PermissionError
verdict, but it is no barrier (code in the process can switch it off); the kernel's namespaces and limits are.

A program passes only if it runs to its end and says so with a token it was handed on stdin, so a program that exits
early with status 0 (sys.exit(0), os._exit(0)) does not pass. The token lives in the same process as the program,
so code that sets out to forge a pass can: the sandbox contains what a program does to the machine, not the honesty
of its verdict. Memory is bounded per process (RLIMIT_AS): with `Limits.processes` = n, n + 1 times that in all.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    wall_s: float = 30.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # per process (RLIMIT_AS)
    file_bytes: int = 1 << 20  # any one file it writes (RLIMIT_FSIZE)
    scratch_bytes: int = 64 << 20  # its scratch directory, a tmpfs of that size (its input is copied there)
    processes: int = 0  # processes (and threads) it may start beside itself; 0: no fork, no thread, no other program


@dataclass(frozen=True)
class Outcome:
    passed: bool
    verdict: str  # "passed", or why not: "AssertionError", "MemoryError", "wall-clock limit", "CPU limit", ...
    seconds: float
    detail: str = ""  # the last lines of its stderr
    output: str = ""  # the last lines of its stdout


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine: model code is not run at all."""


SCRATCH = "/scratch"  # its working directory, inside the sandbox
INPUT = "/input"  # what it was given, read-only, inside the sandbox
_PRIVATE_UIDS = (1_800_000_000, 1 << 24)  # as root, each run's uid: first, count (no account, no file, owns nothing)
_INSTALL = (
    "refusing to run model code without a sandbox: it needs bubblewrap (`apt-get install bubblewrap` on Debian and "
    "Ubuntu; as root `make setup` installs it) and util-linux's setpriv, and a kernel that lets bwrap make its "
    "namespaces (an ordinary user needs unprivileged user namespaces)"
)

_BOOTSTRAP = r"""
import os, resource, shutil, sys, traceback
token = sys.stdin.readline().strip()
result_fd, script, cpu_s, memory, file_bytes, processes = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
result_fd = int(result_fd)
scratch = "/scratch"
for entry in os.scandir("/input"):  # /scratch itself is bwrap's, not the program's: no copystat onto it
    if entry.is_dir(follow_symlinks=False):
        shutil.copytree(entry.path, os.path.join(scratch, entry.name), symlinks=True)
    else:
        shutil.copy(entry.path, scratch, follow_symlinks=False)
mine = [p for p in os.listdir("/proc") if p.isdigit() and os.stat("/proc/" + p).st_uid == os.getuid()]  # itself,
# and bwrap's init where that runs as the same uid: RLIMIT_NPROC counts them too
resource.setrlimit(resource.RLIMIT_NPROC, (len(mine) + processes, len(mine) + processes))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
path = os.path.join(scratch, script)
source = open(path).read()
sys.argv = [script, *sys.argv[7:]]
sys.path[0] = os.path.dirname(path)
WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATHS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
         "os.utime": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
         "shutil.rmtree": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.copyfile": 2,
         "shutil.copytree": 2, "shutil.move": 2}
PROCESSES = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
             "os.kill", "os.killpg", "pty.spawn")
REFUSED = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "ctypes.dlopen", "ctypes.dlsym",
           "ctypes.cdata", "ctypes.call_function", "os.chroot") + (() if processes else PROCESSES)

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

code = compile(source, script, "exec")
sys.addaudithook(guard)
try:
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
except BaseException as exc:
    status = f"{token} {type(exc).__name__}"
    try:
        traceback.print_exception(exc, limit=-3)
    except BaseException:
        pass
else:
    status = f"{token} passed"
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except BaseException:
        pass
os.write(result_fd, status.encode())
os._exit(0)
"""


@dataclass(frozen=True)
class _Mechanism:
    bwrap: str
    setpriv: str | None  # as root: the uid change inside; None: an ordinary user, mapped by bwrap
    version: str


def network_isolation() -> str:
    """How programs are kept off the network: always "namespace" (a network namespace of their own); raises
    SandboxUnavailable where no sandbox can be made."""
    _mechanism()
    return "namespace"


def mechanism() -> str:
    """The sandbox in words, for a report's header; raises SandboxUnavailable where none can be made."""
    m = _mechanism()
    who = "as root, a uid of its own per run (setpriv)" if m.setpriv else "in a user namespace of its own"
    return f"{m.version}: pid, network, mount, ipc and uts namespaces, {who}"


def run(source: str, limits: Limits = Limits(), scratch_root: str | None = None) -> Outcome:
    """Run `source` as a program in the sandbox; it passes if it runs to its end without an exception. `scratch_root`:
    where the host-side copy of its input is made (the system's temporary directory by default)."""
    return _run_input(lambda tree: (tree / "program.py").write_text(source), "program.py", (), limits, scratch_root)


def run_directory(
    directory: str | os.PathLike,
    script: str,
    limits: Limits = Limits(),
    args: Sequence[str] = (),
    scratch_root: str | None = None,
) -> Outcome:
    """Run `python <script> <args>` on a copy of `directory` in the sandbox: the copy, in a tmpfs of
    `limits.scratch_bytes`, is its working directory and sys.path[0]; `directory` itself is never written. It passes
    if the script runs to its end without an exception (a test script must not end with sys.exit(), which does not
    pass: e.g. `unittest.main(exit=False)` and raise if the result is not successful). Only regular files,
    directories and symlinks are copied; symlinks stay links, resolved inside the sandbox."""
    source = Path(directory)
    if not (source / script).is_file():
        raise FileNotFoundError(f"no script {script!r} in {source}")
    return _run_input(lambda tree: _copy_tree(source, tree), script, tuple(args), limits, scratch_root)


def _run_input(fill, script: str, args: tuple[str, ...], limits: Limits, scratch_root: str | None) -> Outcome:
    m = _mechanism()
    tree = Path(tempfile.mkdtemp(prefix="tandem-sandbox-", dir=scratch_root))
    try:
        fill(tree)
        _readable_by_anyone(tree)
        return _execute(m, tree, script, args, limits)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def _execute(m: _Mechanism, tree: Path, script: str, args: tuple[str, ...], limits: Limits) -> Outcome:
    token = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    info_read, info_write = os.pipe()
    command = _command(m, tree, info_write, limits)
    command += [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(write_fd), script, str(limits.cpu_s)]
    command += [str(limits.memory_bytes), str(limits.file_bytes), str(limits.processes), *args]
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": SCRATCH, "TMPDIR": SCRATCH}
    pidfd = -1
    started = time.monotonic()
    try:
        # Its stdout and stderr are unnamed files of ours: nothing it leaves in /scratch is read back here.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                pass_fds=(write_fd, info_write),
                start_new_session=True,
            )
            os.close(write_fd)
            os.close(info_write)
            write_fd = info_write = -1
            try:
                process.stdin.write(token.encode() + b"\n")
                process.stdin.close()
            except BrokenPipeError:
                pass
            pidfd = _open_init(info_read, started + limits.wall_s)
            # Waited for on a pidfd: Popen.wait(timeout) polls, up to 50 ms late.
            with _pidfd(process.pid) as bwrap:
                remaining = max(0.0, started + limits.wall_s - time.monotonic())
                timed_out = not select.select([bwrap], [], [], remaining)[0]
            if timed_out:
                _kill(pidfd)
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            _await_end(pidfd)  # the namespace's init gone: no process of the run is left
            seconds = time.monotonic() - started
            status = _read_all(read_fd)
            detail, output = _tail(err), _tail(out)
    finally:
        for fd in (read_fd, write_fd, info_read, info_write, pidfd):
            if fd >= 0:
                os.close(fd)
    return Outcome(*_verdict(status, token, process.returncode, timed_out), seconds, detail, output)


def _command(m: _Mechanism, tree: Path, info_fd: int, limits: Limits) -> list[str]:
    command = [m.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    command += ["--die-with-parent", "--new-session", "--info-fd", str(info_fd)]
    if m.setpriv is None:
        command += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
    else:
        command += ["--cap-drop", "ALL"]  # but those setpriv needs to change uid and drop the rest
        command += [a for c in ("SETUID", "SETGID", "SETPCAP") for a in ("--cap-add", f"CAP_{c}")]
    mounts = _read_only_roots()
    for parent in sorted({str(p) for _, inside in mounts for p in Path(inside).parents} - {"/"}):
        command += ["--perms", "0755", "--dir", parent]  # bwrap would make them 0700: closed to the program's uid
    for host, inside in mounts:
        command += ["--ro-bind", host, inside]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        top = Path("/") / name
        if top.is_symlink():
            command += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            command += ["--ro-bind", str(top), str(top)]
    command += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", str(tree), INPUT]
    command += ["--size", str(limits.scratch_bytes), "--perms", "0777", "--tmpfs", SCRATCH, "--chdir", SCRATCH]
    command += ["--remount-ro", "/", "--"]
    if m.setpriv is not None:
        uid = str(_PRIVATE_UIDS[0] + secrets.randbelow(_PRIVATE_UIDS[1]))
        command += [m.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
        command += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return command


@functools.cache
def _read_only_roots() -> tuple[tuple[str, str], ...]:
    """(host path, path inside) of /usr, the virtual environment and the interpreter it was made from: the fewest
    trees holding the interpreter, its standard library and the environment's packages. The environment is also
    mounted where sys.executable names it, should a symlink lead there."""
    roots: list[str] = []
    for path in sorted({"/usr", os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}, key=len):
        if not any(path == r or path.startswith(r + os.sep) for r in roots):
            roots.append(path)
    mounts = [(root, root) for root in roots]
    if os.path.realpath(sys.prefix) != os.path.abspath(sys.prefix):
        mounts.append((os.path.realpath(sys.prefix), os.path.abspath(sys.prefix)))
    return tuple(mounts)


def _open_init(info_fd: int, deadline: float) -> int:
    """A pidfd on the sandbox's init (pid 1 of its namespace, named in bwrap's --info-fd), or -1 if it never
    started."""
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(info_fd, 4096) if ready else b""
        if not chunk:
            break
        data += chunk
        with contextlib.suppress(ValueError):
            pid = json.loads(data)["child-pid"]
            try:
                return os.pidfd_open(pid)
            except ProcessLookupError:
                return -1
    return -1


@contextlib.contextmanager
def _pidfd(pid: int):
    fd = os.pidfd_open(pid)  # our child, not reaped before Popen.wait: it exists
    try:
        yield fd
    finally:
        os.close(fd)


def _kill(pidfd: int) -> None:
    if pidfd >= 0:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def _await_end(pidfd: int, timeout_s: float = 10.0) -> None:
    """Its init ends only after the kernel has killed and reaped every other process of its pid namespace."""
    if pidfd < 0:
        return
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
    if not ready:
        _kill(pidfd)
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        if not ready:
            raise RuntimeError("sandbox: a sandboxed process outlived its run and a SIGKILL")


@functools.cache
def _mechanism() -> _Mechanism:
    """bubblewrap as found here, checked by running a trivial program through it once per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"{_INSTALL}: no `bwrap` on PATH")
    setpriv = None
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxUnavailable(f"{_INSTALL}: running as root and no `setpriv` (util-linux) on PATH")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip() or "bubblewrap"
    m = _Mechanism(bwrap, setpriv, version)
    tree = Path(tempfile.mkdtemp(prefix="tandem-sandbox-probe-"))
    try:
        (tree / "program.py").write_text("pass\n")
        _readable_by_anyone(tree)
        probe = _execute(m, tree, "program.py", (), Limits(wall_s=60, cpu_s=10))
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if not probe.passed:
        raise SandboxUnavailable(f"{_INSTALL}: a trivial program failed in it ({probe.verdict}: {probe.detail})")
    return m


def _copy_tree(source: Path, target: Path) -> None:
    for entry in os.scandir(source):
        to = target / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), to)
        elif entry.is_dir(follow_symlinks=False):
            to.mkdir()
            _copy_tree(Path(entry.path), to)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, to, follow_symlinks=False)
            if os.stat(entry.path, follow_symlinks=False).st_mode & 0o111:
                to.chmod(0o755)


def _readable_by_anyone(tree: Path) -> None:
    """As root the program runs as a uid that owns nothing: its input must be readable by all (it is read-only)."""
    for directory, _, files in os.walk(tree):
        os.chmod(directory, 0o755)
        for name in files:
            path = os.path.join(directory, name)
            mode = os.stat(path, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                os.chmod(path, 0o755 if mode & 0o111 else 0o644)


def _verdict(status: str, token: str, returncode: int, timed_out: bool) -> tuple[bool, str]:
    if timed_out:
        return False, "wall-clock limit"
    if status.startswith(token + " "):
        verdict = status[len(token) + 1 :]
        return verdict == "passed", verdict
    # bwrap exits with 128 + n when the program was killed by signal n.
    signalled = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if signalled in (signal.SIGXCPU, signal.SIGKILL):
        return False, "CPU limit" if signalled == signal.SIGXCPU else "killed"
    with contextlib.suppress(ValueError):  # an exit status above 128 that names no signal
        return False, f"killed by {signal.Signals(signalled).name}"
    return False, f"ended without finishing (exit status {returncode})"


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
        if sum(map(len, chunks)) > 4096:
            break
    return b"".join(chunks).decode(errors="replace")


def _tail(file, lines: int = 3) -> str:
    file.seek(0, os.SEEK_END)
    file.seek(max(0, file.tell() - 2000))
    text = file.read().decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-lines:])
