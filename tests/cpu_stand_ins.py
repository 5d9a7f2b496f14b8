"""Helper shared by the CPU test modules that run the library's ops through CPU stand-ins of their kernels (the
extension's op schemas and C++ autograd nodes, the stand-ins' arithmetic): the device, sm90 and build checks pass,
the checked-call and document caches start empty, and the build query has run."""

import contextlib

import pytest
import torch

from flash_attn_hopper import _ops, interface


@contextlib.contextmanager
def ops_on_cpu(monkeypatch, impls, needs):
    """Registers `impls` (op name -> CPU function) as the CPU kernels of the flash_attn_hopper ops for the duration;
    skips, naming `needs`, where the extension is not built."""
    if not _ops.EXTENSION_LOADED:
        pytest.skip(f"the extension is needed for {needs}: {_ops._load_error}")
    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_check_sm90", lambda name, device: None)
    # the stand-ins run every head_dim and dtype, whatever this build compiled (FAH_HDIMS / FAH_DTYPES)
    monkeypatch.setattr(interface, "_check_compiled", lambda *args: None)
    monkeypatch.setattr(interface, "_capturing", lambda device: False)  # (a CUDA query)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    monkeypatch.setattr(interface, "_CHECKED_VARLEN_CALLS", {})
    monkeypatch.setattr(interface, "_DOCUMENT_BOUNDS", interface._ValueNotes())
    _ops._compiled()
    lib = torch.library.Library("flash_attn_hopper", "IMPL")
    try:
        for name, fn in impls.items():
            lib.impl(name, fn, "CPU")
        yield
    finally:
        lib._destroy()
        _ops._compiled.cache_clear()
