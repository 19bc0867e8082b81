"""TLS material and the bearer token, turned into what a gRPC channel needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

# PEM given inline as bytes, or as the path of a file holding it.
PemSource = bytes | str | os.PathLike[str]


def read_pem(source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    return Path(source).read_bytes()


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """TLS (optionally mutual) and a bearer token; everything optional."""

    tls: bool = False
    root_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_options(
        cls,
        *,
        tls: bool | None,
        tls_root_cert: PemSource | None,
        tls_client_cert: PemSource | None,
        tls_client_key: PemSource | None,
        token: str | None,
    ) -> ChannelSecurity:
        if (tls_client_cert is None) != (tls_client_key is None):
            raise ValueError("tls_client_cert and tls_client_key go together (mutual TLS)")
        if token is not None and (not token or any(c in token for c in "\r\n")):
            raise ValueError("token must be a non-empty single line")
        any_pem = any(p is not None for p in (tls_root_cert, tls_client_cert, tls_client_key))
        if tls is False and any_pem:
            raise ValueError("TLS certificates were given with tls=False")
        return cls(
            # Certificates imply TLS; tls=True alone means TLS with the system roots.
            tls=bool(tls) or any_pem,
            root_cert=read_pem(tls_root_cert),
            client_cert=read_pem(tls_client_cert),
            client_key=read_pem(tls_client_key),
            token=token,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_cert,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Sent as plain call metadata rather than call credentials, which gRPC
        # only allows on TLS channels: a token over loopback must work too.
        if self.token is None:
            return ()
        return (("authorization", f"Bearer {self.token}"),)
