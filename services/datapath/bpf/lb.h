// SPDX-License-Identifier: GPL-2.0
/*
 * Services (included by palisade.c): the rewrite of a packet's address and port with its
 * checksums; DNAT of a new connection to a frontend to a backend (kept per connection in
 * lb_conntrack, ClientIP affinity in lb_affinity); reverse NAT of the replies (lb_revnat).
 */
#ifndef PALISADE_LB_H
#define PALISADE_LB_H

/* Whether the packet's protocol is load-balanced: TCP, UDP and SCTP (whose checksum sctp_csum fixes
 * once the packet is final). */
static __always_inline int lb_l4(const struct flow *f)
{
    return f->has_l4 && (f->protocol == IPPROTO_TCP || f->protocol == IPPROTO_UDP || f->protocol == IPPROTO_SCTP);
}

/* The flow as the packet now is, after its address and port on one side were rewritten. */
static __always_inline void lb_flow_rewritten(struct flow *f, u8 *cur, const u8 *addr, __be16 port, int dst)
{
    __builtin_memcpy(cur, addr, 16);
    if (dst) {
        f->dport = port;
        f->policy_port = bpf_ntohs(port);
    } else {
        f->sport = port;
    }
}

/* Rewrite the destination (dst) or source address and port, keeping checksums right. SCTP's
 * checksum covers no address, and its port changes are accounted for once the packet is final
 * (sctp_fix_csum). */
static __always_inline int lb_rewrite(struct __sk_buff *skb, struct flow *f, const u8 *addr, __be16 port, int dst)
{
    u32 l4 = f->l4_off;
    u32 csum_off = l4 + (f->protocol == IPPROTO_TCP ? TCP_CSUM_OFF : UDP_CSUM_OFF);
    u64 mangled = 0;
    int l4_csum = 1;
    u64 store_flags = 0;
    if (unlikely(f->protocol == IPPROTO_SCTP)) {
        l4_csum = 0;
        store_flags = BPF_F_RECOMPUTE_CSUM;
    } else if (f->protocol == IPPROTO_UDP) {
        __sum16 udp_csum = 0;
        if (bpf_skb_load_bytes(skb, csum_off, &udp_csum, sizeof(udp_csum)) < 0)
            return -1;
        if (f->family == FAMILY_V4 && udp_csum == 0)
            l4_csum = 0;  /* IPv4 UDP without a checksum stays without one */
        mangled = BPF_F_MARK_MANGLED_0;
    }
    u8 *cur = dst ? f->daddr : f->saddr;
    if (f->family == FAMILY_V4) {
        u32 from, to;
        __builtin_memcpy(&from, cur, 4);
        __builtin_memcpy(&to, addr, 4);
        if (from != to) {
            if (bpf_l3_csum_replace(skb, IPV4_CSUM_OFF, from, to, 4) < 0)
                return -1;
            if (l4_csum && bpf_l4_csum_replace(skb, csum_off, from, to, BPF_F_PSEUDO_HDR | mangled | 4) < 0)
                return -1;
            if (bpf_skb_store_bytes(skb, dst ? IPV4_DADDR_OFF : IPV4_SADDR_OFF, &to, 4, 0) < 0)
                return -1;
        }
    } else {
        u32 from[4], to[4];
        __builtin_memcpy(from, cur, 16);
        __builtin_memcpy(to, addr, 16);
        s64 diff = bpf_csum_diff(from, 16, to, 16, 0);
        if (l4_csum && bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | mangled) < 0)
            return -1;
        if (bpf_skb_store_bytes(skb, dst ? IPV6_DADDR_OFF : IPV6_SADDR_OFF, to, 16, 0) < 0)
            return -1;
    }
    __be16 old_port = dst ? f->dport : f->sport;
    if (old_port != port) {
        if (l4_csum && bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled | sizeof(port)) < 0)
            return -1;
        if (bpf_skb_store_bytes(skb, l4 + (dst ? L4_DPORT_OFF : L4_SPORT_OFF), &port, sizeof(port), store_flags) < 0)
            return -1;
    }
    lb_flow_rewritten(f, cur, addr, port, dst);
    return 0;
}

/* The IPv4 header checksum ``check`` after a 32-bit word of the header changed from ``from`` to
 * ``to`` (RFC 1624, as the kernel's csum_replace4): one's complement arithmetic, in the header's
 * own byte order. */
static __always_inline __sum16 ip_csum_replace4(__sum16 check, __be32 from, __be32 to)
{
    u64 sum = (u16)~check;
    sum += (u32)~from;
    sum += to;
    sum = (sum & 0xffffffff) + (sum >> 32);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return (__sum16)~sum;
}

