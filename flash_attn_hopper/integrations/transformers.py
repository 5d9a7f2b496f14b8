"""Hugging Face transformers integration: ``attn_implementation="flash_attn_hopper"``.

Usage::

    import flash_attn_hopper.integrations.transformers as fah_tf
    from transformers import AutoModelForCausalLM

    fah_tf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flash_attn_hopper", dtype=torch.bfloat16)

``register()`` puts two functions into transformers' global registries under the name ``"flash_attn_hopper"``:

- ``flash_attn_hopper_attention_forward`` into ``AttentionInterface`` (the attention function every layer calls);
- ``flash_attn_hopper_mask`` into ``AttentionMaskInterface`` (the mask builder the model calls once per forward).
  It never builds a dense 4D mask: it returns None for plain causal (or bidirectional) attention without padding, and
  the 2D boolean padding mask otherwise, with which the attention function runs the batch through the
  variable-length kernel (unpad, ``attention_varlen``, pad: as transformers' flash-attention path). Without a mask
  registration,
  transformers would drop every attention mask for this name without a word
  (``masking_utils._preprocess_mask_arguments`` returns None for names it has no mask function for), so a padded
  batch would silently attend to its padding.

What it supports today: self-attention with nheads_k dividing nheads (MHA, GQA, MQA), causal or not, and
encoder-decoder cross-attention (a padded encoder's mask describes the keys: BART and the like), sliding windows
(``config.sliding_window``, e.g. Mistral, Gemma 2's local layers; bidirectional ones, e.g. ModernBERT's local
layers, Gemma 3 with ``use_bidirectional_attention``: EmbeddingGemma), attention logit soft-capping (Gemma 2's
``attn_logit_softcapping``), any softmax scale, fp16/bf16 (or fp32 under ``torch.autocast``), head_dim a multiple
of 8 up to 256 (value's may differ from query's and key's), padded batches (a 2D attention_mask: left or right
padding, run through ``attention_varlen``; not under torch.compile's fullgraph, which cannot trace the mask's host
read), packed sequences (DataCollatorWithFlattening, any batch size): from position_ids, as per-position document
bounds computed on the device (no host synchronization, also under torch.compile; transformers' own packed-sequence
check, a device read every forward, is skipped for this name), or from its flash-attention keyword arguments (run by
``attention_varlen``), a DynamicCache (prefill and decoding: the causal mask is aligned bottom-right, as in
transformers' flash-attention path).
Everything else raises a Python exception, naming what is unsupported, before any kernel runs: among it, modules
without an ``is_causal`` attribute called without an is_causal argument, and keyword arguments it does not know
(attention sinks, sparse indices, ...), which it does not drop.

Tested with transformers 5.17.0. This module imports transformers; ``import flash_attn_hopper`` does not.
"""

import functools
import os
import types

import torch
from torch.utils import _python_dispatch

try:
    import transformers
    from transformers import AttentionInterface, masking_utils
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        flash_attention_mask,
    )
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flash_attn_hopper.integrations.transformers needs the `transformers` package (>= 5; tested with 5.17.0): "
        f"pip install transformers. flash_attn_hopper itself does not need it. ({_e})"
    ) from _e

from .. import interface as _interface
from ..interface import _IdentityNotes, _ValueNotes, _capturing

ATTN_IMPLEMENTATION = "flash_attn_hopper"
"""The ``attn_implementation`` name that ``register()`` registers."""

# Keyword arguments through which transformers (and its DataCollatorWithFlattening) asks for variable-length batches.
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# Keyword arguments read by flash_attn_hopper_attention_forward besides its named parameters.
_CONSUMED_KWARGS = frozenset(_VARLEN_KWARGS + ("position_ids", "deterministic", "output_attentions", "s_aux",
                                               "position_bias"))
# Keyword arguments that transformers' models pass on (checked: 5.17's Llama, Mistral, Gemma 1-3, Qwen 2/3, Mixtral,
# BART, BERT, ModernBERT, and TransformersKwargs) and that do not change the attention of the given query, key and
# value: the module has already used them (cache, rotary embedding, encoder states) or they concern other outputs.
# seq_idx comes from DataCollatorWithFlattening with the position_ids that carry the same documents (transformers'
# attention paths ignore it too). Any other keyword with a value is refused: it may change the softmax (sinks) or the
# visible keys (sparse indices), and dropping it would silently give other results than eager.
_HARMLESS_KWARGS = frozenset((
    "use_cache", "cache_position", "past_key_values", "past_key_value", "position_embeddings",
    "encoder_hidden_states", "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "seq_idx",
))


def _where(module):
    """The start of an error message: which attention module raised it (built only when raising)."""
    layer_idx = getattr(module, "layer_idx", None)
    return f"flash_attn_hopper attention in {type(module).__name__}" + (
        f" (layer {layer_idx})" if layer_idx is not None else ""
    )


