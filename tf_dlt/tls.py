"""TLS of the gRPC control plane (the data plane is plain TCP: keep it on a
private network, docs/security.md).

Server: `tf-dlt server --tls-cert cert.pem --tls-key key.pem` (and
`--tls-client-ca ca.pem` to require client certificates: mutual TLS).
Clients: `tf_dlt.Client(..., tls=TlsConfig(ca="ca.pem"))`, or the
environment variables below, which every client tf_dlt makes for you
(transpile, save / load, export, DenseOnShards, tf-dlt stats) also reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

ENV_CA = "TF_DLT_TLS_CA"
ENV_CERT = "TF_DLT_TLS_CERT"
ENV_KEY = "TF_DLT_TLS_KEY"
ENV_SERVER_NAME = "TF_DLT_TLS_SERVER_NAME"


def _read(path: str | None, what: str) -> bytes | None:
    """The PEM file `path` holds (None for none). ValueError where it cannot
    be read or holds no PEM block: gRPC said only that a handshake failed,
    at the first call."""
    if not path:
        return None
    try:
        pem = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} {path!r}: {e.strerror}") from None
    if b"-----BEGIN " not in pem:
        raise ValueError(f"the TLS {what} {path!r} is not PEM (no -----BEGIN line)")
    return pem


@dataclass(frozen=True)
class TlsConfig:
    """Client side: trust `ca` (PEM; None: the system roots); present
    `cert` / `key` for mutual TLS; `server_name` overrides the name checked
    against the shard's certificate (default: the host of its address)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls) -> TlsConfig | None:
        """The TF_DLT_TLS_* settings, or None when none is set. ValueError
        when TF_DLT_TLS_CA is unset and another is set: the client spoke
        plaintext without a word, its certificate never shown."""
        if not os.environ.get(ENV_CA):
            named = [v for v in (ENV_CERT, ENV_KEY, ENV_SERVER_NAME) if os.environ.get(v)]
            if named:
                raise ValueError(
                    f"{' and '.join(named)} set without {ENV_CA} (without it the client "
                    f"speaks plaintext): set {ENV_CA} to the CA certificate that signed the "
                    "shards' certificates, or unset them"
                )
            return None
        return cls(
            os.environ[ENV_CA],
            os.environ.get(ENV_CERT) or None,
            os.environ.get(ENV_KEY) or None,
            os.environ.get(ENV_SERVER_NAME) or None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS client certificate needs both cert and key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA certificate"),
            private_key=_read(self.key, "client key"),
            certificate_chain=_read(self.cert, "client certificate"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """Credentials of a shard's control plane; with `client_ca`, clients
    must present a certificate it signed."""
    chain, private = _read(cert, "certificate"), _read(key, "key")
    assert chain is not None and private is not None
    roots = _read(client_ca, "client CA certificate")
    return grpc.ssl_server_credentials(
        [(private, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def channel(
    address: str, tls: TlsConfig | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A channel to `address`, secure when `tls` is given."""
    opts = list(options or [])
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(
        address, tls.channel_credentials(), options=opts + tls.channel_options()
    )
