"""Every input check of ``flash_attn_hopper.attention``, on CPU: each case asserts the exception type and that the
message names the offending argument (and, where there is one, the accepted values).

No GPU is needed: ``attention`` checks types, shapes and strides before devices, so CPU tensors reach every shape
check; the device checks are called directly (``interface._check_devices`` / ``_check_sm90``)."""

import math
import re

import pytest
import torch

import flash_attn_hopper
from flash_attn_hopper import _ops, attention, interface

B, SQ, SK, H, D = 2, 5, 7, 3, 64


def _qkv(dtype=torch.float16, head_dim=D, seqlen_q=SQ, seqlen_k=SK):
    q = torch.randn(B, seqlen_q, H, head_dim).to(dtype)
    k = torch.randn(B, seqlen_k, H, head_dim).to(dtype)
    v = torch.randn(B, seqlen_k, H, head_dim).to(dtype)
    return q, k, v


def _replace(name, new, q, k, v):
    args = {"q": q, "k": k, "v": v}
    args[name] = new
    return args["q"], args["k"], args["v"]


def _shape_with(t, dim, value):
    shape = list(t.shape)
    shape[dim] = value
    return torch.randn(shape).to(t.dtype)


# --------------------------------------------------------------------------------------------- types and dtypes


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 1.0, [[1.0]], "q"], ids=["None", "float", "list", "str"])
def test_not_a_tensor(name, bad):
    q, k, v = _replace(name, bad, *_qkv())
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor, got {type(bad).__name__}"):
        attention(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool, torch.uint8])
def test_unsupported_dtype(name, dtype):
    q, k, v = _qkv()
    bad = {"q": q, "k": k, "v": v}[name].to(dtype)
    q, k, v = _replace(name, bad, q, k, v)
    with pytest.raises(TypeError, match=rf"^{name} has dtype {re.escape(str(dtype))}") as info:
        attention(q, k, v)
    assert "torch.float16" in str(info.value) and "torch.bfloat16" in str(info.value)
    # a floating dtype gets the way out (a cast, or autocast upstream); an integer one does not
    assert ("torch.autocast" in str(info.value)) == dtype.is_floating_point, str(info.value)


def test_all_float32_names_q():
    q, k, v = (t.float() for t in _qkv())
    with pytest.raises(TypeError, match=r"^q has dtype torch\.float32"):
        attention(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_dtype_mismatch(name):
    q, k, v = _qkv(torch.float16)
    bad = {"q": q, "k": k, "v": v}[name].to(torch.bfloat16)
    q, k, v = _replace(name, bad, q, k, v)
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype") as info:
        attention(q, k, v)
    msg = str(info.value)
    assert f"{name} torch.bfloat16" in msg
    assert msg.count("torch.float16") == 2


# ------------------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(name, rank):
    q, k, v = _qkv()
    t = {"q": q, "k": k, "v": v}[name]
    bad = t[:, :, 0] if rank == 3 else t.unsqueeze(0)
    q, k, v = _replace(name, bad, q, k, v)
    with pytest.raises(ValueError, match=rf"^{name} must have rank 4 .* got rank {rank}"):
        attention(q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_batch_mismatch(name):
    q, k, v = _qkv()
    bad = _shape_with({"k": k, "v": v}[name], 0, B + 1)
    q, k, v = _replace(name, bad, q, k, v)
    with pytest.raises(ValueError, match=rf"^{name} has batch {B + 1} but q has batch {B}"):
        attention(q, k, v)


def test_batch_mismatch_when_q_differs():
    q, k, v = _qkv()
    q = _shape_with(q, 0, B + 1)
    with pytest.raises(ValueError, match=rf"^k has batch {B} but q has batch {B + 1}"):
        attention(q, k, v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_seqlen_k_mismatch(name):
    q, k, v = _qkv()
    bad = _shape_with({"k": k, "v": v}[name], 1, SK + 2)
    q, k, v = _replace(name, bad, q, k, v)
    ks, vs = (SK + 2, SK) if name == "k" else (SK, SK + 2)
    with pytest.raises(ValueError, match=rf"^k and v must have the same seqlen_k, got k {ks} and v {vs}"):
        attention(q, k, v)


def test_nheads_k_not_dividing_nheads():
    q, k, v = _qkv()  # H = 3 query heads
    k2, v2 = _shape_with(k, 2, 2), _shape_with(v, 2, 2)
    with pytest.raises(ValueError, match=rf"^k has 2 heads but q has {H}; q's nheads must be a multiple of"):
        attention(q, k2, v2)


def test_nheads_k_differs_between_k_and_v():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^v has 1 heads but k has {H}"):
        attention(q, k, _shape_with(v, 2, 1))


@pytest.mark.parametrize("nheads_k", [1, H])
def test_gqa_mqa_shapes_pass_the_shape_checks(nheads_k):
    q, k, v = _qkv()  # H = 3 query heads: nheads_k 1 is MQA; 3 is MHA
    k, v = _shape_with(k, 2, nheads_k), _shape_with(v, 2, nheads_k)
    interface._check_tensor_args(q, k, v)  # no exception: the shapes are valid


def test_zero_kv_heads_need_zero_query_heads():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^k has 0 heads but q has {H}"):
        attention(q, _shape_with(k, 2, 0), _shape_with(v, 2, 0))


def test_head_dim_mismatch_k():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^k has head_dim 128 but q has head_dim {D}"):
        attention(q, _shape_with(k, 3, 128), v)
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match=rf"^k has head_dim 128 but q has head_dim {D}"):
        flash_attn_hopper.attention_varlen(q, _shape_with(k, 2, 128), v, cu_q, cu_k, 20, 20)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (128, 64), (64, 128), (40, 72), (256, 128), (8, 256)])
def test_head_dim_v_may_differ(head_dim, head_dim_v):
    """v's head_dim (that of out) may differ from q's and k's, each a multiple of 8 in [8, 256]: the shape checks
    pass (the call then fails only on the device, CPU here), dense and varlen."""
    q, k, v = _qkv(head_dim=head_dim)
    v = _shape_with(v, 3, head_dim_v)
    interface._check_tensor_args(q, k, v)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'.*CUDA"):
        attention(q, k, v)
    q, k, v, cu_q, cu_k = _varlen_args(head_dim=head_dim)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'.*CUDA"):
        flash_attn_hopper.attention_varlen(q, k, _shape_with(v, 2, head_dim_v), cu_q, cu_k, 20, 20)


