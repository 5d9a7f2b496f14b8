"""Thirty-sixth round of the bug hunt (tests/bug_report_sources.md, "Thirty-sixth round"), CPU part: the premises of
tests/test_bug_reports_thirtysixth_gpu.py, without a GPU or the extension.

- GN: for 132 SMs (H100 SXM, H200) and 114 (H100 PCIe) every case's batch puts the tiles exactly at waves x SMs, one
  batch element's tiles short of it or over it (so the last wave is full, one step short, or one step into a new
  wave; with one wave short, fewer tiles than CTAs); the query-block count is the same at both head_dim 64 tile
  heights; every case is a persistent launch: its forward kernel is built persistent (csrc/flash/config.hpp's
  kPersistent: head_dim 64, 96, 128; 192 and 256 launch one CTA per tile) and within kFwdPersistentMaxKeyBlocks.
- GO: on small float64 / fp16 analogues, the dLSE term moves dQ and dK far outside the rule (a backward that drops it
  fails check_grads_where_required's comparison) and leaves dV unchanged; with the loss on the LSE alone the
  reference's dV is exactly 0.
- GP: attention takes batch 65535 through every limit check (the call then stops at the device check, on a CPU
  tensor) and refuses 65536 by name."""

import os
import re

import pytest
import torch

import test_bug_reports_thirtysixth_gpu as gpu_file
from flash_attn_hopper import attention
from flash_attn_hopper.testing import assert_close_by_rule, attention_ref_grads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("sms", [132, 114])
def test_gn_batches_put_the_tiles_at_the_wave_boundaries(sms):
    for _, _, _, _, seqlen_q, _, nheads, _, _ in gpu_file.GN_CASES:
        step = nheads * gpu_file.gn_m_blocks(seqlen_q)
        assert sms % step == 0, "every case must run on both SM counts (no skip)"
        for waves in gpu_file.GN_WAVES:
            for offset_name, offset in gpu_file.GN_OFFSETS.items():
                batch = gpu_file.gn_batch(sms, step, waves, offset)
                tiles = batch * step
                assert batch >= 1
                assert tiles == waves * sms + offset * step
                last_wave = tiles - (-(-tiles // sms) - 1) * sms  # tiles in the persistent grid's last wave
                expected = {-1: sms - step, 0: sms, 1: step}[offset]
                assert last_wave == expected, (sms, step, waves, offset_name)
                if waves == 1 and offset == -1:
                    assert tiles < sms  # fewer tiles than CTAs: the grid is the tiles (launch_fwd_sm90.hpp)


def test_gn_batch_refuses_a_step_that_does_not_divide_the_sms():
    with pytest.raises(ValueError, match="not a multiple"):
        gpu_file.gn_batch(114, 4, 1, 0)


def test_gn_query_blocks_do_not_depend_on_the_tile_height():
    for case in gpu_file.GN_CASES:
        seqlen_q = case[4]
        assert -(-seqlen_q // 128) == -(-seqlen_q // 192) == gpu_file.gn_m_blocks(seqlen_q)
    with pytest.raises(AssertionError, match="premise"):
        gpu_file.gn_m_blocks(150)  # 2 blocks of 128 rows, 1 of 192: such a length would make the tiles ambiguous


def test_gn_cases_are_persistent_launches():
    text = open(os.path.join(ROOT, "csrc", "flash", "config.hpp")).read()
    match = re.search(r"constexpr int kFwdPersistentMaxKeyBlocks = (\d+);", text)
    assert match and int(match.group(1)) == gpu_file.GN_MAX_KEY_BLOCKS
    block_ns = {int(n) for n in re.findall(r"kBlockN = (\d+), kStages", text)}  # the forward tile configs
    assert block_ns and min(block_ns) == gpu_file.GN_MIN_BLOCK_N, block_ns
    persistent = {}  # forward kernel head dim -> kPersistent of its tile configurations
    for head, body in re.findall(r"struct FwdTileConfig(<\d+>|64Narrow) \{(.*?)\};", text, re.S):
        flag = re.search(r"kPersistent = (true|false);", body)
        assert flag, head
        dim = 64 if head == "64Narrow" else int(head[1:-1])
        persistent[dim] = persistent.get(dim, True) and flag.group(1) == "true"
    assert sorted(persistent) == [64, 96, 128, 192, 256], persistent
    assert tuple(d for d in sorted(persistent) if persistent[d]) == gpu_file.GN_PERSISTENT_KERNELS
    for case in gpu_file.GN_CASES:
        assert gpu_file.gn_persistent(max(case[1], case[2]), case[5]), case[0]
    assert not gpu_file.gn_persistent(64, gpu_file.GN_MAX_KEY_BLOCKS * gpu_file.GN_MIN_BLOCK_N + 1)
    assert not gpu_file.gn_persistent(192, 77) and not gpu_file.gn_persistent(256, 77)


def _go_small(dtype, g):
    q = torch.randn(2, 21, 6, 16, generator=g).to(dtype)
    k = torch.randn(2, 29, 2, 16, generator=g).to(dtype)
    v = torch.randn(2, 29, 2, 16, generator=g).to(dtype)
    dout = torch.randn(2, 21, 6, 16, generator=g).to(dtype)
    dlse = torch.randn(2, 6, 21, generator=g)
    return q, k, v, dout, dlse


@pytest.mark.parametrize("loss", list(gpu_file.GO_LOSSES))
def test_go_lse_term_is_what_the_rule_checks(loss):
    dtype = gpu_file.DTYPES[gpu_file.GO_LOSSES[loss]]
    g = torch.Generator().manual_seed(36)
    q, k, v, dout, dlse = _go_small(dtype, g)
    dout_ref = dout if loss == "out-and-lse" else torch.zeros_like(dout)
    ref = attention_ref_grads(q, k, v, dout_ref, dlse=dlse, causal=True)
    naive = attention_ref_grads(q, k, v, dout_ref, dlse=dlse, causal=True, upcast=False)
    dropped = attention_ref_grads(q, k, v, dout_ref, causal=True)  # a backward that ignores dLSE
    for i, gname in enumerate(("dq", "dk")):
        assert_close_by_rule(ref[i].to(dtype), ref[i], naive[i], f"{gname} (control)")
        with pytest.raises(AssertionError):
            assert_close_by_rule(dropped[i].to(dtype), ref[i], naive[i], f"{gname} without the dLSE term")
    assert torch.equal(dropped[2], ref[2]), "dV does not depend on the LSE's gradient"
    if loss == "lse":
        assert torch.equal(ref[2], torch.zeros_like(ref[2])) and torch.equal(naive[2], torch.zeros_like(naive[2]))


def test_go_subsets_cover_each_input_and_pairs():
    assert set("".join(gpu_file.GO_WHICH)) == {"q", "k", "v"}
    assert any(len(w) == 2 for w in gpu_file.GO_WHICH) and all(w != "qkv" for w in gpu_file.GO_WHICH)
    b, sq, sk, h, hk, _ = gpu_file.GO_SHAPE
    assert sq <= sk and h % hk == 0 and h // hk > 1  # bottom-right causal: every row sees keys; GQA


@pytest.mark.parametrize("batch,refused", [(gpu_file.GP_BATCH, False), (gpu_file.GP_BATCH + 1, True)])
def test_gp_batch_passes_the_limit_checks(batch, refused):
    t = torch.randn(1, 4, 2, 64).half().expand(batch, 4, 2, 64)  # no memory for the batch
    match = "at most 65535 is supported" if refused else "needs tensors on a CUDA device"
    with pytest.raises(ValueError, match=match):
        attention(t, t, t, causal=True)
    assert gpu_file.GP_BATCH == 65535
    for case in gpu_file.GP_CASES:
        _, head_dim, _, seqlen_q, seqlen_k, nheads, nheads_k, _ = case
        assert head_dim % 8 == 0 and nheads % nheads_k == 0
        assert seqlen_q <= gpu_file.BWD_SEQLEN_Q_ROUNDING  # one workspace tile of rows per (batch, head)
    # the free-memory guard's figure: the largest case's dQ accumulator is 16 GiB
    assert 15 * 2**30 < max(gpu_file.gp_workspace_bytes(c[1], c[5]) for c in gpu_file.GP_CASES) <= 16 * 2**30
    assert any(c[3] > c[4] and c[7].get("causal") for c in gpu_file.GP_CASES)  # rows that see no key
    assert any(c[7].get("deterministic") and c[5] > c[6] for c in gpu_file.GP_CASES)  # GQA, deterministic
