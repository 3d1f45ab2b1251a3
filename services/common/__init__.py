"""Helpers shared by every Palisade service: config, logging, bus, gRPC, etcd, lifecycle."""
