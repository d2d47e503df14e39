"""Values from ``storage_options`` are never printed: not in datacat's errors, not in any log line.

A storage client puts what it was given into its own text (gcsfs's token
check fails with ``.../tokeninfo?access_token=<the token>`` in the URL), so
redacting datacat's own messages is not enough. Every value the storage
layer is handed is remembered (in each process that uses it, worker
processes included), and

- ``redact(text)`` replaces each one, also URL-quoted, with ``<redacted>``:
  datacat passes every foreign error text through it;
- a log record factory does the same to every log record of the process,
  whichever library writes it.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["REDACTED", "redact", "remember"]

REDACTED = "<redacted>"
_MIN_LENGTH = 4
# gcsfs's token modes: names of how to authenticate, not secrets.
_NOT_SECRET = frozenset({"anon", "google_default", "cache", "cloud", "browser", "true", "false"})

_secrets: tuple[str, ...] = ()  # longest first, so a value inside another is not half-replaced
_lock = threading.Lock()
_factory_installed = False


def remember(options: Mapping[str, Any]) -> None:
    """Adds every string in ``options`` (nested too) to the values this process never prints."""
    global _secrets
    found = {text for value in _strings(options) for text in _forms(value)}
    if not found - set(_secrets):
        return
    with _lock:
        _secrets = tuple(sorted(set(_secrets) | found, key=len, reverse=True))
    _install_log_factory()


def redact(text: object) -> str:
    """``str(text)`` with every remembered value replaced by ``<redacted>``."""
    out = str(text)
    for secret in _secrets:
        if secret in out:
            out = out.replace(secret, REDACTED)
    return out


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        if len(value) >= _MIN_LENGTH and value.lower() not in _NOT_SECRET:
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _forms(value: str) -> set[str]:
    # As written, and as it appears in a URL's query string.
    return {value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value)}


def _install_log_factory() -> None:
    global _factory_installed
    with _lock:
        if _factory_installed:
            return
        _factory_installed = True
    previous = logging.getLogRecordFactory()

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if _secrets:
            try:
                message = record.getMessage()
            except Exception:  # a malformed log call: logging reports it when the record is emitted, as usual
                return record
            cleaned = redact(message)
            if cleaned != message:
                record.msg, record.args = cleaned, None
            if record.exc_info and record.exc_info[1] is not None:
                text = logging.Formatter().formatException(record.exc_info)
                if redact(text) != text:  # the traceback shows a secret: keep only its redacted text
                    record.exc_text, record.exc_info = redact(text), None
        return record

    logging.setLogRecordFactory(redacting_factory)
