"""Test-time PKI and secure channels for the security tests.

Certificates are made fresh with ``cryptography`` for each test session: a CA,
a server certificate for 127.0.0.1/localhost, client certificates with
chosen SANs, and a second CA that the server does not trust.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, TypedDict

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from handoff_proto.v1 import coordinator_pb2_grpc as pb_grpc

# Only the stubs' .pyi knows the async stub type.
Stub: TypeAlias = "pb_grpc.HandoffCoordinatorAsyncStub"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM bytes and as files."""

    cert: bytes
    key: bytes
    cert_path: Path
    key_path: Path


class Authority:
    """A self-signed CA that issues server and client certificates into ``folder``."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = self._cert.public_bytes(serialization.Encoding.PEM)
        self.cert_path = folder / f"{name}.pem"
        self.cert_path.write_bytes(self.cert)

    def issue(
        self,
        file_stem: str,
        *,
        dns: tuple[str, ...] = (),
        uris: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        emails: tuple[str, ...] = (),
        server: bool = False,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        sans += [x509.RFC822Name(e) for e in emails]
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(file_stem))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
        cert_path = self.folder / f"{file_stem}.pem"
        key_path = self.folder / f"{file_stem}.key"
        cert_path.write_bytes(cert)
        key_path.write_bytes(_pem_key(key))
        return Issued(cert, _pem_key(key), cert_path, key_path)


class TlsSettings(TypedDict, total=False):
    """Settings overrides for a TLS server (typed, so they can be ``**``-passed)."""

    tls_cert: str
    tls_key: str
    tls_client_ca: str


@dataclass(frozen=True)
class Pki:
    folder: Path
    ca: Authority
    rogue_ca: Authority  # trusted by nobody
    server: Issued
    client: Issued  # SAN DNS:router.frontend: a frontend, bound to no engine
    prefill: Issued  # SAN DNS:prefill-0.engines
    decode: Issued  # SAN URI:spiffe://cluster.local/ns/serving/sa/decode-0
    rogue_client: Issued  # from rogue_ca, with prefill-0's SAN

    def tls_settings(self, mutual: bool = True) -> TlsSettings:
        settings = TlsSettings(
            tls_cert=str(self.server.cert_path), tls_key=str(self.server.key_path)
        )
        if mutual:
            settings["tls_client_ca"] = str(self.ca.cert_path)
        return settings


PREFILL_SAN = "prefill-0.engines"
DECODE_SAN = "spiffe://cluster.local/ns/serving/sa/decode-0"


def make_pki(folder: Path) -> Pki:
    ca = Authority(folder, "handoff-test-ca")
    rogue = Authority(folder, "rogue-ca")
    return Pki(
        folder=folder,
        ca=ca,
        rogue_ca=rogue,
        server=ca.issue("server", dns=("localhost",), ips=("127.0.0.1",), server=True),
        client=ca.issue("router", dns=("router.frontend",)),
        prefill=ca.issue("prefill-0", dns=(PREFILL_SAN,)),
        decode=ca.issue("decode-0", uris=(DECODE_SAN,)),
        rogue_client=rogue.issue("rogue", dns=(PREFILL_SAN,)),
    )


def secure_channel(
    port: int, root: bytes, client: Issued | None = None, token: str | None = None
) -> grpc.aio.Channel:
    """A TLS channel to 127.0.0.1 (mutual when ``client`` is given)."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=root,
        private_key=client.key if client else None,
        certificate_chain=client.cert if client else None,
    )
    if token is not None:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token)
        )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)


def docs_block(language: str) -> str:
    """The one ```language code block of docs/limits.md, which tests load as written."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text()
    (block,) = [part.split("```", 1)[0] for part in text.split(f"```{language}\n")[1:]]
    return block
