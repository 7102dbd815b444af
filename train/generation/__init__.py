"""Generation and scoring (package): sampling from a (LoRA-)model, prompts from a format's examples,
completions scored against the references, and `--eval-generate` during a run.

What each module holds and which rooms this one may import: README.md beside this file.
"""
