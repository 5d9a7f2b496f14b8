"""The built extension shares torch's C++ runtime: libstdc++ is a shared-library dependency, and the .so holds no
private copy of it. A private copy (a compiler driver that links libstdc++ statically; the H200 image's g++ wrapper
did, session 6) made the process die with SIGSEGV at the first C++ error message with a number in it (iostreams of
the copy, locale of the shared library). tests/test_tile_choice_cpu.py::test_bad_arguments_raise is the behavioural
check; this one reads the binary, so it fails on such a build even where nothing raises."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import flash_attn_hopper
from flash_attn_hopper import _ops

pytestmark = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not on PATH: cannot read the extension's ELF tables")
    return path


def test_libstdcxx_is_a_shared_dependency():
    out = subprocess.run([_tool("readelf"), "-d", _ops.LIBRARY_PATH], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert any(n.startswith("libstdc++.so") for n in needed), f"{_ops.LIBRARY_PATH} NEEDED: {needed}"


def test_no_private_copy_of_libstdcxx():
    # Defined (not undefined) iostream/locale internals mean a static copy was linked in. The full symbol table is gone
    # from a stripped .so, the dynamic one is not (a static copy exports these there too), so both are read.
    nm = _tool("nm")
    private = []
    for table in ([], ["-D"]):
        out = subprocess.run([nm, *table, "-C", "--defined-only", _ops.LIBRARY_PATH], capture_output=True, text=True,
                             check=True).stdout
        if table:
            assert out.strip(), f"nm -D read no dynamic symbols from {_ops.LIBRARY_PATH}"
        private += [line for line in out.splitlines()
                    if line.endswith(("std::locale::classic()", "std::ios_base::Init::Init()"))]
    assert not private, f"{_ops.LIBRARY_PATH} defines libstdc++ internals: {private}"


def test_cxx_error_with_numbers_raises():
    # The crash's path (c10::str formatting integers), in a child process so that a crash fails this test instead of
    # ending the test run. The child imports the package this process tested.
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(flash_attn_hopper.__file__)))
    code = (f"import sys; sys.path.insert(0, {package_root!r})\n"
            "import torch, flash_attn_hopper\n"
            "try:\n"
            "    torch.ops.flash_attn_hopper.fwd_block_m(64, 64, 1, 1, 128, 128, False, -1, -1, 0)\n"
            "except RuntimeError as e:\n"
            "    print('raised:', str(e).splitlines()[0])\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=tempfile.gettempdir())
    assert child.returncode == 0, f"the child died (exit {child.returncode}): {child.stderr[-2000:]}"
    assert "raised: fwd_block_m: num_sms must be in [1, 65535], got 0" in child.stdout, child.stdout + child.stderr
