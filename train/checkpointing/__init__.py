"""The `--checkpoint-dir` folder (package): what a checkpointed run is, when it saves, and how it
resumes with exactly the next batch.

What each module holds and which rooms this one may import: README.md beside this file.
"""
