"""scripts/bwd_trace.py's analysis of the backward trace probe's file (CPU, made-up data): the layout it parses is the
one the probe writes (benchmarks/results/2026-12-06_session57/bwd_trace_probe_UNRUN.patch), and CTAs that ran no tile
(varlen blocks past a sequence) stay out of the shares."""

import struct

import numpy as np

from repo_scripts import load_script


def _module():
    return load_script("scripts/bwd_trace.py", "bwd_trace")


def test_selftest_shares():
    _module().selftest()  # asserts the overall share, key block 0's row and the start lead


def test_ctas_without_tiles_are_left_out():
    # One pair of 2 key blocks; key block 1 (launched first) ran no tile and has no times.
    gx, slots = 2, 2
    rows = [[0] * 6 + [0] * 4, [100, 4100, 3, 2, 10, 7010, 100, 0, 2100, 1750]]
    raw = struct.pack("<4q", gx, 1, 1, slots) + np.array(rows, dtype=np.uint64).tobytes()
    text = _module().analyze(raw, "t")
    assert "1 CTAs ran" in text, text
    assert "waited 25.0 %" in text, text  # 1750 of 7000 cycles
