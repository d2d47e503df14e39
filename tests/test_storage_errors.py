"""The storage boundary: each storage library's exception type mapped to datacat's, unknown ones untouched, retries."""

from __future__ import annotations

import errno
import importlib
import subprocess
import sys
import time

import aiohttp
import fsspec.exceptions
import gcsfs.retry
import google.auth.exceptions
import pytest
import requests

from datacat.errors import OptionError, ShardError
from datacat.redact import remember
from datacat.storage.errors import KNOWN, Meaning, classify, mapped_errors
from datacat.storage.retry import retry_count, retry_each, with_retries

URL = "gs://bucket/shard-0001.tar"


def _response_error(status: int) -> aiohttp.ClientResponseError:
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL as Url

    url = Url("https://storage.example/b/bucket/o/shard-0001.tar")
    request = aiohttp.RequestInfo(url=url, method="GET", headers=CIMultiDictProxy(CIMultiDict()), real_url=url)
    return aiohttp.ClientResponseError(request_info=request, history=(), status=status, message="answer")


KNOWN_ERRORS = [
    (FileNotFoundError(2, "No such file", "x"), Meaning.MISSING),
    (PermissionError(13, "denied"), Meaning.REFUSED),
    (IsADirectoryError(21, "a folder"), Meaning.REFUSED),
    (OSError(errno.EIO, "I/O error"), Meaning.REFUSED),
    (ConnectionResetError(104, "reset by peer"), Meaning.TRANSIENT),
    (TimeoutError("one request"), Meaning.TRANSIENT),
    (fsspec.exceptions.FSTimeoutError(), Meaning.DEADLINE),
    (gcsfs.retry.HttpError({"code": 503, "message": "unavailable"}), Meaning.TRANSIENT),
    (gcsfs.retry.HttpError({"code": 429, "message": "slow down"}), Meaning.TRANSIENT),
    (gcsfs.retry.HttpError({"code": 404, "message": "no such object"}), Meaning.MISSING),
    (gcsfs.retry.HttpError({"code": 403, "message": "forbidden"}), Meaning.REFUSED),
    (gcsfs.retry.ChecksumError("md5 differs"), Meaning.TRANSIENT),
    (aiohttp.ClientPayloadError("Response payload is not completed"), Meaning.TRANSIENT),
    (aiohttp.ServerDisconnectedError(), Meaning.TRANSIENT),
    (aiohttp.ServerTimeoutError("read timed out"), Meaning.TRANSIENT),
    (_response_error(502), Meaning.TRANSIENT),
    (_response_error(400), Meaning.REFUSED),
    (aiohttp.InvalidURL("not a url"), Meaning.REFUSED),
    (google.auth.exceptions.TransportError("metadata server unreachable"), Meaning.TRANSIENT),
    (google.auth.exceptions.RefreshError("invalid_grant"), Meaning.REFUSED),
    (requests.exceptions.ConnectionError("refused"), Meaning.TRANSIENT),
    (requests.exceptions.ReadTimeout("slow"), Meaning.TRANSIENT),
    (requests.exceptions.TooManyRedirects("loop"), Meaning.REFUSED),
]

UNKNOWN_ERRORS = [KeyError("size"), RuntimeError("a bug"), ValueError("a bug"), AttributeError("a bug")]


@pytest.mark.parametrize(
    ("exc", "meaning"), KNOWN_ERRORS, ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.name
)
def test_each_known_exception_type_has_its_meaning(exc: BaseException, meaning: Meaning) -> None:
    assert classify(exc) is meaning


@pytest.mark.parametrize("exc", UNKNOWN_ERRORS, ids=lambda e: type(e).__name__)
def test_an_unknown_exception_has_no_meaning_and_passes_the_boundary_untouched(exc: Exception) -> None:
    assert classify(exc) is None
    with pytest.raises(type(exc)) as raised, mapped_errors(URL):
        raise exc
    assert raised.value is exc and raised.value.args == exc.args and not getattr(exc, "__notes__", None)


def test_every_row_of_the_table_names_a_real_exception_type() -> None:
    # A misspelt row would silently never match: each names an exception class of its library.
    for name, _ in KNOWN:
        module, _, qualname = name.partition(":")
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        assert isinstance(found, type) and issubclass(found, BaseException), name


def test_datacats_own_errors_are_never_remapped() -> None:
    own = ShardError("already said", url=URL)
    assert classify(own) is None
    with pytest.raises(ShardError) as raised, mapped_errors("gs://elsewhere"):
        raise own
    assert raised.value is own