/* lb_rewrite of an IPv4 TCP or UDP packet, for the paths every packet of a service connection takes
 * (the DNAT of each packet to a frontend, lb_egress; the reverse NAT of each reply, lb_reverse): only
 * the L4 checksum goes through a helper (how to update it depends on the skb's checksum state, which
 * only the kernel sees); the UDP checksum is read, and the address, the IPv4 checksum and the port
 * written, straight in the packet: three helper calls fewer (measured, DNAT: about 130 ns a packet).
 * Anything else, or headers past the directly readable part, goes through lb_rewrite. Direct writes
 * make the verifier put an unclone check before the program (a cloned packet is copied first):
 * from_container and deliver write packets directly anyway (hairpin_back, forward_rewrite), so only
 * they pass ``direct`` (from_container for DNAT, deliver for reverse NAT); to_container keeps the
 * helpers. */
static __always_inline int lb_rewrite_fast(struct __sk_buff *skb, struct flow *f, const u8 *addr, __be16 port,
                                           int dst, int direct)
{
    u32 l4 = f->l4_off;
    if (!direct || f->family != FAMILY_V4 || (f->protocol != IPPROTO_TCP && f->protocol != IPPROTO_UDP) ||
        l4 > LOAD_DIRECT_MAX_OFF)
        return lb_rewrite(skb, f, addr, port, dst);
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    if (data + l4 + UDP_HDR_LEN > data_end || data + ETH_HLEN + sizeof(struct iphdr) > data_end)
        return lb_rewrite(skb, f, addr, port, dst);
    u32 csum_off = l4 + (f->protocol == IPPROTO_TCP ? TCP_CSUM_OFF : UDP_CSUM_OFF);
    u64 mangled = 0;
    int l4_csum = 1;
    if (f->protocol == IPPROTO_UDP) {
        __sum16 *udp_csum = data + l4 + UDP_CSUM_OFF;
        l4_csum = *udp_csum != 0;  /* IPv4 UDP without a checksum stays without one */
        mangled = BPF_F_MARK_MANGLED_0;
    }
    u8 *cur = dst ? f->daddr : f->saddr;
    __be32 from, to;
    __builtin_memcpy(&from, cur, 4);
    __builtin_memcpy(&to, addr, 4);
    __be16 old_port = dst ? f->dport : f->sport;
    if (l4_csum) {
        if (from != to && bpf_l4_csum_replace(skb, csum_off, from, to, BPF_F_PSEUDO_HDR | mangled | 4) < 0)
            return -1;
        if (old_port != port && bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled | sizeof(port)) < 0)
            return -1;
    }
    /* The helpers may have moved the packet: its pointers again. */
    data = (void *)(long)skb->data;
    data_end = (void *)(long)skb->data_end;
    struct iphdr *ip = data + ETH_HLEN;
    if ((void *)(ip + 1) > data_end || data + l4 + L4_PORTS_LEN > data_end)
        return -1;
    __be16 *ports = data + l4;
    if (from != to) {
        ip->check = ip_csum_replace4(ip->check, from, to);
        if (dst)
            ip->daddr = to;
        else
            ip->saddr = to;
    }
    ports[dst ? 1 : 0] = port;
    lb_flow_rewritten(f, cur, addr, port, dst);
    return 0;
}

static __always_inline u32 lb_pick(const struct lb_service_key *sk, const struct lb_service_value *svc,
                                   const struct flow *f, u64 now)
{
    struct lb_affinity_key ak = {};
    struct lb_affinity_value *av = NULL;
    if (svc->flags & SVC_FLAG_AFFINITY) {
        __builtin_memcpy(ak.client, f->saddr, 16);
        ak.rev_nat = svc->rev_nat;
        ak.family = f->family;
        av = lb_affinity.lookup(&ak);
        if (av && now - av->last_ns < (u64)svc->affinity_s * NSEC) {
            struct lb_backend_key bk = {.id = av->backend_id};
            if (lb_backends.lookup(&bk)) {
                av->last_ns = now;
                return av->backend_id;
            }
        }
    }
    struct lb_service_key slot = *sk;
    slot.slot = (bpf_get_prandom_u32() % svc->count) + 1;
    struct lb_service_value *sv = lb_services.lookup(&slot);
    if (!sv)
        return 0;
    if (svc->flags & SVC_FLAG_AFFINITY) {
        struct lb_affinity_value nv = {.last_ns = now, .backend_id = sv->backend_id};
        lb_affinity.update(&ak, &nv);
    }
    return sv->backend_id;
}

#define LB_NONE 0      /* not a frontend: the packet goes on unchanged */
#define LB_DNAT 1      /* rewritten to a backend; *rev_nat names the service */
#define LB_REJECT 2    /* a frontend without backends: answered, the packet was consumed */
#define LB_DROP 3      /* cannot be translated */

/* The service key of the packet's destination (slot 0: the service itself). */
static __always_inline void lb_service_key_of(const struct flow *f, struct lb_service_key *sk)
{
    __builtin_memcpy(sk->addr, f->daddr, 16);
    sk->port = f->dport;
    sk->slot = 0;
    sk->family = f->family;
    sk->protocol = f->protocol;
    sk->pad[0] = 0;
    sk->pad[1] = 0;
}

/* The service the packet is addressed to, asked only where lb_ports says some frontend has its
 * destination port (an array lookup, which the verifier inlines; *looked_up then says the service
 * map was asked), else NULL. */
