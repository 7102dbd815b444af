"""The trained adapter on disk (package): the prepack and PEFT formats, reading either back onto its
base, and the merged export in Hugging Face's layout.

What each module holds and which rooms this one may import: README.md beside this file.
"""
