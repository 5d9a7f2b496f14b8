"""CB: the extension loaded twice in one process, and a reload of the module that loads it.

The compiled extension defines the ``flash_attn_hopper`` op namespace with TORCH_LIBRARY, which PyTorch allows once per
process: a second copy of the file (a vendored copy, a source tree with a build beside an installed wheel, two versions
side by side) aborted the interpreter with SIGABRT from C++ ("Only a single TORCH_LIBRARY can be used to register the
namespace flash_attn_hopper"), which no try/except catches (xformers#1348, huggingface/kernel-builder#11,
metatensor#871, vllm-ascend#1239). ``importlib.reload`` of ``flash_attn_hopper._ops`` (Jupyter's ``%autoreload``)
raised "register_fake(...): the operator flash_attn_hopper::fwd already has an fake impl registered" (pytorch#125183).

Each case runs in a fresh interpreter (the fault kills it) with the package found beside this checkout's import of it;
they need the compiled extension and skip without it. No GPU: the calls run on the CPU stand-ins of
tests/cpu_stand_ins.py."""

import os
import shutil
import subprocess
import sys

import pytest

import flash_attn_hopper
from flash_attn_hopper import _ops

pytestmark = pytest.mark.skipif(
    not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it; see README)"
)

PKG_DIR = os.path.dirname(os.path.abspath(flash_attn_hopper.__file__))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _run(script, *paths):
    """Runs `script` in a fresh interpreter with `paths` and the package's parent directory first on sys.path."""
    path = os.pathsep.join([*paths, os.path.dirname(PKG_DIR), TESTS_DIR, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=path), cwd=TESTS_DIR)
    assert r.returncode == 0, f"exit status {r.returncode} (-6: SIGABRT)\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _copy_package(tmp_path, name, with_library=True):
    """A copy of the package under another name (as a project vendors it), with or without the compiled file."""
    ignore = shutil.ignore_patterns("__pycache__", *(() if with_library else ("_C*.so",)))
    shutil.copytree(PKG_DIR, tmp_path / name, ignore=ignore)
    return str(tmp_path)


_TWO_COPIES = """
import importlib, os
first, second = (importlib.import_module(name) for name in {order!r})
assert first.EXTENSION_LOADED, first._ops._load_error
assert not second.EXTENSION_LOADED
try:
    second.build_config()
except RuntimeError as e:
    message = str(e)
else:
    raise AssertionError("the second copy's build_config() did not raise")
for path in (os.path.realpath(first._ops.LIBRARY_PATH), second._ops._LIB_DIR):
    assert path in message, (path, message)
assert "one copy per process" in message, message
assert first.build_config()["head_dims"]  # the first copy's ops still run
print("refused:", message)
"""


@pytest.mark.parametrize("order", [("flash_attn_hopper", "fah_vendored"), ("fah_vendored", "flash_attn_hopper")],
                         ids=["installed_first", "vendored_first"])
def test_second_copy_is_refused_with_both_paths(tmp_path, order):
    """xformers#1348 (a vendored and an installed FlashAttention 3 in one process, either import order) and
    kernel-builder#11 / metatensor#871 / vllm-ascend#1239 (the uncaught c10::Error of a second TORCH_LIBRARY, exit 134):
    a copy of the package (its .py files and its .so) under another name, imported after the original or before it.
    The second import loads nothing: EXTENSION_LOADED is False there and build_config() (like attention, through
    require_extension) raises a RuntimeError naming both files and the remedy; the interpreter lives on (exit 0) and
    the first copy's ops still run."""
    root = _copy_package(tmp_path, "fah_vendored")
    out = _run(_TWO_COPIES.format(order=order), root)
    assert "refused:" in out


def test_same_file_through_a_link_is_reused(tmp_path):
    """The package reached through a second name whose directory is a link to it (the same .so file): nothing is
    loaded again, the ops are reused (EXTENSION_LOADED is True in both) and the second module's fake kernels replace
    the first's without an error; a meta call runs them."""
    os.symlink(PKG_DIR, tmp_path / "fah_link", target_is_directory=True)
    out = _run("""
import torch
import flash_attn_hopper, fah_link
assert fah_link.EXTENSION_LOADED, fah_link._ops._load_error
assert fah_link._ops.LIBRARY_PATH != flash_attn_hopper._ops.LIBRARY_PATH  # reached through the link
assert fah_link.build_config() == flash_attn_hopper.build_config()
q = torch.empty(2, 40, 4, 64, device="meta", dtype=torch.bfloat16)
out, lse = torch.ops.flash_attn_hopper.fwd(q, q, q, 0.125, True, -1, 0, 0.0, False)
assert out.shape == (2, 40, 4, 64) and lse.shape == (2, 4, 40), (out.shape, lse.shape)
print("reused")
""", str(tmp_path))
    assert "reused" in out