static __always_inline struct lb_service_value *lb_hinted_frontend(const struct flow *f, int *looked_up)
{
    u16 port = bpf_ntohs(f->dport);
    struct lb_port_key pk = {.word = port / 64};
    struct lb_port_value *pv = lb_ports.lookup(&pk);
    if (!pv || !((pv->bits >> (port % 64)) & 1))
        return NULL;
    *looked_up = 1;
    struct lb_service_key sk;
    lb_service_key_of(f, &sk);
    return lb_services.lookup(&sk);
}

/* DNAT of a packet to a frontend. ``svc``, when ``looked_up``: the caller's lookup of the packet's
 * service (NULL: not a frontend); otherwise it is looked up here. */
static __always_inline int lb_egress(struct __sk_buff *skb, struct flow *f, u32 ep_id, u64 now, u16 *rev_nat,
                                     struct lb_service_value *svc, int looked_up)
{
    if (!lb_l4(f))
        return LB_NONE;
    struct lb_service_key sk;
    lb_service_key_of(f, &sk);
    if (!looked_up)
        svc = lb_services.lookup(&sk);
    if (!svc)
        return LB_NONE;

    struct lb_ct_key ck = {};
    __builtin_memcpy(ck.saddr, f->saddr, 16);
    __builtin_memcpy(ck.vaddr, f->daddr, 16);
    ck.sport = f->sport;
    ck.vport = f->dport;
    ck.ep_id = ep_id;
    ck.family = f->family;
    ck.protocol = f->protocol;
    const u8 *addr = NULL;
    __be16 port = 0;
    /* Read before any backend is: an entry is stamped with a revision no newer than its lookup. */
    u32 revision = *(volatile u32 *)&svc->revision;
    struct lb_ct_value *cv = lb_conntrack.lookup(&ck);
    /* A bare SYN on a closing connection's entry opens a new connection: it is balanced anew. */
    int reopens = (f->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
    if (cv && cv->expires_ns >= now && cv->rev_nat == svc->rev_nat && !(reopens && cv->closing)) {
        if (likely(cv->revision == revision)) {
            /* No backend has left the service since the entry was written: its backend stands. */
            addr = cv->addr;
            port = cv->port;
        } else {
            /* A backend left: the connection keeps its own if that is still there (the entry
             * then carries the service's current revision), else it is balanced anew below. */
            struct lb_backend_key bk = {.id = cv->backend_id};
            struct lb_backend_value *kept = lb_backends.lookup(&bk);
            if (kept) {
                __builtin_memcpy(cv->addr, kept->addr, 16);
                cv->port = kept->port;
                cv->revision = revision;
                addr = kept->addr;
                port = kept->port;
            }
        }
    }
    u8 closing = (f->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) ? 1 : 0;
    if (addr) {
        /* The connection keeps its backend. Its entry is written as conntrack's (ct_refresh): on a
         * FIN or RST, else when its expiry is more than CT_REFRESH_NS behind; most packets only read it. */
        if (unlikely(closing && !cv->closing)) {
            cv->closing = 1;
            cv->expires_ns = now + ct_lifetime(f->protocol, 1);
        } else {
            u64 expires = now + ct_lifetime(f->protocol, cv->closing);
            if (unlikely(cv->expires_ns + CT_REFRESH_NS < expires))
                cv->expires_ns = expires;
        }
    } else {
        /* A new connection, or its backend went away: a live backend of the service
         * (the new one answers a mid-connection TCP segment with a reset: it ends cleanly). */
        if (svc->count == 0)
            return LB_REJECT;
        u32 id = lb_pick(&sk, svc, f, now);
        struct lb_backend_key bk = {.id = id};
        struct lb_backend_value *be = lb_backends.lookup(&bk);
        if (!be)
            return LB_DROP;
        struct lb_ct_value nv = {};
        nv.expires_ns = now + ct_lifetime(f->protocol, closing);
        nv.backend_id = id;
        nv.rev_nat = svc->rev_nat;
        nv.closing = closing;
        __builtin_memcpy(nv.addr, be->addr, 16);
        nv.port = be->port;
        nv.revision = revision;
        lb_conntrack.update(&ck, &nv);
        addr = be->addr;
        port = be->port;
    }
    if (lb_rewrite_fast(skb, f, addr, port, 1, 1) < 0)
        return LB_DROP;
    *rev_nat = svc->rev_nat;
    return LB_DNAT;
}

/* A reply entering the client: the backend's address and port become the frontend's (``direct``: see
 * lb_rewrite_fast). */
static __always_inline int lb_reverse(struct __sk_buff *skb, struct flow *f, u16 rev_nat, int direct)
{
    struct lb_revnat_key rk = {.id = rev_nat};
    struct lb_revnat_value *rv = lb_revnat.lookup(&rk);
    if (!rv)
        return -1;
    return lb_rewrite_fast(skb, f, rv->addr, rv->port, 0, direct);
}

#endif /* PALISADE_LB_H */
