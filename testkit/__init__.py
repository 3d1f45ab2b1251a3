"""What tests and benchmarks share: real servers (NATS, etcd, containerd, a list/watch API server),
dev stacks, datapath nodes and traffic, and the played nodes of the policy service.

Kept out of ``tests/`` so that benchmarks import no test module; nothing in ``services/`` imports it.
"""
