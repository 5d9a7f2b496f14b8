"""Seventeenth round of the bug hunt (tests/bug_report_sources.md, "Seventeenth round"): CPU tests.

DS: `assert` statements vanish under `python -O` / PYTHONOPTIMIZE. flash_attn_hopper.testing.assert_close_by_rule (the
rule of DESIGN.md §3, the check of nearly every GPU correctness test) and the checks of tests/gpu_helpers.py were bare
asserts, and pytest rewrites the asserts of test modules only: under -O every such check passed whatever the kernels
returned (google/flax#5514, google/flax#5505: attention shape checks stripped under -O; ROCm/aiter#4147). Fixed: they
raise AssertionError explicitly.
DT: `python -OO` strips docstrings (``__doc__`` None): libraries that format or concatenate docstrings at import failed
there (pytorch/audio#3884, huggingface/transformers#36045, pytorch/pytorch#15281). No fault: the import, the ops' help
texts (plain strings) and the checks work.
DU: process-wide state changed by an import (NVIDIA/TransformerEngine#812: `warnings.simplefilter("default")` at
import). No fault: importing the library (and its transformers integration, and register()) changes no warning
filter, torch flag, default dtype / device, grad mode or logging setup; the one addition is the documented
sys.meta_path entry that registers the FLOP formulas when torch.utils.flop_counter is imported (class DC).
DV: a softmax_scale / softcap computed from symbolic sizes under torch.compile(dynamic=True) (`q.shape[-1] ** -0.5`: a
SymFloat; pytorch/pytorch#194444, #191203: such a scale reached an op's float argument as a tensor and crashed). No
fault: the compiled call equals the eager one, bit for bit, for two sequence lengths.
DW: TorchScript (Dao-AILab/flash-attention#431: a module calling flash attention could not be scripted, saved and
loaded). The ops (TORCH_LIBRARY schemas) script, save and load; ``attention`` itself is Python that TorchScript does
not compile (and torch.jit.script is deprecated in favour of torch.compile / torch.export, classes AS, BP).
DX: torch.set_default_dtype (tinygrad/tinygrad#5100: attention's output dtype followed the default float;
pytorch/pytorch#161936). The ops' outputs do not depend on it (bits and dtypes equal for every default), but the
public varlen reference flash_attn_hopper.testing.attention_varlen_ref made its LSE rows outside the sequences in the
default dtype, so its LSE became float64 under a float64 default (and so did the CPU stand-ins'). Fixed: float32.
DZ: numpy scalar arguments under torch.compile (pytorch/pytorch#141343: a np.float64 became a numpy array inside
compiled code; hexgrad/kokoro#91: a numpy value turned into a fake tensor broke an op's argument under compile;
pytorch/pytorch#123470). Eager calls take numpy scalars (np.float32 / np.float64 scale, np.int64 window side or
max_seqlen, np.bool_ causal); with fullgraph=True the same call was refused, "got ndarray", naming neither numpy nor
torch.compile, because dynamo traces a numpy scalar as a 0-d array whose value the trace does not have. Fixed: an
integer numpy max_seqlen works under torch.compile as in eager (the op takes SymInt); the other arguments, which the op
takes as plain float / int / bool, are refused saying why and what to pass.
EA: window_size None or (None, None) (FlashAttention-4's convention for "unbounded"; meta-pytorch/MSLK#397: a bare
"'NoneType' object is not subscriptable") and softcap None (transformers' convention): a TypeError naming the argument
now also says which value means unbounded / off (DESIGN.md §2: the accepted values).

The ops run through the CPU stand-ins of tests/cpu_stand_ins.py where a test calls them.
"""

import ast
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, testing

from gpu_helpers import ambient_defaults

np = pytest.importorskip("numpy")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _run_python(flags, script, timeout=240):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONOPTIMIZE", None)
    r = subprocess.run([sys.executable, *flags, "-c", script], capture_output=True, text=True, env=env, timeout=timeout,
                       cwd=str(TESTS))
    assert r.returncode == 0, f"python {' '.join(flags)}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _dense(dtype=torch.bfloat16, seqlen=17):
    torch.manual_seed(0)
    q = torch.randn(2, seqlen, 4, 64, dtype=dtype)
    k = torch.randn(2, seqlen, 2, 64, dtype=dtype)
    return q, k, torch.randn_like(k)