def test_namespace_probe_loads_nothing(tmp_path):
    """The check that runs before the load is a registry lookup: in a copy without the .so, it finds no op, loads no
    file and registers nothing (the real package then loads normally), and it sees the ops once they are loaded."""
    root = _copy_package(tmp_path, "fah_noext", with_library=False)
    out = _run("""
import torch
import fah_noext
assert not fah_noext.EXTENSION_LOADED and "not built" in fah_noext._ops._load_error
assert not fah_noext._ops._namespace_defined()
assert not torch.ops.loaded_libraries, torch.ops.loaded_libraries
with open("/proc/self/maps") as maps:
    assert "_C.abi3" not in maps.read()
import flash_attn_hopper
assert flash_attn_hopper.EXTENSION_LOADED, flash_attn_hopper._ops._load_error
assert fah_noext._ops._namespace_defined()
print("probed")
""", root)
    assert "probed" in out


def test_missing_extension_raises_runtime_error(tmp_path):
    """A copy of the package without the compiled file (as a checkout before its build): attention and build_config
    raise the RuntimeError that names the missing extension, once the device checks are passed by stand-ins so that
    the call gets as far as the extension. In a fresh interpreter, so it runs wherever the real package is built
    (before, the test skipped wherever the extension was loaded: in CI and on the GPU machine)."""
    root = _copy_package(tmp_path, "fah_noext", with_library=False)
    out = _run("""
import re, torch
import fah_noext
from fah_noext import interface
assert not fah_noext.EXTENSION_LOADED
interface._check_devices = lambda named: None
interface._check_sm90 = lambda name, device: None
q, k, v = (torch.randn(2, 37, 4, 64).to(torch.float16) for _ in range(3))
for name, call in (("attention", lambda: fah_noext.attention(q, k, v)), ("build_config", fah_noext.build_config)):
    try:
        call()
    except RuntimeError as e:
        assert re.search("flash_attn_hopper CUDA extension (is not built|could not be loaded)", str(e)), (name, str(e))
    else:
        raise AssertionError(name + " did not raise")
print("raised")
""", root)
    assert "raised" in out


_RELOAD = """
import importlib
import pytest, torch
from flash_attn_hopper import _ops, interface
from cpu_stand_ins import stand_ins

def step():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 40, h, 64).bfloat16().requires_grad_() for h in (4, 2, 2))
    with pytest.MonkeyPatch.context() as mp, stand_ins(mp):
        out, lse = interface.attention(q, k, v, causal=True, return_lse=True)
        (out.float().square().sum() + lse.sum()).backward()
        compiled = torch.compile(lambda q, k, v: interface.attention(q, k, v, causal=True), backend="aot_eager",
                                 fullgraph=True)
        torch._dynamo.reset()
        out_compiled = compiled(q.detach(), k.detach(), v.detach())
    meta = torch.ops.flash_attn_hopper.fwd(q.to("meta"), k.to("meta"), v.to("meta"), 0.125, True, -1, 0, 0.0, False)
    assert [t.shape for t in meta] == [out.shape, lse.shape]
    return [out, lse, out_compiled, q.grad, k.grad, v.grad]

before = step()
for _ in range(2):
    importlib.reload(_ops)
    importlib.reload(interface)
    assert _ops.EXTENSION_LOADED, _ops._load_error
after = step()
for a, b in zip(before, after):
    assert torch.equal(a, b)
print("reloaded")
"""


def test_module_reload_keeps_working():
    """pytorch#125183 (registrations at import make a module non-reloadable) and pytorch#150806 (allow_override):
    Jupyter's %autoreload runs importlib.reload on changed modules. Twice, _ops and interface are reloaded; before
    and after, a GQA causal call through the CPU stand-ins (out, LSE and the gradients through the C++ autograd node),
    a torch.compile'd call (aot_eager, fullgraph: the fake kernels) and a meta call give the same results."""
    assert "reloaded" in _run(_RELOAD)
