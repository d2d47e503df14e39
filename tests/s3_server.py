"""moto's S3 server as a subprocess on 127.0.0.1, and a proxy in front of it that answers as a failing S3 would.

:class:`MotoServer` runs ``python -m moto.server`` on a free port and waits
until it answers. :class:`S3Proxy` is the GCS tests' :class:`FaultProxy`
(which counts and logs every request) with three S3 faults a test arms for
the paths that match a pattern: the next N requests answered ``503
SlowDown``-style (``ServiceUnavailable``), ``403 AccessDenied``, or held
without an answer (a stalled request). Their bodies are S3's XML error
documents, so botocore parses them as it parses the real service's.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from storage_servers import FaultProxy, _free_port

__all__ = ["MotoServer", "S3Proxy"]


class MotoServer:
    """``python -m moto.server -H 127.0.0.1 -p PORT`` in a subprocess; its output in ``log_path``."""

    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> MotoServer:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto.server exited ({self._proc.returncode}): {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    return self
            except urllib.error.HTTPError:
                return self  # it answered
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto.server did not answer within {timeout:.0f} s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


@dataclass
class _Rule:
    pattern: re.Pattern[str]
    fault: str  # "503", "403" or "stall"
    left: int  # requests still to fault; -1: every one


_ERRORS = {
    "503": (503, "ServiceUnavailable", "injected: please reduce your request rate"),
    "403": (403, "AccessDenied", "injected: Access Denied"),
}


class S3Proxy(FaultProxy):
    """A counting proxy to moto that faults the requests whose path matches an armed pattern (:meth:`arm`)."""

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
        # The GCS tests' proxy's latency and random faults too (a 503, a response cut short, a reset connection).
        super().__init__(
            upstream, delay=delay, fail_rate=fail_rate, cut_large=cut_large, reset_rate=reset_rate, seed=seed
        )
        self._rules: list[_Rule] = []
        self._released = threading.Event()  # set at stop: stalled requests end
        self.bytes_served = 0  # bytes written back for the requests that came in since the last reset_counts
        self._resets = 0  # reset_counts calls so far: a response still being written across a reset is not counted

    def arm(self, pattern: str, fault: str, times: int = -1) -> None:
        """Faults the next ``times`` requests (-1: all) whose path (with its query) matches ``pattern``."""
        with self._lock:
            self._rules.append(_Rule(re.compile(pattern), fault, times))

    def disarm(self) -> None:
        with self._lock:
            self._rules = []

    def stop(self) -> None:
        self._released.set()
        super().stop()

    def reset_counts(self) -> None:
        super().reset_counts()
        with self._lock:
            self.bytes_served = 0
            self._resets += 1

    def _armed(self, path: str) -> str | None:
        with self._lock:
            for rule in self._rules:
                if rule.left != 0 and rule.pattern.search(path):
                    rule.left -= rule.left > 0
                    self.faults += 1
                    return rule.fault
        return None

    def _handle(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        fault = self._armed(handler.path)
        if fault is None:
            counted = _CountingWriter(handler, self)
            try:
                super()._handle(handler)
            finally:
                counted.done()
            return
        with self._lock:
            self.requests += 1
            self.log.append((handler.command, handler.path, handler.headers.get("range")))
        if fault == "stall":
            self._released.wait(120)  # no byte comes back until the test ends
            handler.close_connection = True
            return
        status, code, message = _ERRORS[fault]
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{handler.path}</Resource><RequestId>injected</RequestId></Error>"
        ).encode()
        length = int(handler.headers.get("Content-Length") or 0)
        if length:
            handler.rfile.read(length)
        handler.send_response(status)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", "0" if handler.command == "HEAD" else str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)


class _CountingWriter:
    """Counts the bytes the proxy writes back to the client for one request (headers included)."""

    def __init__(self, handler: http.server.BaseHTTPRequestHandler, proxy: S3Proxy) -> None:
        self.handler, self.proxy, self.sent = handler, proxy, 0
        self._resets = proxy._resets  # the resets before this request came in
        self._write = handler.wfile.write

        def write(data: bytes) -> int:
            self.sent += len(data)
            return int(self._write(data) or 0)

        handler.wfile.write = write  # type: ignore[method-assign]

    def done(self) -> None:
        self.handler.wfile.write = self._write  # type: ignore[method-assign]
        with self.proxy._lock:
            if self._resets == self.proxy._resets:
                self.proxy.bytes_served += self.sent