# ------------------------------------------------------------------------------------------------- DS, DT

_OPTIMIZED_SCRIPT = r"""
import sys
import torch
import flash_attn_hopper
from flash_attn_hopper.testing import assert_close_by_rule
import gpu_helpers

assert sys.flags.optimize >= 1 and __debug__ is False or True  # (this line itself is stripped under -O)
print("optimize", sys.flags.optimize)
ref = torch.ones(4, 4)
for name, out in (("error 100", ref + 100.0), ("NaN", ref.masked_fill(torch.eye(4, dtype=torch.bool), float("nan"))),
                  ("shape", torch.ones(4, 5))):
    try:
        assert_close_by_rule(out, ref, ref + 1e-3, name)
        print("ACCEPTED", name)
    except AssertionError as e:
        print("refused", name, e)
assert_close_by_rule(ref + 1e-3, ref, ref + 1e-3, "right answer")  # the rule still accepts a right answer
leaves = {n: torch.zeros(3, requires_grad=True) for n in "qkv"}
leaves["q"].grad = torch.ones(3)
try:
    gpu_helpers.check_grads_where_required(leaves, "", None, None, torch.float32, "helper")
    print("ACCEPTED helper")
except AssertionError as e:
    print("refused helper", e)
if flash_attn_hopper.EXTENSION_LOADED:
    assert torch.ops.flash_attn_hopper.fwd.__doc__.startswith("fwd("), "op help text lost"
q = torch.randn(1, 3, 2, 64)
try:
    flash_attn_hopper.attention(q, q, q)
    print("ACCEPTED float32")
except TypeError as e:
    print("refused float32", e)
print("done")
"""


@pytest.mark.parametrize("flag", ["-O", "-OO"])
def test_checks_hold_under_python_optimize(flag):
    """DS, DT: under -O (asserts stripped) and -OO (docstrings stripped too) the rule helper and the GPU tests' helpers
    still refuse a wrong answer, a NaN and a wrong shape (and accept a right one), the import and the ops' help texts
    work, and a float32 input is still refused by name. Before the fix the rule helper and gpu_helpers accepted
    everything under both flags."""
    out = _run_python([flag], _OPTIMIZED_SCRIPT)
    assert f"optimize {len(flag) - 1}" in out and "done" in out, out
    assert "ACCEPTED" not in out, out
    for what in ("error 100", "NaN", "shape", "helper"):
        assert f"refused {what}" in out, out
    assert "refused float32 q has dtype torch.float32" in out, out


def _assert_statements(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]


def test_no_assert_statements_outside_test_modules():
    """DS: the package and the tests' helper modules (what pytest does not rewrite: every module of tests/ but
    test_*.py and conftest.py) check with explicit raises, which -O keeps. Before the fix testing.py held 5 asserts and
    gpu_helpers.py 16."""
    paths = sorted((ROOT / "flash_attn_hopper").rglob("*.py"))
    paths += [p for p in sorted(TESTS.glob("*.py")) if not p.name.startswith("test_") and p.name != "conftest.py"]
    assert any(p.name == "gpu_helpers.py" for p in paths) and any(p.name == "testing.py" for p in paths)
    found = {str(p.relative_to(ROOT)): lines for p in paths if (lines := _assert_statements(p))}
    assert not found, f"assert statements (stripped under python -O) in {found}"


# ------------------------------------------------------------------------------------------------------ DU

