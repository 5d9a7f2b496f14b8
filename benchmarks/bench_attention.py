#!/usr/bin/env python3
"""Entry point kept for scripts/gpu_check.sh and habit: the benchmark lives in flash_attn_hopper/benchmark.py
(``python -m flash_attn_hopper.benchmark``), which this file loads by path, without importing the package (and so
torch): ``--help`` and the record-only modes (``--input``) work anywhere. Same arguments; see that module."""

import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "flash_attn_hopper", "benchmark.py")
_spec = importlib.util.spec_from_file_location("_flash_attn_hopper_benchmark", _PATH)
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})

if __name__ == "__main__":
    sys.exit(_module.main())
