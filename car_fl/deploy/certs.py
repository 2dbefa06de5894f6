"""TLS for a SuperLink: a private CA and a server certificate; key pairs for SuperNode auth
(with ``cryptography``, imported on use: no ``openssl`` needed)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TLSFiles:
    """CA certificate, server certificate and key (as written by :func:`make_certificates`)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_folder(cls, folder: str | Path) -> TLSFiles:
        folder = Path(folder)
        files = cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")
        for path in (files.ca_cert, files.server_cert, files.server_key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} is missing; make the certificates first: "
                    f"python scripts/make_certs.py --out {folder} --host <name or IP>"
                )
        return files


def make_certificates(out: str | Path, hosts: Sequence[str], *, days: int = 365) -> TLSFiles:
    """A private CA and a server certificate whose SAN lists ``hosts`` (names and IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise ValueError("give at least one host name or IP address for the certificate")
    # The SuperExec and local tools reach the SuperLink through the loopback interface.
    hosts = list(dict.fromkeys([*hosts, "127.0.0.1", "localhost"]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "car-fl private CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(files.server_key, 0o600)
    return files


def make_node_key(path: str | Path) -> tuple[Path, Path]:
    """An ECDSA (P-384) key pair for SuperNode authentication: ``path`` and ``path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = Path(path)
    private.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    os.chmod(private, 0o600)
    public = private.with_suffix(private.suffix + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return private, public
