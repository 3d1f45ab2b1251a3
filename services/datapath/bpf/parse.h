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

/* ICMP and ICMPv6 types and codes the programs read or write (RFC 792, RFC 4443, RFC 4861, RFC 3810;
 * the kernel's ICMP_* and ICMPV6_*). */
#define ICMP4_ECHO_REPLY 0
#define ICMP4_DEST_UNREACH 3
#define ICMP4_PORT_UNREACH 3     /* code of ICMP4_DEST_UNREACH */
#define ICMP4_ECHO_REQUEST 8
#define ICMP4_TIME_EXCEEDED 11
#define ICMP4_PARAMETER_PROBLEM 12
#define ICMP6_DEST_UNREACH 1
#define ICMP6_PORT_UNREACH 4     /* code of ICMP6_DEST_UNREACH */
#define ICMP6_ERROR_MAX 4        /* errors are types 1 (unreachable) to 4 (parameter problem) */
#define ICMP6_ECHO_REQUEST 128
#define ICMP6_ECHO_REPLY 129
#define ICMP6_MLD_QUERY 130      /* MLD query, report, done: 130-132 */
#define ICMP6_ND_REDIRECT 137    /* router and neighbour discovery: 133 (router solicitation) to 137 */
#define ICMP6_MLD2_REPORT 143

/* Header layouts (RFC 791, 8200, 793, 768). */
#define IPV4_IHL_UNIT 4             /* ihl counts 32-bit words */
#define IPV4_FRAG_OFFSET 0x1fff     /* frag_off's offset bits (the kernel's IP_OFFSET) */
#define IPV6_FRAG_OFFSET 0xfff8     /* a fragment header's offset bits (IP6_OFFSET) */
#define IPV6_EXT_LEN_UNIT 8         /* an extension header's length counts 8-byte units past the first */
#define IPV6_FRAG_HDR_LEN 8
#define IPV6_EXT_MAX 4              /* extension headers skipped before the L4 header */
#define L4_PORTS_LEN 4              /* source and destination port, first in TCP, UDP and SCTP */
#define TCP_FLAGS_END 14            /* TCP's header through its flags byte */
#define L4_SPORT_OFF 0
#define L4_DPORT_OFF 2
#define TCP_CSUM_OFF 16
#define UDP_CSUM_OFF 6
#define TCP_HDR_LEN 20              /* without options */
#define UDP_HDR_LEN 8

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
        int loaded = f->protocol == IPPROTO_TCP ? load(skb, off, &l4, TCP_FLAGS_END) : load(skb, off, &l4, L4_PORTS_LEN);
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
        u8 request = f->protocol == IPPROTO_ICMP ? ICMP4_ECHO_REQUEST : ICMP6_ECHO_REQUEST;
        u8 reply = f->protocol == IPPROTO_ICMP ? ICMP4_ECHO_REPLY : ICMP6_ECHO_REPLY;
        if (icmp.type == request) {
            f->sport = icmp.id;
        } else if (icmp.type == reply) {
            f->dport = icmp.id;  /* mirrors the request so the reversed tuple matches */
        } else if (f->protocol == IPPROTO_ICMP) {
            /* destination unreachable, time exceeded, parameter problem */
            if (icmp.type == ICMP4_DEST_UNREACH || icmp.type == ICMP4_TIME_EXCEEDED ||
                icmp.type == ICMP4_PARAMETER_PROBLEM)
                return PARSE_PASS;
        } else {
            /* ICMPv6 errors, MLD, router/neighbour discovery */
            if (icmp.type <= ICMP6_ERROR_MAX || (icmp.type >= ICMP6_MLD_QUERY && icmp.type <= ICMP6_ND_REDIRECT) ||
                icmp.type == ICMP6_MLD2_REPORT)
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
        int first = (ip.frag_off & bpf_htons(IPV4_FRAG_OFFSET)) == 0;
        return parse_l4(skb, ETH_HLEN + ip.ihl * IPV4_IHL_UNIT, f, first);
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
        for (int i = 0; i < IPV6_EXT_MAX; i++) {
            if (next == IPPROTO_HOPOPTS || next == IPPROTO_ROUTING || next == IPPROTO_DSTOPTS) {
                u8 ext[2];
                if (bpf_skb_load_bytes(skb, off, ext, 2) < 0)
                    return PARSE_INVALID;
                next = ext[0];
                off += ((u32)ext[1] + 1) * IPV6_EXT_LEN_UNIT;
            } else if (next == IPPROTO_FRAGMENT) {
                struct {
                    u8 next;
                    u8 reserved;
                    __be16 frag_off;
                    u32 id;
                } frag;
                if (bpf_skb_load_bytes(skb, off, &frag, sizeof(frag)) < 0)
                    return PARSE_INVALID;
                next = frag.next;
                first = (frag.frag_off & bpf_htons(IPV6_FRAG_OFFSET)) == 0;
                off += IPV6_FRAG_HDR_LEN;
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