@pytest.mark.parametrize("head_dim_v", [0, 4, 12, 100, 260, 264])
def test_unsupported_head_dim_v(head_dim_v):
    """v's head_dim follows the same rule as q's, and the error names v."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^v has head_dim {head_dim_v}; supported head_dim values are") as info:
        attention(q, k, _shape_with(v, 3, head_dim_v))
    assert "multiples of 8 from 8 to 256" in str(info.value)
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match=rf"^v has head_dim {head_dim_v}; supported head_dim values are"):
        flash_attn_hopper.attention_varlen(q, k, _shape_with(v, 2, head_dim_v), cu_q, cu_k, 20, 20)


@pytest.mark.parametrize("head_dim", [0, 1, 4, 12, 20, 100, 130, 255, 260, 264, 512])
def test_unsupported_head_dim(head_dim):
    """head_dim must be a multiple of 8 in [8, 256]: anything else raises before any launch, naming head_dim and the
    rule (also from attention_varlen, and with every other argument valid)."""
    q, k, v = _qkv(head_dim=head_dim)
    with pytest.raises(ValueError, match=rf"^q has head_dim {head_dim}; supported head_dim values are") as info:
        attention(q, k, v)
    assert "multiples of 8 from 8 to 256" in str(info.value)
    q, k, v, cu_q, cu_k = _varlen_args(head_dim=head_dim)
    with pytest.raises(ValueError, match=rf"^q has head_dim {head_dim}; supported head_dim values are"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20)


@pytest.mark.parametrize("head_dim", [8, 16, 40, 64, 72, 96, 104, 128, 136, 192, 200, 248, 256])
def test_head_dims_multiple_of_8_pass_the_checks(head_dim):
    """Every multiple of 8 up to 256 passes the shape checks (the call then fails only on the device, CPU here)."""
    q, k, v = _qkv(head_dim=head_dim)
    interface._check_tensor_args(q, k, v)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'.*CUDA"):
        attention(q, k, v)


@pytest.mark.parametrize(
    "head_dim,kernel,backward_kernel",
    [(8, 64, 64), (40, 64, 64), (64, 64, 64), (72, 96, 128), (96, 96, 128), (104, 128, 128), (128, 128, 128),
     (136, 192, 256), (192, 192, 256), (200, 256, 256), (256, 256, 256)]
    + [(bad, None, None) for bad in (0, -8, 4, 12, 260, 264)],
)
def test_kernel_head_dim_rounds_up(head_dim, kernel, backward_kernel):
    assert interface.kernel_head_dim(head_dim) == kernel
    assert interface.kernel_head_dim(head_dim, backward=True) == backward_kernel


@pytest.mark.parametrize("backward", [False, True])
def test_kernel_head_dim_covers_every_multiple_of_8(backward):
    sizes = interface.BACKWARD_HEAD_DIMS if backward else interface.SUPPORTED_HEAD_DIMS
    for head_dim in range(8, 257, 8):
        kernel = interface.kernel_head_dim(head_dim, backward=backward)
        assert kernel in sizes and head_dim <= kernel
        assert all(d < head_dim for d in sizes if d < kernel)  # the smallest that holds it


def test_default_softmax_scale_is_of_the_true_head_dim():
    assert interface._check_scale(None, 40) == 1.0 / math.sqrt(40)


# ----------------------------------------------------------------------------------------------------- strides


def _transposed_view(t):
    """Same shape and values as t, last-dim stride != 1 (a transposed view of a (b, s, d, h) tensor)."""
    b, s, h, d = t.shape
    view = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert view.shape == t.shape and view.stride(-1) == h
    return view


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("kind", ["transposed", "every_other"])
def test_last_dim_stride_not_one(name, kind):
    q, k, v = _qkv()
    t = {"q": q, "k": k, "v": v}[name]
    if kind == "transposed":
        bad = _transposed_view(t)
    else:
        bad = torch.randn(*t.shape[:-1], 2 * t.shape[-1]).to(t.dtype)[..., ::2]
        assert bad.shape == t.shape and bad.stride(-1) == 2
    q, k, v = _replace(name, bad, q, k, v)
    with pytest.raises(ValueError, match=rf"^{name} must have stride 1 in its last dimension"):
        attention(q, k, v)


def test_other_strides_pass_the_checks():
    """Slices of one packed (b, s, 3, h, d) tensor and a misaligned view pass every shape/stride check; the call
    then fails only on the device (CPU), not before."""
    qkv = torch.randn(B, SQ, 3, H, D).half()
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    interface._check_tensor_args(q, k, v)
    wide = torch.randn(B, SQ, H, D + 8).half()
    interface._check_tensor_args(wide[..., 1 : 1 + D], k, v)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'.*CUDA"):
        attention(q, k, v)


# --------------------------------------------------------------------------------------- softmax_scale, causal


@pytest.mark.parametrize(
    "bad",
    [float("nan"), float("inf"), float("-inf"), 0.0, 0, -0.5, 1e39, 1e-50],
    ids=["nan", "inf", "-inf", "zero", "int0", "neg", "float32-overflow", "float32-underflow"],
)
def test_softmax_scale_not_finite_or_not_positive(bad):
    with pytest.raises(ValueError, match=r"^softmax_scale must be a positive float32-representable value .*, got " + re.escape(str(float(bad)))):
        attention(*_qkv(), softmax_scale=bad)


def test_softmax_scale_zero_names_the_dropout_mix_up():
    """attention(q, k, v, 0.0) and attention_varlen(..., max_seqlen_k, 0.0) as FlashAttention-2's dropout_p: the
    refusal says so; a negative scale gets no such hint."""
    with pytest.raises(ValueError, match=r"got 0\.0; a 0\.0 here is often a dropout_p passed by position"):
        attention(*_qkv(), 0.0)
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match=r"got 0\.0; a 0\.0 here is often a dropout_p passed by position"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20, 0.0)
    with pytest.raises(ValueError, match=r"got -0\.5$"):
        attention(*_qkv(), -0.5)


@pytest.mark.parametrize(
    "bad", ["0.125", True, torch.tensor(0.125), [0.125], 1 + 2j], ids=["str", "bool", "tensor", "list", "complex"]
)
def test_softmax_scale_wrong_type(bad):
    with pytest.raises(TypeError, match=r"^softmax_scale must be a real number \(float or int\) or None, got " + type(bad).__name__):
        attention(*_qkv(), softmax_scale=bad)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_softmax_scale_default_and_accepted_values(head_dim):
    assert interface._check_scale(None, head_dim) == 1.0 / math.sqrt(head_dim)
    assert interface._check_scale(0.3, head_dim) == 0.3
    assert interface._check_scale(2, head_dim) == 2.0 and isinstance(interface._check_scale(2, head_dim), float)
    assert interface._check_scale(1e-3, head_dim) == 1e-3


@pytest.mark.parametrize("bad", [1, 0, "True", None, 1.0], ids=["int1", "int0", "str", "None", "float"])
def test_causal_not_bool(bad):
    with pytest.raises(TypeError, match=r"^causal must be a bool, got builtins\." + type(bad).__name__):
        attention(*_qkv(), causal=bad)


def test_causal_numpy_bool_accepted():
    np = pytest.importorskip("numpy")
    # Accepted as a bool: the call proceeds to the device check (CPU tensors here).
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        attention(*_qkv(), causal=np.bool_(True))


# ---------------------------------------------------------------------------------------------- window, softcap


@pytest.mark.parametrize("bad", [5, (1, 2, 3), "ab", None, (1,)], ids=["int", "triple", "str", "None", "single"])
def test_window_size_not_a_pair(bad):
    with pytest.raises(TypeError, match=r"^window_size must be a pair \(left, right\) of ints"):
        attention(*_qkv(), window_size=bad)


@pytest.mark.parametrize("bad,side", [((1.0, 2), "left"), ((1, True), "right"), ((None, 0), "left")])
def test_window_size_side_not_int(bad, side):
    with pytest.raises(TypeError, match=rf"^window_size {side} side must be an int"):
        attention(*_qkv(), window_size=bad)


@pytest.mark.parametrize("bad,side", [((-2, 0), "left"), ((3, -5), "right")])
def test_window_size_below_minus_one(bad, side):
    with pytest.raises(ValueError, match=rf"^window_size {side} side must be >= -1 \(-1: unbounded\)"):
        attention(*_qkv(), window_size=bad)


def test_window_size_right_side_with_causal():
    with pytest.raises(ValueError, match=r"^causal=True means a window right side of 0"):
        attention(*_qkv(), causal=True, window_size=(4, 1))


@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (4, 0), (-1, 0), [3, 7], (2**40, 2**40)])
def test_window_size_accepted(window):
    np = pytest.importorskip("numpy")
    # Accepted: the call proceeds to the device check (CPU tensors here).
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        attention(*_qkv(), window_size=window)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        attention(*_qkv(), window_size=(np.int64(window[0]), window[1] if window[1] <= 0 else 0), causal=True)


def test_window_size_with_causal_fixes_right_side():
    assert interface._check_window((5, -1), True) == (5, 0)
    assert interface._check_window((5, 0), True) == (5, 0)
    assert interface._check_window((-1, -1), False) == (-1, -1)
    assert interface._check_window((2**40, 3), False) == (2**31 - 1, 3)


@pytest.mark.parametrize("bad", ["1", None, True, 1j], ids=["str", "None", "bool", "complex"])
def test_softcap_wrong_type(bad):
    with pytest.raises(TypeError, match=r"^softcap must be a real number \(float or int\)"):
        attention(*_qkv(), softcap=bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), -0.5])
def test_softcap_negative_or_not_finite(bad):
    with pytest.raises(ValueError, match=r"^softcap must be finite and >= 0 \(0: off\)"):
        attention(*_qkv(), softcap=bad)


@pytest.mark.parametrize("softcap,scale", [(1e-39, 1.0), (1e38, 1e-3), (3e38, 1.0)])
def test_softcap_out_of_float32_range(softcap, scale):
    with pytest.raises(ValueError, match=r"softmax_scale / softcap and softcap \* log2\(e\) must be normal float32"):
        attention(*_qkv(), softcap=softcap, softmax_scale=scale)


@pytest.mark.parametrize("softcap", [0, 0.0, 30, 50.0])
def test_softcap_accepted(softcap):
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        attention(*_qkv(), softcap=softcap)


# ----------------------------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_tensors_rejected(causal):
    # The message names the GPUs that run it: a user without one learns a CUDA device alone is not enough.
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'; flash_attn_hopper needs tensors on a CUDA device "
                       r"\(an sm90 GPU: H100, H200, H800, GH200\)$"):
        attention(*_qkv(), causal=causal)


def test_shape_errors_come_before_device_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^k has head_dim"):
        attention(q, _shape_with(k, 3, 128), v)


@pytest.mark.parametrize("name", ["k", "v"])
def test_check_devices_names_the_cpu_tensor(name):
    devs = {"q": torch.device("cuda:0"), "k": torch.device("cuda:0"), "v": torch.device("cuda:0")}
    devs[name] = torch.device("cpu")
    with pytest.raises(ValueError, match=rf"^{name} is on device 'cpu'; .*CUDA device"):
        interface._check_devices(list(devs.items()))


@pytest.mark.parametrize("name", ["k", "v"])
def test_check_devices_different_cuda_devices(name):
    devs = {"q": torch.device("cuda:0"), "k": torch.device("cuda:0"), "v": torch.device("cuda:0")}
    devs[name] = torch.device("cuda:1")
    with pytest.raises(ValueError, match=rf"^{name} is on cuda:1 but q is on cuda:0; all tensors must be on one"):
        interface._check_devices(list(devs.items()))


def test_check_devices_accepts_one_cuda_device():
    assert interface._check_devices([(n, torch.device("cuda:1")) for n in "qkv"]) is None


def test_check_sm90_rejects_other_gpus(monkeypatch):
    monkeypatch.setattr(interface, "_SM90_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"^q is on cuda:0, a GPU of compute capability 8\.0") as info:
        interface._check_sm90("q", torch.device("cuda:0"))
    msg = str(info.value)
    assert "NVIDIA A100" in msg and "sm90" in msg and "H100/H200" in msg


@pytest.mark.parametrize("capability", [(9, 0)])
def test_check_sm90_accepts_hopper(monkeypatch, capability):
    monkeypatch.setattr(interface, "_SM90_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert interface._check_sm90("q", torch.device("cuda:0")) is None


def test_check_sm90_asks_each_device_once(monkeypatch):
    monkeypatch.setattr(interface, "_SM90_DEVICES", set())
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    for _ in range(3):
        interface._check_sm90("q", torch.device("cuda:1"))
    assert asked == [torch.device("cuda:1")]


@pytest.mark.parametrize("capability", [(10, 0), (12, 0), (8, 9)])
def test_check_sm90_rejects_newer_and_older(monkeypatch, capability):
    monkeypatch.setattr(interface, "_SM90_DEVICES", set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    with pytest.raises(ValueError, match=rf"^q is on cuda:0, a GPU of compute capability {capability[0]}\."):
        interface._check_sm90("q", torch.device("cuda:0"))


# ---------------------------------------------------------------------------------------- build and extension


def test_check_compiled_names_head_dim_and_dtype(monkeypatch):
    monkeypatch.setattr(_ops, "_compiled", lambda: ((128,), (torch.float16,)))
    with pytest.raises(
        ValueError, match=r"^q has head_dim 64 \(run by the head_dim 64 forward kernels\), which this build does not include"
    ) as info:
        interface._check_compiled(64, torch.float16)
    assert "[128]" in str(info.value)
    with pytest.raises(TypeError, match=r"^q has dtype torch\.bfloat16, which this build does not include"):
        interface._check_compiled(128, torch.bfloat16)
    assert interface._check_compiled(128, torch.float16) is None


def test_check_compiled_uses_the_larger_of_head_dim_and_head_dim_v(monkeypatch):
    """With v's head_dim differing, the kernels are those of the larger one; the error names both."""
    monkeypatch.setattr(_ops, "_compiled", lambda: ((96, 128), (torch.float16,)))
    for head_dim, head_dim_v in ((128, 64), (64, 128), (40, 72), (72, 72)):
        assert interface._check_compiled(head_dim, torch.float16, head_dim_v) is None
    for head_dim, head_dim_v, kernel in ((192, 128, 192), (128, 256, 256)):
        with pytest.raises(
            ValueError,
            match=rf"^q has head_dim {head_dim} and v head_dim {head_dim_v} \(run by the head_dim {kernel} forward "
            r"kernels\), which this build does not include",
        ):
            interface._check_compiled(head_dim, torch.float16, head_dim_v)


