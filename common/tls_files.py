"""What a TLS file must hold, checked when it is read: by the router for its public port and by the clients
(`colibri generate`) for their connection, so that a wrong file is one line at start-up rather than handshakes
that fail later (or, for a client, a connection error that reads as a router down)."""

from __future__ import annotations

import os
import ssl


def check_certificates(data: bytes, what: str) -> None:
    """Raises ValueError unless `data` holds PEM certificates (a CA bundle) that OpenSSL parses."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, ssl.SSLError):  # binary (DER?), empty, or no certificate block
        raise ValueError(f"{what} holds no PEM certificate (-----BEGIN CERTIFICATE----- blocks)") from None


def check_pair(cert: bytes, key: bytes) -> None:
    """Raises ValueError unless `cert` and `key` are PEM and `key` is the private key of `cert`: a rotation caught
    half-way (new certificate, old key) is not served. The key goes through anonymous memory files, never the disk."""
    for data, which in ((cert, "certificate"), (key, "key")):
        if b"-----BEGIN" not in data:
            raise ValueError(f"the {which} file is not PEM (no -----BEGIN line)")
    fds = [os.memfd_create(name) for name in ("cert", "key")]
    try:
        for fd, data in zip(fds, (cert, key)):
            os.write(fd, data)
        cert_path, key_path = (f"/proc/self/fd/{fd}" for fd in fds)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as e:
        raise ValueError(f"the certificate and key do not form a pair ({e.reason or e})") from None
    finally:
        for fd in fds:
            os.close(fd)
