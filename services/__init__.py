"""Palisade: identity-based network policy for Kubernetes pods, enforced with eBPF."""

__version__ = "0.1.0"
