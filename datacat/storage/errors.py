"""The one mapping of storage libraries' exceptions to datacat's, applied where storage is called.

Each known exception type has one meaning (:data:`KNOWN`, most specific
first, as httpx's ``map_exceptions`` maps its transports' errors):

- ``MISSING``: no such object, a ``FileNotFoundError`` with the URL as its filename;
- ``TRANSIENT``: a cut connection, a request's timeout, 408/429/5xx: the retry
  loop (:mod:`datacat.storage.retry`) tries again within the deadline;
- ``DEADLINE``: the storage call ran past its whole deadline: a ``ShardError``;
- ``REFUSED``: permission, a bad request, credentials, an unreadable file: a
  ``ShardError`` naming the URL.

An exception of no known type is a bug, not a storage failure: it is
re-raised untouched. Another storage library is one more block of rows in
:data:`KNOWN`. Types are named ``"module:QualName"`` and looked up only in
modules already imported, so classifying imports no storage client (an
exception of a module never imported cannot exist).
"""

from __future__ import annotations

import contextlib
import enum
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

from datacat.errors import DatacatError, ShardError
from datacat.limits import read_timeout
from datacat.redact import redact

__all__ = [
    "KNOWN",
    "Meaning",
    "classify",
    "failed",
    "mapped_errors",
    "not_found",
    "raise_mapped",
    "storage_error",
    "too_slow",
]


class Meaning(enum.Enum):
    """What a storage library's exception means for the read that met it."""

    MISSING = "missing"
    TRANSIENT = "transient"
    DEADLINE = "deadline"
    REFUSED = "refused"


def _by_status(attribute: str) -> Callable[[BaseException], Meaning]:
    """An HTTP error by the status it holds in ``attribute``: 404 missing, 408, 429 and 5xx transient, else refused."""

    def meaning(exc: BaseException) -> Meaning:
        return _of_status(getattr(exc, attribute, None))

    return meaning


def _of_status(code: object) -> Meaning:
    if code == 404:
        return Meaning.MISSING
    if isinstance(code, int) and (code in (408, 429) or code >= 500):
        return Meaning.TRANSIENT
    return Meaning.REFUSED


_S3_TRANSIENT_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling", "ThrottlingException"}
)


def _s3_answer(exc: BaseException) -> Meaning:
    """botocore's ``ClientError`` (S3's answer): by its HTTP status, or its error code where it names a throttle."""
    response = getattr(exc, "response", None) or {}
    if response.get("Error", {}).get("Code") in _S3_TRANSIENT_CODES:
        return Meaning.TRANSIENT
    if response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchBucket"):
        return Meaning.MISSING
    return _of_status(response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def _os_error(exc: BaseException) -> Meaning:
    """Any other ``OSError``: refused, unless s3fs made it of S3's answer (its cause), which then decides.

    s3fs turns botocore's ``ClientError`` into a built-in error: the specific
    ones (``FileNotFoundError``, ``PermissionError``, ``TimeoutError``) match
    above; a 503 ``SlowDown`` or a 500 ``InternalError`` becomes a plain
    ``OSError`` (EBUSY, EREMOTEIO) with the ``ClientError`` as its cause or
    context, which says it is transient.
    """
    answer = _known_type("botocore.exceptions:ClientError")
    cause = exc.__cause__ if exc.__cause__ is not None else exc.__context__
    if answer is not None and isinstance(cause, answer):
        return _s3_answer(cause)
    return Meaning.REFUSED


Classifier = Meaning | Callable[[BaseException], Meaning]

KNOWN: tuple[tuple[str, Classifier], ...] = (
    # fsspec: its deadline on a whole call (a TimeoutError subclass, so before the built-in one).
    ("fsspec.exceptions:FSTimeoutError", Meaning.DEADLINE),
    # botocore (s3fs's client, through aiobotocore), raised as it is once s3fs's own retries end: S3's
    # answer; a refused, dropped or timed-out connection (ReadTimeoutError is an OSError too, so it comes
    # first), a body cut short or unparsable; anything else (no credentials, a bad config) refused.
    ("botocore.exceptions:ClientError", _s3_answer),
    ("botocore.exceptions:ConnectionError", Meaning.TRANSIENT),
    ("botocore.exceptions:HTTPClientError", Meaning.TRANSIENT),
    ("botocore.exceptions:IncompleteReadError", Meaning.TRANSIENT),
    ("botocore.parsers:ResponseParserError", Meaning.TRANSIENT),
    ("botocore.exceptions:BotoCoreError", Meaning.REFUSED),
    # The built-in OSError family, which every client raises for a missing object.
    ("builtins:FileNotFoundError", Meaning.MISSING),
    ("builtins:IsADirectoryError", Meaning.REFUSED),
    ("builtins:NotADirectoryError", Meaning.REFUSED),
    ("builtins:PermissionError", Meaning.REFUSED),
    # gcsfs: the service's answer, by status; a body whose checksum did not match (gcsfs retries it too).
    ("gcsfs.retry:HttpError", _by_status("code")),
    ("gcsfs.retry:ChecksumError", Meaning.TRANSIENT),
    # aiohttp (gcsfs's transport): a body cut short, a dropped or refused connection, a status.
    ("aiohttp.http_exceptions:ContentLengthError", Meaning.TRANSIENT),
    ("aiohttp.client_exceptions:ClientPayloadError", Meaning.TRANSIENT),
    ("aiohttp.client_exceptions:ClientConnectionError", Meaning.TRANSIENT),
    ("aiohttp.client_exceptions:ClientResponseError", _by_status("status")),
    ("aiohttp.client_exceptions:ClientError", Meaning.REFUSED),
    # google-auth (gcsfs's credentials): the token endpoint unreachable, or the credentials refused.
    ("google.auth.exceptions:TransportError", Meaning.TRANSIENT),
    ("google.auth.exceptions:GoogleAuthError", Meaning.REFUSED),
    # requests (google-auth's metadata-server and token calls).
    ("requests.exceptions:ConnectionError", Meaning.TRANSIENT),
    ("requests.exceptions:Timeout", Meaning.TRANSIENT),
    ("requests.exceptions:RequestException", Meaning.REFUSED),
    # The rest of the OSError family: a reset or refused connection and one request's timeout are
    # transient (asyncio.TimeoutError is TimeoutError); any other OSError (EIO, ENOSPC) is refused,
    # unless s3fs made it of a ClientError that says otherwise (a 503 SlowDown).
    ("builtins:ConnectionError", Meaning.TRANSIENT),
    ("builtins:TimeoutError", Meaning.TRANSIENT),
    ("builtins:OSError", _os_error),
)
"""Storage exception types, most specific first, and what each means: the first match decides."""


def _known_type(name: str) -> type[BaseException] | None:
    module, _, qualname = name.partition(":")
    found: object = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def classify(exc: BaseException) -> Meaning | None:
    """What ``exc`` means for a read of storage, by its type; None for a type no storage library raises."""
    if isinstance(exc, DatacatError):
        return None  # already datacat's own
    for name, meaning in KNOWN:
        known = _known_type(name)
        if known is not None and isinstance(exc, known):
            return meaning if isinstance(meaning, Meaning) else meaning(exc)
    return None


def not_found(url: str) -> FileNotFoundError:
    """The error for a missing shard: the built-in one, its filename the URL, so ``except FileNotFoundError`` works."""
    return FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url)


