"""A conditional write on gs:// whose response is lost is retried, and the retry meets its own
first attempt (412): the run reads the object back, finds its own bytes, and goes on.

The proxy (testkit/http_delay_proxy.py) forwards the request, lets the emulator commit it,
then drops the response, so google-cloud-storage retries it. Only the output layer's client
goes through the proxy; Beam's own GCS traffic goes straight to the emulator.
Shown to fail with the read-back after a 412 removed (GcsStorage._upload_if re-raising):
on the lock create the run then refused itself ("being written by run <its own id> (pid <its
own pid>)") and left its .lock behind; on a manifest switch it said "changed by another run
... already switched by this run: none" with some lengths new and some old.
"""

from __future__ import annotations

import json
import os

import pytest

import loaders
from pipelines.launch.cli import main
from pipelines.output import lock as output_lock
from prepack.storage import storage_for
from prepack.storage import gcs
from prepack.format import layout
from prepack.format.run_record import RunRecord
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.http_delay_proxy import start_proxy
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

LENGTHS = (64, 256)


@pytest.fixture
def lossy(gcs_emulator, monkeypatch):
    """The output layer's GCS client, through a proxy that can lose responses."""
    with start_proxy(os.environ["STORAGE_EMULATOR_HOST"]) as proxy:
        saved = os.environ["STORAGE_EMULATOR_HOST"]
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint
        try:
            client = gcs._client(proxy.endpoint)
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        monkeypatch.setattr(gcs, "gcs_client", lambda: client)
        yield proxy


def object_key(path: str) -> bytes:
    return json.dumps(gcs.split_gcs(path)[1]).encode()  # as the upload's metadata names it


def test_lost_response_on_the_lock_create(lossy, gcs_prefix):
    out = f"{gcs_prefix}/out"
    lossy.drop_response(object_key(layout.lock_path(out)))
    held = output_lock.OutputLock.acquire(out, "run-a", renew=False)
    assert lossy.stats()["dropped"] == ["POST /upload/storage/v1/b/prepack-test/o"]
    assert output_lock.read_lock(out).run_id == "run-a"
    held.check()
    held.release()
    assert output_lock.read_lock(out) is None  # nothing left behind to block other hosts


@pytest.mark.slow
@pytest.mark.parametrize("target", ["L64/manifest.json", "L256/manifest.json", "tokens/manifest.json", "published.json"])
def test_lost_response_on_each_switch(lossy, gcs_prefix, tmp_path, target):
    old = write_jsonl(str(tmp_path / "old.jsonl"), alpaca_records(16, seed=0))
    new = write_jsonl(str(tmp_path / "new.jsonl"), alpaca_records(16, seed=5))
    out = f"{gcs_prefix}/out"

    def pack(inp: str, *extra: str) -> int:
        return main(["--input", inp, "--format", "alpaca", "--output", out, "--max-length", *map(str, LENGTHS),
                     "--no-progress", *IN_PROCESS, *extra])

    assert pack(old) == 0
    lossy.drop_response(object_key(f"{out}/{target}"))
    assert pack(new, "--overwrite") == 0
    assert len(lossy.stats()["dropped"]) == 1
    assert sorted(loaders.published_lengths(out)) == list(LENGTHS)
    for L in LENGTHS:
        with loaders.open_shards(layout.length_dir(out, L), expected_max_length=L, verify=True) as view:
            assert os.path.basename(view.manifest.inputs[0]["spec"]) == "new.jsonl"
    store = storage_for(out)
    record = RunRecord.from_json(store.read(layout.run_record_path(out)).data.decode())
    tokens = store.read(layout.tokens_manifest_path(out)).data
    assert record.tokens_manifest_sha256 == __import__("hashlib").sha256(tokens).hexdigest()
    assert os.path.basename(json.loads(tokens)["inputs"][0]["spec"]) == "new.jsonl"
    assert output_lock.read_lock(out) is None