def flash_attn_hopper_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers attention function (``AttentionInterface`` signature) computed by ``flash_attn_hopper.attention``.

    Args:
        module: the calling attention module. Read: ``is_causal`` (used when the ``is_causal`` argument is None;
            without the attribute that raises) and, for messages, ``layer_idx``.
        query: ``(batch, nheads, seqlen_q, head_dim)``.
        key, value: ``(batch, nheads_k, seqlen_k, head_dim)`` and ``(batch, nheads_k, seqlen_k, head_dim_v)``
            (head_dim_v may differ, e.g. DeepSeek-V2/V3's 192 / 128); nheads_k divides nheads (grouped-query /
            multi-query attention when smaller: passed to the kernel as they are, never repeated in memory).
            Dtypes: float16 or bfloat16 (all three the same). Under ``torch.autocast`` on the tensors' device, every
            input is first cast to the autocast dtype, as autocast does for SDPA: with float32 weights, Llama's query
            and key are float32 after the rotary embedding while value is already bfloat16. Only the last dimension
            must have stride 1; the (batch, seqlen, nheads, head_dim) views are passed to the kernel without a copy.
        attention_mask: None, or the 2D boolean ``(batch, seqlen_k)`` padding mask (True: a kept token) that the mask
            function registered with this one passes on (it turns an all-ones mask into None). With a padding mask the
            batch runs through ``attention_varlen``; the mask is read from the device once per forward (shared by the
            layers). Causal (or with a bidirectional window, as many queries as keys): the kept tokens of each row
            form one sequence, queries being the row's last seqlen_q positions (causal and windows aligned
            bottom-right per sequence; padded query rows get output 0), as transformers' flash-attention path does.
            Non-causal without a window (an encoder; cross-attention, where the mask is the encoder's and seqlen_q
            may be any length): the mask describes the keys only and every query row is computed, as in eager.
            Any other mask (4D, additive, custom) raises ValueError.
        dropout: attention dropout probability; must be 0 in a training-mode forward (eval passes 0): build the
            model with ``attention_dropout=0.0`` (through ``from_pretrained``, or on the config given to
            ``from_config``; the attention modules copy it when built, so setting it on the config afterwards has no
            effect).
        scaling: softmax scale (multiplier of Q Kᵀ); None means ``1 / sqrt(head_dim)``.
        is_causal: causal mask if True; None means ``module.is_causal`` (a ValueError when the module has none: the
            mask the model builds, which decides in eager, is not seen here).
            The causal mask is aligned bottom-right (query row i sees key j iff j <= i + seqlen_k - seqlen_q), which
            is what decoding with a DynamicCache needs (a single query row sees every cached key) and matches
            transformers' flash-attention path; SDPA's ``is_causal`` is aligned top-left.
        sliding_window: transformers' window W (a query sees itself and the W - 1 keys before it): window_size
            (W - 1, 0), or (W - 1, W - 1) when not causal (transformers' flash-attention convention: ModernBERT
            passes W = H + 1 for its mask ``|i - j| <= H``; a W - 1 other than the model's H raises
            NotImplementedError, as eager follows the mask: H is the half-width ``flash_attn_hopper_mask`` recognised
            for the module's config, else ``config.sliding_window``). softcap: attention logit soft-capping (Gemma 2).
        kwargs: ``cu_seq_lens_q/k`` and ``max_length_q/k`` (all four, as DataCollatorWithFlattening's
            ``return_flash_attn_kwargs=True`` gives them, batch 1): the packed sequences run through
            ``flash_attn_hopper.attention_varlen``. Otherwise, without an attention_mask and with as many keys as
            queries, ``position_ids`` ``(batch or 1, seqlen)`` split each row into documents wherever they do not count
            up by one (packed sequences, as DataCollatorWithFlattening gives them; transformers' rule), passed to the
            kernel as ``document_ids``: computed on the device once per position_ids tensor (shared by the layers),
            with no host read, also under torch.compile. Rows that count up by one are one document (the plain
            causal kernel, plus a bounds read per tile). Against cached keys (decoding) position_ids are not used,
            as in transformers. ``s_aux`` and
            ``position_bias`` must be None. ``output_attentions=True`` is ignored with a warning (no attention weights
            are formed). ``deterministic`` (else the environment variable ``FLASH_ATTENTION_DETERMINISTIC=1``, as
            transformers' flash-attention path reads them): the deterministic backward. Ignored, as they do not change
            the attention of the given query, key and value: ``use_cache``, ``cache_position``, ``past_key_values``,
            ``past_key_value``, ``position_embeddings``, ``encoder_hidden_states``, ``output_hidden_states``,
            ``output_router_logits``, ``return_dict``, ``num_items_in_batch``, ``seq_idx``. Any other keyword
            argument that is not None raises NotImplementedError.

    Returns:
        ``(attn_output, None)``: ``attn_output`` of shape ``(batch, seqlen_q, nheads, head_dim_v)`` in the compute dtype
        (q's dtype, or the autocast dtype), differentiable with respect to query, key and value.

    Raises:
        ValueError: ``attention_mask`` is not None and not the 2D boolean padding mask described above (or, causal,
            with fewer keys than queries); no ``is_causal`` argument and no ``module.is_causal``;
            ``dropout`` is not 0 (a training-mode forward of a model built with attention dropout); a partial set
            of ``cu_seq_lens_*`` / ``max_length_*``, or them with a batch of more than one row; and, from
            ``flash_attn_hopper.attention``, bad shapes, head_dim not a multiple of 8 in [8, 256], tensors not on an
            sm90 CUDA device.
        NotImplementedError: attention sinks (``s_aux``), a position bias, any other keyword argument not listed above
            with a value (``sinks``, ``indices``, ``block_indices``, ...); a sliding window in non-causal attention
            with a padding mask and seqlen_q != seqlen_k (cross-attention); a non-causal sliding_window W whose
            W - 1 is not the half-width of the model's own bidirectional mask (T5Gemma's encoder, DiffusionGemma's
            decoder).
        TypeError: a dtype other than float16/bfloat16 outside autocast (for example a float32 model: load it with
            ``dtype=torch.bfloat16`` or run it under ``torch.autocast("cuda", dtype=torch.bfloat16)``).
        RuntimeError: the compiled extension is not available.

    All checks run before any kernel launch.
    """
    if dropout:
        raise ValueError(
            f"{_where(module)}: dropout={dropout}; flash_attn_hopper has no attention dropout, so training needs "
            "a model built with attention_dropout=0.0 (pass it to from_pretrained, or set it on the config given to "
            "from_config: the attention modules copy it when built)"
        )
    if is_causal is None:
        if not hasattr(module, "is_causal"):
            # transformers' eager path follows the mask the model builds, which this function never sees: guessing
            # causal ran bidirectional encoders (AlignText, ClapText, Splinter in 5.17) causal.
            raise ValueError(
                f"{_where(module)}: the module has no `is_causal` attribute and no is_causal argument was passed, so "
                "flash_attn_hopper cannot tell causal from bidirectional attention (transformers' own flash-attention "
                "path fails on it too). Set `is_causal = False` (an encoder) or `True` (a decoder) on the attention "
                "modules, or use attn_implementation='eager'."
            )
        is_causal = module.is_causal
    causal = bool(is_causal)
    if attention_mask is not None and not _is_padding_mask(attention_mask, query, key, causal):
        raise ValueError(f"{_where(module)}: {_mask_problem(attention_mask, query, key, causal)} Use "
                         "attn_implementation='sdpa' for it.")
    unsupported = {
        "s_aux": kwargs.get("s_aux"),
        "position_bias": kwargs.get("position_bias"),
    }
    for name, val in unsupported.items():
        if val is not None:
            raise NotImplementedError(
                f"{_where(module)}: {name} is not supported by flash_attn_hopper yet (got {name} != None)"
            )
    unknown = sorted(name for name, val in kwargs.items()
                     if val is not None and name not in _CONSUMED_KWARGS and name not in _HARMLESS_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"{_where(module)}: got the keyword argument(s) {', '.join(unknown)}, which flash_attn_hopper does not "
            "know; such arguments can change the attention (attention sinks, sparse key indices, ...), so they are "
            "not dropped silently. Use attn_implementation='eager' or 'sdpa' for this model."
        )
    keys_only = attention_mask is not None and not causal
    if keys_only and sliding_window is not None and query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"{_where(module)}: sliding_window={sliding_window!r} in non-causal attention with a padding mask and "
            f"{query.shape[2]} queries against {key.shape[2]} keys (cross-attention) is not supported: the window's "
            "alignment of queries to the unpadded keys is not defined. Use attn_implementation='sdpa' for it."
        )
    # Non-causal without a window: the mask describes the keys (for cross-attention, only the keys), every query row
    # is computed; a bidirectional window needs the query positions, so it keeps the self-attention unpadding.
    keys_only = keys_only and sliding_window is None
    packed = None if attention_mask is not None else _packed_sequences(module, query, key, kwargs)
    documents = None if attention_mask is not None or packed is not None else _documents(
        kwargs.get("position_ids"), query, key)
    if kwargs.get("output_attentions", False):
        transformers.utils.logging.get_logger(__name__).warning_once(
            "flash_attn_hopper attention does not form attention weights; `output_attentions=True` returns None "
            "for them. Use attn_implementation='eager' to get them."
        )

    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # Autocast casts SDPA's inputs to the autocast dtype; do the same (no-op for tensors already in it).
        target = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(target), key.to(target), value.to(target)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in _interface.SUPPORTED_DTYPES:
            raise TypeError(
                f"{_where(module)}: {name} has dtype {t.dtype}; flash_attn_hopper computes in torch.float16 or "
                "torch.bfloat16: build the model with dtype=torch.bfloat16, or run it under "
                "torch.autocast(device_type='cuda', dtype=torch.bfloat16)"
            )

    window_size = (-1, -1)
    if sliding_window is not None:
        # transformers' sliding window W: a query sees itself and the W - 1 keys before it (and, bidirectional, the
        # W - 1 after it), as in its mask functions and its flash-attention path.
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"{_where(module)}: sliding_window must be an int >= 1, got {sliding_window!r}")
        window_size = (sliding_window - 1, 0 if causal else sliding_window - 1)
        if not causal:
            _check_band(module, sliding_window)
    # deterministic as transformers' flash-attention path takes it: the keyword, else FLASH_ATTENTION_DETERMINISTIC=1.
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    options = dict(softmax_scale=scaling, causal=causal, window_size=window_size,
                   softcap=0.0 if softcap is None else softcap, deterministic=deterministic)
    # (batch, nheads, seqlen, head_dim) -> (batch, seqlen, nheads, head_dim): a view; the kernel reads these strides.
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if packed is not None:  # one row of packed sequences: (total, nheads, head_dim) views of it
        cu_q, cu_k, max_q, max_k = packed
        attn_output = _interface.attention_varlen(query[0], key[0], value[0], cu_q, cu_k, max_q, max_k, **options)
        return attn_output.unsqueeze(0), None
    if attention_mask is not None:
        return _padded_attention(attention_mask, query, key, value, options, keys_only), None
    return _interface.attention(query, key, value, document_ids=documents, **options), None


def _is_padding_mask(attention_mask, query, key, causal):
    """Whether attention_mask is the 2D boolean (batch, kv_length) padding mask that transformers' flash-attention
    mask function (and so ``flash_attn_hopper_mask``) passes on; query and key are (batch, nheads, seqlen, head_dim).
    Causal attention takes the queries' positions from its last columns, so it needs kv_length >= q_length; a
    non-causal one (cross-attention: an encoder's mask) describes the keys only."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.dtype == torch.bool
        and attention_mask.shape[0] == query.shape[0]
        and attention_mask.shape[1] == key.shape[2]
        and (key.shape[2] >= query.shape[2] or not causal)
        and attention_mask.device == query.device
    )


def _mask_problem(attention_mask, query, key, causal):
    """Why attention_mask is not a padding mask ``_is_padding_mask`` accepts (the middle of a ValueError)."""
    expected = (f"the 2D torch.bool (batch, key length) = ({query.shape[0]}, {key.shape[2]}) padding mask on "
                f"{query.device} that its mask function passes on (padded batches run through the variable-length "
                "kernel)")
    if not isinstance(attention_mask, torch.Tensor):
        return f"got an attention_mask of type {type(attention_mask).__name__}; flash_attn_hopper takes {expected}."
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() != 2:
        return (f"got an attention_mask of shape {shape}; flash_attn_hopper takes causal or full attention, and "
                f"{expected}; this one is a {attention_mask.dim()}D or custom mask.")
    if shape[0] == query.shape[0] and shape[1] < key.shape[2]:
        return (f"got a 2D attention_mask of {shape[1]} positions for {key.shape[2]} key/value positions: a StaticCache "
                "(also generate(..., cache_implementation='static')) or another preallocated cache returns positions "
                "not filled yet, with or without an attention_mask; use a DynamicCache (generate's default).")
    if tuple(shape) == (query.shape[0], key.shape[2]) and attention_mask.dtype == torch.bool and causal:
        return (f"got a 2D padding mask with {key.shape[2]} key positions for {query.shape[2]} queries in causal "
                "attention, which aligns the queries with the mask's last columns: it needs at least as many keys as "
                "queries.")
    return (f"got a 2D attention_mask of shape {shape}, dtype {attention_mask.dtype} on {attention_mask.device}; "
            f"flash_attn_hopper takes {expected}.")


# Padding masks already turned into token indices -> {(q_length, keys_only): result of _unpadding}, per CUDA stream.
# The layers of one forward get the same mask tensor, so it is read from the device once per forward.
_UNPADDING = _ValueNotes()


# An attention_mask's padding is read on the host (by _unpadding, or by transformers to drop an all-ones mask), which a
# torch.jit.trace would keep for every replay.
_TRACED_MASK_REFUSAL = ("flash_attn_hopper: an attention_mask cannot be traced by torch.jit.trace, make_fx, "
                        "AOTAutograd or torch.export's non-strict mode: its sequence "
                        "lengths are read on the host; pass no attention_mask, or pack the batch (position_ids) "
                        "instead")


def _tracing_outside_dynamo():
    """A tracer that runs this Python code and keeps what it reads on the host as constants (torch.jit.trace, make_fx,
    AOTAutograd, torch.export's non-strict mode, fake tensors: interface._graph_tracing); dynamo instead breaks the
    graph at the host read (or raises with fullgraph=True), as docs/transformers.md says."""
    return _interface._graph_tracing() and not torch.compiler.is_dynamo_compiling()


def _unpadding(attention_mask, q_length, keys_only=False):
    """(indices_q, indices_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a (batch, kv_length) padding
    mask whose last q_length columns are the queries' positions (the keys before them come from a cache); with
    keys_only, the mask describes the keys alone and every row's q_length queries form its sequence (indices_q None)."""
    if attention_mask.is_cuda and _capturing(attention_mask.device):
        # (a cached result would replay the warm-up's padding whatever mask the graph is later given)
        raise RuntimeError("flash_attn_hopper: a padding attention_mask cannot be used inside a CUDA graph capture: its "
                           "sequence lengths are read on the host; pack the batch (position_ids) instead")
    if _tracing_outside_dynamo():  # the same: the trace would keep the trace-time lengths as constants
        raise RuntimeError(_TRACED_MASK_REFUSAL)
    # One entry per mask: BART's encoder mask serves the encoder (keys only, q_length = kv_length) and the
    # cross-attention (another q_length) in one forward.
    notes = _UNPADDING.computed(attention_mask, dict, attention_mask.device,
                                per_call=_PER_FORWARD_MASKS.get(attention_mask) is not None)
    key = (q_length, keys_only)
    if key not in notes:
        with torch.inference_mode(False):  # as _ValueNotes.computed: a training step's index_select saves the indices
            notes[key] = _unpadding_of(attention_mask, q_length, keys_only)
    return notes[key]


def _unpadding_of(attention_mask, q_length, keys_only):
    """_unpadding's result for one (q_length, keys_only)."""
    batch, kv_length = attention_mask.shape
    mask_k = attention_mask
    if keys_only:
        length_k = mask_k.sum(-1, dtype=torch.int32)
        cu_k = torch.nn.functional.pad(length_k.cumsum(-1, dtype=torch.int32), (1, 0))
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=mask_k.device) * q_length
        longest_k = max(length_k.tolist(), default=0)  # the one host read
        return None, mask_k.flatten().nonzero().flatten(), cu_q, cu_k, q_length, longest_k
    mask_q = mask_k[:, kv_length - q_length:]  # (not [:, -q_length:]: -0 takes every column)
    lengths = torch.stack([mask_q.sum(-1, dtype=torch.int32), mask_k.sum(-1, dtype=torch.int32)])
    cu = torch.nn.functional.pad(lengths.cumsum(-1, dtype=torch.int32), (1, 0))
    indices_q = mask_q.flatten().nonzero().flatten()
    indices_k = mask_k.flatten().nonzero().flatten()
    longest_q, longest_k = (max(row, default=0) for row in lengths.tolist())  # the one host read
    return indices_q, indices_k, cu[0], cu[1], longest_q, longest_k


def _padded_attention(attention_mask, query, key, value, options, keys_only=False):
    """A padded batch through ``attention_varlen``, as transformers' flash-attention path does it: the kept tokens of
    each row form one sequence (queries: the row's last q_length positions), causal masks and windows align
    bottom-right per sequence, and padded query rows get output 0. With keys_only (non-causal attention, e.g.
    cross-attention to a padded encoder output) only the keys are unpadded and every query row is computed, as in
    eager. query/key/value: (batch, seqlen, nheads, head_dim) views; returns (batch, seqlen_q, nheads, head_dim_v)."""
    batch, q_length, nheads, _ = query.shape
    indices_q, indices_k, cu_q, cu_k, max_q, max_k = _unpadding(attention_mask, q_length, keys_only)
    q = query.reshape(batch * q_length, nheads, query.shape[-1])
    if indices_q is not None:
        q = q.index_select(0, indices_q)
    k, v = (t.reshape(batch * t.shape[1], t.shape[2], t.shape[3]).index_select(0, indices_k) for t in (key, value))
    out = _interface.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options)
    if indices_q is None:
        return out.view(batch, q_length, nheads, out.shape[-1])
    full = out.new_zeros(batch * q_length, nheads, out.shape[-1]).index_copy(0, indices_q, out)
    return full.view(batch, q_length, nheads, out.shape[-1])


def _packed_sequences(module, query, key, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) from transformers' flash-attention keyword arguments
    (one row of packed sequences) when given, else None."""
    given = {name: kwargs.get(name) for name in _VARLEN_KWARGS}
    if any(v is not None for v in given.values()):
        missing = [name for name, v in given.items() if v is None]
        if missing:
            raise ValueError(f"{_where(module)}: got some of {', '.join(_VARLEN_KWARGS)} but not {', '.join(missing)}")
        if query.shape[0] != 1:
            raise ValueError(f"{_where(module)}: cu_seq_lens_* describe one row of packed sequences, got batch {query.shape[0]}")
        max_q, max_k = (int(v) for v in (given["max_length_q"], given["max_length_k"]))
        cu_q, cu_k = (t.to(device=query.device, dtype=torch.int32) for t in (given["cu_seq_lens_q"], given["cu_seq_lens_k"]))
        return cu_q, cu_k, max_q, max_k
    return None


# position_ids tensors -> (batch, document_ids for that batch), per CUDA stream. The layers of one forward pass the same
# tensor, so the ids (and the kernels' bounds, cached by flash_attn_hopper.interface per ids tensor and stream) are
# computed once per forward.
_DOCUMENTS = _ValueNotes()


def _documents(position_ids, query, key):
    """document_ids (batch, seqlen) for ``flash_attn_hopper.attention`` from position_ids, on the device with no host
    read: a new document wherever the position does not count up by one (transformers' rule, as in its
    ``find_packed_sequence_indices``). None when position_ids do not describe the self-attention rows (a cache of
    earlier keys, other shapes): there the kernel runs the causal/window rule alone, as transformers does."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    batch, seqlen = query.shape[0], query.shape[2]
    if key.shape[2] != seqlen or position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch):
        return None
    # Under torch.compile, torch.jit.trace and inside a CUDA graph capture (a replay must derive them from the ids it
    # finds) the ids are computed every call.
    compiling = _interface._graph_tracing() or (query.is_cuda and _capturing(query.device))
    if not compiling:
        cached = _DOCUMENTS.get(position_ids, query.device)
        if cached is not _ValueNotes.MISSING and cached[0] == batch:
            return cached[1]
        # Kept ids are made outside inference mode (as _ValueNotes.computed makes its results): ids made during a
        # torch.inference_mode() forward were inference tensors, which the training forwards that followed with the
        # same position_ids were served; flash_attn_hopper.attention never keeps the bounds of inference tensors, so
        # every layer of those forwards recomputed them.
        version = _ValueNotes._version(position_ids, False)  # before the ids are made: round 42's HI
        with torch.inference_mode(False):
            ids = _document_ids(position_ids, query.device, batch, seqlen)
        _DOCUMENTS.put(position_ids, (batch, ids), query.device, version=version)
        return ids
    return _document_ids(position_ids, query.device, batch, seqlen)


