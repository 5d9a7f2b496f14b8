"""The CPU part of the fifth round of bug-report tests (tests/test_bug_reports_fifth_gpu.py; sources in
tests/bug_report_sources.md): tensors in layouts other than torch.strided (nested jagged or strided, sparse COO or CSR)
passed as q, k, v, cu_seqlens or document_ids must be refused before any launch with a TypeError, ValueError or
NotImplementedError whose message names the argument (DESIGN.md §2: "Anything else raises a Python exception ...
naming the argument and the accepted values, before any kernel launch").

No GPU is needed: the device check is replaced by a no-op and the extension check by a sentinel exception, so an input
that passes every argument check (and would reach the op or the device-side preparation on a GPU) shows up as
_PassedEveryCheck instead of as a device error."""

import re
import warnings

import pytest
import torch

from flash_attn_hopper import _ops, attention, attention_varlen, interface

LAYOUTS = ["nested_jagged", "nested_strided", "sparse_coo", "sparse_csr"]
ACCEPTED = (TypeError, ValueError, NotImplementedError)


class _PassedEveryCheck(Exception):
    pass


@pytest.fixture
def checks_only(monkeypatch):
    """Device checks pass; reaching the extension check raises _PassedEveryCheck."""
    monkeypatch.setattr(interface, "_check_devices", lambda named: None)

    def reached():
        raise _PassedEveryCheck("every argument check passed: on a GPU the call would go on to the op")

    monkeypatch.setattr(_ops, "require_extension", reached)


def _in_layout(layout, shape, dtype=torch.float16):
    """A tensor of `shape` in `layout`. Nested ones hold two entries of lengths shape[1] and shape[1] - 1 (other sizes
    shape[2:]): shape's rank, with a ragged second dimension."""
    if layout.startswith("nested"):
        parts = [torch.randn(n, *shape[2:]).to(dtype) for n in (shape[1], shape[1] - 1)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the strided nested layout is a prototype
            return torch.nested.nested_tensor(parts, layout=torch.jagged if layout == "nested_jagged" else torch.strided)
    t = torch.randn(*shape).to(dtype)
    return t.to_sparse() if layout == "sparse_coo" else t.to_sparse_csr()


def _names_one_of(message, names):
    return any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) for n in names)


# https://github.com/pytorch/pytorch/issues/110669, https://github.com/pytorch/pytorch/issues/130196 and
# https://github.com/meta-pytorch/segment-anything-fast/issues/99 (nested / jagged q, k, v handed to flash attention
# kernels: errors from deep inside, wrong output shapes)
@pytest.mark.parametrize("arg", ["q", "k", "v", "kv"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_strided_layouts_are_refused_naming_the_argument(layout, arg, checks_only):
    """SDPA users move nested (jagged) tensors and sparse tensors between attention backends; this library takes
    strided tensors only. One of q, k, v (or k and v together, sharing their ragged dimension) in a nested or sparse
    layout must raise TypeError / ValueError / NotImplementedError naming it, not an internal error (a symbolic-size
    comparison, 'NestedTensorImpl doesn't support sizes', 'Sparse CSR tensors do not have strides'), and must not pass
    the checks."""
    shapes = {"q": (2, 5, 3, 64), "k": (2, 7, 3, 64), "v": (2, 7, 3, 64)}
    args = {name: torch.randn(*shape).half() for name, shape in shapes.items()}
    names = ["k", "v"] if arg == "kv" else [arg]
    args[names[0]] = _in_layout(layout, shapes[names[0]])
    if arg == "kv":
        args["v"] = args["k"].clone()
    with pytest.raises(ACCEPTED) as info:
        attention(args["q"], args["k"], args["v"])
    assert _names_one_of(str(info.value), names), f"{type(info.value).__name__} names no argument: {info.value}"


@pytest.mark.parametrize("arg", ["q", "k"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_non_strided_layouts_are_refused_naming_the_argument(layout, arg, checks_only):
    """The same for attention_varlen's packed (total_tokens, nheads, head_dim) q and k: a nested tensor of rank 3 (two
    entries of (n, 64)) or a sparse one must be refused by name before the op."""
    shapes = {"q": (9, 3, 64), "k": (11, 3, 64), "v": (11, 3, 64)}
    args = {name: torch.randn(*shape).half() for name, shape in shapes.items()}
    args[arg] = _in_layout(layout, shapes[arg])
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    with pytest.raises(ACCEPTED) as info:
        attention_varlen(args["q"], args["k"], args["v"], cu_q, cu_k, 5, 6)
    assert _names_one_of(str(info.value), [arg]), f"{type(info.value).__name__} names no argument: {info.value}"


@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_sparse_cu_seqlens_are_refused_naming_the_argument(arg, checks_only):
    q, k, v = torch.randn(9, 3, 64).half(), torch.randn(11, 3, 64).half(), torch.randn(11, 3, 64).half()
    cu = {"cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.int32),
          "cu_seqlens_k": torch.tensor([0, 5, 11], dtype=torch.int32)}
    cu[arg] = cu[arg].to_sparse()
    with pytest.raises(ACCEPTED) as info:
        attention_varlen(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 5, 6)
    assert _names_one_of(str(info.value), [arg]), f"{type(info.value).__name__} names no argument: {info.value}"


@pytest.mark.parametrize("layout", ["nested_jagged", "sparse_coo", "sparse_csr"])
def test_document_ids_in_non_strided_layouts_are_refused_naming_them(layout, checks_only):
    """document_ids (batch, seqlen) as a sparse or nested tensor: its dtype, device and shape checks pass for the sparse
    ones, and on a GPU the bounds are then computed from it with strided-only operations (aten::as_strided has no
    sparse kernel: an unnamed NotImplementedError or RuntimeError). It must be refused by name before that."""
    q, k, v = (torch.randn(2, 6, 3, 64).half() for _ in range(3))
    dense = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.int32)
    if layout == "nested_jagged":
        ids = torch.nested.nested_tensor([dense[0], dense[1, :5]], layout=torch.jagged)
    else:
        ids = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    with pytest.raises(ACCEPTED) as info:
        attention(q, k, v, document_ids=ids)
    assert _names_one_of(str(info.value), ["document_ids"]), f"{type(info.value).__name__}: {info.value}"
