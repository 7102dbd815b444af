"""How the job fails, below every other folder of pipelines/: one-line failures (failures) and named failpoints (failpoints)."""
