"""deploy/cpu_features.py: a native llama.cpp build leaves out AMX where the CPU advertises it and cannot run it."""

from __future__ import annotations

import shlex

from deploy import cpu_features

AMX_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8\n"
PLAIN_CPU = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def test_amx_is_read_from_the_cpu_flags():
    assert cpu_features.amx_advertised(AMX_CPU)
    assert not cpu_features.amx_advertised(PLAIN_CPU)
    assert not cpu_features.amx_advertised("model name\t: amx_tile in a name is not a flag\n")


def test_a_machine_that_cannot_run_amx_builds_without_it(monkeypatch):
    monkeypatch.setattr(cpu_features, "amx_crashes", lambda: True)
    args = cpu_features.llama_cmake_args()
    assert args == [f"-DCMAKE_C_FLAGS={cpu_features.NO_AMX}", f"-DCMAKE_CXX_FLAGS={cpu_features.NO_AMX}"]
    # The Makefile passes them through CMAKE_ARGS, which scikit-build-core splits with shlex.
    assert shlex.split(shlex.join(args)) == args


def test_a_machine_that_runs_amx_or_lacks_it_builds_natively(monkeypatch):
    monkeypatch.setattr(cpu_features, "amx_crashes", lambda: False)
    assert cpu_features.llama_cmake_args() == []


def test_the_installed_package_runs_on_this_machine():
    """What the set-up guarantees (the Makefile rebuilds a cached wheel that fails this): the installed ggml has no
    AMX compiled in where this CPU cannot run it."""
    assert not (cpu_features.amx_crashes() and cpu_features.installed_llama_has_amx())
