// SPDX-License-Identifier: GPL-2.0
/*
 * handle()'s translation steps (included by palisade.c, after the parts they use): a new connection
 * leaving a pod for a service frontend (DNAT to a backend, ICMP reject without one, hairpin to the
 * pod itself); a connection whose tuple another flow holds (a port of its own); a reply to a
 * translated connection (its translations undone). Each returns 1 when it has decided the packet
 * (the program's verdict in *action), 0 to go on.
 */
#ifndef PALISADE_TRANSLATE_H
#define PALISADE_TRANSLATE_H

/* A packet leaving a pod that is established neither way: a connection to a service frontend is
 * translated first (established service flows are keyed by their backend, so every packet of one
 * comes here; ``svc``/``svc_looked_up``: handle() asked the service map already, see lb_egress). The frontend is looked up first: a packet to a frontend then pays no endpoints lookup
 * (its peer is the backend, looked up by policy_step only if the flow needs a verdict), and only a
 * new flow to anything else pays the frontend miss. A local endpoint's address is never a frontend
 * (pod and service addresses come from disjoint ranges). After a DNAT, ``*ct`` and ``key`` are the
 * backend's tuple's. */
static __always_inline int service_step(struct __sk_buff *skb, struct flow *f, u32 ifindex, u32 ep_id,
                                        u32 local_id, u8 dir, u64 now, u8 *host_flow, struct peer *peer,
                                        union ct_tuple *key, struct ct_value **ct, struct lb_service_value *svc,
                                        int svc_looked_up, int *action)
{
    sctp_note_once(f, ep_id, dir, host_flow);
    int lb = lb_egress(skb, f, ep_id, now, &peer->rev_nat, svc, svc_looked_up);
    if (lb == LB_NONE) {
        peer->remote_id = local_identity(f->family, f->daddr);
        peer->remote_local = 0;
    }
    if (lb == LB_REJECT || lb == LB_DROP) {
        drop_event(skb, ifindex, f, ep_id, local_id, WORLD_ID, dir, REASON_NO_BACKEND);
        if (lb == LB_REJECT && lb_reject(skb, f) == 0)
            *action = bpf_redirect_peer(skb->ifindex, 0);
            return 1;
        *action = TC_ACT_SHOT;
        return 1;
    }
    if (lb == LB_DNAT) {
        peer->remote_local = 1;  /* the backend's address is another one */
        u8 ct_dir = dir;
        if (unlikely(addr_equal(f, f->saddr, f->daddr))) {
            /* The pod's own backend: it sees the connection come from the hairpin address. */
            if (hairpin_snat(skb, f) < 0) {
                drop_event(skb, ifindex, f, ep_id, local_id, local_id, dir, REASON_NO_BACKEND);
                *action = TC_ACT_SHOT;
                return 1;
            }
            peer->hairpin = 1;
            ct_dir = DIR_INGRESS;
            *host_flow |= OUT_HAIRPIN;
        }
        ct_key_of(f, ep_id, ct_dir, 0, key);
        *ct = ct_lookup(f->family, key, now);
    }
    return 0;
}

/* A packet leaving a pod (no reply, no hairpin) whose tuple's entry is not this flow's (another
 * translation's, or one Palisade gave this tuple's port, or a bare SYN on a closing entry), or
 * that has no entry where a connection may have been given a port: snat_resolve finds the tuple the
 * flow is tracked by (``key``, ``*ct``), rewriting the source port to the one given to the
 * connection. ``*given_port``: the packet now has it. */
static __always_inline int snat_step(struct __sk_buff *skb, struct flow *f, u32 ifindex, u32 ep_id, u32 local_id,
                                     u8 dir, u8 syn, u64 now, u8 *host_flow, struct peer *peer, union ct_tuple *key,
                                     struct ct_value **ct, u8 *given_port, int *action)
{
    sctp_note_once(f, ep_id, dir, host_flow);
    int resolved = snat_resolve(skb, f, ep_id, peer->rev_nat, syn, now, key, ct);
    if (resolved == SNAT_FAILED) {
        u32 remote = peer->remote_id ? peer->remote_id : local_identity(f->family, f->daddr);
        if (!remote)
            remote = cidr_identity(f->family, f->daddr);
        drop_event(skb, ifindex, f, ep_id, local_id, remote, dir, REASON_NO_PORT);
        *action = TC_ACT_SHOT;
        return 1;
    }
    *given_port = resolved == SNAT_GIVEN;
    return 0;
}

/* A reply to a translated connection: the client's own port back (CT_F_SNAT), the pod's own address
 * for a hairpin connection, then the frontend as source. A reply whose service or port record is
 * gone is dropped: the client could not match it. A reply entering the client by local delivery
 * ("deliver": ingress, not ``via_host``) is reverse-NATed by direct writes (lb_rewrite_fast);
 * to_container keeps to the helpers, and from_container too (its verifier budget is spent). */
static __always_inline int reply_step(struct __sk_buff *skb, struct flow *f, u32 ifindex, u32 ep_id, u32 local_id,
                                      u8 dir, u8 via_host, u8 *host_flow, const struct ct_value *ct, int *action)
{
    sctp_note_once(f, ep_id, dir, host_flow);
    int undone = 0;
    if (ct->flags & CT_F_SNAT) {
        struct snat_key rk = {};
        snat_key_of(f, ep_id, ct->rev_nat, SNAT_REVERSE, 1, &rk);
        struct snat_value *back = snat.lookup(&rk);
        undone = back ? lb_rewrite(skb, f, f->daddr, back->port, 1) : -1;
    }
    if (undone == 0 && (ct->flags & CT_F_HAIRPIN)) {
        /* The pod answering itself: back to its own address, then from the frontend. */
        undone = lb_rewrite(skb, f, f->saddr, f->dport, 1);
        *host_flow |= OUT_HAIRPIN;
    }
    if (undone == 0 && ct->rev_nat)
        undone = lb_reverse(skb, f, ct->rev_nat, dir == DIR_INGRESS && !via_host);
    if (undone < 0) {
        drop_event(skb, ifindex, f, ep_id, local_id, ct->remote_identity, dir, REASON_NO_BACKEND);
        *action = TC_ACT_SHOT;
        return 1;
    }
    return 0;
}

#endif /* PALISADE_TRANSLATE_H */
