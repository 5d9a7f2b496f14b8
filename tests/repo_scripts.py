"""Loads a script of this repository (benchmarks/, examples/, scripts/) as a module by its path, for CPU tests of
its pure-Python parts."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path, name):
    """relative_path from the repository root, e.g. "scripts/bwd_trace.py"; name: the module's name."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
