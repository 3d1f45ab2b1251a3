/* DNS steering: an endpoint's DNS queries, once policy has passed them, go to the node's DNS proxy.
 *
 * As Cilium's transparent proxy redirect (bpf/lib/proxy.h, assign_socket): no NAT. The packet keeps
 * its addresses; the proxy's socket is assigned to it (bpf_sk_assign, tc ingress only) and its mark
 * (DNS_PROXY_MARK) makes the node's policy routing deliver it locally, where the assigned socket
 * takes it. The proxy's sockets are IP_TRANSPARENT: it reads the original server from the packet
 * (IP_RECVORIGDSTADDR, or the accepted TCP socket's own address) and answers from that address, so
 * the answer is a reply of the flow conntrack already holds.
 *
 * dns_steering holds (endpoint, destination port, protocol) -> the proxy's port, written by the
 * proxy for the endpoints its DNS rules select. The entries stay while the proxy restarts; a packet
 * that then finds no proxy socket is dropped (its client retries) rather than sent past the proxy
 * to a server whose answers would not be learned or filtered. */
#ifndef PALISADE_DNS_H
#define PALISADE_DNS_H

struct dns_steer_key {
    u32 ep_id;
    u16 port;      /* destination port, host order */
    u8 protocol;
    u8 pad;
};
struct dns_steer_value {
    u16 proxy_port;  /* host order */
    u16 pad;
};

BPF_TABLE_PINNED("hash", struct dns_steer_key, struct dns_steer_value, dns_steering, DNS_STEER_MAX,
                 PIN_DIR "/dns_steering");

#define DNS_CB_PORT 4  /* skb->cb slot where handle() leaves the destination port (cb[0-3]: delivery) */
#define DNS_PASS -1
#define DNS_TCP_FLAGS_OFF 13  /* the flags byte in a TCP header */  /* not steered: the caller goes on */

/* Steers the packet to the proxy when its endpoint, port and protocol are in dns_steer: TC_ACT_OK
 * with the proxy's socket assigned, TC_ACT_SHOT when the proxy has no socket, DNS_PASS otherwise.
 * IPv4 and IPv6 without extension headers (DNS clients send none). */
static __always_inline int dns_steer_to_proxy(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct bpf_sock_tuple t = {};
    u32 tuple_len;
    u8 proto;
    __be16 *ports;
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end || ip->ihl != 5 || (ip->frag_off & bpf_htons(0x3fff)))
            return DNS_PASS;
        proto = ip->protocol;
        ports = (void *)(ip + 1);
        t.ipv4.saddr = ip->saddr;
        t.ipv4.daddr = ip->daddr;
        tuple_len = sizeof(t.ipv4);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end)
            return DNS_PASS;
        proto = ip6->nexthdr;
        ports = (void *)(ip6 + 1);
        __builtin_memcpy(t.ipv6.saddr, &ip6->saddr, 16);
        __builtin_memcpy(t.ipv6.daddr, &ip6->daddr, 16);
        tuple_len = sizeof(t.ipv6);
    } else {
        return DNS_PASS;
    }
    if ((proto != IPPROTO_UDP && proto != IPPROTO_TCP) || (void *)(ports + 2) > data_end)
        return DNS_PASS;
    struct endpoint_key self = {};
    self.ifindex = skb->ifindex;
    struct endpoint_value *ep = endpoints.lookup(&self);
    if (!ep)
        return DNS_PASS;
    struct dns_steer_key k = {};
    k.ep_id = ep->ep_id;
    k.port = bpf_ntohs(ports[1]);
    k.protocol = proto;
    struct dns_steer_value *v = dns_steering.lookup(&k);
    if (!v)
        return DNS_PASS;

    struct bpf_sock *sk;
    /* sport/dport sit at one offset in both tuple layouts. */
    if (tuple_len == sizeof(t.ipv4)) {
        t.ipv4.sport = ports[0];
        t.ipv4.dport = ports[1];
    } else {
        t.ipv6.sport = ports[0];
        t.ipv6.dport = ports[1];
    }
    if (proto == IPPROTO_TCP) {
        /* Only a SYN needs the proxy's listener: the connection it accepts has the packet's own
         * tuple, which the local stack finds for every later packet (as TPROXY's). */
        u8 *flags = (u8 *)ports + DNS_TCP_FLAGS_OFF;
        if ((void *)(flags + 1) > data_end)
            return TC_ACT_SHOT;
        if ((*flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) != TCP_FLAG_SYN)
            goto mark;
    }
    if (tuple_len == sizeof(t.ipv4))
        t.ipv4.dport = bpf_htons(v->proxy_port);
    else
        t.ipv6.dport = bpf_htons(v->proxy_port);
    if (proto == IPPROTO_TCP)
        sk = bpf_skc_lookup_tcp(skb, &t, tuple_len, BPF_F_CURRENT_NETNS, 0);
    else
        sk = bpf_sk_lookup_udp(skb, &t, tuple_len, BPF_F_CURRENT_NETNS, 0);
    if (!sk)
        return TC_ACT_SHOT;  /* no proxy now: the client retries */
    long err = bpf_sk_assign(skb, sk, 0);
    bpf_sk_release(sk);
    if (err)
        return TC_ACT_SHOT;
mark:
    skb->mark = (skb->mark & ~DNS_PROXY_MARK_MASK) | DNS_PROXY_MARK;
    return TC_ACT_OK;
}

#endif /* PALISADE_DNS_H */
