"""Who may call a stage: every call carries the cluster's secret, and between nodes the
channel is mutual TLS under a certificate authority made at start.

`skippy serve` makes a random secret (or reads the user's) and, when TLS is on, a CA that
lives only in its memory; it issues each stage actor and the driver a leaf certificate,
handed over in the actor's arguments (Ray's own authentication guards those). A stage's
server refuses a call without the secret before any handler runs, so a caller without it
can make a stage neither compute nor cache anything.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from skippy.mesh.private_file import read_private
from skippy.topology.errors import UserError

SECRET_ENV = "SKIPPY_CLUSTER_SECRET"
TLS_MODES = ("auto", "on", "off")
METADATA_KEY = "x-skippy-cluster-token"
# Every leaf names this peer and every channel checks for it: stages move between
# addresses (Ray restarts them elsewhere), so the certificate names the cluster, not a host.
PEER_NAME = "skippy-stage"
# The CA dies with the serve process that made it, so nothing needs to expire before that.
VALIDITY = datetime.timedelta(days=3650)


class SecretError(UserError):
    """A cluster secret the user pointed at that cannot be used."""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def load_secret(path: str | None = None) -> str:
    """The secret in the file at `path` (only its owner may read it), else in
    $SKIPPY_CLUSTER_SECRET, else a new one."""
    if path is None:
        return os.environ.get(SECRET_ENV, "").strip() or new_secret()
    secret = read_private(path, "the cluster secret file", SecretError).strip()
    if not secret:
        raise SecretError(f"the cluster secret file {path} is empty")
    return secret


def tls_wanted(mode: str, can_grow: bool) -> bool:
    """Whether stages talk TLS (`mode` one of TLS_MODES): `auto` turns it on whenever
    another host can be in the cluster (now or after a node joins): stage traffic can
    then leave this host."""
    return mode == "on" or (mode == "auto" and can_grow)


def _token(secret: str) -> str:
    # Calls carry a digest, not the secret: any text works as a secret (metadata must be
    # ASCII), every token has one length, and a user's secret never travels as typed.
    return hashlib.sha256(b"skippy-stage-call:" + secret.encode()).hexdigest()


@dataclass(frozen=True)
class StageCredentials:
    """What one process needs to serve or call stages: the call token and, with TLS, the
    cluster CA and this process's own certificate and key (PEM)."""

    token: str = field(repr=False)  # never in a log line
    ca: bytes = b""
    cert: bytes = b""
    key: bytes = field(default=b"", repr=False)

    @classmethod
    def plain(cls, secret: str) -> StageCredentials:
        return cls(_token(secret))

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata every stub call must send."""
        return ((METADATA_KEY, self.token),)

    def add_port(self, rpc: grpc.Server, host: str) -> int:
        """Listen on host:<free port>; with TLS only TLS, with client certificates required."""
        if not self.tls:
            return rpc.add_insecure_port(f"{host}:0")
        creds = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                            require_client_auth=True)
        return rpc.add_secure_port(f"{host}:0", creds)

    def channel(self, address: str, options: list, *, aio: bool = False):
        """A channel to a stage (grpc.aio's with `aio`), checking it holds a certificate
        of this cluster and showing ours, with TLS."""
        kind = grpc.aio if aio else grpc
        if not self.tls:
            return kind.insecure_channel(address, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert)
        return kind.secure_channel(address, creds, options + _PEER)


_PEER = [("grpc.ssl_target_name_override", PEER_NAME)]


class ClusterCredentials:
    """The serve process's issuer: the secret, and with TLS the in-memory CA."""

    def __init__(self, secret: str, tls: bool):
        self._token = _token(secret)
        self.tls = tls
        self._ca_key = self._ca_cert = None
        if tls:
            self._ca_key = ec.generate_private_key(ec.SECP256R1())
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skippy cluster CA")])
            self._ca_cert = (
                _builder(name, name, self._ca_key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_usage(cert_sign=True), critical=True)
                .sign(self._ca_key, hashes.SHA256()))

    def issue(self) -> StageCredentials:
        """Credentials for one more process (a stage actor, the driver): each with TLS gets
        a fresh key and a leaf that serves and calls as PEER_NAME."""
        if not self.tls:
            return StageCredentials(self._token)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PEER_NAME)])
        both_ways = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                           ExtendedKeyUsageOID.CLIENT_AUTH])
        leaf = (
            _builder(name, self._ca_cert.subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_NAME)]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(cert_sign=False), critical=True)
            .add_extension(both_ways, critical=False)
            .sign(self._ca_key, hashes.SHA256()))
        pem = serialization.Encoding.PEM
        return StageCredentials(
            self._token, ca=self._ca_cert.public_bytes(pem), cert=leaf.public_bytes(pem),
            key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # peers' clocks drift
            .not_valid_after(now + VALIDITY))


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False,
                         key_encipherment=False, data_encipherment=False,
                         key_agreement=not cert_sign, key_cert_sign=cert_sign,
                         crl_sign=cert_sign, encipher_only=False, decipher_only=False)


class SecretCheck(grpc.ServerInterceptor):
    """Refuses, UNAUTHENTICATED, every call whose token is missing or wrong, before the
    method's handler (or even its request parser) runs."""

    def __init__(self, token: str):
        self._token = token.encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)  # looks the method up; runs nothing
        sent = dict(details.invocation_metadata or ()).get(METADATA_KEY, b"")
        sent = sent.encode() if isinstance(sent, str) else sent
        if handler is None or hmac.compare_digest(sent, self._token):
            return handler
        return _REFUSALS[handler.request_streaming, handler.response_streaming]


def _deny(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "this stage takes calls from its cluster only")


# A refusal has its method's shape, which decides how gRPC reads the request: a streaming
# caller is refused at once, not left waiting for a request read.
_REFUSALS = {
    (False, False): grpc.unary_unary_rpc_method_handler(_deny),
    (False, True): grpc.unary_stream_rpc_method_handler(_deny),
    (True, False): grpc.stream_unary_rpc_method_handler(_deny),
    (True, True): grpc.stream_stream_rpc_method_handler(_deny),
}
