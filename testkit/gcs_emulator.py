"""A real local GCS emulator for tests, started by the tests themselves.

    from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

    def test_x(gcs_emulator, gcs_prefix):
        out = f"{gcs_prefix}/shards"          # gs://prepack-test/<test>-<uuid>/shards
        ...
        assert gcs_emulator.list(out)         # object names under that URL

The server is `gcp-storage-emulator` (pure Python, in the dev extra), run in a
child process so that clients in this process, including array_record's C++
reader that holds the GIL while it reads, never wait on our own threads.
Four things are added around it, each because a real client needs it:

* a threading HTTP server: the stock one serves one request at a time, and
  array_record's reader (google-cloud-cpp) asks for `bytes=N-` ranges and stops
  reading once it has its record. A single-threaded server then blocks writing
  the rest of that response and every later request hangs (seen as a hang in
  the reader's destructor);
* suffix ranges (`Range: bytes=-N`): the reader fetches a file's footer that
  way; the stock server ignores the header and returns the whole object with
  200, which riegeli reads as a corrupt file once a shard is over 1 MiB;
* ifGenerationMatch preconditions on uploads and deletes (412 when not met): the
  pipeline's output lock and manifest switch rely on them, as on GCS;
* a token endpoint (`POST /token`): Application Default Credentials point at a
  throwaway service-account key whose token_uri is this server, so Beam's
  GcsIO finds credentials at once (otherwise it retries google.auth.default
  with back-off for ~30 s and then goes anonymous) and google-auth refreshes
  them here, never on the network.

fake-gcs-server (the Go emulator) reads fine, but it has no batch endpoint
(fsouza/fake-gcs-server#411), and Beam's FileSystems.rename/delete on gs://
always go through batches, so the pipeline's publish step could not run on it.

Environment set while the fixture lives (and restored after):
STORAGE_EMULATOR_HOST (google-cloud-storage, Beam's GcsIO),
CLOUD_STORAGE_EMULATOR_ENDPOINT (google-cloud-cpp, i.e. array_record's gs:// reader),
GOOGLE_APPLICATION_CREDENTIALS and GOOGLE_CLOUD_PROJECT (see above).
Beam worker processes started by the FnApiRunner inherit them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, unquote

import pytest

DEFAULT_BUCKET = "prepack-test"
EMULATOR_PROJECT = "prepack-emulator"
START_TIMEOUT_S = 30.0

# The environment variables the fixture owns; saved before and restored after.
ENV_KEYS = (
    "STORAGE_EMULATOR_HOST",
    "CLOUD_STORAGE_EMULATOR_ENDPOINT",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
)

# Object download paths, by client: JSON API (google-cloud-cpp, Python metadata
# calls), the /download prefix (Python media downloads), no /storage/v1 (Node),
# and the XML-style public path.
_OBJECT_PATHS = (
    re.compile(r"^(?:/download)?(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o/(?P<object>.+)$"),
    re.compile(r"^/(?P<bucket>[^/]+)/(?P<object>.+)$"),
)
_SUFFIX_RANGE = re.compile(r"^\s*bytes=-(?P<n>\d+)\s*$")


# ----------------------------------------------------------------------------- the server (child process)


def _send_json(handler: Any, code: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _conditioned_object(handler: Any) -> tuple[str, str, int] | None:
    """(bucket, object, wanted generation) of an upload or delete with ifGenerationMatch, None
    without one. A multipart upload names its object in the metadata part: the body is read
    and put back for the stock handler."""
    path, _, query = handler.path.partition("?")
    wanted = parse_qs(query).get("ifGenerationMatch")
    if not wanted:
        return None
    m = re.match(r"^(?:/upload)?/storage/v1/b/(?P<bucket>[^/]+)/o(?:/(?P<object>.+))?$", path)
    if not m:
        return None
    name = unquote(m["object"]) if m["object"] else (parse_qs(query).get("name") or [None])[0]
    if name is None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length)
        handler.rfile = io.BytesIO(body)
        found = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
        name = json.loads(b'"' + found.group(1) + b'"') if found else None
    return None if name is None else (m["bucket"], name, int(wanted[0]))


def _make_handler_class():
    """The emulator's request handler plus the three additions above (imported lazily:
    only the child process needs gcp_storage_emulator)."""
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.server import RequestHandler

    # Uploads, copies and deletes change shared state; downloads only read it and may
    # be long, so only the former take the lock.
    mutation_lock = threading.Lock()

    class Handler(RequestHandler):
        def _object_size(self) -> int | None:
            path = self.path.split("?", 1)[0]
            for pattern in _OBJECT_PATHS:
                m = pattern.match(path)
                if m:
                    try:
                        return int(self.storage.get_file_obj(unquote(m["bucket"]), unquote(m["object"]))["size"])
                    except NotFound:
                        return None
            return None

        def do_GET(self) -> None:
            m = _SUFFIX_RANGE.match(self.headers.get("Range", ""))
            if m:
                size = self._object_size()
                if size is not None:
                    # GCS answers `bytes=-N` with the last N bytes; the stock handler only
                    # understands `bytes=START-[END]`, so restate the suffix that way.
                    del self.headers["Range"]
                    if size > 0:
                        self.headers["Range"] = f"bytes={max(0, size - int(m['n']))}-"
            super().do_GET()

        def _token(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            _send_json(self, 200, {"access_token": "emulator-token", "expires_in": 3600, "token_type": "Bearer"})

        def _generation_now(self, bucket: str, name: str) -> int:
            try:
                return int(self.storage.get_file_obj(bucket, name).get("generation") or 0)
            except NotFound:
                return 0

        def _precondition_failed(self) -> bool:
            """ifGenerationMatch on uploads and deletes (0: the object must not exist). Checked
            under the mutation lock, so check and write are one step as on GCS."""
            target = _conditioned_object(self)
            if target is None or self._generation_now(target[0], target[1]) == target[2]:
                return False
            length = int(self.headers.get("Content-Length") or 0)
            if self.rfile is not None and not isinstance(self.rfile, io.BytesIO) and length:
                self.rfile.read(length)
            _send_json(self, 412, {"error": {"code": 412, "message": "conditionNotMet"}})
            return True

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] == "/token":
                self._token()
                return
            with mutation_lock:
                if not self._precondition_failed():
                    super().do_POST()

        def do_PUT(self) -> None:
            with mutation_lock:
                super().do_PUT()

        def do_PATCH(self) -> None:
            with mutation_lock:
                super().do_PATCH()

        def do_DELETE(self) -> None:
            with mutation_lock:
                if not self._precondition_failed():
                    super().do_DELETE()

    return Handler


def serve(host: str, port: int, buckets: list[str]) -> None:
    """Runs the emulator in memory until killed; prints `PORT <n>` once it listens."""
    from functools import partial
    from http.server import ThreadingHTTPServer

    from gcp_storage_emulator.handlers.buckets import create_bucket
    from gcp_storage_emulator.storage import Storage

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        # array_record's reader opens a burst of connections at once (one per
        # parallel range read). With the default backlog of 5 the kernel drops the
        # overflow after the client already sees them established, and those
        # reads then wait forever.
        request_queue_size = 256

    storage = Storage(use_memory_fs=True)
    for name in buckets:
        create_bucket(name, storage)
    httpd = Server((host, port), partial(_make_handler_class(), storage))
    threading.Thread(target=_exit_when_parent_goes, daemon=True).start()
    print(f"PORT {httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def _exit_when_parent_goes() -> None:
    # The parent holds our stdin open; EOF means it is gone (even if it was killed
    # without running its teardown), so no emulator outlives its test session.
    sys.stdin.read()
    os._exit(0)


# ----------------------------------------------------------------------------- the client side (tests)


@dataclasses.dataclass(frozen=True)
class GcsEmulator:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    project: str
    log_path: str  # the server's stderr, for failures

    def url(self, *parts: str) -> str:
        """gs://BUCKET/part/part..."""
        return "/".join([f"gs://{self.bucket}", *(p.strip("/") for p in parts if p)])

    def client(self) -> Any:
        from google.cloud import storage

        return storage.Client(project=self.project)

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        if not url.startswith("gs://"):
            raise ValueError(f"not a gs:// URL: {url}")
        bucket, _, key = url[len("gs://") :].partition("/")
        return bucket, key

    def list(self, url: str) -> list[str]:
        """Object names under a gs:// folder URL, relative to it, sorted."""
        bucket, key = self.split(url)
        prefix = key.rstrip("/") + "/" if key else ""
        return sorted(b.name[len(prefix) :] for b in self.client().list_blobs(bucket, prefix=prefix))

    def read_bytes(self, url: str) -> bytes:
        bucket, key = self.split(url)
        return self.client().bucket(bucket).blob(key).download_as_bytes()

    def upload_file(self, local_path: str, url: str) -> None:
        bucket, key = self.split(url)
        self.client().bucket(bucket).blob(key).upload_from_filename(local_path)


