"""An HTTP proxy that holds every request for a fixed delay, counts requests, and can lose responses.

Put between a client and the GCS emulator (testkit/gcs_emulator.py), it stands in
for the round trip to real GCS: each request waits `delay_ms` before it is sent
on, whatever connection it arrives on. It also counts what passes through, so
tests and benchmarks can see how many requests and connections a read costs.

    with start_proxy("http://127.0.0.1:PORT", delay_ms=50) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint
        ...
        proxy.stats()   # {"requests": n, "connections": n, "bytes_down": n, "by_path": {...}}
        proxy.reset()

Lost responses: `proxy.drop_response(b"out/L64/manifest.json", count=1)` makes the next
request whose head or body holds those bytes reach the server, which commits it, while its
response is read and thrown away and the client's connection closed: as when a network
path fails after the server acted. The client then retries, as GCS clients do.

It runs in a child process (asyncio), so its CPU is not the client's and a
client holding the GIL never stalls it. GET /__proxy__/stats, POST /__proxy__/reset
and POST /__proxy__/drop are answered by the proxy itself. Request bodies must
carry Content-Length (reads and small uploads do; chunked uploads are refused).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from urllib.parse import urlsplit

STATS_PATH = "/__proxy__/stats"
RESET_PATH = "/__proxy__/reset"
DROP_PATH = "/__proxy__/drop"
START_TIMEOUT_S = 30.0


class _Counts:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.connections = 0
        self.bytes_down = 0
        self.by_path: Counter[str] = Counter()
        self.drops: list[list] = []  # [bytes to match, responses still to drop]
        self.dropped: list[str] = []  # "METHOD path" of each request whose response was dropped

    def take_drop(self, request: bytes) -> bool:
        for drop in self.drops:
            if drop[1] > 0 and drop[0] in request:
                drop[1] -= 1
                return True
        return False

    def as_dict(self) -> dict:
        return {"requests": self.requests, "connections": self.connections, "bytes_down": self.bytes_down,
                "by_path": dict(self.by_path), "dropped": list(self.dropped)}


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip()
    return None


async def _answer(writer: asyncio.StreamWriter, body: dict) -> None:
    data = json.dumps(body).encode()
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: _Counts) -> None:
    try:
        while data := await reader.read(1 << 16):
            counts.bytes_down += len(data)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        # The server closed (HTTP/1.0 answers end that way): so does the client's connection.
        writer.close()


async def _send_and_discard(upstream: tuple[str, int], request: bytes) -> None:
    """Sends one request on its own connection and reads its whole answer (the server has
    acted on it by then), answering nobody."""
    up_r, up_w = await asyncio.open_connection(*upstream)
    try:
        up_w.write(request)
        await up_w.drain()
        head = await asyncio.wait_for(up_r.readuntil(b"\r\n\r\n"), timeout=60)
        length = _header(head, b"content-length")
        if length is not None:
            await asyncio.wait_for(up_r.readexactly(int(length)), timeout=60)
        else:
            await asyncio.wait_for(up_r.read(), timeout=60)  # until the server closes
    finally:
        up_w.close()


async def _serve_connection(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, upstream: tuple[str, int], delay_s: float, counts: _Counts
) -> None:
    up_w: asyncio.StreamWriter | None = None
    pump: asyncio.Task | None = None
    try:
        while True:
            try:
                head = await client_r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            method, target = head.split(b" ", 2)[:2]
            path = target.decode("latin-1").split("?", 1)[0]
            if path == STATS_PATH:
                await _answer(client_w, counts.as_dict())
                continue
            if path == RESET_PATH:
                counts.reset()
                await _answer(client_w, {"reset": True})
                continue
            if _header(head, b"transfer-encoding"):
                return  # chunked request bodies are not supported (see the module docstring)
            body = await client_r.readexactly(int(_header(head, b"content-length") or 0))
            if path == DROP_PATH:
                ask = json.loads(body)
                counts.drops.append([ask["match"].encode("latin-1"), int(ask["count"])])
                await _answer(client_w, {"armed": True})
                continue
            counts.requests += 1
            counts.by_path[f"{method.decode()} {path}"] += 1
            await asyncio.sleep(delay_s)  # the round trip this proxy stands in for
            if counts.take_drop(head + body):
                counts.dropped.append(f"{method.decode()} {path}")
                await _send_and_discard(upstream, head + body)
                return  # the client's connection closes with no answer
            if up_w is None or pump is None or pump.done():
                if up_w is not None:
                    return  # the server closed after its answer; the client must reconnect
                up_r, up_w = await asyncio.open_connection(*upstream)
                counts.connections += 1
                pump = asyncio.create_task(_pump(up_r, client_w, counts))
            up_w.write(head + body)
            await up_w.drain()
    finally:
        if pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pump, timeout=60)
        if up_w is not None:
            up_w.close()
        client_w.close()


async def _main(host: str, port: int, upstream: str, delay_ms: float) -> None:
    target = urlsplit(upstream if "://" in upstream else f"http://{upstream}")
    counts = _Counts()
    server = await asyncio.start_server(
        lambda r, w: _serve_connection(r, w, (target.hostname, target.port or 80), delay_ms / 1000, counts),
        host, port, backlog=512, limit=1 << 20,
    )
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    threading.Thread(target=_exit_when_parent_goes, daemon=True).start()
    async with server:
        await server.serve_forever()


def _exit_when_parent_goes() -> None:
    sys.stdin.read()  # EOF: the parent is gone
    os._exit(0)


# ----------------------------------------------------------------------------- the parent side


@dataclasses.dataclass(frozen=True)
class DelayProxy:
    endpoint: str  # http://127.0.0.1:PORT
    delay_ms: float

    def stats(self) -> dict:
        with urllib.request.urlopen(self.endpoint + STATS_PATH, timeout=10) as r:
            return json.load(r)

    def reset(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.endpoint + RESET_PATH, data=b"", method="POST"), timeout=10).read()

    def drop_response(self, match: bytes, count: int = 1) -> None:
        """The next `count` requests holding `match` (in the request line, headers or body) reach
        the server, but their responses are lost."""
        body = json.dumps({"match": match.decode("latin-1"), "count": count}).encode()
        urllib.request.urlopen(urllib.request.Request(self.endpoint + DROP_PATH, data=body, method="POST"), timeout=10).read()


@contextlib.contextmanager
def start_proxy(upstream: str, delay_ms: float = 0.0) -> Iterator[DelayProxy]:
    """Starts the proxy in a child process in front of `upstream`; stops it after."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--upstream", upstream, "--delay-ms", str(delay_ms)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        port: list[int] = []
        reader = threading.Thread(target=lambda: port.append(int(proc.stdout.readline().split()[1])), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not port:
            raise RuntimeError(f"the delay proxy did not start within {START_TIMEOUT_S:.0f}s (exit status {proc.poll()})")
        yield DelayProxy(endpoint=f"http://127.0.0.1:{port[0]}", delay_ms=delay_ms)
    finally:
        from testkit.gcs_emulator import stop_server

        stop_server(proc)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="http://HOST:PORT of the server (the GCS emulator)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="hold each request this long")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port, printed as `PORT <n>`")
    args = p.parse_args(argv)
    asyncio.run(_main(args.host, args.port, args.upstream, args.delay_ms))


if __name__ == "__main__":
    main()
