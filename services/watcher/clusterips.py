"""A dev cluster's ClusterIP allocator: what the API server does for a Service created without one.

Pure. Each Service of the folder with no ``spec.clusterIP`` (and not ExternalName or
headless) gets an address of the service range, chosen by a hash of its namespace and
name (stable across restarts and edits) and moved to the next free one on a collision;
addresses the folder writes itself are never given to another Service.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import zlib
from collections.abc import Mapping

from services.common.k8sobjects import as_map
from services.watcher.kinds import Kind
from services.watcher.objects import KObject, ObjectKey


def assign_cluster_ips(objects: Mapping[ObjectKey, KObject], cidr: str) -> dict[ObjectKey, KObject]:
    network = ipaddress.ip_network(cidr)
    size = network.num_addresses - 2  # neither the network address nor the last one
    if size < 1:
        raise ValueError(f"service range {cidr} is too small")
    out = dict(objects)
    services = sorted((key, obj) for key, obj in objects.items() if key.kind is Kind.SERVICE)
    taken = {str(as_map(obj.body.get("spec")).get("clusterIP")) for _, obj in services}
    for key, obj in services:
        spec = as_map(obj.body.get("spec"))
        if spec.get("clusterIP") or spec.get("type") == "ExternalName":
            continue
        offset = zlib.crc32(f"{key.namespace}/{key.name}".encode()) % size
        for step in range(size):
            candidate = str(network.network_address + 1 + (offset + step) % size)
            if candidate not in taken:
                break
        else:
            continue  # the range is full: the Service stays without a ClusterIP
        taken.add(candidate)
        family = "IPv4" if network.version == 4 else "IPv6"
        new_spec = {**spec, "clusterIP": candidate, "clusterIPs": [candidate], "ipFamilies": [family]}
        out[key] = dataclasses.replace(obj, body={**obj.body, "spec": new_spec})
    return out
