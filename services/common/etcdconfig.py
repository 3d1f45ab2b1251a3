"""How Palisade runs etcd: the listen URLs and, with credentials, TLS with client certificates.

Used by `make run` and the test fixtures, so every etcd they start speaks TLS on its
client and peer ports and accepts only ipam's certificate: the CA must have signed it
and it must carry the name ``ipam`` (every component has a certificate from the same CA;
only ipam's passes). Peers must be ``etcd``.
"""

from __future__ import annotations

from services.common.trust import Credentials

#: The one component etcd serves.
CLIENT = "ipam"


def flags(
    tls: Credentials | None, name: str, client: str, peer: str, members: dict[str, str] | None = None
) -> list[str]:
    """etcd flags for one member ``name`` listening on ``client`` and ``peer`` (host:port).

    ``members`` (name -> peer host:port, this one included) makes it one of a cluster.
    """
    scheme = "http" if tls is None else "https"
    initial = ",".join(f"{n}={scheme}://{p}" for n, p in (members or {name: peer}).items())
    out = [
        "--listen-client-urls", f"{scheme}://{client}",
        "--advertise-client-urls", f"{scheme}://{client}",
        "--listen-peer-urls", f"{scheme}://{peer}",
        "--initial-advertise-peer-urls", f"{scheme}://{peer}",
        "--initial-cluster", initial,
        "--initial-cluster-token", "palisade",
    ]  # fmt: skip
    if tls is not None:
        cert, key, ca = str(tls.cert_file), str(tls.key_file), str(tls.ca_file)
        out += [
            "--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
            "--client-cert-allowed-hostname", CLIENT,
            "--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca, "--peer-client-cert-auth",
            "--peer-cert-allowed-cn", "etcd",
        ]  # fmt: skip
    return out


def ctl_flags(tls: Credentials | None) -> list[str]:
    """etcdctl flags that present ``tls`` (a client's credentials)."""
    if tls is None:
        return []
    return ["--cacert", str(tls.ca_file), "--cert", str(tls.cert_file), "--key", str(tls.key_file)]
