"""flash_attn_hopper: exact attention for NVIDIA Hopper GPUs (H100/H200) on CUTLASS/CuTe kernels."""

from ._ops import EXTENSION_LOADED, build_config
from .interface import attention, attention_varlen

__all__ = ["attention", "attention_varlen", "build_config", "EXTENSION_LOADED"]
__version__ = "0.1.0"
