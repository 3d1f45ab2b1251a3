"""Trust: one small CA per installation and one certificate per component.

A trust directory (``--tls-dir``; `make run` keeps one in its run directory, Kubernetes
and compose mount it from a secret) holds::

    ca.crt                 the installation's CA, trusted by every component
    ca.key                 the CA's key: only where certificates are issued, never mounted
    <name>.crt <name>.key  one pair per component (COMPONENTS)

A component's certificate is both its server certificate (DNS names: its name,
``palisade-<name>`` and the Kubernetes Service names; ``localhost``, 127.0.0.1, ::1)
and its client certificate (common name = its name). Clients check the server's
certificate against the name of the service they mean to reach, whatever address they
dial; servers learn the caller's name from its certificate and decide with
:mod:`services.common.access`. NATS maps the same certificates to its users, etcd
accepts only ipam's.

Keys are written owner-only (0600) in an owner-only directory (0700). A container gets a
bundle of its own (:func:`write_bundle`, ``palisade tls bundle``): a directory holding the CA
certificate and its component's pair only, owned by the user it runs as.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import ssl
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

#: Every component that holds a certificate. ``devnode`` is `make run`'s stand-in for kubelet.
COMPONENTS = ("watcher", "policy", "ipam", "datapath", "cli", "devnode", "nats", "etcd")
#: The namespace whose Service names the certificates carry.
NAMESPACE = "palisade-system"
CA_NAME = "ca"
VALID_DAYS = 825
CA_VALID_DAYS = 3650


class TrustError(RuntimeError):
    """Certificates are missing or unusable; the message says how to make them."""


def _hint(directory: Path) -> str:
    return (
        f"create them with `palisade tls init --dir {directory}` (make run does this itself), "
        "or point --tls-dir / PALISADE_TLS_DIR at the directory that holds them"
    )


@dataclasses.dataclass(frozen=True)
class Credentials:
    """One component's certificate, key and the installation's CA, as files."""

    name: str
    directory: Path

    @property
    def ca_file(self) -> Path:
        return self.directory / f"{CA_NAME}.crt"

    @property
    def cert_file(self) -> Path:
        return self.directory / f"{self.name}.crt"

    @property
    def key_file(self) -> Path:
        return self.directory / f"{self.name}.key"

    @classmethod
    def load(cls, directory: str | Path, name: str) -> Credentials:
        """The credentials of ``name`` in ``directory``; TrustError naming what is missing."""
        creds = cls(name, Path(directory))
        for path in (creds.ca_file, creds.cert_file, creds.key_file):
            if not path.is_file():
                raise TrustError(f"no {path.name} in {directory} for the {name} component: {_hint(Path(directory))}")
            if not os.access(path, os.R_OK):
                raise TrustError(f"cannot read {path}: run as its owner (the key is owner-only)")
        return creds

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return self.ca_file.read_bytes(), self.cert_file.read_bytes(), self.key_file.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS: present our certificate, require a client certificate from our CA."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def client_ssl_context(self) -> ssl.SSLContext:
        """A TLS client context (NATS): trust only our CA, present our certificate."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        return ctx


def dns_names(name: str) -> list[str]:
    """The DNS names a component's certificate carries."""
    service = f"palisade-{name}"
    return [
        name,
        service,
        f"{service}.{NAMESPACE}",
        f"{service}.{NAMESPACE}.svc",
        f"{service}.{NAMESPACE}.svc.cluster.local",
        # StatefulSet members (NATS servers, etcd members) by their own names, for routes and peers.
        f"*.{service}-headless.{NAMESPACE}.svc",
        f"*.{service}-headless.{NAMESPACE}.svc.cluster.local",
        "localhost",
    ]


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ensure_pki(
    directory: str | Path,
    names: Iterable[str] = COMPONENTS,
    *,
    extra_hosts: Sequence[str] = (),
) -> Path:
    """Create the CA and any missing component certificate in ``directory``; idempotent.

    A new CA reissues every certificate (old ones would not verify against it).
    ``extra_hosts`` (names or addresses) go into every certificate, e.g. a node's address.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM
    ca_crt, ca_key_path = root / f"{CA_NAME}.crt", root / f"{CA_NAME}.key"
    fresh_ca = not (ca_crt.is_file() and ca_key_path.is_file())
    if fresh_ca:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Palisade"),
                x509.NameAttribute(NameOID.COMMON_NAME, "Palisade CA"),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(key, hashes.SHA256())
        )
        _write(ca_key_path, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        _write(ca_crt, cert.public_bytes(pem))
    ca_cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    for name in names:
        crt, key_path = root / f"{name}.crt", root / f"{name}.key"
        if not fresh_ca and crt.is_file() and key_path.is_file():
            continue
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names(name)]
        for host in ("127.0.0.1", "::1", *extra_hosts):
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Palisade"),
                        x509.NameAttribute(NameOID.COMMON_NAME, name),
                    ]
                )
            )
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(key_path, key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        _write(crt, cert.public_bytes(pem))
    return root


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who a bundle belongs to: the uid and gid its component runs as."""

    uid: int
    gid: int

    @classmethod
    def parse(cls, text: str) -> Owner:
        """``UID[:GID]`` (numbers; GID defaults to UID); ValueError saying what is wrong."""
        uid, _, gid = text.partition(":")
        try:
            owner = cls(int(uid), int(gid or uid))
        except ValueError:
            raise ValueError(f"owner {text!r}: expected numeric UID[:GID], e.g. 10001:10001") from None
        if owner.uid < 0 or owner.gid < 0:
            raise ValueError(f"owner {text!r}: ids cannot be negative")
        return owner


def write_bundle(
    directory: str | Path,
    name: str,
    destination: str | Path,
    owner: Owner,
    *,
    extra: Sequence[str] = (),
) -> Path:
    """Copy ``name``'s credentials (and the CA certificate) from ``directory`` into ``destination``.

    What one container mounts as its trust directory: ``ca.crt``, ``<name>.crt`` and
    ``<name>.key`` (plus the pairs of ``extra`` components, e.g. a certificate a health
    check presents), owned by ``owner`` and readable by it only; no other key. Files left
    from an earlier bundle are removed, so a bundle never keeps a key it no longer names.
    """
    source = Path(directory)
    names = (name, *extra)
    wanted = [f"{CA_NAME}.crt", *(f"{n}.{ext}" for n in names for ext in ("crt", "key"))]
    for file in wanted:
        if not (source / file).is_file():
            raise TrustError(f"no {file} in {source} for the {name} bundle: {_hint(source)}")
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    for stale in dest.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    for file in wanted:
        _write(dest / file, (source / file).read_bytes())
        os.chown(dest / file, owner.uid, owner.gid)
        os.chmod(dest / file, 0o400 if file.endswith(".key") else 0o444)
    os.chown(dest, owner.uid, owner.gid)
    os.chmod(dest, 0o500)
    return dest