def test_check_compiled_needs_the_backward_kernel_too(monkeypatch):
    """head_dim 96 runs forward on the 96-wide kernel and backward on the 128-wide one: both must be built."""
    monkeypatch.setattr(_ops, "_compiled", lambda: ((96,), (torch.float16,)))
    with pytest.raises(
        ValueError,
        match=r"^q has head_dim 96 \(run by the head_dim 128 backward kernels\), which this build does not include",
    ):
        interface._check_compiled(96, torch.float16)


def test_check_compiled_uses_the_rounded_head_dim(monkeypatch):
    """A head_dim that runs on a larger kernel is in the build when that kernel size is; the error names both."""
    monkeypatch.setattr(_ops, "_compiled", lambda: ((96, 128), (torch.float16,)))
    for head_dim in (72, 96, 120, 128):
        assert interface._check_compiled(head_dim, torch.float16) is None
    for head_dim, kernel in ((40, 64), (8, 64), (136, 192), (248, 256)):
        with pytest.raises(
            ValueError,
            match=rf"^q has head_dim {head_dim} \(run by the head_dim {kernel} forward kernels\), which this build does "
            "not include",
        ) as info:
            interface._check_compiled(head_dim, torch.float16)
        assert "[96, 128]" in str(info.value)


# ------------------------------------------------------------------------------------- failed calls touch nothing


