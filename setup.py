"""Builds flash_attn_hopper._C: CUDA kernels for sm_90a on CUTLASS/CuTe, ops registered through TORCH_LIBRARY.

Knobs (environment):
  FAH_HDIMS=64,128,256   kernel widths to compile (default all: 64,96,128,192,256; 96 and 192 are forward-only,
                         their backward runs on 128 and 256); one for fast development builds
  FAH_DTYPES=fp16,bf16   dtypes to compile (default both)
  CUTLASS_PATH=/path     CUTLASS source tree (default: the installed nvidia-cutlass wheel)
  MAX_JOBS=N             parallel compile jobs (torch's ninja builder)
  FAH_PTXAS_VERBOSE=1    ptxas's resource report (registers, spills) per kernel in the build log
"""

import os
import sys

from setuptools import setup

ALL_HDIMS = (64, 96, 128, 192, 256)
BWD_HDIMS = (64, 128, 256)  # 96 and 192 have forward kernels only
ALL_DTYPES = ("fp16", "bf16")
ROOT = os.path.dirname(os.path.abspath(__file__))

# torch guesses CUDA_HOME from the nvcc on PATH, which may be a wrapper script outside the toolkit; point it at
# the toolkit itself when that is unambiguous.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
    for _candidate in ("/usr/local/cuda",):
        if os.path.isfile(os.path.join(_candidate, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = _candidate
            break


def _list_knob(name, allowed, cast):
    raw = os.environ.get(name, "")
    if not raw.strip():
        return list(allowed)
    try:
        values = [cast(x.strip()) for x in raw.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"{name}={raw!r}: expected a comma-separated list from {list(allowed)}")
    bad = [x for x in values if x not in allowed]
    if bad:
        sys.exit(f"{name}: {bad} not in {list(allowed)}")
    if not values:
        # (e.g. FAH_HDIMS=",": the build went on without a kernel, and every call failed at run time)
        sys.exit(f"{name}={raw!r} selects nothing: give a comma-separated list from {list(allowed)}, or leave it unset "
                 "for all")
    return [x for x in allowed if x in values]


def _cutlass_dir():
    path = os.environ.get("CUTLASS_PATH")
    if not path:
        try:
            import cutlass_library
        except ImportError:
            sys.exit("CUTLASS headers not found: `pip install nvidia-cutlass==4.2.0.0` or set CUTLASS_PATH")
        path = cutlass_library.source_path
    inc = os.path.join(path, "include")
    if not os.path.isfile(os.path.join(inc, "cute", "tensor.hpp")):
        sys.exit(f"CUTLASS headers not found under {inc}")
    return path


def _cxx_std():
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "c++20" if (major, minor) >= (2, 13) else "c++17"


def _extension():
    ptxas_verbose = os.environ.get("FAH_PTXAS_VERBOSE", "0") not in ("", "0")
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    hdims = _list_knob("FAH_HDIMS", ALL_HDIMS, int)
    # 96 and 192 have forward kernels only: their head dims need 128 / 256 for the backward.
    for fwd_only, bwd in ((96, 128), (192, 256)):
        if fwd_only in hdims and bwd not in hdims:
            print(f"FAH_HDIMS: adding {bwd} (the backward of head_dim {fwd_only}'s kernels)", file=sys.stderr)
            hdims = sorted(hdims + [bwd])
    dtypes = _list_knob("FAH_DTYPES", ALL_DTYPES, str)
    cutlass = _cutlass_dir()
    std = _cxx_std()
    sources = ["csrc/api/flash_api.cpp", "csrc/api/varlen_rows.cu"] + [
        f"csrc/instantiations/{direction}_hdim{h}_{d}_sm90.cu"
        for direction in ("fwd", "bwd")
        for h in hdims
        for d in dtypes
        if direction == "fwd" or h in BWD_HDIMS
    ]
    defines = [f"-DFAH_HDIM{h}" for h in hdims] + [f"-DFAH_{d.upper()}" for d in dtypes]
    include_dirs = [
        os.path.join(ROOT, "csrc"),
        os.path.join(cutlass, "include"),
        os.path.join(cutlass, "tools", "util", "include"),
    ]
    cccl = os.path.join(CUDA_HOME or "/usr/local/cuda", "include", "cccl")
    if os.path.isdir(cccl):
        include_dirs.append(cccl)
    nvcc_flags = [
        f"-std={std}",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-O3",
        "-DNDEBUG",
        "--use_fast_math",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        # WGMMA tile widths that are not powers of two (N = 112 for head_dim 192's kBlockN).
        "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
        "-Xptxas=-v" if ptxas_verbose else "",
        "--resource-usage" if ptxas_verbose else "",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ] + defines
    nvcc_flags = [f for f in nvcc_flags if f]
    cxx_flags = [f"-std={std}", "-O3", "-DNDEBUG"] + defines
    del torch
    return CUDAExtension(
        name="flash_attn_hopper._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        # libstdc++ as a shared library, named by file: a toolchain whose first library directory holds only the
        # static archive (the H200 image's g++ wrapper puts its own lib/gcc first with -B) links a private copy into
        # the .so for the driver's plain -lstdc++, and that copy's iostreams crashed (SIGSEGV) formatting the first
        # TORCH_CHECK message with a number in it. Named here, after the objects and before the driver's own
        # -lstdc++, it takes the symbols (tests/test_linkage_cpu.py). The linker takes the first libstdc++.so.6 on its
        # search path; an older copy in a -L directory ahead of the compiler's can leave newer symbols unresolved.
        extra_link_args=["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else [],
        # No -lcuda: CUTLASS reaches cuTensorMapEncodeTiled through cudaGetDriverEntryPoint, so the build needs no
        # driver library (CI machines have none) and the .so loads wherever torch's CUDA runtime does.
        py_limited_api=True,
    )


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _build_ext()},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},  # compiled with Py_LIMITED_API 3.10
)
