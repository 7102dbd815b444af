"""The layering the project promises: the core imports neither Beam nor JAX, the
pipeline never imports JAX (Dataflow workers install no JAX), and the loader
never imports Beam. Each check runs in a fresh interpreter so nothing else in
the test session has loaded the modules first."""

import subprocess
import sys

import pytest

CASES = {
    "core": (
        "import prepack.rowformat, prepack.packer, prepack.stats, prepack.manifest, prepack.shardfile, "
        "prepack.templates, prepack.chat_formats, prepack.tokenizer, prepack.gemma3_gguf, prepack.cli; "
        "from prepack.tokenizer import load_tokenizer; load_tokenizer('gemma3').encode('hi')",
        ("apache_beam", "jax", "grain"),
    ),
    "pipeline": (
        "import pipelines.cli, pipelines.job, pipelines.transforms, pipelines.writer, pipelines.publish, "
        "pipelines.sources, pipelines.readers, pipelines.planning",
        ("jax", "flax", "tunix", "grain"),
    ),
    "loader": (
        "import loaders, loaders.shards, loaders.dataset, loaders.mask, loaders.checkpoint, loaders.inspect",
        ("apache_beam",),
    ),
}


@pytest.mark.parametrize("side", sorted(CASES))
def test_side_does_not_import_the_other(side):
    code, forbidden = CASES[side]
    check = f"import sys; {code}; print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{side} imported {out.stdout.strip()}"


def test_the_check_can_fail():
    """A module that does import jax is caught, so the assertions above are not vacuous."""
    out = subprocess.run([sys.executable, "-c", "import sys, jax.numpy; print(sorted(m for m in ('jax',) if m in sys.modules))"],
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "['jax']"