def _document_ids(position_ids, device, batch, seqlen):
    """_documents' ids: a new document wherever the position does not count up by one, expanded to the batch."""
    pos = position_ids.to(device)
    restarts = (pos[:, 1:] != pos[:, :-1] + 1).to(torch.int32)
    ids = torch.cat([torch.zeros_like(restarts[:, :1]), restarts], dim=1).cumsum(1, dtype=torch.int32)
    return ids.expand(batch, seqlen)


def _without_packing_check(preprocess):
    """Wraps transformers' ``masking_utils._preprocess_mask_arguments`` (checked: 5.17), which the model's mask builder
    calls once per forward: for ``attn_implementation="flash_attn_hopper"`` it is called without position_ids, which it
    reads only to look for packed sequences, through ``find_packed_sequence_indices``, a device read (a host
    synchronization every forward, which stalls an eager training loop the GPU would otherwise run ahead of). The
    attention layers find packed sequences in position_ids themselves, on the device (``_documents``). Other
    attention implementations get the function unchanged."""
    if getattr(preprocess, "_flash_attn_hopper_wrapper", False):
        return preprocess

    def wrapper(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args, **kwargs):
        if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            position_ids = None
        return preprocess(config, inputs_embeds, attention_mask, past_key_values, position_ids, *args, **kwargs)

    wrapper._flash_attn_hopper_wrapper = True
    wrapper.__wrapped__ = preprocess
    wrapper.__doc__ = preprocess.__doc__
    return wrapper


