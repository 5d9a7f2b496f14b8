"""Integrations of flash_attn_hopper with other libraries.

Each submodule imports its library on import, so import only the one you use; ``import flash_attn_hopper`` imports
none of them, and none of those libraries is a dependency of the package.

- ``flash_attn_hopper.integrations.transformers``: Hugging Face transformers' attention registry
  (``attn_implementation="flash_attn_hopper"``); call its ``register()`` first.
"""
