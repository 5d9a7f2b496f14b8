"""Thirtieth round of the bug hunt (tests/bug_report_sources.md, "Thirtieth round"), CPU part.

- The tile table of tests/test_bug_reports_thirtieth_gpu.py (FWD_TILES, BWD_TILES), on which every premise of the GPU
  file rests, is the one csrc/flash/config.hpp declares (and documents take the 128-row tiles at head_dim 64).
- The premises of every GPU case (FU: a boundary on each block grid of both passes that no other grid has, interior
  blocks against a document edge, one-key rows; FV: each family's edge at a multiple of 112 + r, a diagonal over
  three blocks), without the extension.
- Some GPU bodies through the library's own Python layer, op schemas and autograd nodes with tests/cpu_stand_ins.py's
  kernels (float32 references; backwards from the saved out and LSE): the document bounds the Python layer computes
  for the grid-edge layouts (interface.document_bounds, handed to the ops as doc_bounds; the stand-ins take their
  documents from them), and the options it hands the ops. The kernels' arithmetic is the GPU file's business.
- That the GPU checks can fail: the same bodies with a stand-in forward whose document boundaries are each one key
  late (FU), or whose window reaches one key further (FV), must raise AssertionError.

The stand-in bodies skip, with the reason, where the extension is not built (its op schemas and autograd node are
needed); the table and premise tests need nothing but the source tree."""

import pathlib
import re

import pytest
import torch

import cpu_stand_ins
import test_bug_reports_thirtieth_gpu as gpu_file
from flash_attn_hopper.interface import kernel_head_dim

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc" / "flash"


# ------------------------------------------------ the tile table

def _fwd_config(text, name):
    m = re.search(name + r"\s*\{\s*static constexpr int kBlockM = (\d+), kBlockN = (\d+),", text)
    assert m, f"{name} not found in config.hpp"
    documents = re.search(name + r"\s*\{[^}]*kDocuments = (true|false);", text)
    assert documents, f"{name}: kDocuments not found"
    return (int(m.group(1)), int(m.group(2))), documents.group(1) == "true"


def test_tile_table_is_the_kernels():
    """FWD_TILES / BWD_TILES against csrc/flash/config.hpp: the forward configurations that run documents (head_dim
    64: the narrow one, which csrc/flash/fwd/launch_fwd_sm90.hpp picks whenever doc_bounds is given), and the
    backward's formulas evaluated at 64, 128, 256."""
    text = (CSRC / "config.hpp").read_text()
    narrow, narrow_docs = _fwd_config(text, r"struct FwdTileConfig64Narrow")
    wide, wide_docs = _fwd_config(text, r"struct FwdTileConfig<64>")
    assert narrow_docs and not wide_docs and narrow == gpu_file.FWD_TILES[64], (narrow, wide)
    launch = (CSRC / "fwd" / "launch_fwd_sm90.hpp").read_text()
    assert "p.doc_bounds != nullptr ? FwdTileConfig64Narrow::kBlockM" in launch
    for width in (96, 128, 192, 256):
        tiles, docs = _fwd_config(text, rf"struct FwdTileConfig<{width}>")
        assert docs and tiles == gpu_file.FWD_TILES[width], (width, tiles)
    assert "static constexpr int kBlockM = kHeadDim <= 64 ? 128 : 64" in text
    assert "static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;" in text
    for width in (64, 128, 256):
        assert gpu_file.BWD_TILES[width] == (128 if width <= 64 else 64, 128 if width <= 128 else 64), width
    # the head dims each class names run on those kernels
    assert {kernel_head_dim(d) for d in (136, 160, 192)} == {gpu_file.FV_WIDTH}
    assert kernel_head_dim(192, backward=True) == 256 and kernel_head_dim(96, backward=True) == 128


# ------------------------------------------------ the premises of every GPU case

@pytest.mark.parametrize("r", gpu_file.R_VARIANTS)
@pytest.mark.parametrize("config", list(gpu_file.FU_CONFIGS))
def test_fu_premises(config, r):
    head_dim, head_dim_v = gpu_file.FU_CONFIGS[config][:2]
    seqlen, rows = gpu_file.fu_rows(head_dim, head_dim_v, r)
    gpu_file.fu_premises(head_dim, head_dim_v, r, seqlen, rows)
    # the ids make the documents meant: runs of equal ids, split exactly at the boundaries
    ids = gpu_file.doc_ids(rows, seqlen, "cpu")
    for b, bounds in enumerate(rows):
        changes = (torch.nonzero(ids[b, 1:] != ids[b, :-1]).flatten() + 1).tolist()
        assert changes == list(bounds), (config, r, b)


@pytest.mark.parametrize("r", gpu_file.R_VARIANTS)
@pytest.mark.parametrize("family", gpu_file.FV_FAMILIES)
def test_fv_premises(family, r):
    gpu_file.fv_premises(family, r, *gpu_file.fv_case(family, r))


