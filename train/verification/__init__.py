"""Packed-row parity on the model (package): `prepack verify --model` and `--verify-first`.

What each module holds and which rooms this one may import: README.md beside this file.
"""
