"""Eighteenth round of the bug hunt (tests/bug_report_sources.md, "Eighteenth round"), GPU part.

EE: a stream made by another library and handed to PyTorch (torch.cuda.get_stream_from_external; pytorch/pytorch#182960
and NVIDIA/cudnn-frontend#355: a wrapper of a caller's stream must launch on that very stream): the forward and
backward of attention (packed documents, whose bounds are kept per stream) and attention_varlen run on it while it is
still busy writing their inputs, so a kernel on any other stream would read stale inputs. Right by the rule.
EF: allocations routed to a user memory pool (torch.cuda.MemPool / use_mem_pool; pytorch/pytorch#146431,
pytorch/pytorch#124807): DESIGN.md §2 says the kernels allocate only through PyTorch's caching allocator, so out, LSE
and the gradients lie in the pool's segments, and the results are right by the rule.

Skipped, with the reason, without an sm90 GPU and the built extension (conftest.py), and per test when the build lacks
the head_dim / dtype."""

import pytest
import torch

from flash_attn_hopper import attention, attention_varlen, interface
from gpu_helpers import built_dtype, check_attention, check_attention_varlen, cu_seqlens, poison_allocator, randn

pytestmark = [pytest.mark.requires_sm90, pytest.mark.gpu]

HEAD_DIM = 128


# ------------------------------------------------------------------------------------------------------ EE

def test_attention_on_an_external_stream_busy_writing_the_inputs(monkeypatch):
    """EE: a raw stream handle (here from a torch.cuda.Stream, as another library would hand one over) wrapped with
    get_stream_from_external and made current; the stream sleeps, then copies the inputs; attention (documents,
    causal, GQA) and attention_varlen run forward and backward on it. The varlen cu_seqlens are checked by an earlier
    call on the same stream (the check's cache is per stream), and the checked calls must not read them on the host
    again: such a read would wait for the stream and hide a launch on the wrong one. Results right by the rule."""
    dtype = built_dtype(HEAD_DIM)
    q, dout = randn(2, 203, 4, HEAD_DIM, dtype=dtype), randn(2, 203, 4, HEAD_DIM, dtype=dtype)
    k, v = randn(2, 203, 2, HEAD_DIM, dtype=dtype), randn(2, 203, 2, HEAD_DIM, dtype=dtype)
    ids = torch.tensor([[0] * 70 + [1] * 133, [5] * 150 + [6] * 53], device="cuda")
    lq, lk = [130, 0, 77], [100, 20, 77]
    qv, doutv = randn(sum(lq), 4, HEAD_DIM, dtype=dtype), randn(sum(lq), 4, HEAD_DIM, dtype=dtype)
    kv, vv = randn(sum(lk), 2, HEAD_DIM, dtype=dtype), randn(sum(lk), 2, HEAD_DIM, dtype=dtype)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    sources = (q, k, v, dout, qv, kv, vv, doutv)
    stale = [torch.randn_like(t) for t in sources]
    torch.cuda.synchronize()
    owner = torch.cuda.Stream()  # the other library's stream; only its handle is passed on
    external = torch.cuda.get_stream_from_external(owner.cuda_stream, device=q.device)
    assert external.cuda_stream == owner.cuda_stream != torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(external):
        poison_allocator(q.numel() * q.element_size(), qv.numel() * qv.element_size())  # synchronizes: before the sleep
        attention_varlen(qv, kv, vv, cu_q, cu_k, max(lq), max(lk), causal=True)  # the host check, on this stream
        torch.cuda.synchronize()
        monkeypatch.setattr(interface, "_read_cu_seqlens", _no_host_read)
        torch.cuda._sleep(100_000_000)  # keeps the stream busy for tens of ms
        for dst, src in zip(stale, sources):
            dst.copy_(src)
        dense = _leaves_in_place(stale[:3])
        out, lse = attention(*dense, causal=True, return_lse=True, document_ids=ids)
        grads = torch.autograd.grad(out, dense, stale[3])
        packed = _leaves_in_place(stale[4:7])
        outv, lsev = attention_varlen(*packed, cu_q, cu_k, max(lq), max(lk), causal=True, return_lse=True)
        gradsv = torch.autograd.grad(outv, packed, stale[7])
    torch.cuda.current_stream().wait_stream(external)
    for t in stale + [ids, cu_q, cu_k]:
        t.record_stream(external)
    check_attention(out.detach(), lse.detach(), grads, q, k, v, dout, "external stream dense", causal=True,
                    document_ids=ids)
    check_attention_varlen(outv.detach(), lsev.detach(), gradsv, qv, kv, vv, doutv, cu_q, cu_k,
                           "external stream varlen", causal=True)


def _no_host_read(name, cu):
    raise AssertionError(f"{name} read on the host again: the read waits for the busy stream")


def _leaves_in_place(tensors):
    # (the copies themselves: made leaves on the external stream, where they were written)
    return [t.requires_grad_(True) for t in tensors]


# ------------------------------------------------------------------------------------------------------ EF

def test_allocations_go_to_a_user_memory_pool():
    """EF: inside torch.cuda.use_mem_pool(pool), the forward (GQA, causal, LSE returned) and the backward op called on
    this thread (use_mem_pool routes only the current thread's allocations, and autograd's backward runs on its own
    device thread): out, LSE, dq, dk and dv lie in the pool's segments (the kernels' tensors come from PyTorch's
    allocator), and they are right by the rule."""
    dtype = built_dtype(HEAD_DIM)
    torch.manual_seed(0)
    q, dout = randn(2, 333, 4, HEAD_DIM, dtype=dtype), randn(2, 333, 4, HEAD_DIM, dtype=dtype)
    k, v = randn(2, 257, 2, HEAD_DIM, dtype=dtype), randn(2, 257, 2, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM ** -0.5
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        out, lse = attention(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
        grads = torch.ops.flash_attn_hopper.bwd(dout, q, k, v, out, lse, None, scale, True, -1, 0, 0.0, False)
    torch.cuda.synchronize()
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot(include_traces=False)]
    assert segments, "nothing was allocated in the pool"
    for name, t in (("out", out), ("lse", lse), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert any(lo <= t.data_ptr() < hi for lo, hi in segments), f"{name} is not in the pool"
    check_attention(out, lse, grads, q, k, v, dout, "mem pool", softmax_scale=scale, causal=True)
    del out, lse, grads
