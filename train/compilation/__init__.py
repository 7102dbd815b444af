"""How a run's programs are compiled and kept (package): JAX's persistent compilation cache
(`--compile-cache`), the bounded reads of its folder, the preload of a repeat run's executables
(`--compile-preload`) and `--remat auto`'s verdicts on steps that did not fit without remat.

Runtime machinery, not options: threads, process-wide state and a wrapper on JAX's private cache
read. What each module holds and which rooms this one may import: README.md beside this file.
"""
