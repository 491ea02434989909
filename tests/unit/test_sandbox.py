"""The sandbox that runs model code (app/tools/bench/sandbox.py) against programs that set out to escape it.

Each escaping program first switches off the in-process audit hook (as any program can: it is a guard against
mistakes, not a barrier), so what holds is bubblewrap's namespaces and the kernel's limits. Each program passes only
if it got out; every test asserts that it did not, that the harness saw it fail, and that the host shows no trace of
it. The programs are tiny: the module takes a few seconds and loads no model.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.tools.bench import sandbox
from app.tools.bench.sandbox import Limits, SandboxUnavailable, mechanism, network_isolation, run, run_directory

FAST = Limits(wall_s=20, cpu_s=2, memory_bytes=512 << 20, file_bytes=1 << 16)

# Replaces the audit hook's code with a no-op, then checks it is off: while armed, the hook refuses "os.system".
DISARM = """
import gc, sys
for hook in [f for f in gc.get_objects() if getattr(f, "__name__", None) == "guard" and hasattr(f, "__code__")]:
    hook.__code__ = (lambda event, args: None).__code__
sys.audit("os.system", b"is the hook off?")
class Contained(Exception):
    pass
"""


def _program(directory: Path, body: str) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "escape.py").write_text(DISARM + body)
    return directory


def _processes_naming(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass  # it ended while we looked
    return found


# -- what it is -----------------------------------------------------------------------------------------------------


def test_each_run_has_namespaces_and_a_user_of_its_own():
    namespaces = ("pid", "net", "mnt", "ipc", "uts")
    probe = f"import os\nprint(os.getuid(), *(os.stat('/proc/self/ns/' + n).st_ino for n in {namespaces!r}))"
    first, second = run(probe, FAST), run(probe, FAST)
    assert first.passed and second.passed, (first, second)
    uid, *inside = map(int, first.output.split())
    outside = [os.stat(f"/proc/self/ns/{n}").st_ino for n in namespaces]
    assert all(a != b for a, b in zip(inside, outside, strict=True)), (inside, outside)
    if os.geteuid() == 0:  # as root (CI): a uid that owns nothing, a new one per run
        assert uid >= 1_800_000_000 and uid != int(second.output.split()[0])
    assert network_isolation() == "namespace"
    assert mechanism().startswith("bubblewrap")


def test_without_bubblewrap_it_refuses_to_run_model_code(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    sandbox._mechanism.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match=r"apt-get install bubblewrap.*no `bwrap` on PATH"):
            run("open('ran', 'w')", FAST)
        with pytest.raises(SandboxUnavailable):
            network_isolation()
    finally:
        monkeypatch.undo()
        sandbox._mechanism.cache_clear()
    assert run("assert True", FAST).passed


# -- processes ------------------------------------------------------------------------------------------------------


def test_a_fork_bomb_is_held_to_its_process_limit_and_ends_at_its_wall_clock(tmp_path):
    marker = secrets.token_hex(8)
    body = """
import os, time
original, refused, started = os.getpid(), 0, time.monotonic()
while time.monotonic() - started < 0.5:  # every process forks as fast as it can, its children too
    try:
        os.fork()
    except OSError:
        refused += 1
if os.getpid() == original:
    mine = [p for p in os.listdir("/proc") if p.isdigit() and os.stat("/proc/" + p).st_uid == os.getuid()]
    print("processes", len(mine), "refused", refused, flush=True)
time.sleep(60)
"""
    limits = Limits(wall_s=3, cpu_s=2, memory_bytes=256 << 20, processes=6)
    outcome = run_directory(_program(tmp_path / "bomb", body), "escape.py", limits, args=[marker])
    assert (outcome.passed, outcome.verdict) == (False, "wall-clock limit")
    assert outcome.seconds < limits.wall_s + 5  # the kill took effect at once: nothing kept the run going
    _, processes, _, refused = outcome.output.split()
    assert 2 <= int(processes) <= limits.processes + 2, outcome.output  # itself, 6 more, bwrap's init (as a user)
    assert int(refused) > 0  # the kernel's limit stopped it, not the clock
    assert _processes_naming(marker) == []


@pytest.mark.parametrize("ending", ["ends", "killed"])
def test_no_process_outlives_its_run(tmp_path, ending):
    """A daemon (double fork, setsid, exec) outlives neither a program that ends nor one the wall clock kills."""
    marker = secrets.token_hex(8)
    body = """
import os, sys, time
marker = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(3, 4096)  # holds none of the harness's pipes: nothing of the harness waits for it
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)", marker, "daemon"])
    os._exit(0)
