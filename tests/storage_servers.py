"""A GCS emulator that serves like GCS, and a proxy in front of it that adds latency and faults.

Both listen on 127.0.0.1 only. The emulator is ``gcp-storage-emulator`` with
two corrections: it serves requests from threads (the stock server answers
one at a time), and it honours a suffix range ``bytes=-N`` (the stock one
sends the whole object, which breaks array_record's footer read on shards
over 1 MB). The proxy delays each response's first byte by ``delay``
seconds (GCS's time-to-first-byte is 30-100 ms), counts requests, and can
inject faults: a 503 on a fraction of requests, each large download cut
once mid-body, a fraction of ranged reads reset. Used by the tests and by
``benchmarks/remote_speed.py``.
"""

from __future__ import annotations

import http.client
import http.server
import random
import re
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["Emulator", "FaultProxy"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a class attribute: listen() takes it during __init__ (the stock backlog is 5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients hang up on purpose here (cut bodies, resets); their tracebacks say nothing


class _SharedBytes:
    """The emulator's storage with each object's bytes read once and served as views.

    The stock server copies a whole object for every ranged read (twice), which
    on 20 MB shards costs more CPU than the client being measured.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], memoryview] = {}
        self._lock = threading.Lock()

    def over(self, storage: Any) -> Any:
        shared = self

        class View:
            def __getattr__(self, name: str) -> Any:
                return getattr(storage, name)

            def get_file(self, bucket: str, name: str, show_error: bool = True) -> memoryview:
                meta = storage.get_file_obj(bucket, name)
                key = (bucket, name, meta.get("md5Hash"), meta.get("generation"), meta.get("size"))
                with shared._lock:
                    view = shared._cache.get(key)
                if view is None:
                    view = memoryview(storage.get_file(bucket, name, show_error))
                    with shared._lock:
                        shared._cache[key] = view
                return view

        return View()


class Emulator:
    """gcp-storage-emulator in this process, threaded and with suffix ranges served as GCS does."""

    def __init__(self) -> None:
        from gcp_storage_emulator import server as emulator_server
        from gcp_storage_emulator.handlers import objects

        download = getattr(objects.download, "original", objects.download)
        shared = _SharedBytes()

        def download_with_suffix_range(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            headers = request._request_handler.headers
            match = re.fullmatch(r"\s*bytes=-(\d+)\s*", headers.get("range") or "")
            if match:
                size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
                del headers["range"]
                headers["range"] = f"bytes={max(0, size - int(match.group(1)))}-"
            return download(request, response, shared.over(storage), *args, **kwargs)

        download_with_suffix_range.original = download  # type: ignore[attr-defined]
        objects.download = download_with_suffix_range  # objects.get calls it for ?alt=media
        emulator_server.HANDLERS = tuple(
            (pattern, {m: download_with_suffix_range if h is download else h for m, h in handlers.items()})
            for pattern, handlers in emulator_server.HANDLERS
        )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = emulator_server.create_server("127.0.0.1", self.port, in_memory=True)
        api = self._server._api

        def run() -> None:
            httpd = _QuietServer(("127.0.0.1", self.port), lambda *a: emulator_server.RequestHandler(api._storage, *a))
            api._httpd = httpd
            api.is_running.set()
            httpd.serve_forever()

        api.run = run

    def start(self) -> Emulator:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


class FaultProxy:
    """An HTTP proxy to ``upstream`` that delays first bytes, counts requests and injects faults."""

    def __init__(
        self,
        upstream: str,
        *,
        delay: float = 0.0,
        fail_rate: float = 0.0,
        cut_large: bool = False,
        reset_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.delay, self.fail_rate, self.cut_large, self.reset_rate = delay, fail_rate, cut_large, reset_rate
        self.requests = 0
        self.faults = 0
        self.log: list[tuple[str, str, str | None]] = []
        """(method, path, Range header) of every request, in order."""
        self.times: list[float] = []
        """``time.monotonic()`` at each request of :attr:`log` (one clock for every process of the host)."""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._cut: set[str] = set()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

        self._httpd = _QuietServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._local = threading.local()

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = self.faults = 0
            self.log, self.times = [], []

    def _draw(self) -> float:
        with self._lock:
            self.requests += 1
            return self._rng.random()

    def _fault(self) -> None:
        with self._lock:
            self.faults += 1

    def _upstream(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        return conn

    def _handle(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        draw = self._draw()
        with self._lock:
            self.log.append((handler.command, handler.path, handler.headers.get("range")))
            self.times.append(time.monotonic())
        ranged = "range" in {k.lower() for k in handler.headers}
        if handler.command == "GET" and draw < self.fail_rate:
            self._fault()
            message = b'{"error": {"code": 503, "message": "injected: service unavailable"}}'
            handler.send_response(503)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(message)))
            handler.end_headers()
            handler.wfile.write(message)
            return
        if handler.command == "GET" and ranged and draw > 1 - self.reset_rate:
            self._fault()  # a connection reset before any answer
            handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.close_connection = True
            handler.connection.close()
            return
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection")}
        for attempt in range(2):
            conn = self._upstream()
            try:
                conn.request(handler.command, handler.path, body=body, headers=headers)
                response = conn.getresponse()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        if self.delay:
            threading.Event().wait(self.delay)
        # Streamed through in pieces, as GCS streams: a client that reads an open-ended range
        # (array_record's asks for "bytes=N-") and hangs up after its record costs only what it read.
        length = int(response.getheader("Content-Length") or 0)
        cut = False
        if self.cut_large and handler.command == "GET" and length > 64 * 1024:
            key = f"{handler.path}|{handler.headers.get('range')}"
            with self._lock:
                cut = key not in self._cut
                self._cut.add(key)
        handler.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                handler.send_header(key, value)
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        sent, limit = 0, 0 if handler.command == "HEAD" else length // 2 if cut else length
        try:
            while sent < limit:
                piece = response.read(min(256 * 1024, limit - sent))
                if not piece:
                    break
                handler.wfile.write(piece)
                sent += len(piece)
            handler.wfile.flush()
        except OSError:  # the client hung up: the upstream connection still holds the rest
            handler.close_connection = True
        if sent < length or handler.close_connection:
            conn.close()
            self._local.conn = None
        if cut:
            self._fault()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
