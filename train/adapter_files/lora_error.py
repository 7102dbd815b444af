"""LoraFileError, the one error of every adapter read or write (imported by lora_file.py and adapter_scale.py alike)."""

from __future__ import annotations


class LoraFileError(ValueError):
    """A LoRA file that cannot be written or used as asked; the message says why and what to do."""