for _ in range(100):
    time.sleep(0.05)
    if any(b"daemon" in open(f"/proc/{p}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit()):
        print("daemon running", flush=True)
        break
if sys.argv[2] == "killed":
    time.sleep(60)
"""
    limits = Limits(wall_s=20 if ending == "ends" else 3, cpu_s=2, memory_bytes=256 << 20, processes=4)
    outcome = run_directory(_program(tmp_path / "daemon", body), "escape.py", limits, args=[marker, ending])
    assert outcome.output == "daemon running", outcome
    assert (outcome.passed, outcome.verdict) == ((True, "passed") if ending == "ends" else (False, "wall-clock limit"))
    assert _processes_naming(marker) == []
    time.sleep(0.5)
    assert _processes_naming(marker) == []


def test_by_default_it_starts_no_process_even_past_the_audit_hook(tmp_path):
    for body in ("import os\nos.fork()", "import subprocess\nsubprocess.run(['/usr/bin/true'])"):
        outcome = run_directory(_program(tmp_path / "fork", body), "escape.py", FAST)
        assert (outcome.passed, outcome.verdict) == (False, "BlockingIOError"), (body, outcome)


# -- the file system ------------------------------------------------------------------------------------------------

VISIBLE = os.path.realpath(sys.prefix)  # the virtual environment: in the sandbox, read-only


@pytest.mark.parametrize(
    "body",
    [
        "import os\nfd = os.open(OUTSIDE, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open(NAME, os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "import os\nfd = os.open(VISIBLE, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open(NAME, os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "import os\nfd = os.open('/', os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.close(os.open(NAME, os.O_CREAT | os.O_WRONLY, dir_fd=fd))",
        "import sqlite3\nsqlite3.connect(OUTSIDE + '/' + NAME).execute('create table t (x)')",
        "import sqlite3\nsqlite3.connect(VISIBLE + '/' + NAME).execute('create table t (x)')",
        "import os\nos.close(os.open(OUTSIDE + '/' + NAME, os.O_CREAT | os.O_WRONLY))",
        "import os\nos.close(os.open(VISIBLE + '/' + NAME, os.O_CREAT | os.O_WRONLY))",
        "import os\nos.symlink(OUTSIDE + '/' + NAME, 'link')\nopen('link', 'w').write('escaped')",
        "import os\nos.symlink(VISIBLE + '/' + NAME, 'link')\nopen('link', 'w').write('escaped')",
        "import os\nopen('here', 'w').write('escaped')\nos.rename('here', VISIBLE + '/' + NAME)",
    ],
    ids=[
        "dir_fd-outside",
        "dir_fd-read-only",
        "dir_fd-root",
        "sqlite3-outside",
        "sqlite3-read-only",
        "os.open-outside",
        "os.open-read-only",
        "symlink-outside",
        "symlink-read-only",
        "rename-read-only",
    ],
)
def test_it_cannot_write_outside_its_scratch_directory(tmp_path, body):
    outside = tmp_path / "outside"
    outside.mkdir()
    name = f"escaped-{secrets.token_hex(6)}"
    paths = f"OUTSIDE, VISIBLE, NAME = {str(outside)!r}, {VISIBLE!r}, {name!r}\n"
    try:
        outcome = run_directory(_program(tmp_path / "writer", paths + body), "escape.py", FAST)
        assert not outcome.passed
        # The kernel's answers (not mounted; a read-only mount), not the audit hook's PermissionError.
        assert outcome.verdict in ("FileNotFoundError", "OSError", "OperationalError"), outcome
        kernel = ("Read-only file system", "No such file", "cross-device", "unable to open", "readonly database")
        assert any(reason in outcome.detail for reason in kernel), outcome.detail
    finally:
        escaped = [p for p in (outside / name, Path(VISIBLE) / name) if p.exists()]
        for path in escaped:
            path.unlink()
    assert escaped == []
    assert list(outside.iterdir()) == []


def test_it_cannot_read_a_file_outside(tmp_path):
    state = tmp_path / "state.json"  # stands for the gateway's state file
    state.write_text('{"secret": "the gateway\'s"}')
    state.chmod(0o644)
    targets = [str(state), f"/proc/{os.getpid()}/root{state}", str(Path(__file__).resolve()), "/etc/passwd"]
    body = f"""
read = []
for path in {targets!r}:
    try:
        read.append((path, open(path).read()[:20]))
    except FileNotFoundError:
        pass
if not read:
    raise Contained("none of them exists here")
print(read)
"""
    outcome = run_directory(_program(tmp_path / "reader", body), "escape.py", FAST)
    assert (outcome.passed, outcome.verdict) == (False, "Contained"), outcome


# -- the network ----------------------------------------------------------------------------------------------------


def _host_address() -> str | None:
    """This machine's address on its default route, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            return probe.getsockname()[0]
        except OSError:
            return None


@pytest.fixture
def listeners():
    """A TCP listener on loopback (and on the host's own address where it has one) and one on an abstract Unix
    socket; yields their addresses, then asserts that nothing ever connected to them."""
    servers, targets = [], []
    for host in ["127.0.0.1", _host_address()]:
        if host:
            server = socket.create_server((host, 0))
            servers.append(server)
            targets.append(("inet", (host, server.getsockname()[1])))
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0tandem-sandbox-test-{secrets.token_hex(6)}")
    abstract.listen()
    servers.append(abstract)
    targets.append(("unix", abstract.getsockname().decode()))
    try:
        yield targets
        for server in servers:
            server.settimeout(0.2)
            with pytest.raises(TimeoutError):
                server.accept()  # nothing ever connected
    finally:
        for server in servers:
            server.close()


CONNECT = """
import socket
def connected(targets):
    reached = []
    for family, address in targets:
        s = socket.socket(socket.AF_INET if family == "inet" else socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(tuple(address) if family == "inet" else address)
            reached.append(address)
        except OSError:
            pass
        s.close()
    return reached
"""


def test_it_cannot_open_a_socket_to_the_hosts_loopback(tmp_path, listeners):
    body = CONNECT + f"reached = connected({listeners!r})\nif not reached:\n    raise Contained('no connection')\n"
    outcome = run_directory(_program(tmp_path / "client", body), "escape.py", FAST)
    assert (outcome.passed, outcome.verdict) == (False, "Contained"), outcome


def test_it_cannot_leave_its_network_namespace(tmp_path, listeners):
    host_netns = os.stat("/proc/self/ns/net").st_ino
    body = (
        CONNECT
        + f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
candidates = ["/proc/{os.getpid()}/ns/net", "/proc/1/ns/net", "/run/netns/default", "/var/run/netns/default"]
def join_any():
    for path in candidates + [f"/proc/{{p}}/ns/net" for p in os.listdir("/proc") if p.isdigit()]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        libc.setns(fd, CLONE_NEWNET)
        os.close(fd)
def escaped():
    return os.stat("/proc/self/ns/net").st_ino == {host_netns} or connected({listeners!r})
routes = [
    lambda: None,
    join_any,
    lambda: libc.unshare(CLONE_NEWNET),
    lambda: libc.unshare(CLONE_NEWUSER | CLONE_NEWNET),  # capabilities in a namespace of its own, where allowed
    join_any,
]
for route in routes:
    route()
    if escaped():
        break
else:
    raise Contained("in a network namespace of its own all along")
"""
    )
    outcome = run_directory(_program(tmp_path / "netns", body), "escape.py", FAST)
    assert (outcome.passed, outcome.verdict) == (False, "Contained"), outcome


# -- other processes ------------------------------------------------------------------------------------------------


def test_it_cannot_ptrace_or_signal_a_process_outside(tmp_path):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        body = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_ATTACH, PTRACE_SEIZE = 16, 0x4206
got = []
for request in (PTRACE_ATTACH, PTRACE_SEIZE):
    if libc.ptrace(request, {victim.pid}, None, None) == 0:
        got.append(request)
for how in (lambda: os.kill({victim.pid}, signal.SIGSTOP), lambda: open("/proc/{victim.pid}/mem", "rb").read(1)):
    try:
        how()
        got.append(how)
    except OSError:
        pass
if not got:
    raise Contained("no such process here")
"""
        outcome = run_directory(_program(tmp_path / "tracer", body), "escape.py", FAST)
        assert (outcome.passed, outcome.verdict) == (False, "Contained"), outcome
        lines = Path(f"/proc/{victim.pid}/status").read_text().splitlines()
        status = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        assert victim.poll() is None
        assert status["State"].split()[0] == "S" and status["TracerPid"].strip() == "0", status
    finally:
        victim.kill()
        victim.wait()


# -- a directory of files -------------------------------------------------------------------------------------------


def test_a_directory_runs_on_a_copy_with_its_arguments(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's")
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    (work / "pkg" / "__init__.py").write_text("def answer():\n    return 42\n")
    (work / "link").symlink_to(secret)  # a link the caller's tree holds: copied as a link, resolved inside
    (work / "test_pkg.py").write_text(
        "import os, sys\nfrom pkg import answer\nassert answer() == 42\nassert sys.argv[1:] == ['-v', 'x y']\n"
        "assert not os.path.exists('link')  # its target is not in the sandbox\n"
        "open('written.txt', 'w').write('mine')\nos.remove('pkg/__init__.py')\nprint('ran', os.getcwd())\n"
    )
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    outcome = run_directory(work, "test_pkg.py", FAST, args=["-v", "x y"])
    assert (outcome.passed, outcome.output) == (True, "ran /scratch"), outcome
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # the caller's tree is untouched
    failing = run_directory(work, "test_pkg.py", FAST)
    assert (failing.passed, failing.verdict) == (False, "AssertionError")
    with pytest.raises(FileNotFoundError, match="no script"):
        run_directory(work, "missing.py", FAST)