_SIDE_EFFECTS_SCRIPT = r"""
import logging, sys, warnings
import torch
first = sys.argv[1]
if first == "transformers":
    import transformers  # (its own import sets warning filters; not the library's doing)
    import flash_attn_hopper

def state():
    return {
        "warnings.filters": list(warnings.filters), "showwarning": warnings.showwarning,
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision()),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
                          torch.backends.cudnn.benchmark),
        "sdp": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()),
        "default dtype": torch.get_default_dtype(), "default device": torch.get_default_device(),
        "grad mode": torch.is_grad_enabled(), "threads": torch.get_num_threads(),
        "logging": (logging.root.level, list(logging.root.handlers), logging.getLogger("torch").level),
        "excepthook": sys.excepthook, "path": list(sys.path), "path_hooks": list(sys.path_hooks),
        "meta_path": list(sys.meta_path),
    }

calls = []  # (calling module, function, arguments) of every change to the warning filters from here on
for fname in ("filterwarnings", "simplefilter", "resetwarnings"):
    def recorder(*args, _f=getattr(warnings, fname), _name=fname, **kwargs):
        calls.append((sys._getframe(1).f_globals.get("__name__", "?"), _name, args, kwargs))
        return _f(*args, **kwargs)
    setattr(warnings, fname, recorder)

before = state()
if first == "library":
    import flash_attn_hopper
else:
    import flash_attn_hopper.integrations.transformers as integration
    integration.register()
after = state()
for key in before:
    if key == "meta_path":
        added = [f for f in after[key] if f not in before[key]]
        assert [f for f in before[key] if f not in after[key]] == [], "a finder was removed"
        names = [type(f).__module__ + "." + type(f).__name__ for f in added]
        print("meta_path added", names)
    elif key == "warnings.filters" and first == "transformers":
        pass  # transformers imports more of itself (and scipy, sympy), which add their own filters: see `calls`
    elif before[key] != after[key]:
        print("CHANGED", key, before[key], "->", after[key])
for call in calls:
    if call[0].startswith("flash_attn_hopper"):
        print("CHANGED warnings by", call)
print("extension loaded", sys.modules["flash_attn_hopper._ops"].EXTENSION_LOADED)
print("done")
"""


@pytest.mark.parametrize("what", ["library", "transformers"])
def test_import_changes_no_process_wide_state(what):
    """DU: `import flash_attn_hopper` (in a fresh interpreter) and, after transformers' own import, importing the
    integration and register(), change no torch flag, default dtype / device, grad mode, logging setup, excepthook or
    import path, and no code of the library calls warnings.filterwarnings / simplefilter / resetwarnings (the library's
    import leaves the filters equal; transformers' own lazy imports add theirs); the library's import adds only its
    FLOP-formula finder to sys.meta_path."""
    if what == "transformers":
        pytest.importorskip("transformers")
    out = _run_python([], _SIDE_EFFECTS_SCRIPT.replace("sys.argv[1]", repr(what)))
    assert "done" in out and "CHANGED" not in out, out
    if what == "library":
        # The child's own build state: it imports the tree's package (PYTHONPATH), which may lack the extension where
        # this process runs an installed copy (CI).
        loaded = "extension loaded True" in out
        assert loaded or "extension loaded False" in out, out
        expected = "['flash_attn_hopper._ops._RegisterWhenImported']" if loaded else "[]"
        assert f"meta_path added {expected}" in out, out
    else:
        assert "meta_path added []" in out, out


# ------------------------------------------------------------------------------------------------------ DV

