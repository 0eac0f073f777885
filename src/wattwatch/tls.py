"""TLS for the HTTP clients (agent -> collector, ``report --server``): which CA to trust, and a failed
certificate check said in one line."""

from __future__ import annotations

import ssl
from pathlib import Path

from wattwatch.errors import ConfigError


def client_verify(ca_file: str, named: str = "--ca-file / WATTWATCH_CA_FILE") -> ssl.SSLContext | bool:
    """What httpx should verify server certificates with: the system's CAs, or only ``ca_file``'s
    (``named``: where the user set it, for the error)."""
    if not ca_file:
        return True
    path = Path(ca_file).expanduser()
    try:
        return ssl.create_default_context(cafile=str(path))
    except FileNotFoundError:
        raise ConfigError(f"CA file {path} does not exist; check {named}") from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"CA file {path} is not a PEM certificate ({exc}); check {named}") from None


def untrusted_certificate(exc: BaseException) -> str | None:
    """For a failed connection: why the server's certificate was not trusted, or None if that was not it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return str(seen.verify_message or seen.reason or seen)
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return "certificate verify failed" if "CERTIFICATE_VERIFY_FAILED" in text else None


def untrusted_message(url: str, reason: str) -> str:
    """One line saying a server's certificate is not trusted, and how to trust it."""
    return (
        f"the TLS certificate of {url} is not trusted ({reason}); give the CA that signed it with --ca-file "
        "or WATTWATCH_CA_FILE"
    )


def check_server_files(cert: str, key: str) -> None:
    """Fail early, in one line, when the collector's certificate and key are not a usable pair (none: plain HTTP)."""
    if not cert and not key:
        return
    if bool(cert) != bool(key):
        raise ConfigError("HTTPS needs both --tls-cert and --tls-key (WATTWATCH_TLS_CERT, WATTWATCH_TLS_KEY)")
    for flag, name in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(name).expanduser().is_file():
            raise ConfigError(f"{flag} {name}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(Path(cert).expanduser()), str(Path(key).expanduser()))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot use --tls-cert {cert} with --tls-key {key} ({exc}); give a PEM pair") from None