def _without_packed_overlay(mask_function):
    """transformers (checked: 5.17) composes ``and_masks(pattern, packed_sequence_mask_function(...))`` when it finds
    packed sequences in position_ids; returns ``pattern`` for that composition, else ``mask_function`` unchanged."""
    if getattr(mask_function, "__name__", "") != "and_mask" or not getattr(mask_function, "__closure__", None):
        return mask_function
    parts = [c.cell_contents for c in mask_function.__closure__ if isinstance(c.cell_contents, tuple)]
    if len(parts) != 1 or len(parts[0]) != 2:
        return mask_function
    pattern, overlay = parts[0]
    # (__code__.co_qualname too: while torch.compile traces, a nested function's __qualname__ reads as "")
    names = (getattr(overlay, "__qualname__", ""), getattr(getattr(overlay, "__code__", None), "co_qualname", ""))
    if "packed_sequence_mask_function.<locals>.inner_mask" not in names:
        return mask_function
    return pattern


def _check_band(module, sliding_window):
    """Non-causal attention with a sliding window W runs the band |i - j| <= W - 1 (transformers' flash-attention
    convention, window (W - 1, W - 1); ModernBERT passes W = H + 1 for its mask |i - j| <= H). Eager follows the
    model's mask instead: the half-width H that ``flash_attn_hopper_mask`` recognised for the module's config, else
    the config's ``sliding_window`` (the band ``create_bidirectional_sliding_window_mask`` builds). Where that is not
    W - 1 (T5Gemma's encoder passes W = H; DiffusionGemma's decoder passes W = config.sliding_window with a mask that
    has no band at all) the two differ: refused rather than run with a mask other than eager's. A module without a
    config (a direct call) is taken at its word. The mask function recognises no pattern while torch.compile traces
    it: a model whose band is not config.sliding_window (Gemma 3 with use_bidirectional_attention) is then refused
    until one forward outside torch.compile has let its mask be recognised, and the message says so."""
    config = getattr(module, "config", None)
    band = _BIDIRECTIONAL_WINDOWS.get(config) if config is not None else None
    recognised = band is not None
    if band is None:
        band = getattr(config, "sliding_window", None)
        if isinstance(band, bool) or not isinstance(band, int):
            return
    if band != sliding_window - 1:
        if recognised:
            source = (f"the model's own mask (eager, sdpa) is the band |i - j| <= {band}; the layer should pass "
                      f"sliding_window={band + 1}")
        else:
            source = ("no bidirectional sliding-window mask was recognised for this model's config (the mask function "
                      "recognises none while torch.compile traces it: run one forward outside torch.compile first), "
                      f"so its config.sliding_window is taken as the band of eager's mask: |i - j| <= {band} (a layer "
                      f"of that band passes sliding_window={band + 1}; with a mask without a band eager attends to "
                      "every key)")
        raise NotImplementedError(
            f"{_where(module)}: sliding_window={sliding_window} in non-causal attention means the band |i - j| <= "
            f"{sliding_window - 1} (transformers' flash-attention convention), but {source}. Use "
            "attn_implementation='sdpa' for this model."
        )