@pytest.mark.parametrize(
    "case",
    ["cpu_device", "bad_scale", "bad_causal", "head_dim_mismatch", "dtype_mismatch", "stride", "bad_window",
     "bad_softcap"],
)
def test_failed_call_leaves_inputs_unchanged(case):
    q, k, v = _qkv()
    kwargs = {}
    if case == "bad_scale":
        kwargs["softmax_scale"] = float("nan")
    elif case == "bad_causal":
        kwargs["causal"] = 1
    elif case == "head_dim_mismatch":
        v = _shape_with(v, 3, 128)
    elif case == "dtype_mismatch":
        k = k.to(torch.bfloat16)
    elif case == "stride":
        q = _transposed_view(q)
    elif case == "bad_window":
        kwargs["window_size"] = (-3, 0)
    elif case == "bad_softcap":
        kwargs["softcap"] = -1.0
    before = [(t.clone(), t.shape, t.stride(), t.dtype, t.data_ptr()) for t in (q, k, v)]
    with pytest.raises((TypeError, ValueError)):
        attention(q, k, v, **kwargs)
    for t, (clone, shape, stride, dtype, ptr) in zip((q, k, v), before):
        assert t.shape == shape and t.stride() == stride and t.dtype == dtype and t.data_ptr() == ptr
        assert torch.equal(t, clone)


@pytest.mark.parametrize("what,dim", [("batch", 0), ("nheads", 2)])
def test_batch_or_nheads_beyond_grid_limit(what, dim):
    shape = [1, 4, 1, D]
    shape[dim] = 65536
    t = torch.randn(1, 4, 1, D).half().expand(*shape)  # no memory for the large dim
    with pytest.raises(ValueError, match=rf"^q has {what} 65536; at most 65535 is supported"):
        attention(t, t, t)


# ------------------------------------------------------------------------------------------------- attention_varlen


def _varlen_args(total_q=30, total_k=30, head_dim=D):
    q = torch.randn(total_q, H, head_dim).half()
    k = torch.randn(total_k, H, head_dim).half()
    v = torch.randn(total_k, H, head_dim).half()
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    return q, k, v, cu, cu.clone()


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_varlen_rank(name):
    q, k, v, cu_q, cu_k = _varlen_args()
    args = {"q": q, "k": k, "v": v}
    args[name] = args[name][None]
    with pytest.raises(ValueError, match=rf"^{name} must have rank 3 \(total_tokens, nheads, head_dim\)"):
        flash_attn_hopper.attention_varlen(args["q"], args["k"], args["v"], cu_q, cu_k, 20, 20)


def test_varlen_k_v_rows_named_as_rows():
    """A varlen k / v mismatch is in rows (total_k): the message must not speak of a seqlen_k varlen has not."""
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match=r"^k and v must have the same number of rows \(total_k\), got k 30 and v 10"):
        flash_attn_hopper.attention_varlen(q, k, v[:10], cu_q, cu_k, 20, 20)


@pytest.mark.parametrize(
    "which,bad,exc,match",
    [
        ("q", torch.tensor([0, 10, 30], dtype=torch.int64), ValueError, r"^cu_seqlens_q must have dtype torch\.int32"),
        ("k", torch.tensor([0, 10, 30], dtype=torch.float32), ValueError, r"^cu_seqlens_k must have dtype torch\.int32"),
        ("q", torch.tensor([[0, 10, 30]], dtype=torch.int32), ValueError, r"^cu_seqlens_q must be 1-D of length batch"),
        ("k", torch.tensor([], dtype=torch.int32), ValueError, r"^cu_seqlens_k must be 1-D of length batch \+ 1 >= 1"),
        ("q", [0, 10, 30], TypeError, r"^cu_seqlens_q must be a torch\.Tensor"),
        ("k", torch.tensor([0, 30], dtype=torch.int32), ValueError, r"^cu_seqlens_q and cu_seqlens_k must have the same"),
    ],
)
def test_varlen_cu_seqlens_meta(which, bad, exc, match):
    q, k, v, cu_q, cu_k = _varlen_args()
    if which == "q":
        cu_q = bad
    else:
        cu_k = bad
    with pytest.raises(exc, match=match):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20)