def test_a_missing_object_is_file_not_found_naming_the_url_and_chained() -> None:
    cause = gcsfs.retry.HttpError({"code": 404, "message": "no such object"})
    missing = pytest.raises(FileNotFoundError, match=r"shard not found: gs://bucket/shard-0001\.tar")
    with missing as raised, mapped_errors(URL):
        raise cause
    assert raised.value.filename == URL and raised.value.__cause__ is cause


@pytest.mark.parametrize(
    "exc",
    [PermissionError(13, "denied"), gcsfs.retry.HttpError({"code": 403, "message": "forbidden"}), _response_error(400)],
    ids=lambda e: type(e).__name__,
)
def test_a_refusal_is_a_shard_error_carrying_the_url(exc: Exception) -> None:
    with pytest.raises(ShardError) as raised, mapped_errors(URL):
        raise exc
    assert raised.value.url == URL and URL in str(raised.value) and type(exc).__name__ in str(raised.value)
    assert raised.value.__cause__ is exc


def test_types_refused_at_one_call_only_are_mapped_there_only() -> None:
    with (
        pytest.raises(ShardError, match="cannot connect to"),
        mapped_errors(URL, "cannot connect to", refused=(ValueError,)),
    ):
        raise ValueError("malformed token")
    with pytest.raises(ValueError, match="malformed token"), mapped_errors(URL):
        raise ValueError("malformed token")
    with pytest.raises(OptionError), mapped_errors(URL, refused=(ValueError,)):  # datacat's own ValueError stays
        raise OptionError("an option")


def test_a_client_error_holding_a_secret_is_not_chained() -> None:
    remember({"token": "ya29.not-a-real-token"})
    cause = PermissionError(13, "tokeninfo?access_token=ya29.not-a-real-token refused")
    with pytest.raises(ShardError) as raised, mapped_errors(URL):
        raise cause
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert "ya29.not-a-real-token" not in str(raised.value) and "<redacted>" in str(raised.value)
    assert any("not chained" in note for note in raised.value.__notes__)


def test_a_transient_error_is_retried_and_counted() -> None:
    failures = [ConnectionResetError(104, "reset"), aiohttp.ClientPayloadError("cut mid-body")]
    before = retry_count()

    def read() -> bytes:
        if failures:
            raise failures.pop(0)
        return b"data"

    assert with_retries(read, URL) == b"data"
    assert retry_count() - before == 2


def test_a_transient_error_that_persists_fails_within_the_deadline() -> None:
    calls = []

    def read() -> bytes:
        calls.append(time.monotonic())
        raise gcsfs.retry.HttpError({"code": 503, "message": "unavailable"})

    started = time.monotonic()
    with pytest.raises(ShardError, match=r"no answer within 1 s") as raised:
        with_retries(read, URL, seconds=1.0)
    assert time.monotonic() - started < 1.5 and len(calls) >= 2  # retried, and stopped before the deadline
    assert raised.value.url == URL and isinstance(raised.value.__cause__, gcsfs.retry.HttpError)


def test_a_permanent_error_is_not_retried() -> None:
    calls = []

    def read() -> bytes:
        calls.append(1)
        raise PermissionError(13, "denied")

    with pytest.raises(ShardError, match="PermissionError"):
        with_retries(read, URL)
    assert calls == [1]


def test_an_unknown_error_in_a_read_is_raised_untouched_at_once() -> None:
    bug = KeyError("size")
    calls = []

    def read() -> bytes:
        calls.append(1)
        raise bug

    with pytest.raises(KeyError) as raised:
        with_retries(read, URL)
    assert raised.value is bug and calls == [1]


def test_any_error_retries_a_parse_failure_but_not_a_missing_object() -> None:
    damaged = [RuntimeError("DATA_LOSS: footer cut short")]

    def read() -> str:
        if damaged:
            raise damaged.pop(0)
        return "opened"

    assert with_retries(read, URL, any_error=True) == "opened"
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError(2, "gone")), URL, any_error=True)


def test_a_batch_retries_only_its_transient_keys_and_answers_each() -> None:
    seen: list[list[str]] = []
    flaky = {"b": [aiohttp.ServerDisconnectedError()]}

    def fetch(keys, left: float):
        assert 0 < left <= 30
        seen.append(list(keys))
        out: list[object] = []
        for key in keys:
            if key == "missing":
                out.append(FileNotFoundError(2, "gone", key))
            elif flaky.get(key):
                out.append(flaky[key].pop())
            else:
                out.append(key.encode())
        return out

    results = retry_each(["a", "b", "missing"], fetch, lambda k: f"gs://bucket/{k}", seconds=30)
    assert results[:2] == [b"a", b"b"] and isinstance(results[2], FileNotFoundError)
    assert results[2].filename == "gs://bucket/missing"
    assert seen == [["a", "b", "missing"], ["b"]]