def _reads_tensors(obj, depth=0, seen=None, read_globals=True):
    """Whether a mask function reads tensors besides its index arguments: a tensor in a closure cell, a default value,
    a module global it names, a bound ``self`` or a partial's arguments, also of the functions it composes
    (``and_masks`` / ``or_masks`` keep them in a closure tuple). Such a mask depends on data, per batch row (image or
    token-type blocks: Gemma 3's and PaliGemma's ``blockwise_overlay``, a chunked mask's left padding), that sample
    indices of batch row 0 cannot cover; and evaluating it at sample indices past the sequence would index those
    tensors out of bounds (on a CUDA device a device-side assert, which no exception handler undoes)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 16 or id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, (tuple, list, set, frozenset)):
        parts = list(obj)
    elif isinstance(obj, dict):
        parts = list(obj.values())
    elif isinstance(obj, functools.partial):
        parts = [obj.func, obj.args, obj.keywords]
    elif isinstance(obj, types.MethodType):
        parts = [obj.__func__, obj.__self__]
    elif isinstance(obj, types.FunctionType):
        parts = [obj.__defaults__ or (), obj.__kwdefaults__ or {}]
        if read_globals:  # (torch.compile's trace cannot read a function's globals: _refuse_while_compiling)
            parts += [v for v in (obj.__globals__.get(n) for n in obj.__code__.co_names) if isinstance(v, torch.Tensor)]
        for cell in obj.__closure__ or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    elif callable(obj) and hasattr(obj, "__dict__"):  # a callable object: its attributes
        parts = list(vars(obj).values())
    else:
        return False
    return any(_reads_tensors(part, depth + 1, seen, read_globals) for part in parts)


def _mask_values(mask_function, q, kv):
    """mask_function(batch 0, head 0, q, kv) on plain host index tensors, or None where it cannot be evaluated on
    them (not index-based) or must not be (it reads tensors: ``_reads_tensors``). Its tensors are made outside any
    dispatch mode: under a FakeTensorMode (torch.export's non-strict mode, shape tracing) they would be fake, and the
    comparisons' values data-dependent. They (and the sample indices of the pattern checks) name the CPU: made on the
    default device, ``torch.set_default_device("cuda")`` ran each check on the GPU with a host synchronisation (an
    error inside a CUDA graph capture), and a meta default device made it raise."""
    if _reads_tensors(mask_function):
        return None
    with _python_dispatch._disable_current_modes():
        q, kv = torch.as_tensor(q, device="cpu").view(-1, 1), torch.as_tensor(kv, device="cpu")
        kv = kv.view(1, -1) if kv.dim() == 1 else kv
        zero = torch.tensor(0, device="cpu")
        try:
            got = torch.as_tensor(mask_function(zero, zero, q, kv), device="cpu")
            return got.expand(torch.broadcast_shapes(q.shape, kv.shape))
        except Exception:
            return None


def _is_sliding_causal(mask_function, window):
    """Whether mask_function(batch, head, q, kv) is ``kv <= q and kv > q - window`` (transformers'
    ``sliding_window_causal_mask_function(window)``), checked at the window's edges for a few query positions."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return False
    with _python_dispatch._disable_current_modes():
        q = torch.tensor([0, 1, window - 1, window, window + 1, 2 * window + 3], device="cpu").view(-1, 1)
        kv = (q + torch.tensor([-window - 1, -window, -window + 1, -1, 0, 1], device="cpu")).clamp(min=0)
        got = _mask_values(mask_function, q, kv)
        return got is not None and bool(torch.equal(got, (kv <= q) & (kv > q - window)))


def _is_sliding_bidirectional(mask_function, half_width):
    """Whether mask_function(batch, head, q, kv) is ``|q - kv| <= half_width`` (transformers'
    ``sliding_window_bidirectional_mask_function(half_width)``: ModernBERT's local layers and the like), checked on
    both sides of the band for a few query positions."""
    if isinstance(half_width, bool) or not isinstance(half_width, int) or half_width < 0:
        return False
    w = half_width
    with _python_dispatch._disable_current_modes():
        q = torch.tensor([0, 1, w, w + 1, 2 * w + 3], device="cpu").view(-1, 1)
        kv = (q + torch.tensor([-w - 1, -w, -w + 1, -1, 0, 1, w - 1, w, w + 1], device="cpu")).clamp(min=0)
        got = _mask_values(mask_function, q, kv)
        return got is not None and bool(torch.equal(got, (kv - q).abs() <= w))


def _bidirectional_half_width(mask_function, local_size):
    """H when mask_function is the band ``|q - kv| <= H`` for H = local_size (transformers'
    ``create_bidirectional_sliding_window_mask``: ModernBERT) or local_size - 1 (a sliding-window causal mask of
    window local_size widened by a bidirectional overlay ``|q - kv| < local_size``: Gemma 3 with
    ``use_bidirectional_attention``, EmbeddingGemma); else None."""
    if isinstance(local_size, bool) or not isinstance(local_size, int):
        return None
    return next((h for h in (local_size, local_size - 1) if _is_sliding_bidirectional(mask_function, h)), None)


def _is_everywhere(mask_function):
    """Whether mask_function lets every query see every key (a bidirectional mask built as an overlay, e.g. a causal
    mask or'ed with True: Gemma 3 with ``use_bidirectional_attention``), checked on near and far index pairs on both
    sides of the diagonal; never for a mask that reads tensors (``_reads_tensors``: data-dependent overlays such as
    image blocks, which may be True everywhere in batch row 0 only)."""
    if mask_function is bidirectional_mask_function:
        return True
    with _python_dispatch._disable_current_modes():
        idx = torch.tensor([0, 1, 2, 7, 63, 64, 65, 1000, 4097, 70001], device="cpu")
        got = _mask_values(mask_function, idx, idx)
        return got is not None and bool(got.all())


# Model configs -> the half-width H of the bidirectional sliding-window mask (|i - j| <= H) that transformers asked
# this mask function for. The attention function runs the layers' window from their sliding_window argument W as
# (W - 1, W - 1), transformers' flash-attention convention (ModernBERT passes W = H + 1 for it); a layer whose W - 1
# is not the mask's H would silently differ from eager, so it raises instead.
_BIDIRECTIONAL_WINDOWS = _IdentityNotes()
# The padding-mask views flash_attn_hopper_mask returns, one per model forward (see _unpadding).
_PER_FORWARD_MASKS = _IdentityNotes()


def _pattern_refusal(mask_function):
    return ("flash_attn_hopper attention supports plain causal, bidirectional and sliding-window (causal or "
            "bidirectional) masks only; this model call needs the mask pattern "
            f"{getattr(mask_function, '__name__', mask_function)!r}: a chunked pattern or a custom mask function, or "
            "one that reads tensors (image or token-type blocks) (packed sequences and sliding windows are fine); use "
            "attn_implementation='sdpa' for this model.")


def _check_filled(kv_length, filled):
    if kv_length != filled:
        raise ValueError(
            f"flash_attn_hopper attention: the cache returns {kv_length} key/value positions but only {filled} are "
            "filled (a StaticCache or other preallocated cache); without an attention_mask the empty positions would "
            "be attended. Use a DynamicCache, or attn_implementation='sdpa'."
        )


def _refuse_while_compiling(mask_function, q_length, kv_length, q_offset, kv_offset, attention_mask):
    """flash_attn_hopper_mask's refusals that need no host value, kept while torch.compile traces (skipping them there
    let a compiled model run, silently, what its eager forward refuses): a mask that reads tensors (Gemma 3's image
    blocks, PaliGemma's prefix: ``_reads_tensors`` inspects the function's closures, evaluating nothing; the trace
    cannot read its globals), and, for a causal mask without an attention_mask, a cache with empty positions where
    the offsets are plain ints (a StaticCache's prefill or a call with its offsets given as ints). What needs the
    mask's values (sample indices: chunked or other custom patterns of plain indices) or a tensor offset stays
    unchecked here (docs/transformers.md)."""
    pattern = _without_packed_overlay(mask_function)
    if (pattern is not causal_mask_function and pattern is not bidirectional_mask_function
            and _reads_tensors(pattern, read_globals=False)):
        raise ValueError(_pattern_refusal(pattern))
    if (pattern is causal_mask_function and attention_mask is None and isinstance(q_offset, int)
            and isinstance(kv_offset, int) and isinstance(kv_length, int) and isinstance(q_length, int)):
        _check_filled(kv_length, q_offset + q_length - kv_offset)


def flash_attn_hopper_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=causal_mask_function,
    attention_mask=None,
    **kwargs,
):
    """transformers mask function (``AttentionMaskInterface`` signature) for ``flash_attn_hopper``.

    Returns None when the attention is plain causal, plain bidirectional (also as an overlay that lets every query see
    every key, checked on sample indices) or with a sliding window (transformers'
    ``sliding_window_causal_mask_function`` or the band ``|i - j| <= H`` with H = ``local_size`` or ``local_size - 1``,
    recognised by the ``local_size`` argument and checked on sample indices; the band's half-width is noted for the
    ``config`` passed, which the attention function checks its layers' windows against) without padding (``attention_mask`` None or all ones), so the attention function runs the kernel's own masking;
    otherwise returns the 2D boolean padding mask ``(batch, kv_length)``, with which
    ``flash_attn_hopper_attention_forward`` runs the batch through the variable-length kernel. Same
    as transformers' ``flash_attention_mask``, plus two checks, of which torch.compile's trace keeps the parts that need
    no host value (``_refuse_while_compiling``):

    Packed sequences: ``register()`` keeps transformers from looking for them for this name (the attention layers
    take them from position_ids on the device); should its ``packed_sequence_mask_function`` overlay still arrive (a
    model that calls the mask preprocessing by its own import), it is accepted on top of those patterns, as the layers
    apply the same documents.

    Raises:
        ValueError: the mask pattern is not plain causal, bidirectional or sliding-window causal or bidirectional (a
            chunked pattern, a custom ``or/and_mask_function``, a mask that reads tensors such as Gemma 3's or
            PaliGemma's image / token-type blocks: refused without being evaluated); a bidirectional sliding window
            whose queries are not the last key positions (``q_offset + q_length != kv_offset + kv_length``: the kernel
            aligns windows bottom-right); or, without an
            attention_mask, the key/value length is not ``q_offset + q_length - kv_offset`` (a StaticCache with empty
            slots, which would be attended).
        RuntimeError: an attention_mask under torch.jit.trace (its padding is read on the host, which a trace would
            keep for every replay).
    """
    if torch.compiler.is_compiling():
        _refuse_while_compiling(mask_function, q_length, kv_length, q_offset, kv_offset, attention_mask)
    else:
        # Packed sequences: the attention layers apply them (document_ids from position_ids), so only the pattern
        # under a packing overlay must be one the kernel computes.
        mask_function = _without_packed_overlay(mask_function)
        local_size = kwargs.get("local_size")
        sliding = local_size is not None and _is_sliding_causal(mask_function, local_size)
        half_width = None if sliding or local_size is None else _bidirectional_half_width(mask_function, local_size)
        sliding_bidirectional = half_width is not None
        if (mask_function is not causal_mask_function and not sliding and not sliding_bidirectional
                and not _is_everywhere(mask_function)):
            raise ValueError(_pattern_refusal(mask_function))
        if sliding_bidirectional:
            # The kernel aligns a window bottom-right: the queries must be the last positions of the keys.
            if int(q_offset) + q_length != int(kv_offset) + kv_length:
                raise ValueError(
                    f"flash_attn_hopper attention: a bidirectional sliding window over {kv_length} key positions from "
                    f"{int(kv_offset)} for {q_length} queries from {int(q_offset)}: the queries must be the last "
                    "key positions. Use attn_implementation='sdpa' for it."
                )
            if kwargs.get("config") is not None:
                _BIDIRECTIONAL_WINDOWS.put(kwargs["config"], half_width)
        if (mask_function is causal_mask_function or sliding) and attention_mask is None:
            _check_filled(kv_length, int(q_offset) + q_length - int(kv_offset))
    if attention_mask is not None and _tracing_outside_dynamo():
        # transformers drops an all-ones mask by a host read, and a trace would keep that as "no padding" for every
        # replay (as it would keep the lengths of one with padding: _unpadding refuses those by the same message)
        raise RuntimeError(_TRACED_MASK_REFUSAL)
    mask = flash_attention_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )
    if mask is not None and mask is not attention_mask and not torch.compiler.is_compiling():
        # A view made for this forward (its last kv_length columns): its unpadding can be kept for the forward's
        # layers also under torch.inference_mode(), where the caller's mask has no version counter to tell a refill.
        _PER_FORWARD_MASKS.put(mask, True)
    return mask


