"""What a `prepack train` run is asked to do (package): TrainConfig and its error, the options' ranges,
the mesh, the vocabulary check, the learning-rate schedule and the run's outputs (the compilation
cache's folder among them), each checked before any weight loads.

What each module holds and which rooms this one may import: README.md beside this file.
"""
