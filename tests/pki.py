"""Test certificates: a CA and a certificate it signs for 127.0.0.1/localhost
(``cryptography``), as an operator's PKI would give each process."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


DAY = datetime.timedelta(days=1)
VALID = (-datetime.timedelta(minutes=5), DAY)


def make_pki(
    directory: Path,
    ca_name: str = "iserve test CA",
    *,
    ca_valid: tuple[datetime.timedelta, datetime.timedelta] = VALID,
    cert_valid: tuple[datetime.timedelta, datetime.timedelta] = VALID,
    usages: tuple = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
    key: str = "p256",
    names: tuple[str, ...] = ("localhost", "127.0.0.1"),
) -> dict[str, Path]:
    """A CA and one certificate it signs for 127.0.0.1/localhost, usable by servers and
    clients alike (what each iserve process presents). ``ca_valid`` and ``cert_valid``
    are when each is valid from and until, from now; ``usages`` the certificate's
    extended key usages; ``key`` its key: ``p256``, ``secp256k1``, ``ed25519`` or
    ``p256-empty-passphrase`` (encrypted with ""); ``names`` the host names and IP
    addresses in its subjectAltName."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name(ca_name))
        .issuer_name(_name(ca_name))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + ca_valid[0])
        .not_valid_after(now + ca_valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    kind = key
    key = (
        ed25519.Ed25519PrivateKey.generate()
        if kind == "ed25519"
        else ec.generate_private_key(ec.SECP256K1() if kind == "secp256k1" else ec.SECP256R1())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("iserve"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + cert_valid[0])
        .not_valid_after(now + cert_valid[1])
        .add_extension(
            x509.SubjectAlternativeName([_general_name(name) for name in names]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(list(usages)),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca": directory / "ca.pem",
        "cert": directory / "cert.pem",
        "key": directory / "key.pem",
    }
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, paths["key"])
    if kind == "p256-empty-passphrase":
        # cryptography encrypts with no empty passphrase; the openssl command does.
        plain = directory / "plain-key.pem"
        paths["key"].rename(plain)
        subprocess.run(
            ["openssl", "pkcs8", "-topk8", "-in", str(plain), "-out", str(paths["key"])]
            + ["-passout", "pass:"],
            check=True,
            capture_output=True,
        )
    return paths


def _general_name(name: str) -> x509.GeneralName:
    """An IPAddress entry for an address, else a DNSName."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
