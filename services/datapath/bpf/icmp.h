// SPDX-License-Identifier: GPL-2.0
/*
 * ICMP replies (included by palisade.c): a connection to a frontend without backends is answered
 * with ICMP / ICMPv6 port unreachable, as kube-proxy does.
 */
#ifndef PALISADE_ICMP_H
#define PALISADE_ICMP_H

/* The reply's headers: [eth][ip][icmp][the original IP header][its first L4 bytes]. */
#define ICMP_HDR_LEN 8
#define REPLY_TTL 64                /* the kernel's default TTL and hop limit */
#define IPTOS_INTERNETCONTROL 0xc0  /* the ToS the kernel gives ICMP errors */
#define IPV4_HDR_LEN 20             /* without options */
#define IPV6_HDR_LEN 40
#define REJECT4_ROOM (IPV4_HDR_LEN + ICMP_HDR_LEN)                 /* new bytes in front */
#define REJECT4_LEN (IPV4_HDR_LEN + ICMP_HDR_LEN + IPV4_HDR_LEN)   /* the IP packet, less the quote */
#define REJECT6_ROOM (IPV6_HDR_LEN + ICMP_HDR_LEN)
#define REJECT6_PAYLOAD (ICMP_HDR_LEN + IPV6_HDR_LEN)              /* the IPv6 payload, less the quote */

static __always_inline u16 csum_fold(u64 sum)
{
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return (u16)~sum;
}

/* The L4 bytes an ICMP error quotes: TCP's 20-byte header or UDP's 8; 0 if they cannot be read. */
static __always_inline u32 lb_quote(struct __sk_buff *skb, const struct flow *f, u8 *l4)
{
    if (f->protocol == IPPROTO_TCP)
        return bpf_skb_load_bytes(skb, f->l4_off, l4, TCP_HDR_LEN) < 0 ? 0 : TCP_HDR_LEN;
    return bpf_skb_load_bytes(skb, f->l4_off, l4, UDP_HDR_LEN) < 0 ? 0 : UDP_HDR_LEN;
}

static __always_inline s64 lb_quote_sum(u8 *l4, u32 quote, s64 sum)
{
    if (quote == TCP_HDR_LEN)
        return bpf_csum_diff(0, 0, (void *)l4, TCP_HDR_LEN, sum);
    return bpf_csum_diff(0, 0, (void *)l4, UDP_HDR_LEN, sum);
}

/* Turn the packet into "port unreachable" from the frontend back to the client:
 * [eth][ip][icmp][the original IP header][its first L4 bytes]. The original
 * headers stay where they are; room for the new ones is made in front of them.
 * The quote is the UDP header, or the whole 20-byte TCP header: a checksum the
 * stack still has to fill in (CHECKSUM_PARTIAL) must stay inside the packet. */
static __always_inline int lb_reject(struct __sk_buff *skb, const struct flow *f)
{
    struct ethhdr eth;
    if (bpf_skb_load_bytes(skb, 0, &eth, sizeof(eth)) < 0)
        return -1;
    u8 mac[ETH_ALEN];
    __builtin_memcpy(mac, eth.h_dest, ETH_ALEN);
    __builtin_memcpy(eth.h_dest, eth.h_source, ETH_ALEN);
    __builtin_memcpy(eth.h_source, mac, ETH_ALEN);
    u8 l4[TCP_HDR_LEN] = {};
    struct {
        u8 type;
        u8 code;
        __sum16 csum;
        u32 unused;
    } icmp = {};
    if (f->family == FAMILY_V4) {
        struct iphdr orig;
        if (f->l4_off != ETH_HLEN + sizeof(orig))
            return -1;  /* IP options: not worth quoting, the packet is dropped */
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &orig, sizeof(orig)) < 0)
            return -1;
        u32 quote = lb_quote(skb, f, l4);
        if (!quote)
            return -1;
        if (bpf_skb_adjust_room(skb, REJECT4_ROOM, BPF_ADJ_ROOM_MAC, 0) < 0 ||
            bpf_skb_change_tail(skb, ETH_HLEN + REJECT4_LEN + quote, 0) < 0)
            return -1;
        icmp.type = ICMP4_DEST_UNREACH;
        icmp.code = ICMP4_PORT_UNREACH;
        s64 sum = bpf_csum_diff(0, 0, (void *)&icmp, sizeof(icmp), 0);
        sum = bpf_csum_diff(0, 0, (void *)&orig, sizeof(orig), sum);
        sum = lb_quote_sum(l4, quote, sum);
        icmp.csum = csum_fold(sum);
        struct iphdr ip = {};
        ip.version = 4;
        ip.ihl = sizeof(ip) / IPV4_IHL_UNIT;
        ip.tos = IPTOS_INTERNETCONTROL;
        ip.tot_len = bpf_htons(REJECT4_LEN + quote);
        ip.ttl = REPLY_TTL;
        ip.protocol = IPPROTO_ICMP;
        ip.saddr = orig.daddr;
        ip.daddr = orig.saddr;
        ip.check = csum_fold(bpf_csum_diff(0, 0, (void *)&ip, sizeof(ip), 0));
        if (bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
            bpf_skb_store_bytes(skb, ETH_HLEN, &ip, sizeof(ip), 0) < 0 ||
            bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(ip), &icmp, sizeof(icmp), 0) < 0)
            return -1;
        return 0;
    }
    struct ipv6hdr orig6;
    if (f->l4_off != ETH_HLEN + sizeof(orig6))
        return -1;  /* extension headers: dropped */
    if (bpf_skb_load_bytes(skb, ETH_HLEN, &orig6, sizeof(orig6)) < 0)
        return -1;
    u32 quote = lb_quote(skb, f, l4);
    if (!quote)
        return -1;
    if (bpf_skb_adjust_room(skb, REJECT6_ROOM, BPF_ADJ_ROOM_MAC, 0) < 0 ||
        bpf_skb_change_tail(skb, ETH_HLEN + IPV6_HDR_LEN + REJECT6_PAYLOAD + quote, 0) < 0)
        return -1;
    icmp.type = ICMP6_DEST_UNREACH;
    icmp.code = ICMP6_PORT_UNREACH;
    struct ipv6hdr ip6 = {};
    ip6.version = 6;
    ip6.payload_len = bpf_htons(REJECT6_PAYLOAD + quote);
    ip6.nexthdr = IPPROTO_ICMPV6;
    ip6.hop_limit = REPLY_TTL;
    ip6.saddr = orig6.daddr;
    ip6.daddr = orig6.saddr;
    struct {
        u32 len;
        u32 next;
    } pseudo = {.len = bpf_htonl(REJECT6_PAYLOAD + quote), .next = bpf_htonl(IPPROTO_ICMPV6)};
    s64 sum = bpf_csum_diff(0, 0, (void *)&ip6.saddr, 32, 0);
    sum = bpf_csum_diff(0, 0, (void *)&pseudo, sizeof(pseudo), sum);
    sum = bpf_csum_diff(0, 0, (void *)&icmp, sizeof(icmp), sum);
    sum = bpf_csum_diff(0, 0, (void *)&orig6, sizeof(orig6), sum);
    sum = lb_quote_sum(l4, quote, sum);
    icmp.csum = csum_fold(sum);
    if (bpf_skb_store_bytes(skb, 0, &eth, sizeof(eth), 0) < 0 ||
        bpf_skb_store_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6), 0) < 0 ||
        bpf_skb_store_bytes(skb, ETH_HLEN + sizeof(ip6), &icmp, sizeof(icmp), 0) < 0)
        return -1;
    return 0;
}

#endif /* PALISADE_ICMP_H */
