"""The draws of tests/test_random_configs_gpu.py, on the CPU: its seeds reach every feature and both paths, so its
cases are not all alike (the GPU module's marks would skip this check on a machine without a GPU)."""

from test_random_configs_gpu import N_CASES, draw


def test_draws_cover_the_features():
    """Every feature, both paths and every layout appear among the seeds."""
    cases = [draw(s) for s in range(N_CASES)]
    assert any(c["varlen"] for c in cases) and not all(c["varlen"] for c in cases)
    for key in ("causal", "window_size", "softcap", "softmax_scale"):
        assert any(key in c["opts"] for c in cases), key
    assert any(c["head_dim"] != c["head_dim_v"] for c in cases)
    assert any(c["nheads"] != c["nheads_k"] for c in cases) and any(c["nheads_k"] == 1 for c in cases)
    assert any(c["dlse"] for c in cases) and any(c["deterministic"] for c in cases)
    assert any(c["varlen"] and 0 in c["lengths_q"] + c["lengths_k"] for c in cases)
    assert any("documents" in c for c in cases)
    assert {c["layout"] for c in cases} == {"contiguous", "transposed", "fused"}
    # NaN columns beside q's (and k's) columns within the kernel's width: head_dim below a kernel size, fused
    assert any(c["layout"] == "fused" and c["head_dim"] % 64 and c["head_dim"] < c["head_dim_v"] for c in cases)
