"""Mutual TLS for internal gRPC (router -> worker, prefill -> decode, the cache-event subscription).

Every component presents a certificate signed by one deployment CA, as a server and as a client; servers
require a client certificate (`require_client_auth=True`), so a peer without one, or with one from another
CA, fails the handshake before any method runs. The internal token (proto/internal_auth.py) is still checked
on top. Workers move between addresses (Ray restarts, pods), so clients check the peer certificate against one
fixed name (`server_name`, a DNS subjectAltName of every internal certificate) instead of the address dialled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_SERVER_NAME = "hybridserve-internal"


@dataclass(frozen=True)
class InternalTlsConfig:
    """Where the PEM files of this component's TLS identity are; all empty: plaintext internal gRPC."""

    # PEM file of the CA that signs every internal certificate (empty: no TLS; the token alone authenticates)
    ca_file: str = ""
    # PEM certificate this component presents as server and as client (signed by the CA)
    cert_file: str = ""
    # PEM private key of the certificate
    key_file: str = ""
    # DNS subjectAltName every internal certificate carries; clients check it instead of the address dialled
    server_name: str = DEFAULT_SERVER_NAME

    def __post_init__(self) -> None:
        given = [bool(self.ca_file), bool(self.cert_file), bool(self.key_file)]
        if any(given) and not all(given):
            raise ValueError("internal TLS needs all three of --internal-tls-ca-file, --internal-tls-cert-file and "
                             "--internal-tls-key-file (or none of them for plaintext)")
        if not self.server_name:
            raise ValueError("--internal-tls-server-name must name the certificates' DNS subjectAltName")

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate, key) PEM bytes, read now: new channels and servers pick up rotated files."""
        out = []
        for flag, path in (("ca-file", self.ca_file), ("cert-file", self.cert_file), ("key-file", self.key_file)):
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                raise ValueError(f"--internal-tls-{flag} {path!r} cannot be read: {exc}") from exc
        return out[0], out[1], out[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present the certificate, require and verify a client certificate of the same CA."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against the CA, present the certificate as the client's."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options that check the peer certificate against `server_name`, not the address."""
        return [("grpc.ssl_target_name_override", self.server_name), ("grpc.default_authority", self.server_name)]
