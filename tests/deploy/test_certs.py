"""car_fl.deploy.certs: the private CA, the server certificate, SuperNode key pairs."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from car_fl.deploy.certs import TLSFiles, make_certificates, make_node_key


def test_server_certificate_is_signed_by_the_ca_for_every_host(tmp_path: Path) -> None:
    files = make_certificates(tmp_path / "certs", ["aggregator.local", "192.168.1.10"], days=7)
    assert files == TLSFiles.in_folder(tmp_path / "certs")
    ca = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"aggregator.local", "localhost"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("192.168.1.10"),
        ipaddress.ip_address("127.0.0.1"),
    }
    lifetime = server.not_valid_after_utc - server.not_valid_before_utc
    assert 7 <= lifetime.days <= 8
    key = serialization.load_pem_private_key(files.server_key.read_bytes(), password=None)
    assert key.public_key() == server.public_key()
    assert stat.S_IMODE(files.server_key.stat().st_mode) == 0o600


def test_certificates_need_a_host_and_missing_files_say_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one host"):
        make_certificates(tmp_path, [])
    with pytest.raises(FileNotFoundError, match=r"make_certs\.py"):
        TLSFiles.in_folder(tmp_path / "nothing")


def test_node_key_pair_matches_and_is_private(tmp_path: Path) -> None:
    private, public = make_node_key(tmp_path / "keys" / "node0.key")
    assert public == tmp_path / "keys" / "node0.key.pub"
    key = serialization.load_ssh_private_key(private.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert public.read_bytes().startswith(b"ecdsa-sha2-nistp384 ")
    assert serialization.load_ssh_public_key(public.read_bytes()) == key.public_key()
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
