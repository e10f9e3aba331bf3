"""The router's TLS files that are no PEM, a key of another certificate, or a client CA file holding no certificate
are refused at start-up in one line naming the setting and the file: the router said only 'tls: the certificate
and key do not form a pair', 'tls: the certificate and key files must be PEM' or 'tls: the client CA file holds no
PEM certificate', leaving the operator to guess which of two or three files was wrong."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from router_service import security
from router_service.config import RouterConfig
from tests.router_service.certs import issue, make_ca


@pytest.fixture
def files(tmp_path):
    ca = make_ca()
    ours, other = issue(ca, "localhost", server=True), issue(ca, "localhost", server=True)
    paths = {
        "cert": ours.cert,
        "key": ours.key,
        "other_key": other.key,
        "ca": ca.cert,
        "text": b"not a certificate\n",
    }
    for name, data in paths.items():
        (tmp_path / name).write_bytes(data)
    return {name: str(tmp_path / name) for name in paths}


def _refusal(cert: str, key: str, client_ca: str = "") -> str:
    config = RouterConfig(tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=client_ca)
    with pytest.raises(ConfigError) as error:
        security.server_credentials(config)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_key_of_another_certificate_names_both_files(files):
    message = _refusal(files["cert"], files["other_key"])
    assert message.startswith(
        f"tls: tls_cert_file {files['cert']}, tls_key_file {files['other_key']}: the certificate and key do not form "
        "a pair"
    ), message


@pytest.mark.parametrize("wrong, which", [("cert", "certificate"), ("key", "key")])
def test_a_file_that_is_no_pem_is_named(files, wrong, which):
    cert, key = (files["text"], files["key"]) if wrong == "cert" else (files["cert"], files["text"])
    assert _refusal(cert, key) == (
        f"tls: tls_cert_file {cert}, tls_key_file {key}: the {which} file is not PEM (no -----BEGIN line)"
    )


def test_a_client_ca_file_without_a_certificate_is_named(files):
    assert _refusal(files["cert"], files["key"], files["text"]) == (
        f"tls: tls_client_ca_file {files['text']} holds no PEM certificate (-----BEGIN CERTIFICATE----- blocks)"
    )


def test_the_right_files_are_taken(files):
    config = RouterConfig(tls_cert_file=files["cert"], tls_key_file=files["key"], tls_client_ca_file=files["ca"])
    assert security.server_credentials(config) is not None
