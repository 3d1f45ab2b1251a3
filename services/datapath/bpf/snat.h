// SPDX-License-Identifier: GPL-2.0
/*
 * Clashing tuples (included by palisade.c): a source port of Palisade's for a connection whose
 * tuple another flow holds; the snat map keeps both directions. REASON_NO_PORT: a clashing
 * connection found no free port (counted in its direction's slot 0).
 */
#ifndef PALISADE_SNAT_H
#define PALISADE_SNAT_H

#define SNAT_TRIES 6

/* -- clashing tuples: a port of Palisade's for a connection whose tuple another flow holds ---------- */

/* The snat key of a flow as its client sent it (reversed: of a reply to it), after any DNAT. */
static __always_inline void snat_key_of(const struct flow *f, u32 ep_id, u16 rev_nat, u8 kind, int reversed,
                                        struct snat_key *k)
{
    __builtin_memcpy(k->saddr, reversed ? f->daddr : f->saddr, 16);
    __builtin_memcpy(k->daddr, reversed ? f->saddr : f->daddr, 16);
    k->sport = reversed ? f->dport : f->sport;
    k->dport = reversed ? f->sport : f->dport;
    k->ep_id = ep_id;
    k->rev_nat = rev_nat;
    k->family = f->family;
    k->protocol = f->protocol;
    k->kind = kind;
}

#define SNAT_NONE 0    /* the packet keeps its port; *ct is NULL: a new flow on its own tuple */
#define SNAT_GIVEN 1   /* the packet now has the port given to its connection; *ct is that flow's entry
                        * (NULL: a new flow on the given tuple) */
#define SNAT_FAILED 2  /* no free port, or the packet could not be rewritten */

/* An egress packet (after any DNAT, ``rev_nat`` its service) whose tuple's entry ``*ct`` belongs to
 * another flow: one with another translation, or one Palisade gave this tuple's port (CT_F_SNAT);
 * or a bare SYN on a closing entry; or, with *ct NULL, a packet that is no SYN (its connection may
 * have been given a port while another flow held the tuple, since gone).
 *
 * Two connections of one client that differ only before DNAT (through a ClusterIP, and straight to
 * the backend, from one port) are one tuple to the backend and to its replies. As netfilter's NAT
 * does for a clashing tuple, the later one gets a source port of its own; the client never sees it
 * (replies get the client's port back). A SYN on the closing entry of a flow with the same
 * translation opens a new flow in its place (Cilium's CT_REOPENED): judged, counted and reported
 * as new, never inheriting the old one's state. ``key`` is left the tuple the flow is tracked by. */
static __always_inline int snat_resolve(struct __sk_buff *skb, struct flow *f, u32 ep_id, u16 rev_nat, u8 syn,
                                        u64 now, union ct_tuple *key, struct ct_value **ct)
{
    __be16 own = f->sport;
    struct snat_key fk = {};
    snat_key_of(f, ep_id, rev_nat, SNAT_FORWARD, 0, &fk);
    struct snat_value *given = snat.lookup(&fk);
    if (given) {
        __be16 port = given->port;
        f->sport = port;
        struct snat_key rk = {};
        snat_key_of(f, ep_id, rev_nat, SNAT_REVERSE, 0, &rk);
        struct snat_value *back = snat.lookup(&rk);
        ct_key_of(f, ep_id, DIR_EGRESS, 0, key);
        struct ct_value *e = ct_lookup(f->family, key, now);
        f->sport = own;
        if (e && (e->flags & CT_F_SNAT) && e->rev_nat == rev_nat && back && back->port == own) {
            if (lb_rewrite(skb, f, f->saddr, port, 0) < 0)
                return SNAT_FAILED;
            *ct = syn == TCP_FLAG_SYN && e->closing ? NULL : e;
            return SNAT_GIVEN;
        }
    }
    struct ct_value *held = *ct;
    *ct = NULL;
    ct_key_of(f, ep_id, DIR_EGRESS, 0, key);
    if (!held || (!(held->flags & CT_F_SNAT) && held->rev_nat == rev_nat))
        return SNAT_NONE;  /* nothing holds the tuple, or it opens again the same way */
    for (int i = 0; i < SNAT_TRIES; i++) {
        __be16 port = bpf_htons(SNAT_PORT_MIN + bpf_get_prandom_u32() % (SNAT_PORT_MAX - SNAT_PORT_MIN + 1));
        f->sport = port;
        ct_key_of(f, ep_id, DIR_EGRESS, 0, key);
        if (ct_lookup(f->family, key, now))
            continue;  /* taken too */
        struct snat_key rk = {};
        snat_key_of(f, ep_id, rev_nat, SNAT_REVERSE, 0, &rk);
        struct snat_value back = {.port = own};
        struct snat_value fwd = {.port = port};
        f->sport = own;
        if (lb_rewrite(skb, f, f->saddr, port, 0) < 0)
            return SNAT_FAILED;
        snat.update(&fk, &fwd);
        snat.update(&rk, &back);
        return SNAT_GIVEN;
    }
    f->sport = own;
    return SNAT_FAILED;
}

#endif /* PALISADE_SNAT_H */