def test_a_batch_with_an_unknown_error_raises_it() -> None:
    bug = TypeError("a bug in the client")
    with pytest.raises(TypeError) as raised:
        retry_each(["a"], lambda keys, left: [bug], lambda k: k)
    assert raised.value is bug


def test_classifying_imports_no_storage_library() -> None:
    code = (
        "import sys\n"
        "from datacat.storage.errors import classify\n"
        "assert classify(ConnectionResetError()) is not None and classify(KeyError()) is None\n"
        "print(sorted(m for m in ('gcsfs', 'aiohttp', 'fsspec', 'google.auth', 'requests', 's3fs', 'botocore') "
        "if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def _s3_errors() -> list[tuple[BaseException, Meaning]]:
    """botocore's exceptions as s3fs meets them, and the built-in ones s3fs makes of S3's answers."""
    botocore = pytest.importorskip("botocore.exceptions", reason="needs botocore (the [s3] extra)")
    from botocore.parsers import ResponseParserError
    from s3fs.errors import translate_boto_error

    def answer(status: int, code: str) -> BaseException:
        response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return botocore.ClientError(response, "GetObject")  # type: ignore[arg-type]

    endpoint = "http://127.0.0.1:9/bucket/shard-0001.tar"
    return [
        (answer(503, "SlowDown"), Meaning.TRANSIENT),
        (answer(500, "InternalError"), Meaning.TRANSIENT),
        (answer(400, "RequestTimeout"), Meaning.TRANSIENT),
        (answer(404, "NoSuchKey"), Meaning.MISSING),
        (answer(403, "AccessDenied"), Meaning.REFUSED),
        (answer(400, "InvalidArgument"), Meaning.REFUSED),
        # What s3fs raises once its retries end: a built-in error, S3's answer its cause.
        (translate_boto_error(answer(503, "ServiceUnavailable")), Meaning.TRANSIENT),
        (translate_boto_error(answer(500, "InternalError")), Meaning.TRANSIENT),
        (translate_boto_error(answer(404, "NoSuchKey")), Meaning.MISSING),
        (translate_boto_error(answer(403, "InvalidAccessKeyId")), Meaning.REFUSED),
        (translate_boto_error(answer(403, "SignatureDoesNotMatch")), Meaning.REFUSED),
        (translate_boto_error(answer(400, "InvalidRange")), Meaning.REFUSED),
        (botocore.EndpointConnectionError(endpoint_url=endpoint), Meaning.TRANSIENT),
        (botocore.ConnectTimeoutError(endpoint_url=endpoint), Meaning.TRANSIENT),
        (botocore.ReadTimeoutError(endpoint_url=endpoint), Meaning.TRANSIENT),  # an OSError too
        (botocore.ConnectionClosedError(endpoint_url=endpoint), Meaning.TRANSIENT),
        (botocore.ResponseStreamingError(error="cut short"), Meaning.TRANSIENT),
        (botocore.IncompleteReadError(actual_bytes=1, expected_bytes=2), Meaning.TRANSIENT),
        (ResponseParserError("not XML"), Meaning.TRANSIENT),
        (botocore.NoCredentialsError(), Meaning.REFUSED),
        (botocore.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"), Meaning.REFUSED),
    ]


def test_s3_client_exceptions_have_their_meaning_by_type() -> None:
    for exc, meaning in _s3_errors():
        assert classify(exc) is meaning, (type(exc).__name__, exc)


def test_an_s3_slow_down_is_retried_and_a_denial_is_datacats_error_naming_the_url() -> None:
    pytest.importorskip("s3fs", reason="needs s3fs (the [s3] extra)")
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    url = "s3://bucket/shard-0001.tar"
    slow = {
        "Error": {"Code": "SlowDown", "Message": "reduce your request rate"},
        "ResponseMetadata": {"HTTPStatusCode": 503},
    }
    failures = [translate_boto_error(ClientError(slow, "GetObject")) for _ in range(2)]  # type: ignore[arg-type]

    def read() -> bytes:
        if failures:
            raise failures.pop()
        return b"ok"

    before = retry_count()
    assert with_retries(read, url) == b"ok" and retry_count() - before == 2
    denied = {
        "Error": {"Code": "AccessDenied", "Message": "Access Denied"},
        "ResponseMetadata": {"HTTPStatusCode": 403},
    }

    def refused() -> bytes:
        raise translate_boto_error(ClientError(denied, "GetObject"))  # type: ignore[arg-type]

    with pytest.raises(
        ShardError, match=r"cannot read s3://bucket/shard-0001\.tar: PermissionError: Access Denied"
    ) as raised:
        with_retries(refused, url)
    assert raised.value.url == url