@pytest.mark.parametrize(
    "max_q,max_k,exc,match",
    [(20.0, 20, TypeError, r"^max_seqlen_q must be a Python int"), (20, True, TypeError, r"^max_seqlen_k must be"),
     (-1, 20, ValueError, r"^max_seqlen_q must be in \[0, 2\^31\)"), (20, 2**31, ValueError, r"^max_seqlen_k must be in")],
)
def test_varlen_max_seqlen(max_q, max_k, exc, match):
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(exc, match=match):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)


def test_varlen_max_seqlen_tensor_names_the_fix():
    """A maximum taken as seqlens.max() (a 0-d tensor) is refused with the way to pass it; a float gets no such hint."""
    q, k, v, cu_q, cu_k = _varlen_args()
    fix = re.escape("(pass int(t) or t.item())")
    with pytest.raises(TypeError, match=rf"^max_seqlen_q must be a Python int, got Tensor {fix}$"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, torch.tensor(20), 20)
    with pytest.raises(TypeError, match=r"^max_seqlen_k must be a Python int, got float$"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20.0)


def test_varlen_valid_arguments_reach_the_device_check():
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20, causal=True, window_size=(3, 0), softcap=5.0)


def test_varlen_cu_seqlens_values():
    def summary(name, cu):
        return interface._cu_seqlens_summary(name, cu)[0]

    assert summary("cu", torch.tensor([0, 10, 10, 35], dtype=torch.int32)) == (0, 35, 25)
    assert summary("cu", torch.tensor([0], dtype=torch.int32)) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"^cu must be non-decreasing, but entry 2 \(5\) < entry 1 \(10\)"):
        summary("cu", torch.tensor([0, 10, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^cu must start at an offset >= 0"):
        summary("cu", torch.tensor([-2, 10], dtype=torch.int32))
    # checked once per tensor version: an in-place change is read again
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert summary("cu", cu) == (0, 9, 5)
    cu[2] = 3
    with pytest.raises(ValueError, match="non-decreasing"):
        summary("cu", cu)


def test_seqlen_of_2_30_minus_256_rejected():
    # The kernels' mask sums reach seqlen_q + seqlen_k plus two tiles: at most 2^30 - 257 rows each keeps them in int32.
    t = torch.randn(1, 1, 1, D).half().expand(1, 2**30 - 256, 1, D)  # no memory for the long dim
    with pytest.raises(ValueError, match=r"^q has 1073741568 rows \(seqlen or total tokens\); at most 1073741567"):
        attention(t, t, t)
    short = torch.randn(1, 1, 1, D).half()
    with pytest.raises(ValueError, match=r"^k has 1073741568 rows"):
        attention(short, t, t)


def test_varlen_cu_seqlens_not_contiguous():
    q, k, v, cu_q, cu_k = _varlen_args()
    strided = torch.tensor([0, 0, 10, 0, 30, 0], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must be contiguous"):
        flash_attn_hopper.attention_varlen(q, k, v, strided, cu_k, 20, 20)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_zero_dim_tensor_rank_error(which):
    """A 0-dimensional q, k or v gets the rank error naming it from both entry points (the checked-call caches' keys
    read stride(-1), which such a tensor does not have: an IndexError naming nothing, before the checks ran)."""
    q, k, v = _qkv()
    scalar = torch.tensor(1.0, dtype=q.dtype)
    args = {"q": q, "k": k, "v": v, which: scalar}
    with pytest.raises(ValueError, match=rf"^{which} must have rank 4"):
        attention(args["q"], args["k"], args["v"])
    q, k, v, cu_q, cu_k = _varlen_args()
    args = {"q": q, "k": k, "v": v, which: scalar}
    with pytest.raises(ValueError, match=rf"^{which} must have rank 3"):
        flash_attn_hopper.attention_varlen(args["q"], args["k"], args["v"], cu_q, cu_k, 20, 20)


def test_varlen_cu_seqlens_inference_mode_not_cached():
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        copies = []
        for _ in range(2):
            summary, checked = interface._cu_seqlens_summary("cu", cu)
            assert summary == (0, 9, 5) and torch.equal(checked, cu) and not checked.is_inference()
            copies.append(checked)
        assert copies[0] is not copies[1]  # nothing kept: read (and copied) again


@pytest.mark.parametrize("bad", [1, None, "yes"], ids=["int", "None", "str"])
@pytest.mark.parametrize("flag", ["deterministic", "return_lse"])
def test_flag_not_bool(flag, bad):
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        attention(*_qkv(), **{flag: bad})
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_q, cu_k, 20, 20, **{flag: bad})


@pytest.mark.skipif(not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it)")
def test_checked_call_cache_never_skips_a_check(monkeypatch):
    """attention() remembers argument signatures that passed every check (host time per call); a call that differs in
    anything a check reads — an argument's type included (1 == True) — must still be checked. Meta tensors stand in for
    CUDA ones: the device and GPU checks are replaced, the op runs its fake kernel."""
    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_check_sm90", lambda name, device: None)
    monkeypatch.setattr(interface, "_check_compiled", lambda *a: None)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    q, k, v = (torch.empty(2, 33, 4, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    calls = []
    original = interface._check_call
    monkeypatch.setattr(interface, "_check_call", lambda *a: calls.append(a) or original(*a))
    for _ in range(3):
        attention(q, k, v, causal=True, window_size=(16, 0), softcap=0.0)
    assert len(calls) == 1  # checked once, then remembered
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(q, k, v, causal=1, window_size=(16, 0), softcap=0.0)
    with pytest.raises(ValueError, match="window_size left side must be >= -1"):
        attention(q, k, v, causal=True, window_size=(-2, 0), softcap=0.0)
    with pytest.raises(ValueError, match="causal=True means a window right side of 0"):
        attention(q, k, v, causal=True, window_size=(16, 3), softcap=0.0)
    with pytest.raises(ValueError, match="softcap must be finite"):
        attention(q, k, v, causal=True, window_size=(16, 0), softcap=-1.0)
    with pytest.raises(ValueError, match="head_dim"):
        attention(q[..., :12], k[..., :12], v[..., :12], causal=True, window_size=(16, 0), softcap=0.0)
    with pytest.raises(ValueError, match="stride 1"):
        strided = torch.empty(2, 33, 4, 128, device="meta", dtype=torch.bfloat16)[..., ::2]
        attention(strided, k, v, causal=True, window_size=(16, 0), softcap=0.0)
    with pytest.raises(TypeError, match="dtype"):
        attention(q.float(), k, v, causal=True, window_size=(16, 0), softcap=0.0)
    assert len(interface._CHECKED_CALLS) == 1
    # the default softcap (the int 0, session 73) and 0.0 are one remembered signature: no check per call
    calls.clear()
    for _ in range(3):
        attention(q, k, v, causal=True, window_size=(16, 0))
    assert len(calls) == 0 and len(interface._CHECKED_CALLS) == 1
    with pytest.raises(ValueError, match="softcap must be finite"):
        attention(q, k, v, causal=True, window_size=(16, 0), softcap=-1)


@pytest.mark.skipif(not _ops.EXTENSION_LOADED, reason="the compiled extension is not built here (CI builds it)")
def test_varlen_checked_call_cache_never_skips_a_check(monkeypatch):
    """attention_varlen remembers the signatures that passed every check but cu_seqlens' values (host time per call:
    110-127 us per call before on an H200 host, most of a seqlen-1024 kernel's time). A call that differs in anything
    a check reads must still be checked; cu_seqlens' values are checked on every call (per tensor version), and the
    op gets this call's cu_seqlens values, not those of the call that filled the cache. Meta tensors stand in for CUDA ones:
    the device and GPU checks are replaced, cu_seqlens' host summary is computed from a CPU copy."""
    seen = []

    def op(q, k, v, cu_q, cu_k, *scalars):
        seen.append((cu_q, cu_k, scalars))
        return q, torch.empty(0)

    host = {}  # meta cu_seqlens -> its values on the CPU (a meta tensor has none)
    summary = interface._cu_seqlens_summary
    _host_checks_only(monkeypatch, op, capturing=False, summary=lambda name, cu: summary(name, host[id(cu)]))
    calls = []
    original = interface._check_varlen_call
    monkeypatch.setattr(interface, "_check_varlen_call", lambda *a: calls.append(a) or original(*a))

    def cu_of(values):
        cpu = torch.tensor(values, dtype=torch.int32)
        cu = cpu.to("meta")
        host[id(cu)] = cpu
        return cu

    q, k, v = (torch.empty(40, 4, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    cu_a, cu_b = cu_of([0, 17, 40]), cu_of([0, 20, 40])
    for cu in (cu_a, cu_b, cu_a):
        flash_attn_hopper.attention_varlen(q, k, v, cu, cu, 23, 23, causal=True, window_size=(16, 0))
    assert len(calls) == 1  # checked once, then remembered
    # the values checked for this call (the eager path launches with a copy of what it read)
    assert all(torch.equal(s[0], host[id(cu)]) and torch.equal(s[1], host[id(cu)])
               for s, cu in zip(seen, (cu_a, cu_b, cu_a), strict=True))
    assert seen[0][2] == (23, 23, 0.125, True, 16, 0, 0.0, False)
    with pytest.raises(ValueError, match=r"^max_seqlen_q is 23 but cu_seqlens_q holds a sequence of length 30"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_of([0, 10, 40]), cu_a, 23, 23, causal=True,
                                           window_size=(16, 0))
    with pytest.raises(ValueError, match=r"^cu_seqlens_k must be non-decreasing"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, cu_of([0, 30, 20]), 23, 23, causal=True,
                                           window_size=(16, 0))
    assert len(calls) == 1  # the values were checked without the signature's checks
    with pytest.raises(TypeError, match="max_seqlen_q must be a Python int"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, cu_a, 23.0, 23, causal=True, window_size=(16, 0))
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, cu_a, 23, 23, causal=1, window_size=(16, 0))
    with pytest.raises(ValueError, match="window_size left side must be >= -1"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, cu_a, 23, 23, causal=True, window_size=(-2, 0))
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must have dtype torch.int32"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a.long(), cu_a, 23, 23, causal=True, window_size=(16, 0))
    with pytest.raises(ValueError, match=r"^cu_seqlens_q and cu_seqlens_k must have the same length"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_of([0, 40]), cu_a, 40, 23, causal=True, window_size=(16, 0))
    with pytest.raises(ValueError, match="stride 1"):
        strided = torch.empty(40, 4, 128, device="meta", dtype=torch.bfloat16)[..., ::2]
        flash_attn_hopper.attention_varlen(strided, k, v, cu_a, cu_a, 23, 23, causal=True, window_size=(16, 0))
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_hopper.attention_varlen(q.float(), k, v, cu_a, cu_a, 23, 23, causal=True, window_size=(16, 0))
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must be contiguous"):  # cu_a's shape, another stride
        strided_cu = torch.empty(6, dtype=torch.int32, device="meta")[::2]
        flash_attn_hopper.attention_varlen(q, k, v, strided_cu, cu_a, 23, 23, causal=True, window_size=(16, 0))
    with pytest.raises(ValueError, match=r"^cu_seqlens_k is on cpu but q is on meta"):  # cu_a's shape, on the CPU
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, torch.tensor([0, 17, 40], dtype=torch.int32), 23, 23,
                                           causal=True, window_size=(16, 0))
    assert len(interface._CHECKED_VARLEN_CALLS) == 1
    # another max_seqlen is another signature: its checks run (and pass), its values are checked against it
    with pytest.raises(ValueError, match="max_seqlen_q is 16 but cu_seqlens_q holds a sequence of length 23"):
        flash_attn_hopper.attention_varlen(q, k, v, cu_a, cu_a, 16, 23, causal=True, window_size=(16, 0))
    assert len(interface._CHECKED_VARLEN_CALLS) == 2


def _host_checks_only(monkeypatch, op, capturing, summary=None):
    """Device and extension checks pass, the checked-call cache starts empty, attention's and attention_varlen's ops
    are `op`; capturing picks attention_varlen's compile / capture branch (True) or its eager one, whose host summary
    of cu_seqlens becomes `summary(name, cu)` when given."""
    import types

    monkeypatch.setattr(interface, "_check_devices", lambda named: None)
    monkeypatch.setattr(interface, "_check_sm90", lambda name, device: None)
    monkeypatch.setattr(interface, "_check_compiled", lambda *a: None)
    monkeypatch.setattr(interface._ops, "require_extension", lambda: None)
    monkeypatch.setattr(interface, "_CHECKED_CALLS", {})
    monkeypatch.setattr(interface, "_capturing", lambda device: capturing)
    if summary is not None:
        monkeypatch.setattr(interface, "_cu_seqlens_summary", summary)
    for name in ("fwd", "fwd_varlen"):
        monkeypatch.setattr(torch.ops.flash_attn_hopper, name, types.SimpleNamespace(default=op), raising=False)


def test_torch_deterministic_mode_reaches_the_op_per_call(monkeypatch):
    """torch.use_deterministic_algorithms(True) turns on the deterministic backward of attention and attention_varlen
    (the op's last scalar argument), call by call: the checked-call cache must not keep the mode of the call that
    filled it, and an explicit deterministic=True stays on outside the mode. Meta tensors stand in for CUDA ones; the
    device checks, the extension check and the ops are replaced (the op records its deterministic argument)."""
    seen = []

    def op(q, k, v, *args):
        seen.append(args[-2] if isinstance(args[-1], (torch.Tensor, type(None))) else args[-1])
        return q, torch.empty(0)

    _host_checks_only(monkeypatch, op, capturing=False, summary=lambda name, cu: ((0, 33, 33), cu))
    q, k, v = (torch.empty(1, 33, 4, 64, device="meta", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 33], dtype=torch.int32).to("meta")
    calls = [
        lambda det: attention(q, k, v, causal=True, deterministic=det),
        lambda det: interface.attention_varlen(q[0], k[0], v[0], cu, cu, 33, 33, causal=True, deterministic=det),
    ]
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    for call in calls:
        seen.clear()
        call(False)
        try:
            torch.use_deterministic_algorithms(True)
            call(False)
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        call(False)
        call(True)
        assert seen == [False, True, False, True]


# ------------------------------------------------------------------------------------------------- document_ids


@pytest.mark.parametrize("bad", [[[0, 0, 1]], 1, "ids"], ids=["list", "int", "str"])
def test_document_ids_not_a_tensor(bad):
    q, k, v = _qkv(seqlen_k=SQ)
    with pytest.raises(TypeError, match=r"^document_ids must be a torch\.Tensor or None, got " + type(bad).__name__):
        attention(q, k, v, document_ids=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bool, torch.complex64, torch.uint32])
def test_document_ids_dtype(dtype):
    q, k, v = _qkv(seqlen_k=SQ)
    msg = r"^document_ids must be int8, int16, int32, int64 or uint8, got "
    with pytest.raises(TypeError, match=msg + re.escape(str(dtype))):
        attention(q, k, v, document_ids=torch.zeros(B, SQ, dtype=dtype))


@pytest.mark.parametrize("shape", [(B,), (B, SQ + 1), (B + 1, SQ), (1, SQ), (B, SQ, 1)])
def test_document_ids_shape(shape):
    q, k, v = _qkv(seqlen_k=SQ)
    with pytest.raises(ValueError, match=rf"^document_ids must have shape \(batch, seqlen\) = \({B}, {SQ}\), got"):
        attention(q, k, v, document_ids=torch.zeros(shape, dtype=torch.int64))


def test_document_ids_need_self_attention_lengths():
    q, k, v = _qkv()  # seqlen_q 5, seqlen_k 7
    with pytest.raises(ValueError, match=rf"^document_ids packs documents for self-attention: seqlen_q \({SQ}\) must "
                                         rf"equal seqlen_k \({SK}\)"):
        attention(q, k, v, document_ids=torch.zeros(B, SQ, dtype=torch.int32))


def test_document_ids_device():
    q, k, v = _qkv(seqlen_k=SQ)
    with pytest.raises(ValueError, match=r"^document_ids is on meta but q is on cpu"):
        attention(q, k, v, document_ids=torch.zeros(B, SQ, dtype=torch.int32, device="meta"))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_good_document_ids_pass_their_checks(dtype):
    """Valid document_ids of every integer dtype pass; the call then stops at the device check (CPU tensors)."""
    q, k, v = _qkv(seqlen_k=SQ)
    with pytest.raises(ValueError, match=r"^q is on device 'cpu'"):
        attention(q, k, v, document_ids=torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 3, 3]], dtype=dtype))


# ------------------------------------------------------------------------------------------------ forward tile count


def _reach_op(monkeypatch, capturing=True, last=None):
    """Device and extension checks pass; reaching the op raises LookupError (every argument check passed).
    capturing: attention_varlen's compile / capture branch (no host read of cu_seqlens); else its eager branch with
    cu_seqlens summarised as `last` = {"cu_seqlens_q": last row, "cu_seqlens_k": last row} (each its longest too)."""
    def op(*args):
        raise LookupError("reached the op")

    summary = None if last is None else (lambda name, cu: ((0, last[name], min(last[name], 80)), cu))
    _host_checks_only(monkeypatch, op, capturing, summary)


@pytest.mark.parametrize("batch, nheads, seqlen_q, seqlen_k, refused", [
    (65535, 16385, 128, 16, False), (65535, 16385, 129, 16, True),  # 1 073 790 975 / 2 147 581 950 tiles
    (32768, 32768, 128, 16, False), (32768, 32768, 129, 16, True),  # 2^30 / exactly 2^31 tiles
    (32768, 32768, 129, 0, False),  # no keys: the op fills the outputs without a launch
])
def test_dense_forward_tiles_past_int32_refused_by_name(monkeypatch, batch, nheads, seqlen_q, seqlen_k, refused):
    """The forward numbers its tiles (query blocks x heads x batch) in int32; the launcher refused more with a bare
    "invalid argument" RuntimeError (seventh round, class BD). Meta tensors: nothing is allocated."""
    _reach_op(monkeypatch)
    q = torch.empty(batch, seqlen_q, nheads, 8, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(batch, seqlen_k, 1, 8, device="meta", dtype=torch.bfloat16)
    if refused:
        tiles = 2 * batch * nheads
        with pytest.raises(ValueError, match=rf"^batch \({batch}\) x nheads \({nheads}\) x "
                                             rf"ceil\(seqlen_q \(129\) / 128\) = {tiles} forward tiles; at most "
                                             r"2\^31 - 1025 are supported"):
            attention(q, k, v)
    else:
        with pytest.raises(LookupError, match="reached the op"):
            attention(q, k, v)


def _check_varlen_tiles(refused, clamped, max_seqlen_q, max_seqlen_k):
    """attention_varlen over 65535 sequences x 128 heads on 114687 rows of q (meta tensors): refused naming the clamp
    `clamped` (a regex of its label and value), or reaching the op."""
    q = torch.empty(114687, 128, 128, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(114687, 8, 128, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(65536, device="meta", dtype=torch.int32)
    if refused:
        with pytest.raises(ValueError, match=r"^the number of sequences \(65535\) x nheads \(128\) x "
                                             rf"ceil\({clamped} / 128\)"):
            flash_attn_hopper.attention_varlen(q, k, v, cu, cu, max_seqlen_q, max_seqlen_k)
    else:
        with pytest.raises(LookupError, match="reached the op"):
            flash_attn_hopper.attention_varlen(q, k, v, cu, cu, max_seqlen_q, max_seqlen_k)


@pytest.mark.parametrize("max_seqlen_q, max_seqlen_k, refused", [
    (32768, 80, False), (32769, 80, True), (10**9, 80, True), (10**9, 0, False)])
def test_varlen_forward_tiles_past_int32_refused_by_name_compiling(monkeypatch, max_seqlen_q, max_seqlen_k, refused):
    """attention_varlen launches every (sequence, head, query block of the longest sequence): 65535 sequences x 128
    heads pass 2^31 - 1 tiles at 257 blocks of 128 rows and not at 256. Under torch.compile or a graph capture the op
    gets q whole and clamps max_seqlen_q to its rows: 10^9 on 114687 rows refuses as 114687 would; without keys
    (max_seqlen_k 0) there is no launch to refuse."""
    _reach_op(monkeypatch, capturing=True)
    _check_varlen_tiles(refused, r"min\(max_seqlen_q, q's rows\) \((32769|114687)\)", max_seqlen_q, max_seqlen_k)


@pytest.mark.parametrize("last_q, last_k, refused", [(32768, 200, False), (32769, 200, True), (32769, 0, False)])
def test_varlen_forward_tiles_past_int32_refused_by_name_eager(monkeypatch, last_q, last_k, refused):
    """The eager call cuts q to cu_seqlens_q[-1] rows (and k to cu_seqlens_k[-1]) before the op, which clamps
    max_seqlen_q to those rows: a max_seqlen_q of 10^9 over 114687 rows of q, of which the sequences use 32768, launches
    256 query blocks per sequence and head (accepted), 32769 rows 257 (refused); no key rows: no launch."""
    _reach_op(monkeypatch, capturing=False, last={"cu_seqlens_q": last_q, "cu_seqlens_k": last_k})
    _check_varlen_tiles(refused, r"min\(max_seqlen_q, cu_seqlens_q\[-1\]\) \(32769\)", 10**9, 80)


# The persistent forward (one CTA per SM, kernel_fwd_sm90.hpp) takes its next tile as the int32 sum
# atomicAdd(tile_counter, 1) + gridDim.x, which reaches tiles - 1 + gridDim.x: within 132 tiles of 2^31 (an H200's SMs)
# it wrapped negative, and a CTA whose producer went on while its consumers stopped at the negative tile would hang.
# The limit is 2^31 - 1025 tiles (room for 1024 CTAs).
INT32_MAX = 2**31 - 1
FWD_TILE_LIMIT = 2**31 - 1025


def test_fwd_tile_limit_leaves_room_for_the_persistent_grid():
    """The arithmetic of the persistent tile counter: tile numbers r + gridDim.x for r in [0, tiles), as int32."""
    assert interface._MAX_FWD_TILES == FWD_TILE_LIMIT
    for tiles, grid in ((FWD_TILE_LIMIT, 1024), (FWD_TILE_LIMIT, 132)):
        assert (tiles - 1) + grid <= INT32_MAX
    # inside the former limit (2^31 - 1 tiles) the sum wrapped on a 132-SM GPU: the calls refused below
    for tiles in (2**31 - 128, 2**31 - 2):
        assert tiles <= INT32_MAX and (tiles - 1) + 132 > INT32_MAX


@pytest.mark.parametrize("batch, nheads, seqlen_q, refused", [
    (38533, 55731, 128, False),  # 2^31 - 1025 tiles: the most accepted
    (33026, 65024, 128, True),  # 2^31 - 1024
    (32776, 65520, 1, True),  # 2^31 - 128: the persistent counter wrapped (77 GB at head_dim 8 with MQA k/v)
])
def test_dense_forward_tiles_near_int32_leave_room_for_the_persistent_grid(monkeypatch, batch, nheads, seqlen_q,
                                                                           refused):
    _reach_op(monkeypatch)
    q = torch.empty(batch, seqlen_q, nheads, 8, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(batch, 16, 1, 8, device="meta", dtype=torch.bfloat16)
    tiles = batch * nheads * -(-seqlen_q // 128)
    assert (tiles > FWD_TILE_LIMIT) == refused and tiles <= INT32_MAX
    if refused:
        with pytest.raises(ValueError, match=rf"^batch \({batch}\) x nheads \({nheads}\) x ceil\(seqlen_q "
                                             rf"\({seqlen_q}\) / 128\) = {tiles} forward tiles; at most 2\^31 - 1025"):
            attention(q, k, v)
    else:
        with pytest.raises(LookupError, match="reached the op"):
            attention(q, k, v)


# (sequences, nheads, max_seqlen_q (and the rows of q), refused)
VARLEN_NEAR_INT32 = [
    (15719, 45539, 384, False),  # 3 query blocks: 2^31 - 1025 tiles
    (16513, 65024, 256, True),  # 2 query blocks: 2^31 - 1024
    (65534, 32769, 1, True),  # 2^31 - 2 tiles: the wrapped counter with 512 KiB of q (one token, 65533 empty sequences)
]


def _check_varlen_tiles_near_int32(sequences, nheads, rows, refused, clamped):
    q = torch.empty(rows, nheads, 8, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(rows, 1, 8, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(sequences + 1, device="meta", dtype=torch.int32)
    tiles = sequences * nheads * -(-rows // 128)
    assert (tiles > FWD_TILE_LIMIT) == refused and tiles <= INT32_MAX
    if refused:
        with pytest.raises(ValueError, match=rf"^the number of sequences \({sequences}\) x nheads \({nheads}\) x "
                                             rf"ceil\({clamped} \({rows}\) / 128\) = {tiles} forward tiles; "
                                             r"at most 2\^31 - 1025"):
            flash_attn_hopper.attention_varlen(q, k, v, cu, cu, rows, rows)
    else:
        with pytest.raises(LookupError, match="reached the op"):
            flash_attn_hopper.attention_varlen(q, k, v, cu, cu, rows, rows)


@pytest.mark.parametrize("sequences, nheads, rows, refused", VARLEN_NEAR_INT32)
def test_varlen_forward_tiles_near_int32_compiling(monkeypatch, sequences, nheads, rows, refused):
    _reach_op(monkeypatch, capturing=True)
    _check_varlen_tiles_near_int32(sequences, nheads, rows, refused, r"min\(max_seqlen_q, q's rows\)")


@pytest.mark.parametrize("sequences, nheads, rows, refused", VARLEN_NEAR_INT32)
def test_varlen_forward_tiles_near_int32_eager(monkeypatch, sequences, nheads, rows, refused):
    _reach_op(monkeypatch, capturing=False, last={"cu_seqlens_q": rows, "cu_seqlens_k": rows})
    _check_varlen_tiles_near_int32(sequences, nheads, rows, refused, r"min\(max_seqlen_q, cu_seqlens_q\[-1\]\)")
