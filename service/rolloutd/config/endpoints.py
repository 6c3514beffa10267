"""The ``grpc``, ``http`` and ``auth`` sections of the configuration (``Config`` composes
them): the two ports ``rolloutd serve`` listens on, their TLS, and who may use them
(docs/security.md).

The checks ``Config`` makes across keys (a certificate and its key set together, metadata
within a gRPC message) stay there."""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator

from rolloutd.config.section import Section


class GrpcConfig(Section):
    host: str = "127.0.0.1"
    """Address the gRPC server binds: this machine only by default. Any other address (0.0.0.0
    for every interface) needs auth.token or grpc.tls_client_ca, or auth.allow_unauthenticated."""
    port: int = Field(50051, ge=0, le=65535)
    """gRPC port; 0 picks a free one."""
    grace_s: float = Field(10.0, ge=0)
    """On shutdown, RPCs in progress get this long to finish."""
    max_message_mb: int = Field(64, gt=0)
    """Largest gRPC message, in MiB."""
    tls_cert: str | None = None
    """PEM certificate chain; with tls_key, serves TLS."""
    tls_key: str | None = None
    """PEM private key."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).
    Needs tls_cert and tls_key."""


class HttpConfig(Section):
    enabled: bool = True
    """Serve the admin HTTP app (health, readiness, /metrics, status)."""
    host: str = "127.0.0.1"
    """Address the admin app binds: this machine only by default. Any other address needs
    auth.token or http.tls_client_ca, or auth.allow_unauthenticated."""
    port: int = Field(8080, ge=0, le=65535)
    """Admin port; 0 picks a free one."""
    dashboard_interval_s: float = Field(5.0, gt=0)
    """How often the dashboard on the admin port's front page samples the metrics."""
    dashboard_points: int = Field(1440, gt=0)
    """Dashboard points kept (in memory and next to the checkpoints): 2 h at 5 s."""
    tls_cert: str | None = None
    """PEM certificate chain; with tls_key, the admin port serves HTTPS only."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_client_ca: str | None = None
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).
    Needs tls_cert and tls_key."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A connection that has not sent a whole request head (request line and headers) this long
    after it opened, or after its previous response, is closed."""


class AuthConfig(Section):
    token: str | None = None
    """Bearer token required on mutating RPCs and on the admin port's POST routes; unset: no
    authentication, which only a loopback bind or auth.allow_unauthenticated allows. Keep it out
    of the YAML file (ROLLOUTD_AUTH__TOKEN, from a Kubernetes Secret). Printable ASCII without
    spaces; whitespace around it (a file's trailing newline) is dropped."""
    allow_unauthenticated: bool = False
    """Serve on an address other than loopback without a token (or mutual TLS): anyone who can
    reach the port may then replace the weights, rewind or submit prompts. Logged as a warning
    at every start."""

    @field_validator("token")
    @classmethod
    def _printable_token(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value or not all("!" <= ch <= "~" for ch in value):
            raise ValueError("must be printable ASCII without spaces (e.g. `openssl rand -hex 32`)")
        return value


def is_loopback(host: str) -> bool:
    """Whether a bind address accepts connections from this machine only. A name other than
    ``localhost`` counts as public: what it resolves to can change."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unauthenticated_binds(grpc: GrpcConfig, http: HttpConfig, auth: AuthConfig) -> list[str]:
    """The host keys of ports bound beyond this machine that nothing authenticates: no
    auth.token and no mutual TLS. ``rolloutd serve`` refuses to start with any unless
    auth.allow_unauthenticated (see docs/security.md)."""
    if auth.token is not None:
        return []
    open_ports = []
    if not is_loopback(grpc.host) and grpc.tls_client_ca is None:
        open_ports.append("grpc.host")
    if http.enabled and not is_loopback(http.host) and http.tls_client_ca is None:
        open_ports.append("http.host")
    return open_ports
