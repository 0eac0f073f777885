"""Secrets out of what wattwatch prints: every log line, error, banner and repr that shows a URL shows it
through here.

A URL may carry a credential in two places: its userinfo (``postgresql://user:pw@host/db``,
``https://user:pw@collector``) and its query (``?password=...``, which libpq and psycopg take, or
``?token=...``). Both are masked; the rest of the URL stays, since it is what a person needs to see to
fix a setup.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query parameters that hold a credential (compared lower-cased).
SECRET_PARAMS = frozenset(
    {"password", "passwd", "pwd", "sslpassword", "token", "access_token", "api_key", "apikey", "secret"}
)
# Something URL-like inside free text: scheme://, then anything up to whitespace or a closing quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# userinfo's password when the URL does not parse (an unbalanced IPv6 bracket): scheme://user:PASSWORD@
_USERINFO_PASSWORD = re.compile(r"(://[^/?#@:]*:)[^/?#@]*@")
_SECRET_QUERY = re.compile(r"([?&](?:" + "|".join(sorted(SECRET_PARAMS)) + r")=)[^&#]*", re.IGNORECASE)


def url(text: str) -> str:
    """``text`` (a URL) with its userinfo password and secret query parameters masked."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - parses the port too, raising on one that is not a number
    except ValueError:
        return _SECRET_QUERY.sub(r"\g<1>" + MASK, _USERINFO_PASSWORD.sub(r"\g<1>" + MASK + "@", text))
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() in SECRET_PARAMS for key, _ in pairs):
            masked = [(key, MASK if key.lower() in SECRET_PARAMS else value) for key, value in pairs]
            query = urlencode(masked, safe="*/:@,")
    if (netloc, query) == (parts.netloc, parts.query):
        return text  # nothing to hide: as given (urlunsplit would drop sqlite:////path's empty authority)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def text(message: str, secrets: Iterable[str] = ()) -> str:
    """``message`` with every URL in it masked (``url``) and each of ``secrets`` (tokens) replaced."""
    out = _URL_IN_TEXT.sub(lambda m: url(m.group(0)), message)
    for secret in secrets:
        if secret:
            out = out.replace(secret, MASK)
    return out


# Tokens this process holds (its own bearer token, the token `up` makes for its agent): masked wherever they
# would appear in a log line. Only added to, by the code that reads or makes a token.
_known_secrets: set[str] = set()


def remember(secret: str) -> None:
    """Mask ``secret`` (a token) in every log line this process writes from now on."""
    if secret:
        _known_secrets.add(secret)


class RedactingFormatter(logging.Formatter):
    """A log formatter whose lines, tracebacks included, pass through ``text`` with the known tokens."""

    def format(self, record: logging.LogRecord) -> str:
        """The formatted record, secrets masked."""
        return text(super().format(record), _known_secrets)