def test_scale_and_softcap_from_symbolic_sizes_under_dynamic_compile(cpu_ops):
    """DV: softmax_scale = q.shape[-1] ** -0.5 and softcap = q.shape[-1] / 4 (SymFloats under dynamic=True): the compiled
    call (fullgraph, two sequence lengths) gives the eager call's output and dq bit for bit."""
    def f(q, k, v):
        return attention(q, k, v, softmax_scale=q.shape[-1] ** -0.5, softcap=q.shape[-1] / 4, causal=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for seqlen in (17, 33):
        results = []
        for fn in (f, compiled):
            q, k, v = _dense(seqlen=seqlen)
            q.requires_grad_(True)
            out = fn(q, k, v)
            (dq,) = torch.autograd.grad(out.float().square().sum(), q)
            results.append((out.detach(), dq))
        assert all(torch.equal(a, b) for a, b in zip(*results)), f"seqlen {seqlen}: compiled != eager"


# ------------------------------------------------------------------------------------------------------ DW

class _ScriptedAttention(torch.nn.Module):
    def forward(self, q, k, v):
        out, lse = torch.ops.flash_attn_hopper.fwd(q, k, v, 0.125, True, -1, 0, 0.0, False, None)
        return out, lse


def test_ops_script_save_and_load(cpu_ops, tmp_path):
    """DW: a module calling the ops scripts, saves and loads (FlashAttention #431's failing steps); the loaded module
    gives attention's output and LSE bit for bit."""
    q, k, v = _dense()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (torch.jit.script is deprecated in torch 2.14)
        scripted = torch.jit.script(_ScriptedAttention())
        path = tmp_path / "attention.pt"
        scripted.save(str(path))
        loaded = torch.jit.load(str(path))
    out, lse = loaded(q, k, v)
    ref_out, ref_lse = attention(q, k, v, softmax_scale=0.125, causal=True, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


# ------------------------------------------------------------------------------------------------------ DX

@pytest.mark.parametrize("default", [torch.float64, torch.float16, torch.bfloat16], ids=["float64", "float16", "bfloat16"])
def test_results_do_not_depend_on_the_default_dtype(cpu_ops, default):
    """DX: under torch.set_default_dtype(default), attention (packed documents, causal) with its backward through out
    and LSE, and attention_varlen with rows past the last sequence give the bits and dtypes of the float32 default (out
    bf16, LSE float32)."""
    cu = torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    ids = torch.tensor([[0] * 5 + [1] * 12, [3] * 17])

    def run():
        q, k, v = _dense()
        q.requires_grad_(True)
        out, lse = attention(q, k, v, causal=True, return_lse=True, document_ids=ids)
        (dq,) = torch.autograd.grad(out.float().square().sum() + lse.sum(), q)
        torch.manual_seed(1)
        qv, kv = torch.randn(24, 4, 64, dtype=torch.bfloat16), torch.randn(24, 2, 64, dtype=torch.bfloat16)
        out_v, lse_v = attention_varlen(qv, kv, kv, cu, cu, 11, 11, return_lse=True)
        return out.detach(), lse.detach(), dq, out_v, lse_v

    expected = run()
    with ambient_defaults(dtype=default):
        got = run()
    for name, a, b in zip(("out", "lse", "dq", "varlen out", "varlen lse"), expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {b.dtype} under the {default} default"
    assert got[1].dtype == got[4].dtype == torch.float32


def test_varlen_reference_lse_is_float32_under_a_float64_default():
    """DX: the public reference's LSE is float32 whatever the default dtype (before the fix its rows outside the
    sequences, and so the whole LSE, were float64 under a float64 default)."""
    torch.manual_seed(0)
    q, k = torch.randn(24, 4, 64, dtype=torch.bfloat16), torch.randn(24, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([2, 5, 9, 20], dtype=torch.int32)
    with ambient_defaults(dtype=torch.float64):
        out, lse = testing.attention_varlen_ref(q, k, k, cu, cu)
    assert lse.dtype == torch.float32 and out.dtype == torch.float32, (out.dtype, lse.dtype)  # (the float32 reference)
    assert torch.isneginf(lse[:, :2]).all() and torch.isneginf(lse[:, 20:]).all() and torch.isfinite(lse[:, 2:20]).all()


# ------------------------------------------------------------------------------------------------------ DZ

def _root_messages(error):
    """The messages of an exception and of everything it was raised from."""
    messages, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        messages.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(messages)


def test_integer_numpy_max_seqlen_under_compile(cpu_ops):
    """DZ: attention_varlen with np.int64 / np.int32 max_seqlen (as eager takes them) under torch.compile(fullgraph):
    the compiled output equals the eager one, for two values. Before the fix: TypeError "must be a Python int, got
    ndarray" at trace time."""
    torch.manual_seed(0)
    qv, kv = torch.randn(24, 4, 64, dtype=torch.bfloat16), torch.randn(24, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 9, 20], dtype=torch.int32)

    def f(q, k, cu, max_seqlen):
        return attention_varlen(q, k, k, cu, cu, max_seqlen, max_seqlen, causal=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for value in (np.int64(11), np.int32(16)):
        assert torch.equal(compiled(qv, kv, cu, value), f(qv, kv, cu, value)), repr(value)


_NUMPY_ARGUMENTS = {
    "softmax_scale": (dict(softmax_scale=np.float32(0.125)), dict(softmax_scale=0.125), "float"),
    "softcap": (dict(softcap=np.float32(5.0)), dict(softcap=5.0), "float"),
    "window_size": (dict(window_size=(np.int64(4), 0)), dict(window_size=(4, 0)), "int"),
    "causal": (dict(causal=np.bool_(True)), dict(causal=True), "bool"),
    "deterministic": (dict(deterministic=np.bool_(True)), dict(deterministic=True), "bool"),
}


@pytest.mark.parametrize("name", list(_NUMPY_ARGUMENTS))
def test_numpy_scalar_arguments_under_compile_are_refused_saying_why(cpu_ops, name):
    """DZ: eager takes the numpy scalar (the Python number's bits: the control); under torch.compile(fullgraph) the
    refusal names the argument, numpy and torch.compile and says what to pass. Before the fix: "got ndarray"."""
    numpy_kwargs, python_kwargs, accepted = _NUMPY_ARGUMENTS[name]
    q, k, v = _dense()
    assert torch.equal(attention(q, k, v, **numpy_kwargs), attention(q, k, v, **python_kwargs))
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, **numpy_kwargs), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(q, k, v)
    text = _root_messages(info.value)
    wanted = "window_size left side" if name == "window_size" else name
    assert f"{wanted} is a numpy scalar" in text and "torch.compile" in text and f"Python {accepted}" in text, text


@pytest.mark.parametrize("how", ["argument", "constant"])
def test_numpy_float64_scale_under_compile(cpu_ops, how):
    """DZ: np.float64 (1 / np.sqrt(head_dim)), a Python float subclass, passed to the compiled function or captured by
    it: dynamo traces it as a numpy array like the others; eager takes it (the control), the compiled call is refused
    with the message above (before the fix: "got ndarray")."""
    q, k, v = _dense()
    scale = 1 / np.sqrt(64)
    assert isinstance(scale, float) and type(scale) is not float

    def given(q, k, v, s):
        return attention(q, k, v, softmax_scale=s)

    def captured(q, k, v):
        return attention(q, k, v, softmax_scale=scale)

    assert torch.equal(given(q, k, v, scale), attention(q, k, v, softmax_scale=0.125))
    with pytest.raises(Exception) as info:
        if how == "argument":
            torch.compile(given, backend="aot_eager", fullgraph=True)(q, k, v, scale)
        else:
            torch.compile(captured, backend="aot_eager", fullgraph=True)(q, k, v)
    text = _root_messages(info.value)
    assert "softmax_scale is a numpy scalar" in text and "Python float" in text, text


# ------------------------------------------------------------------------------------------------------ EA

@pytest.mark.parametrize("kwargs, wanted", [
    (dict(window_size=None), ["window_size must be a pair", "-1"]),
    (dict(window_size=(None, None)), ["window_size left side must be an int", "-1: unbounded"]),
    (dict(window_size=(128, None)), ["window_size right side must be an int", "-1: unbounded"]),
    (dict(softcap=None), ["softcap must be a real number", "0: off"]),
], ids=["window_none", "window_none_none", "window_right_none", "softcap_none"])
def test_none_for_unbounded_or_off_is_refused_with_the_accepted_value(kwargs, wanted):
    """EA: FlashAttention-4 writes an unbounded window side as None, transformers an absent softcap as None: a
    TypeError naming the argument and the value that means unbounded / off (raised before any device check)."""
    q, k, v = _dense(torch.float16)
    with pytest.raises(TypeError) as info:
        attention(q, k, v, **kwargs)
    assert all(w in str(info.value) for w in wanted), str(info.value)
