"""Builders and reference implementations for the tests and benchmarks; not shipped.

Importable from the repository root (pytest puts it on sys.path through the root
conftest.py; benchmarks run as `python -m benchmarks.bench_x`), never by the packages:
tests/test_import_boundaries.py keeps it on the top layer, above every application.

- `reference`: the slow, obvious versions the shipped fast paths are tested against
  (slots by length, one example per row, rows encoded one by one, segments split back,
  the scalar sub-bucket).
- `pipeline`: small inputs in every format and container the job reads, and helpers that
  run the job in process and read shard sets back.
- `shard_sets`: shard sets built directly (no Beam) for the loader and trainer tests.
- `gcs_emulator`: a local GCS emulator and its pytest fixtures.
- `http_delay_proxy`: a proxy in front of it that delays, counts, or loses responses.
- `train_batches`: the same examples laid out packed and unpacked for the trainer.
- `import_graph`: the import graph, the layering check and the circles between modules and between folders (and docs/imports.md).
"""
