"""Session 38: per-row errors of tests/test_bug_reports_fifth_gpu.py::test_equal_scores_at_huge_scaled_logits cases
(usage: python3 scripts/diag_equal_scores.py DTYPE HEAD_DIM CAUSAL LOGIT API ...), run on the device."""
import math
import sys

import torch

sys.path.insert(0, "tests")
from flash_attn_hopper import attention  # noqa: E402
from flash_attn_hopper.testing import attention_ref  # noqa: E402
from gpu_helpers import randn  # noqa: E402

DEVICE = "cuda"


def case(dtype, head_dim, causal, logit_log2, api):
    seqlen_q, seqlen_k, nheads = (300, 300, 2) if api == "documents" else (77, 700, 2)
    gen = torch.Generator(device="cpu").manual_seed(logit_log2 * 1000 + head_dim)
    torch.manual_seed(0)
    q0 = randn(1, 1, 1, head_dim, dtype=torch.float32)
    k0 = randn(1, 1, 1, head_dim, dtype=torch.float32)
    sign = torch.randint(0, 2, (1, seqlen_q, nheads, 1), generator=gen).float() * 2 - 1
    small = torch.rand(1, seqlen_q, nheads, 1, generator=gen) < 0.6
    row_scale = torch.where(small, 2.0 ** -(logit_log2 - 4), 1.0) * sign
    q = (q0 * row_scale.to(DEVICE)).to(dtype)
    k = k0.expand(1, seqlen_k, 1 if api == "gqa" else nheads, head_dim).to(dtype).contiguous()
    v = randn(1, seqlen_k, k.shape[2], head_dim, dtype=dtype)
    score = (q0.to(dtype).float() * k0.to(dtype).float()).sum().abs().item()
    softmax_scale = 2.0**logit_log2 / (score * math.log2(math.e))
    window = (100, 0) if api == "window" else (-1, -1)
    opts = dict(causal=causal, window_size=window)
    if api == "softcap":
        opts["softcap"] = 2.0**logit_log2
    if api == "documents":
        opts["document_ids"] = torch.tensor([0] * 100 + [1] * 150 + [2] * 50, device=DEVICE).unsqueeze(0)
    out, lse = attention(q, k, v, softmax_scale=softmax_scale, return_lse=True, **opts)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, upcast=True, **opts)
    naive, _ = attention_ref(q, k, v, upcast=False, **opts)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().expand(-1, -1, nheads, -1) if api == "gqa" else k.float())
    spread = (s.amax(-1) - s.amin(-1)).abs().max().item()
    err = (out.float() - ref).abs().amax(-1)[0]  # (seqlen_q, nheads)
    nerr = (naive.float() - ref).abs().max().item()
    lerr = (lse - ref_lse).abs()[0]  # (nheads, seqlen_q)
    print(f"{dtype} hd{head_dim} causal={causal} 2^{logit_log2} {api}: out err {err.max().item():.3e} naive {nerr:.3e} "
          f"lse err {lerr.max().item():.3e}; fp32 score spread per row {spread:.3e}")
    for idx in err.flatten().topk(3).indices.tolist():
        i, h = divmod(idx, nheads)
        print(f"  out row {i} head {h}: err {err[i, h].item():.3e} small={bool(small[0, i, h])} "
              f"sign={sign[0, i, h].item():+.0f} lse {lse[0, h, i].item():.4f} ref {ref_lse[0, h, i].item():.4f}")
    for idx in lerr.flatten().topk(3).indices.tolist():
        h, i = divmod(idx, seqlen_q)
        print(f"  lse row {i} head {h}: err {lerr[h, i].item():.3e} small={bool(small[0, i, h])} "
              f"lse {lse[0, h, i].item():.4f} ref {ref_lse[0, h, i].item():.4f}")


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        d, hd, c, lg, api = spec.split(",")
        case(getattr(torch, d), int(hd), c == "1", int(lg), api)