def _skip_flash_kernel_lookup():
    """Keep transformers from looking for a flash-attn kernel named ``flash_attn_hopper`` when a model is built.

    transformers (checked in 5.17.0) treats every ``attn_implementation`` whose name contains "flash" as a
    flash-attention build (``utils.generic.is_flash_attention_requested`` is ``"flash" in name``), and
    ``PreTrainedModel._check_and_adjust_attn_implementation`` then calls
    ``modeling_flash_attention_utils.lazy_import_flash_attention(name)``, which searches for a flash-attn package or
    hub kernel of that name and raises "Could not find the currently requested flash attention implementation".
    That function does nothing when its module-level ``_loaded_implementation`` already equals the name (it sets it
    itself before importing), so set it. The functions it caches are used only by transformers' own flash-attention
    forward, which a model using ``flash_attn_hopper`` never calls; a later flash_attention_2/3 model reloads its own.
    Because that cache holds one name, building a flash_attention_2/3 model in the same process undoes this: call
    ``register()`` again before building the next flash_attn_hopper model.
    """
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:  # pragma: no cover - other transformers layouts
        return
    if not is_flash_attention_requested(requested_attention_implementation=ATTN_IMPLEMENTATION):
        return
    if hasattr(fa_utils, "_loaded_implementation"):
        fa_utils._loaded_implementation = ATTN_IMPLEMENTATION


