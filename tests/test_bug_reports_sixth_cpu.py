"""The CPU part of the sixth round of bug-report tests (class BC of tests/bug_report_sources.md; the GPU test is
tests/test_bug_reports_sixth_gpu.py::test_document_bounds_served_to_another_stream): device tensors that the library
derives from an input tensor and keeps for the next call (document bounds, the transformers integration's document
ids and unpadding indices) must be kept per CUDA stream, since one made on another stream is neither ordered before
this stream's kernels nor kept alive by the caching allocator for them (TensorRT-LLM PR 15265, cudnn-frontend PR 1168).
And per device (session 72's audit): every GPU's default stream has handle 0.

No GPU is needed: the stream a result is keyed by (interface._stream_key) is replaced by a switchable fake, so the
bookkeeping is seen without streams; on the GPU the key is the device's current stream handle."""

import pytest
import torch

from flash_attn_hopper import interface

MISSING = interface._ValueNotes.MISSING


@pytest.fixture
def fake_stream(monkeypatch):
    """current["stream"] is the stream every result on a device is keyed by; host results (device None) stay None."""
    current = {"stream": 1}
    monkeypatch.setattr(interface, "_stream_key", lambda device: None if device is None else current["stream"])
    return current


def test_value_notes_keep_device_results_per_stream(fake_stream):
    notes = interface._ValueNotes()
    t = torch.arange(6)
    notes.put(t, "made on stream 1", "cuda")
    assert notes.get(t, "cuda") == "made on stream 1"
    assert notes.get(t) is MISSING  # a host result is its own entry
    fake_stream["stream"] = 2
    assert notes.get(t, "cuda") is MISSING  # never another stream's
    notes.put(t, "made on stream 2", "cuda")
    fake_stream["stream"] = 1
    assert notes.get(t, "cuda") == "made on stream 1"  # both kept
    t.add_(1)  # a new version drops every stream's result
    assert notes.get(t, "cuda") is MISSING
    fake_stream["stream"] = 2
    assert notes.get(t, "cuda") is MISSING


def test_stream_key_of_host_results_is_none():
    assert interface._stream_key(None) is None
    assert interface._stream_key(torch.device("cpu")) is None


def test_document_bounds_made_per_stream(fake_stream):
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    first = interface._document_bounds(ids, compiling=False)
    assert interface._document_bounds(ids, compiling=False) is first  # the layers of a step share them
    fake_stream["stream"] = 2
    other = interface._document_bounds(ids, compiling=False)
    assert other is not first
    assert torch.equal(other, first)
    assert torch.equal(first, interface.document_bounds(ids))


def test_transformers_document_ids_made_per_stream(fake_stream):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    from flash_attn_hopper.integrations import transformers as fah_tf

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    query = key = torch.randn(1, 2, 8, 16)  # transformers' (batch, heads, seqlen, head_dim)
    first = fah_tf._documents(position_ids, query, key)
    assert fah_tf._documents(position_ids, query, key) is first
    fake_stream["stream"] = 2
    other = fah_tf._documents(position_ids, query, key)
    assert other is not first
    assert torch.equal(other, first)
    assert other.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]


def test_value_notes_keep_results_per_device(fake_stream):
    """Session 72's audit: the key was the stream handle alone, and every GPU's default stream has handle 0, so a
    result made on cuda:0 was served on cuda:1 (the transformers integration's document ids of one position_ids
    tensor fed to layers on two GPUs: a ValueError naming document_ids' device), and a CPU result to a meta call."""
    notes = interface._ValueNotes()
    t = torch.arange(6)
    notes.put(t, "made on cuda:0", torch.device("cuda", 0))
    assert notes.get(t, torch.device("cuda", 0)) == "made on cuda:0"
    assert notes.get(t, torch.device("cuda", 1)) is MISSING  # the same stream handle, another GPU
    notes.put(t, "made on the CPU", torch.device("cpu"))
    assert notes.get(t, torch.device("meta")) is MISSING
    assert notes.get(t, torch.device("cpu")) == "made on the CPU"


def test_transformers_document_ids_made_per_device(fake_stream):
    pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
    from flash_attn_hopper.integrations import transformers as fah_tf

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    query = torch.randn(1, 2, 8, 16)
    on_cpu = fah_tf._documents(position_ids, query, query)
    on_meta = fah_tf._documents(position_ids, query.to("meta"), query.to("meta"))
    assert on_cpu.device.type == "cpu" and on_meta.device.type == "meta"