def stop_server(proc: subprocess.Popen) -> None:
    """Ends a server process started by a fixture or rig: terminate, then kill after 5 s; closes its pipes."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _wait_for_port(proc: subprocess.Popen, timeout: float) -> int:
    """Reads the child's `PORT <n>` line, failing on exit or after `timeout`."""
    found: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("PORT "):
                found.append(int(line.split()[1]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise RuntimeError(f"the GCS emulator did not start within {timeout:.0f}s (exit status {proc.poll()})")
    return found[0]


def _write_adc_file(path: str, endpoint: str) -> None:
    """A throwaway service-account key whose token_uri is the emulator.

    A service account is the one ADC type whose token endpoint google-auth takes
    from the file (authorized_user files are always sent to Google's endpoint).
    The key is made here, for this session only, so none is ever committed.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode("ascii")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {
                "type": "service_account",
                "project_id": EMULATOR_PROJECT,
                "private_key_id": "emulator",
                "private_key": pem,
                "client_email": f"tests@{EMULATOR_PROJECT}.iam.gserviceaccount.com",
                "client_id": "0",
                "token_uri": f"{endpoint}/token",
            },
            f,
        )


@contextlib.contextmanager
def start_emulator(workdir: str, bucket: str = DEFAULT_BUCKET) -> Iterator[GcsEmulator]:
    """Starts the emulator with `bucket` created, points every client at it, and stops it after."""
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "gcs-emulator.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--host", "127.0.0.1", "--port", "0", "--bucket", bucket],
            stdin=subprocess.PIPE,  # closed when we exit: the child then exits too
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    try:
        port = _wait_for_port(proc, START_TIMEOUT_S)
        endpoint = f"http://127.0.0.1:{port}"
        adc = os.path.join(workdir, "adc.json")
        _write_adc_file(adc, endpoint)
        os.environ.update(
            STORAGE_EMULATOR_HOST=endpoint,
            CLOUD_STORAGE_EMULATOR_ENDPOINT=endpoint,
            GOOGLE_APPLICATION_CREDENTIALS=adc,
            GOOGLE_CLOUD_PROJECT=EMULATOR_PROJECT,
        )
        yield GcsEmulator(endpoint=endpoint, bucket=bucket, project=EMULATOR_PROJECT, log_path=log_path)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        stop_server(proc)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """One emulator for the whole session, with DEFAULT_BUCKET; use gcs_prefix for a private folder."""
    with start_emulator(str(tmp_path_factory.mktemp("gcs-emulator"))) as emulator:
        yield emulator


@pytest.fixture
def gcs_prefix(gcs_emulator: GcsEmulator, request: pytest.FixtureRequest) -> str:
    """A gs:// folder no other test uses: gs://BUCKET/<test name>-<8 hex>."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return gcs_emulator.url(f"{name}-{uuid.uuid4().hex[:8]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the test GCS emulator (in memory) until killed.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port; the chosen one is printed as `PORT <n>`")
    parser.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    args = parser.parse_args(argv)
    serve(args.host, args.port, args.bucket or [DEFAULT_BUCKET])


if __name__ == "__main__":
    main()
