"""Everything of the policy service that is pure: no network, store, clock or concurrency.

The engine proper turns policy documents and identities into per-identity map
entries: :mod:`model` (the typed policy), :mod:`parse`, :mod:`selector`,
:mod:`identity`, :mod:`selectorcache`, :mod:`repository`, :mod:`resolve` and
:mod:`policyengine` (the incremental :class:`PolicyEngine`), with :mod:`trace`
and :mod:`analyze` answering questions over it. Around it, the service's own
bookkeeping, equally pure: :mod:`sources` (API vs Kubernetes policies),
:mod:`registry`, :mod:`ipcache`, :mod:`orders` (per-node order planning),
:mod:`realized` (which endpoint enforces which revision), :mod:`wire` (protobuf
conversions) and :mod:`core` (the state the controller task owns).

The import-linter contract in ``pyproject.toml`` forbids this package any
import of grpc, nats, etcd, asyncio or kubernetes, so whatever is added here is
pure by construction; the I/O shell (bus inputs, controller, persistence,
gRPC) lives one level up in :mod:`services.policy`.
"""