def register():
    """Registers ``flash_attn_hopper`` in transformers' attention and mask registries; idempotent.

    After it, ``attn_implementation="flash_attn_hopper"`` is accepted by ``from_pretrained``, ``from_config`` and
    ``set_attn_implementation`` of every model that dispatches through ``AttentionInterface`` (Llama, Mistral, Qwen2,
    ...). Registration is global to the process (transformers' class-level mappings). Call it again before building a
    model if the process has built a flash_attention_2/3 model since (building one makes transformers look up a
    flash-attention kernel for later models as well). It also wraps transformers' mask preprocessing
    (``masking_utils._preprocess_mask_arguments``) so that, for this name only, the mask builder skips its
    packed-sequence check (a host synchronization per forward); the attention layers take packed sequences from
    position_ids on the device instead.

    Returns:
        the name, ``"flash_attn_hopper"``.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, flash_attn_hopper_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attn_hopper_mask)
    if hasattr(masking_utils, "_preprocess_mask_arguments"):
        masking_utils._preprocess_mask_arguments = _without_packing_check(masking_utils._preprocess_mask_arguments)
    _skip_flash_kernel_lookup()
    return ATTN_IMPLEMENTATION


__all__ = ["ATTN_IMPLEMENTATION", "register", "flash_attn_hopper_attention_forward", "flash_attn_hopper_mask"]
