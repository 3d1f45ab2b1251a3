"""The packet path's limit: a tc program that only forwards, the floor any enforcing program sits on.

It does what Palisade's local delivery does to a packet and nothing else: on the host veth's
ingress (where the source pod's packets arrive) it looks the IPv4 destination up in a hash
map, gives the packet the Ethernet addresses the host's forwarding would, one TTL less
(checksum updated as ``ip_decrease_ttl`` does), and puts it into the destination pod's
namespace with ``bpf_redirect_peer``. No conntrack, no endpoint lookup, no policy, no events.
Palisade / this is what enforcement costs on the fastest path the kernel offers.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from services.datapath.maps.bpf import link_create
from services.datapath.netns import PodLink

#: BPF_TCX_INGRESS: attached as Palisade's programs are (tcx links), so both pay the same hook.
BPF_TCX_INGRESS = 46

SOURCE = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/pkt_cls.h>

struct fwd {
    u32 ifindex;
    u8 dmac[6];
    u8 smac[6];
};

BPF_HASH(fwd4, u32, struct fwd, 64);

int redirect(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
        return TC_ACT_OK;
    struct iphdr *ip = data + ETH_HLEN;
    if ((void *)(ip + 1) > data_end)
        return TC_ACT_OK;
    u32 daddr = ip->daddr;
    struct fwd *f = fwd4.lookup(&daddr);
    if (!f || ip->ttl <= 1)
        return TC_ACT_OK;
    u32 check = ip->check;
    check += bpf_htons(0x0100);
    ip->check = (u16)(check + (check >= 0xFFFF));
    ip->ttl--;
    __builtin_memcpy(eth->h_dest, f->dmac, 6);
    __builtin_memcpy(eth->h_source, f->smac, 6);
    return bpf_redirect_peer(f->ifindex, 0);
}
"""


class _Fwd(ctypes.Structure):
    _fields_ = [("ifindex", ctypes.c_uint32), ("dmac", ctypes.c_uint8 * 6), ("smac", ctypes.c_uint8 * 6)]


def _mac(text: str) -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * 6)(*bytes.fromhex(text.replace(":", "")))


@dataclass
class BareRedirect:
    """The compiled program, its forwarding table for ``pods``, and the links while attached."""

    pods: tuple[PodLink, ...]

    def __post_init__(self) -> None:
        from bcc import BPF  # only where it runs: bcc is the loader's, as in the datapath

        self._bpf = BPF(text=SOURCE)
        self._fd = int(self._bpf.load_func("redirect", BPF.SCHED_CLS).fd)
        table = self._bpf["fwd4"]
        for pod in self.pods:
            value = _Fwd(pod.host_ifindex, _mac(pod.pod_mac), _mac(pod.host_mac))
            for ip in pod.ips:
                if ":" not in ip:
                    key = ctypes.c_uint32(int.from_bytes(bytes(map(int, ip.split("."))), "little"))
                    table[table.Key(key.value)] = table.Leaf(value.ifindex, value.dmac, value.smac)
        self._links: list[int] = []

    def attach(self) -> None:
        """On the ingress of every pod's host veth (its packets toward the others)."""
        self._links = [link_create(self._fd, pod.host_ifindex, BPF_TCX_INGRESS) for pod in self.pods]

    def detach(self) -> None:
        for link in self._links:  # unpinned links: closing the last fd detaches
            os.close(link)
        self._links = []

    def close(self) -> None:
        self.detach()
        self._bpf.cleanup()
