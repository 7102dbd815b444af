"""The base model (package): the registry (configs, weights, the GGUF default), qwix LoRA on it, and
the fingerprint of its base weights.

What each module holds and which rooms this one may import: README.md beside this file.
"""
