"""What a run measures (package): the metrics JSONL, MFU and FLOPs, XLA's planned memory of the step, a
step that does not fit, and a run whose loss stops being finite.

What each module holds and which rooms this one may import: README.md beside this file.
"""
