"""Optional packages some CPU tests need, with the skip marker that names what is missing."""

import importlib

import pytest

try:
    importlib.import_module("transformers")
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False

requires_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers is not installed (pip install transformers): integration not tested"
)
