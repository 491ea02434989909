"""What this machine's CPU can actually run, for llama.cpp's native builds.

llama-cpp-python and llama-server are built with GGML_NATIVE (`-march=native`): every instruction set the CPU
advertises. A virtual machine can advertise one it cannot execute. Seen on the project's own machines: a CPU
listing AMX (`amx_tile`, `amx_int8` in /proc/cpuinfo) whose hypervisor faults on the first tile instruction, even
after the kernel granted the tile state (ARCH_REQ_XCOMP_PERM). ggml's AMX path (an "extra buffer type" it repacks
Q4/Q8 weights into) then kills every process on its first matrix product: every gateway died right after loading
its device model.

So before building, a tiny program tries what ggml's AMX init and kernels do first (request the tile state, load
a tile configuration, zero a tile) in a child process. When the CPU advertises AMX and that program dies, the build
is told not to use AMX (`-mno-amx-*`: ggml compiles its AMX path only under `__AMX_INT8__`), and keeps everything
else native (AVX-512, VNNI and the other repacked kernels). A CPU that runs AMX keeps it.

Usage (the Makefile):
    python -m deploy.cpu_features cmake-args     the CMake arguments to add, shell-quoted (often nothing)
    python -m deploy.cpu_features check-llama    exit 1 when the installed llama-cpp-python has AMX compiled in
                                                 and this machine cannot run it (a wheel cached by an older set-up)
Standard library only, like the rest of deploy/.
"""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_PROBE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
struct tile_config { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 2;
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = 16;
    cfg.colsb[0] = 64;
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
"""
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def amx_advertised(cpuinfo: str | None = None) -> bool:
    """Whether the CPU lists AMX's tile instructions (what -march=native would compile for)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and "amx_tile" in line.split() for line in cpuinfo.splitlines())


@functools.cache
def amx_crashes() -> bool:
    """True when the CPU advertises AMX and a program using it dies by a signal here. False when it runs, when the
    kernel refuses the tile state (ggml then leaves AMX alone by itself), or when no compiler can build the probe
    (then -march=native cannot emit AMX either)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if not amx_advertised() or compiler is None:
        return False
    with tempfile.TemporaryDirectory(prefix="tandem-amx-probe-") as tmp:
        source, binary = Path(tmp) / "probe.c", Path(tmp) / "probe"
        source.write_text(_PROBE)
        built = subprocess.run([compiler, "-O1", "-mamx-tile", str(source), "-o", str(binary)], capture_output=True)
        if built.returncode != 0:
            return False
        return subprocess.run([str(binary)], capture_output=True).returncode < 0  # killed by a signal


def llama_cmake_args() -> list[str]:
    """CMake arguments for a native llama.cpp build on this machine."""
    if not amx_crashes():
        return []
    return [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def installed_llama_has_amx() -> bool:
    """Whether the installed llama-cpp-python's ggml was compiled with AMX (its system info, read without loading a
    model)."""
    import llama_cpp  # the venv's; imported here only

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()


def main(argv: list[str] | None = None) -> int:
    command = (argv if argv is not None else sys.argv[1:])[:1]
    if command == ["cmake-args"]:
        print(shlex.join(llama_cmake_args()))
        return 0
    if command == ["check-llama"]:
        if amx_crashes() and installed_llama_has_amx():
            print("the installed llama-cpp-python uses AMX, which this CPU advertises but cannot run", file=sys.stderr)
            return 1
        return 0
    print("usage: python -m deploy.cpu_features cmake-args | check-llama", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
