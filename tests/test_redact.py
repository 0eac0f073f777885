"""URL credentials and tokens are masked in what wattwatch prints (``wattwatch.redact``), and nothing else
of a URL is changed."""

from __future__ import annotations

import logging

import pytest

from wattwatch import redact
from wattwatch.config import Settings


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        (
            "postgresql+psycopg://u:pw@db:5432/w?password=pw2&sslmode=require",
            "postgresql+psycopg://u:***@db:5432/w?password=***&sslmode=require",
        ),
        ("postgresql://db/w?PASSWORD=pw", "postgresql://db/w?PASSWORD=***"),
        ("https://agent:tok@collector:8470/api/v1/ingest", "https://agent:***@collector:8470/api/v1/ingest"),
        ("http://collector:8470/?token=abc#x", "http://collector:8470/?token=***#x"),
        # An unbalanced IPv6 bracket does not parse: masked all the same.
        ("http://u:secret@[::1:8470/", "http://u:***@[::1:8470/"),
        ("http://u:secret@[::1/?password=p", "http://u:***@[::1/?password=***"),
        # Nothing to hide: exactly as given.
        ("sqlite:////var/lib/wattwatch/wattwatch.db", "sqlite:////var/lib/wattwatch/wattwatch.db"),
        ("postgresql://wattwatch@db/w?sslmode=require", "postgresql://wattwatch@db/w?sslmode=require"),
        ("not a url", "not a url"),
    ],
)
def test_a_url_keeps_everything_but_its_credentials(given: str, shown: str) -> None:
    assert redact.url(given) == shown


def test_text_masks_every_url_in_it_and_the_tokens_given() -> None:
    message = "collector 'http://a:pw1@h:1/x' and postgresql://u:pw2@db/w failed with token tok-123"
    shown = redact.text(message, ["tok-123"])
    assert shown == "collector 'http://a:***@h:1/x' and postgresql://u:***@db/w failed with token ***"


def test_the_settings_repr_holds_no_credential() -> None:
    settings = Settings(
        db_url="postgresql://u:pw1@db/w?password=pw2",
        collector_url="https://a:pw3@collector:8470",
        report_server="https://r:pw4@collector:8470",
        token="tok-5",
    )
    shown = repr(settings)
    for secret in ("pw1", "pw2", "pw3", "pw4", "tok-5"):
        assert secret not in shown, shown
    assert "db_url='postgresql://u:***@db/w?password=***'" in shown and "interval_s=" in shown


def test_log_lines_and_their_tracebacks_mask_a_remembered_token() -> None:
    redact.remember("tok-remembered-6")
    formatter = redact.RedactingFormatter("%(levelname)s %(message)s")
    try:
        raise RuntimeError("refused https://a:pw7@c:1 with tok-remembered-6")
    except RuntimeError:
        record = logging.LogRecord("wattwatch", logging.ERROR, __file__, 1, "push: %s", ("tok-remembered-6",), True)
        import sys

        record.exc_info = sys.exc_info()
    line = formatter.format(record)
    assert "tok-remembered-6" not in line and "pw7" not in line, line
    assert line.startswith("ERROR push: ***") and "https://a:***@c:1" in line
