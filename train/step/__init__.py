"""The optimizer step and its loss (package): the model inputs, the masked loss (full, chunked, fused),
the fused LoRA kernel, remat and the layer scan, mixed precision, the optimizer.

What each module holds and which rooms this one may import: README.md beside this file.
"""
