"""Shared pytest setup: the ``requires_sm90`` marker and a per-test seed.

Mark a test (or a module, through ``pytestmark``) with ``@pytest.mark.requires_sm90`` and it is skipped, with the
reason, unless an sm90 GPU (H100/H200) is visible and the compiled extension is loaded. The reason is worked out
once per session; see ``sm90_skip_reason``.

FAH_TEST_HEAD_DIM=N deselects the tests parametrized with another ``head_dim`` (tests without that parameter stay):
tests/test_fwd_tiles_gpu.py runs the forward test files so under each forced head_dim 64 tile height.
"""

import functools
import os
import zlib

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import _ops


@functools.lru_cache(maxsize=None)
def sm90_skip_reason():
    """None when GPU tests can run here, else a sentence saying why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: GPU tests need an sm90 GPU (H100/H200)"
    device = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return (
            f"cuda:{device} is {name} (compute capability {major}.{minor}, sm{major}{minor}): "
            "GPU tests need an sm90 GPU (H100/H200)"
        )
    if not flash_attn_hopper.EXTENSION_LOADED:
        return f"extension not built: {_ops._load_error}"
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_sm90: needs an sm90 GPU (H100/H200) and the built extension; skipped with the reason otherwise",
    )


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("FAH_TEST_HEAD_DIM")
    if only:
        def other_head_dim(item):
            callspec = getattr(item, "callspec", None)
            return callspec is not None and callspec.params.get("head_dim", int(only)) != int(only)

        dropped = [item for item in items if other_head_dim(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if not other_head_dim(item)]
    marked = [item for item in items if item.get_closest_marker("requires_sm90") is not None]
    if not marked:
        return
    reason = sm90_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in marked:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed(request):
    """Seeds torch (CPU and every CUDA device) with a value derived from the test id: fresh data per test,
    the same data on every run of that test. Returns the seed."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def fresh_checked_calls(monkeypatch):
    """Each test starts with empty checked-call caches (attention's and attention_varlen's) and leaves none behind, so
    that a call made while a test replaced a check (the device, sm90 or build checks) never lets a later test's call
    with the same signature skip that check."""
    from flash_attn_hopper import interface

    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    monkeypatch.setattr(interface, "_CHECKED_VARLEN_CALLS", {})


@pytest.fixture(autouse=True)
def full_fp32_matmul(request):
    """GPU tests compare with a float32 reference, which must be real float32 (no TF32)."""
    if request.node.get_closest_marker("requires_sm90") is None:
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture
def cpu_ops(monkeypatch):
    """The library's ops run through the CPU stand-ins of tests/cpu_stand_ins.py (a module's own cpu_ops fixture takes
    precedence); dynamo's caches are reset afterwards, since compiled graphs keep the stand-ins."""
    from cpu_stand_ins import stand_ins

    with stand_ins(monkeypatch):
        yield
    torch._dynamo.reset()
