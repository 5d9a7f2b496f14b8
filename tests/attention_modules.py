"""The library's two entry points as nn.Modules with fixed options, for the tests that export, save or hook a module
(tests/test_bug_reports_fifth_gpu.py, tests/test_bug_reports_ninth_{gpu,cpu}.py)."""

import torch

from flash_attn_hopper import attention, attention_varlen


class Attention(torch.nn.Module):
    """forward(q, k, v[, document_ids]) = attention(q, k, v, document_ids=..., **options)."""

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, q, k, v, document_ids=None):
        return attention(q, k, v, document_ids=document_ids, **self.options)


class AttentionVarlen(torch.nn.Module):
    """forward(q, k, v, cu_seqlens_q, cu_seqlens_k) = attention_varlen(..., max_seqlen_q, max_seqlen_k, **options)."""

    def __init__(self, max_seqlen_q, max_seqlen_k, **options):
        super().__init__()
        self.max_seqlen_q, self.max_seqlen_k, self.options = max_seqlen_q, max_seqlen_k, options

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k):
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k,
                                **self.options)
