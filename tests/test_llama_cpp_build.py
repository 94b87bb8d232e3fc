"""The llama.cpp build the engine runs on: the wheel's flags (scripts/llama_cpp_build.sh)."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.ggml_rpc_lib import lib_dir

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
HEADER = SCRIPTS / "ggml_cpu_tables_hidden.h"


def _key(scripts: Path, cmake_args: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LCP_CMAKE_ARGS"}
    if cmake_args is not None:
        env["LCP_CMAKE_ARGS"] = cmake_args
    done = subprocess.run(["bash", "-c", f'. "{scripts}/llama_cpp_build.sh"; printf %s "$KEY"'],
                          capture_output=True, text=True, env=env, timeout=30, check=True)
    return done.stdout


def test_ggml_cpus_conversion_tables_are_internal_to_its_library():
    """scripts/ggml_cpu_tables_hidden.h was forced into the installed wheel's build: its tables are
    not exported by libggml-cpu (a build without it exports all three), its API still is."""
    hidden = re.findall(r"extern float (\w+)\[", HEADER.read_text())
    assert len(hidden) == 3
    cpu = ctypes.CDLL(os.path.join(lib_dir(), "libggml-cpu.so"))
    for name in hidden:
        with pytest.raises(AttributeError):
            getattr(cpu, name)
    assert cpu.ggml_backend_cpu_init


def test_the_installed_build_is_the_one_the_scripts_build():
    """The environment's marker (scripts/install_llama_cpp.sh) names the key the scripts compute
    today for the args it was built with: a wheel from before a change of the build's flags or of
    the forced header would have another."""
    marker = Path(sys.prefix) / ".llama-cpp-build"
    if not marker.is_file():
        pytest.skip("llama-cpp-python was not installed by scripts/install_llama_cpp.sh")
    key, args = (marker.read_text().splitlines() + ["", ""])[:2]
    assert _key(SCRIPTS, args) == key


def test_the_forced_headers_content_is_in_the_key_and_its_path_is_not(tmp_path):
    """Two clones in two places share one cached wheel; an edited header builds another."""
    here = _key(SCRIPTS, "-DGGML_RPC=ON")
    copy = tmp_path / "elsewhere" / "scripts"
    copy.mkdir(parents=True)
    for path in (SCRIPTS / "llama_cpp_build.sh", HEADER):
        shutil.copy(path, copy / path.name)
    assert _key(copy, "-DGGML_RPC=ON") == here
    with (copy / HEADER.name).open("a") as header:
        header.write("/* edited */\n")
    assert _key(copy, "-DGGML_RPC=ON") != here
