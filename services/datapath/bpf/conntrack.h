// SPDX-License-Identifier: GPL-2.0
/*
 * Conntrack (included by palisade.c): one map per family (conntrack4, conntrack), keys of a
 * packet's tuple or its reverse, lifetimes by protocol and state.
 */
#ifndef PALISADE_CONNTRACK_H
#define PALISADE_CONNTRACK_H

#define CT_REFRESH_NS NSEC

static __always_inline u64 ct_lifetime(u8 proto, int closing)
{
    if (proto == IPPROTO_TCP)
        return (closing ? CT_CLOSING_LIFETIME_S : CT_TCP_LIFETIME_S) * NSEC;
    return CT_OTHER_LIFETIME_S * NSEC;
}

/* A packet's conntrack key: its own tuple (reversed: the reversed tuple with the opposite direction).
 * Every byte of the family's key is written: nothing else initializes it. */
static __always_inline void ct_key_of(const struct flow *f, u32 ep_id, u8 dir, int reversed, union ct_tuple *k)
{
    const u8 *src = reversed ? f->daddr : f->saddr;
    const u8 *dst = reversed ? f->saddr : f->daddr;
    __be16 sport = reversed ? f->dport : f->sport;
    __be16 dport = reversed ? f->sport : f->dport;
    u8 direction = reversed ? (dir == DIR_EGRESS ? DIR_INGRESS : DIR_EGRESS) : dir;
    if (likely(f->family == FAMILY_V4)) {
        __builtin_memcpy(&k->v4.saddr, src, 4);
        __builtin_memcpy(&k->v4.daddr, dst, 4);
        k->v4.sport = sport;
        k->v4.dport = dport;
        k->v4.ep_id = ep_id;
        k->v4.protocol = f->protocol;
        k->v4.direction = direction;
        k->v4.pad = 0;
        return;
    }
    __builtin_memcpy(k->v6.saddr, src, 16);
    __builtin_memcpy(k->v6.daddr, dst, 16);
    k->v6.sport = sport;
    k->v6.dport = dport;
    k->v6.ep_id = ep_id;
    k->v6.family = f->family;
    k->v6.protocol = f->protocol;
    k->v6.direction = direction;
    k->v6.pad = 0;
}

/* Each map access below keeps a call site of its own. Merged into one call with the map chosen at
 * run time (which clang does to two calls that differ only in the map), the verifier can no longer
 * inline the lookup or call the map's own update and delete: measured, 58 ns more per packet. The
 * empty asm makes the two paths differ after the call, so they are not merged. */
#define keep_call_site(x) asm volatile("" : "+r"(x))

/* The live entry of a conntrack key (an expired one counts as none). */
static __always_inline struct ct_value *ct_lookup(u8 family, union ct_tuple *k, u64 now)
{
    struct ct_value *ct;
    if (likely(family == FAMILY_V4)) {
        ct = conntrack4.lookup(&k->v4);
        keep_call_site(ct);
    } else {
        ct = conntrack.lookup(&k->v6);
    }
    return ct && ct->expires_ns >= now ? ct : NULL;
}

static __always_inline void ct_store(u8 family, union ct_tuple *k, struct ct_value *v)
{
    long err;
    if (family == FAMILY_V4) {
        err = conntrack4.update(&k->v4, v);
        keep_call_site(err);
    } else {
        conntrack.update(&k->v6, v);
    }
}

static __always_inline void ct_forget(u8 family, union ct_tuple *k)
{
    long err;
    if (family == FAMILY_V4) {
        err = conntrack4.delete(&k->v4);
        keep_call_site(err);
    } else {
        conntrack.delete(&k->v6);
    }
}

/* An established packet keeps its entry alive: a FIN or RST marks it closing (a shorter lifetime);
 * otherwise its expiry moves at most once a second (lifetimes are 10 s or more), so most packets
 * only read the entry. */
static __always_inline void ct_refresh(const struct flow *f, struct ct_value *ct, u64 now)
{
    if (unlikely((f->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) && !ct->closing)) {
        ct->closing = 1;
        ct->expires_ns = now + ct_lifetime(f->protocol, 1);
    } else {
        u64 expires = now + ct_lifetime(f->protocol, ct->closing);
        if (unlikely(ct->expires_ns + CT_REFRESH_NS < expires))
            ct->expires_ns = expires;
    }
}

#endif /* PALISADE_CONNTRACK_H */
