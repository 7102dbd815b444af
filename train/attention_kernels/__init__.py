"""`--attention dense|blocked|flash|splash` (package): the models' attention layers read [B, L] segment
ids, and the blocked and flash kernels they run.

What each module holds and which rooms this one may import: README.md beside this file.
"""
