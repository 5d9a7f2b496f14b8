"""Twenty-ninth round of the bug hunt (tests/bug_report_sources.md, "Twenty-ninth round"), CPU part: the GPU file's
test bodies (FS: packing buffers refilled in place between pipelined micro-batches; FT: backwards out of forward
order) run on the CPU through the library's own Python layer, op schemas and autograd nodes, with
tests/cpu_stand_ins.py's kernels (float32 references; backwards from the saved out and LSE). What they check here is
the layer around the kernels: that eager calls return every gradient after the caller's cu_seqlens / document_ids
buffers were refilled (the ops save their own copies), that each backward takes its own node's saved tensors and
options whatever ran in between, and that the compiled steps (aot_eager, inductor) take the gradient path or the
error naming the refilled buffer. The kernels' arithmetic is the GPU file's business.

The stand-ins' outputs are made contiguous, as the kernels return them: the float32 reference's out is a strided
view, which inductor's check of an op's output strides against its fake kernel refuses.

Skipped, with the reason, where the extension is not built (its op schemas and autograd node are needed)."""

import pytest
import torch

import cpu_stand_ins
import test_bug_reports_twentyninth_gpu as gpu_file


@pytest.fixture
def cpu_ops(monkeypatch):
    with cpu_stand_ins.gpu_bodies_on_cpu(monkeypatch, gpu_file, "round 29's test bodies"):
        yield


@pytest.mark.parametrize("case", list(gpu_file.FS_VARLEN_CASES))
def test_fs_varlen_eager(cpu_ops, case):
    gpu_file.test_cu_seqlens_buffers_refilled_between_micro_batches(case, torch.bfloat16)


def test_fs_documents_eager(cpu_ops):
    gpu_file.test_document_ids_buffer_refilled_between_micro_batches(torch.bfloat16, True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fs_compiled(cpu_ops, backend, request):
    gpu_file.test_packing_buffers_refilled_between_compiled_micro_batches(backend, request)
    paths = dict(request.node.user_properties)
    # the library's saved copies: no micro-batch's compiled backward needs the refilled buffers
    assert paths == {"fs_varlen_backward_paths": "gradients,gradients,gradients,gradients",
                     "fs_documents_backward_paths": "gradients,gradients,gradients,gradients"}, paths


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("schedule", list(gpu_file.FT_SCHEDULES))
def test_ft(cpu_ops, schedule, deterministic):
    gpu_file.test_backwards_out_of_forward_order(schedule, deterministic, torch.bfloat16)