# ------------------------------------------------ GPU bodies through the Python layer and the stand-ins

@pytest.fixture
def cpu_bodies(monkeypatch):
    """The GPU bodies on the CPU, made smaller for time (the float32 and fp16 / bf16 references of a 1200-token row
    take seconds per run on a CI machine's cores): 2 query heads (on 1 K/V head in FU) instead of 4, and one variant r
    per test (each test sets it), the layouts and edges unchanged."""
    monkeypatch.setattr(gpu_file, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_file, "poison", lambda *args, **kwargs: None)  # (the CUDA caching allocator's)
    monkeypatch.setattr(gpu_file, "require_built", lambda *args, **kwargs: None)  # every head_dim on the CPU
    monkeypatch.setattr(gpu_file, "NHEADS", 2)
    monkeypatch.setattr(gpu_file, "FU_NHEADS_K", 1)
    yield monkeypatch


FU_ON_CPU = [("d64-fp16", False, -1), ("d192-bf16", True, 1)]  # (config, causal, r)
FV_ON_CPU = [("d136-bf16-softcap30", "window_left", 1)]  # (config, family, r)


@pytest.mark.parametrize("config,causal,r", FU_ON_CPU,
                         ids=[f"{c}-{'causal' if k else 'full'}-r{r:+d}" for c, k, r in FU_ON_CPU])
def test_fu_body(cpu_bodies, config, causal, r):
    cpu_bodies.setattr(gpu_file, "R_VARIANTS", (r,))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"):
        gpu_file.test_document_boundaries_on_both_passes_block_grids(config, causal)
    assert [c[0] for c in cpu_stand_ins.CALLS] == ["fwd", "bwd"]


@pytest.mark.parametrize("config,family,r", FV_ON_CPU, ids=[f"{c}-{f}-r{r:+d}" for c, f, r in FV_ON_CPU])
def test_fv_body(cpu_bodies, config, family, r):
    cpu_bodies.setattr(gpu_file, "R_VARIANTS", (r,))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"):
        gpu_file.test_non_power_of_two_key_blocks_at_their_edges(config, family)
    assert [c[0] for c in cpu_stand_ins.CALLS] == ["fwd", "bwd"]


# ------------------------------------------------ the checks fail for the faults they are about

def _late_boundaries_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                         doc_bounds=None):
    """The forward stand-in with every document's first key given to the document before it (each boundary one key
    late), as a block range or interior rounded the wrong way at a document's start would."""
    starts = doc_bounds[..., 0]
    pos = torch.arange(starts.shape[1], dtype=starts.dtype)
    first = (starts == pos) & (pos > 0)
    late = starts.clone()
    late[:, 1:] = torch.where(first[:, 1:], starts[:, :-1], starts[:, 1:])
    return cpu_stand_ins.fwd_stand_in(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                                      torch.stack([late, doc_bounds[..., 1]], dim=-1))


def _wider_window_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                      doc_bounds=None):
    """The forward stand-in with a window's left side one key wider, as an interior's lower end rounded down would."""
    return cpu_stand_ins.fwd_stand_in(q, k, v, softmax_scale, causal, window_left + (window_left >= 0), window_right,
                                      softcap, deterministic, doc_bounds)


# What the checks raise when the results are wrong (the rule, flash_attn_hopper.testing; the one-key rows' bits), not
# the premises' or the construction's asserts.
_WRONG_RESULT = r"max abs error|one-key rows"


def test_fu_fails_for_boundaries_one_key_late(cpu_bodies):
    cpu_bodies.setattr(gpu_file, "R_VARIANTS", (1,))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"):  # the same case passes unmutated
        gpu_file.test_document_boundaries_on_both_passes_block_grids("d64-fp16", True)
    cpu_bodies.setattr(cpu_stand_ins, "STAND_INS", dict(cpu_stand_ins.STAND_INS, fwd=_late_boundaries_fwd))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"), pytest.raises(AssertionError,
                                                                                      match=_WRONG_RESULT):
        gpu_file.test_document_boundaries_on_both_passes_block_grids("d64-fp16", True)


def test_fv_fails_for_a_window_one_key_wider(cpu_bodies):
    cpu_bodies.setattr(gpu_file, "R_VARIANTS", (-1,))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"):  # the same case passes unmutated
        gpu_file.test_non_power_of_two_key_blocks_at_their_edges("d136-bf16-softcap30", "window_left")
    cpu_bodies.setattr(cpu_stand_ins, "STAND_INS", dict(cpu_stand_ins.STAND_INS, fwd=_wider_window_fwd))
    with cpu_stand_ins.stand_ins(cpu_bodies, "round 30's test bodies"), pytest.raises(AssertionError,
                                                                                      match=_WRONG_RESULT):
        gpu_file.test_non_power_of_two_key_blocks_at_their_edges("d136-bf16-softcap30", "window_left")
