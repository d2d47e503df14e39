"""Values from storage_options never printed: redact() and the log record factory, in one process."""

from __future__ import annotations

import logging

import pytest

from datacat.redact import redact, remember


def test_every_form_of_a_remembered_value_is_redacted() -> None:
    remember({"token": "tok/en+value=", "nested": {"key": ["private-key-text"]}, "token_mode": "anon"})
    text = "a tok/en+value= b tok%2Fen%2Bvalue%3D c tok%2Fen%2Bvalue%3D d private-key-text e anon"
    assert redact(text) == "a <redacted> b <redacted> c <redacted> d <redacted> e anon"  # "anon" is a mode


def test_log_records_are_redacted_and_a_malformed_call_still_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    remember({"token": "s3cret-in-a-log"})
    logger = logging.getLogger("some.storage.client")
    with caplog.at_level(logging.DEBUG, logger="some.storage.client"):
        logger.debug("GET /tokeninfo?access_token=%s", "s3cret-in-a-log")
        try:
            raise OSError("connection to ...s3cret-in-a-log... refused")
        except OSError:
            logger.exception("request failed")
    assert "s3cret-in-a-log" not in caplog.text and caplog.text.count("<redacted>") >= 2, caplog.text
    record = logging.getLogRecordFactory()("x", logging.INFO, __file__, 1, "two %s %s", ("args",), None)
    assert record.msg == "two %s %s"  # left for logging to report when it is emitted, not raised here