def failed(url: str, exc: BaseException, doing: str = "cannot read") -> ShardError:
    """The ShardError for a storage failure at ``url``: the client's words, redacted, and what to check."""
    return ShardError(
        f"{doing} {url}: {type(exc).__name__}: {redact(exc)}. Check the URL, the network and the credentials "
        "in storage_options",
        url=url,
    )


def too_slow(url: str, seconds: float, last: str = "") -> ShardError:
    """The error for a read of ``url`` that passed its deadline: the storage client's last complaint, and the fix."""
    also = f" (the storage client was retrying after: {redact(last)})" if last else ""
    return ShardError(
        f"{url}: no answer within {seconds:.0f} s{also}. The storage is unreachable or stalled: check the URL, "
        "the network and the credentials (DATACAT_READ_TIMEOUT sets the deadline)",
        url=url,
    )


def storage_error(url: str, exc: BaseException, meaning: Meaning, doing: str = "cannot read") -> Exception:
    """datacat's error for ``exc`` of ``meaning`` met at ``url`` (a transient one here is out of retries)."""
    if meaning is Meaning.MISSING:
        return not_found(url)
    if meaning is Meaning.DEADLINE:
        return too_slow(url, read_timeout())
    return failed(url, exc, doing)


def _secret_free(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if redact(current) != str(current):
            return False
        current = current.__cause__ or current.__context__
    return True


def raise_mapped(error: BaseException, exc: BaseException) -> NoReturn:
    """Raises ``error`` chained to the client's ``exc``, unless the client's text holds a storage_options value."""
    if _secret_free(exc):
        raise error from exc
    error.add_note(f"(the {type(exc).__name__} of the storage client is not chained: its text holds a secret)")
    raise error from None


@contextlib.contextmanager
def mapped_errors(
    url: str, doing: str = "cannot read", *, refused: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Inside: a storage library's known exception becomes datacat's, naming ``url``; any other passes untouched.

    ``refused``: more types that mean a refusal at this call only (a client
    refusing its options with ``ValueError``, say).
    """
    try:
        yield
    except Exception as exc:  # sorted here: known storage errors are mapped, anything else re-raised untouched
        meaning = classify(exc)
        if meaning is None and isinstance(exc, refused) and not isinstance(exc, DatacatError):
            meaning = Meaning.REFUSED
        if meaning is None:
            raise
        raise_mapped(storage_error(url, exc, meaning, doing), exc)
