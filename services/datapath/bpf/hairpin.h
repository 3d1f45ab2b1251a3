// SPDX-License-Identifier: GPL-2.0
/*
 * Hairpin (included by palisade.c): a pod whose chosen backend is itself gets the connection from
 * the hairpin address, and both ways are put straight back into the pod.
 */
#ifndef PALISADE_HAIRPIN_H
#define PALISADE_HAIRPIN_H

/* The source a pod sees on a connection it made to itself through a ClusterIP (hairpin_snat):
 * Cilium's service loopback address 169.254.42.1 (IPv4 link-local) and, for IPv6, 100::42 of the
 * discard-only prefix (RFC 6666). Both leave the pod by its default route, so its replies come back
 * to from_container. */

static __always_inline int addr_equal(const struct flow *f, const u8 *a, const u8 *b)
{
    if (f->family == FAMILY_V4)
        return *(const u32 *)a == *(const u32 *)b;
    const u64 *x = (const u64 *)a, *y = (const u64 *)b;
    return x[0] == y[0] && x[1] == y[1];
}

/* The source of a hairpin connection's packets becomes the hairpin address (its port stays). */
static __always_inline int hairpin_snat(struct __sk_buff *skb, struct flow *f)
{
    u8 addr[16] = {};
    if (f->family == FAMILY_V4) {
        addr[0] = 169;  /* 169.254.42.1 */
        addr[1] = 254;
        addr[2] = 42;
        addr[3] = 1;
    } else {
        addr[0] = 0x01;  /* 100::42 */
        addr[15] = 0x42;
    }
    return lb_rewrite(skb, f, addr, f->sport, 0);
}

/* A hairpin packet goes back into the pod it left: the Ethernet addresses swapped, as the host's
 * forwarding would give it (the pod's address as destination, the host veth's as source). */
static __always_inline int hairpin_back(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end)
        return TC_ACT_SHOT;
    u8 mac[ETH_ALEN];
    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    return bpf_redirect_peer(skb->ifindex, 0);
}

#endif /* PALISADE_HAIRPIN_H */
