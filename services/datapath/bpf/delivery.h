// SPDX-License-Identifier: GPL-2.0
/*
 * Local delivery (included by palisade.c; LOCAL_DELIVERY, Cilium's BPF host routing): a packet
 * for another local pod goes straight into its namespace, judged there by "deliver", with the
 * Ethernet addresses and TTL the host's forwarding would give it.
 */
#ifndef PALISADE_DELIVERY_H
#define PALISADE_DELIVERY_H

/* -- local delivery ------------------------------------------------------------------------- */

/* What from_container found for "deliver", in skb->cb (kept across a tail call): the destination
 * veth, then the Ethernet addresses the host's forwarding would give the packet. */
struct delivery {
    u32 ifindex;
    u8 dmac[6];
    u8 smac[6];
};

/* Whether the packet goes to another local endpoint that can be delivered to directly; if so, the
 * delivery is written to skb->cb. Read from the packet as it leaves from_container (after DNAT).
 * One hash lookup: the agent wrote the Ethernet addresses the host's forwarding would use (a FIB
 * and neighbour lookup here, bpf_fib_lookup, costs about 90 ns a packet). */
static __always_inline int delivery_of(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct delivery_key dk = {};
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
            return 0;  /* expiring: the host's forwarding answers with ICMP time exceeded */
        dk.family = FAMILY_V4;
        __builtin_memcpy(dk.addr, &ip->daddr, 4);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end || ip6->hop_limit <= 1)
            return 0;
        dk.family = FAMILY_V6;
        __builtin_memcpy(dk.addr, &ip6->daddr, 16);
    } else {
        return 0;
    }
    struct delivery_value *dv = delivery.lookup(&dk);
    if (!dv || dv->generation != EP_GENERATION || dv->ifindex == skb->ifindex)
        return 0;  /* no local pod's, not on these programs yet, or the pod itself (hairpin) */
    struct delivery d = {};
    d.ifindex = dv->ifindex;
    __builtin_memcpy(d.dmac, dv->dmac, 6);
    __builtin_memcpy(d.smac, dv->smac, 6);
    u32 words[4];
    __builtin_memcpy(words, &d, sizeof(words));
    skb->cb[0] = words[0];
    skb->cb[1] = words[1];
    skb->cb[2] = words[2];
    skb->cb[3] = words[3];
    return 1;
}

/* What the host's forwarding would have done: the Ethernet addresses of the destination's link,
 * TTL or hop limit one less (the IPv4 checksum updated as ip_decrease_ttl does). */
static __always_inline int forward_rewrite(struct __sk_buff *skb, const struct delivery *d)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end)
        return -1;
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end)
            return -1;
        u32 check = ip->check;
        check += bpf_htons(0x0100);
        ip->check = (u16)(check + (check >= 0xFFFF));
        ip->ttl--;
    } else {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end)
            return -1;
        ip6->hop_limit--;
    }
    __builtin_memcpy(eth->h_dest, d->dmac, 6);
    __builtin_memcpy(eth->h_source, d->smac, 6);
    return 0;
}

#endif /* PALISADE_DELIVERY_H */
