// SPDX-License-Identifier: GPL-2.0
/*
 * Parsing (included by palisade.c): a packet's flow (addresses, protocol, ports or ICMP echo id,
 * TCP flags, where its L4 header starts), and the offsets of the header fields the programs rewrite.
 */
#ifndef PALISADE_PARSE_H
#define PALISADE_PARSE_H

/* A parsed packet; addresses and ports in network order. */
struct flow {
    u8 saddr[16];
    u8 daddr[16];
    __be16 sport;         /* conntrack ports (ICMP echo: id and 0) */
    __be16 dport;
    u16 policy_port;      /* destination port for policy, host order; 0 without ports */
    u8 family;
    u8 protocol;
    u8 tcp_flags;
    u8 has_l4;            /* the L4 header was parsed (not a later fragment) */
    u16 l4_off;           /* offset of the L4 header */
};

#define PARSE_OK 0
#define PARSE_PASS 1     /* not ours to judge: non-IP, ND, ICMP errors */
#define PARSE_INVALID 2  /* an IP packet too short to parse */

static __always_inline int has_ports(u8 proto)
{
    return proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP;
}

/* Copy len bytes at off: straight from the packet when they are in its linear part (direct
 * access, no helper call: the common case), else through bpf_skb_load_bytes. len must be a
 * constant; off is bounded first so the verifier can check the access. */
#define LOAD_DIRECT_MAX_OFF 255
static __always_inline int load(struct __sk_buff *skb, u32 off, void *to, const u32 len)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    if (likely(off <= LOAD_DIRECT_MAX_OFF)) {
        void *from = data + off;
        if (likely(from + len <= data_end)) {
            __builtin_memcpy(to, from, len);
            return 0;
        }
    }
    return bpf_skb_load_bytes(skb, off, to, len);
}

static __always_inline int parse_l4(struct __sk_buff *skb, u32 off, struct flow *f, int first_fragment)
{
    if (!first_fragment)
        return PARSE_OK;  /* later fragments carry no ports: judged with port 0 */
    f->has_l4 = 1;
    f->l4_off = off;
    if (has_ports(f->protocol)) {
        struct {
            __be16 sport;
            __be16 dport;
            u32 seq;
            u32 ack;
            u8 doff;
            u8 flags;
        } l4 = {};
        int loaded = f->protocol == IPPROTO_TCP ? load(skb, off, &l4, 14) : load(skb, off, &l4, 4);
        if (loaded < 0)
            return PARSE_INVALID;
        f->sport = l4.sport;
        f->dport = l4.dport;
        f->policy_port = bpf_ntohs(l4.dport);
        if (f->protocol == IPPROTO_TCP)
            f->tcp_flags = l4.flags;
        return PARSE_OK;
    }
    if (f->protocol == IPPROTO_ICMP || f->protocol == IPPROTO_ICMPV6) {
        struct {
            u8 type;
            u8 code;
            u16 csum;
            __be16 id;
        } icmp = {};
        if (load(skb, off, &icmp, sizeof(icmp)) < 0)
            return PARSE_INVALID;
        u8 request = f->protocol == IPPROTO_ICMP ? 8 : 128;
        u8 reply = f->protocol == IPPROTO_ICMP ? 0 : 129;
        if (icmp.type == request) {
            f->sport = icmp.id;
        } else if (icmp.type == reply) {
            f->dport = icmp.id;  /* mirrors the request so the reversed tuple matches */
        } else if (f->protocol == IPPROTO_ICMP) {
            /* destination unreachable, time exceeded, parameter problem */
            if (icmp.type == 3 || icmp.type == 11 || icmp.type == 12)
                return PARSE_PASS;
        } else {
            /* ICMPv6 errors (1-4), MLD (130-132, 143), router/neighbour discovery (133-137) */
            if (icmp.type <= 4 || (icmp.type >= 130 && icmp.type <= 137) || icmp.type == 143)
                return PARSE_PASS;
        }
        return PARSE_OK;
    }
    return PARSE_OK;
}

static __always_inline int parse(struct __sk_buff *skb, struct flow *f)
{
    if (likely(skb->protocol == bpf_htons(ETH_P_IP))) {
        struct iphdr ip;
        if (load(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
            return PARSE_INVALID;
        f->family = FAMILY_V4;
        f->protocol = ip.protocol;
        __builtin_memcpy(f->saddr, &ip.saddr, 4);
        __builtin_memcpy(f->daddr, &ip.daddr, 4);
        int first = (ip.frag_off & bpf_htons(0x1fff)) == 0;
        return parse_l4(skb, ETH_HLEN + ip.ihl * 4, f, first);
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (load(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
            return PARSE_INVALID;
        f->family = FAMILY_V6;
        __builtin_memcpy(f->saddr, &ip6.saddr, 16);
        __builtin_memcpy(f->daddr, &ip6.daddr, 16);
        u8 next = ip6.nexthdr;
        u32 off = ETH_HLEN + sizeof(ip6);
        int first = 1;
        /* Skip the extension headers that may precede the L4 header. */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (next == 0 /* hop-by-hop */ || next == 43 /* routing */ || next == 60 /* dest opts */) {
                u8 ext[2];
                if (bpf_skb_load_bytes(skb, off, ext, 2) < 0)
                    return PARSE_INVALID;
                next = ext[0];
                off += ((u32)ext[1] + 1) * 8;
            } else if (next == 44 /* fragment */) {
                struct {
                    u8 next;
                    u8 reserved;
                    __be16 frag_off;
                    u32 id;
                } frag;
                if (bpf_skb_load_bytes(skb, off, &frag, sizeof(frag)) < 0)
                    return PARSE_INVALID;
                next = frag.next;
                first = (frag.frag_off & bpf_htons(0xfff8)) == 0;
                off += 8;
            } else {
                break;
            }
        }
        f->protocol = next;
        return parse_l4(skb, off, f, first);
    }
    return PARSE_PASS;
}

#define IPV4_CSUM_OFF (ETH_HLEN + 10)
#define IPV4_SADDR_OFF (ETH_HLEN + 12)
#define IPV4_DADDR_OFF (ETH_HLEN + 16)
#define IPV6_SADDR_OFF (ETH_HLEN + 8)
#define IPV6_DADDR_OFF (ETH_HLEN + 24)

#endif /* PALISADE_PARSE_H */
