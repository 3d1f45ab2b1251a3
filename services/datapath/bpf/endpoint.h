// SPDX-License-Identifier: GPL-2.0
/*
 * Endpoints and identities (included by palisade.c): the endpoint of a veth, remembered per CPU
 * for one policy epoch; the coarse clock kept beside it; the identity of a remote address (a local
 * endpoint's, else the longest ipcache prefix, else WORLD_ID).
 */
#ifndef PALISADE_ENDPOINT_H
#define PALISADE_ENDPOINT_H

/* Each CPU remembers the endpoints of the veths it saw last (direct-mapped by ifindex), valid
 * for one policy epoch: every endpoint write bumps the epoch, so an entry never outlives what it
 * copied. Saves the endpoints hash lookup on nearly every packet. Not pinned: it lives with the
 * programs and holds nothing a restart needs. */
#define EP_CACHE_SLOTS 256
struct ep_cache_value {
    u32 ifindex;
    u32 ep_id;
    u32 identity;
    u32 pad;
    u64 epoch;
    /* The coarse clock as read in tick clock_jiffies (see coarse_now); not tied to the endpoint. */
    u64 clock_jiffies;
    u64 clock_ns;
};
BPF_PERCPU_ARRAY(ep_cache, struct ep_cache_value, EP_CACHE_SLOTS);

/* CLOCK_MONOTONIC_COARSE in ns: what bpf_ktime_get_coarse_ns returns, which only changes once a tick.
 * The helper call costs about 20 ns a packet; jiffies is one load (the verifier inlines it), so the
 * value is read once a tick and kept beside the endpoint cache entry, whose line is loaded anyway. */
static __always_inline u64 coarse_now(struct ep_cache_value *cached)
{
    u64 tick = bpf_jiffies64();
    if (likely(cached && cached->clock_jiffies == tick))
        return cached->clock_ns;
    u64 now = bpf_ktime_get_coarse_ns();
    if (cached) {
        cached->clock_jiffies = tick;
        cached->clock_ns = now;
    }
    return now;
}

/* A local endpoint's identity by address; 0 (no identity) if the address is no local endpoint's. */
static __always_inline u32 local_identity(u8 family, const u8 *addr)
{
    struct endpoint_key ek = {};
    ek.family = family;
    __builtin_memcpy(ek.addr, addr, 16);
    struct endpoint_value *ep = endpoints.lookup(&ek);
    return ep ? ep->identity : 0;
}

/* Any other address: the longest ipcache prefix holding it, else WORLD_ID. */
static __always_inline u32 cidr_identity(u8 family, const u8 *addr)
{
    struct ipcache_key ik = {};
    ik.prefixlen = IPCACHE_HEADER_BITS + (family == FAMILY_V4 ? 32 : 128);
    ik.family = family;
    __builtin_memcpy(ik.addr, addr, 16);
    struct ipcache_value *iv = ipcache.lookup(&ik);
    return iv ? iv->identity : WORLD_ID;
}

/* The endpoint of veth ``ifindex`` (its id and identity): from this CPU's cache slot for the veth
 * (``cached``, NULL if none) when it holds the veth for the current policy epoch, else from the
 * endpoints map (then cached). 0: not an endpoint's veth (or one being detached). */
static __always_inline int endpoint_of(struct ep_cache_value *cached, u32 ifindex, u64 epoch, u32 *ep_id,
                                       u32 *local_id)
{
    if (likely(cached && cached->ifindex == ifindex && cached->epoch == epoch && epoch)) {
        *ep_id = cached->ep_id;
        *local_id = cached->identity;
        return 1;
    }
    struct endpoint_key self = {};
    self.ifindex = ifindex;
    struct endpoint_value *ep = endpoints.lookup(&self);
    if (!ep)
        return 0;
    *ep_id = ep->ep_id;
    *local_id = ep->identity;
    if (cached) {
        cached->ifindex = ifindex;
        cached->ep_id = *ep_id;
        cached->identity = *local_id;
        cached->epoch = epoch;
    }
    return 1;
}

/* The far end of a packet as handle() learns it, and what the connection's translations are. */
struct peer {
    u32 remote_id;     /* the remote identity, once looked up (0: not yet) */
    int remote_local;  /* whether it may be a local endpoint's address still to look up */
    u16 rev_nat;       /* the service the connection was opened to (0: none) */
    u8 hairpin;        /* a pod's connection to itself through a ClusterIP (CT_F_HAIRPIN) */
};

#endif /* PALISADE_ENDPOINT_H */
