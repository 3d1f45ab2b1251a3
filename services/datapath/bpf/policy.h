// SPDX-License-Identifier: GPL-2.0
/*
 * Policy (included by palisade.c): the policy epoch, and the verdict for a new flow: deny entries,
 * then whether the direction is enforced, then allow entries, else default deny; lookups the
 * endpoint's hints say cannot match are skipped.
 */
#ifndef PALISADE_POLICY_H
#define PALISADE_POLICY_H

static __always_inline u64 current_epoch(void)
{
    struct state_key sk = {.index = 0};
    struct state_value *sv = state.lookup(&sk);
    return sv ? sv->policy_epoch : 0;
}

/* Which of the four lookups below can match: the agent keeps, in the enforcement value, one bit
 * per (direction, verdict, shape) for which the endpoint has entries (a superset: set before
 * entries are written, cleared after they are removed). A shape is 0 (identity, protocol) plus
 * HINTS_SHAPE_ANY_PROTOCOL and HINTS_SHAPE_ANY_IDENTITY for the wildcards it has; a group is
 * HINTS_GROUP_BITS bits, one per shape. Most endpoints have no deny entries and few wildcards: a new
 * flow walks the trie once. */
#define SHAPE_BIT(shape) (1u << (shape))
#define SHAPE_EXACT 0  /* (identity, protocol): neither wildcard */
#define SHAPES_ALL 0xf /* no valid hints: every lookup may match */
static __always_inline u32 lookup_shapes(const struct enforcement_value *en, u8 dir, u8 verdict)
{
    if (!en || !(en->flags & HINTS_VALID))
        return SHAPES_ALL;
    u32 group = (dir == DIR_EGRESS ? HINTS_GROUP_EGRESS : 0) + (verdict == VERDICT_ALLOW ? HINTS_GROUP_ALLOW : 0);
    return (en->flags >> (HINTS_SHIFT + group * HINTS_GROUP_BITS)) & ((1u << HINTS_GROUP_BITS) - 1);
}

static __always_inline int policy_match(u32 ep_id, u8 dir, u32 remote, u8 proto, u16 port, u8 verdict, u32 shapes)
{
    if (!shapes)
        return 0;
    struct policy_key k = {};
    k.prefixlen = POLICY_FULL_PREFIX;
    k.ep_id = ep_id;
    k.direction = dir;
    k.verdict = verdict;
    k.dport = bpf_htons(port);

    k.identity = remote;
    k.protocol = proto;
    if ((shapes & SHAPE_BIT(SHAPE_EXACT)) && policy.lookup(&k))
        return 1;
    k.protocol = 0;
    if ((shapes & SHAPE_BIT(HINTS_SHAPE_ANY_PROTOCOL)) && policy.lookup(&k))
        return 1;
    k.identity = 0;
    k.protocol = proto;
    if ((shapes & SHAPE_BIT(HINTS_SHAPE_ANY_IDENTITY)) && policy.lookup(&k))
        return 1;
    k.protocol = 0;
    if ((shapes & SHAPE_BIT(HINTS_SHAPE_ANY_IDENTITY | HINTS_SHAPE_ANY_PROTOCOL)) && policy.lookup(&k))
        return 1;
    return 0;
}

/* Audit mode (policies marked policy.palisade.io/mode: audit): their entries sit in key spaces of
 * their own (the key's verdict byte), so they never shadow enforced ones. A packet an enforced
 * policy drops is dropped; one that passes is reported with verdict AUDIT (and still passes) when an
 * audited deny matches it, or when only audited policies put its direction in default deny and no
 * audited allow matches. AUDIT_ENTRIES gates the extra lookups: endpoints without audited
 * policies make none.
 * VERDICT_AUDIT (key: an audited deny; event: passed, an audited policy would drop),
 * VERDICT_AUDIT_ALLOW (key: an audited allow, in a direction only audited policies enforce) and the
 * enforcement flags AUDIT_INGRESS, AUDIT_EGRESS, AUDIT_ENTRIES are generated from Python. */

static __always_inline u8 policy_verdict(u32 ep_id, u8 dir, u32 remote, u8 proto, u16 port, u8 *reason)
{
    struct enforcement_key ek = {.ep_id = ep_id};
    struct enforcement_value *en = enforcement.lookup(&ek);
    u32 bit = dir == DIR_INGRESS ? ENFORCE_INGRESS : ENFORCE_EGRESS;
    /* Deny entries hold even where the direction is not enforced (a policy with
     * enableDefaultDeny false still denies what its deny rules name). */
    if (policy_match(ep_id, dir, remote, proto, port, VERDICT_DENY, lookup_shapes(en, dir, VERDICT_DENY))) {
        *reason = REASON_POLICY_DENY;
        return VERDICT_DENY;
    }
    u8 audit = 0;
    u32 audits = en && (en->flags & AUDIT_ENTRIES) ? SHAPES_ALL : 0;
    if (policy_match(ep_id, dir, remote, proto, port, VERDICT_AUDIT, audits))
        audit = REASON_POLICY_DENY;
    if (!en || !(en->flags & bit)) {
        u32 audited = dir == DIR_INGRESS ? AUDIT_INGRESS : AUDIT_EGRESS;
        if (!audit && en && (en->flags & audited) &&
            !policy_match(ep_id, dir, remote, proto, port, VERDICT_AUDIT_ALLOW, audits))
            audit = REASON_DEFAULT_DENY;
        *reason = audit ? audit : REASON_NOT_ENFORCED;
        return audit ? VERDICT_AUDIT : VERDICT_ALLOW;
    }
    if (policy_match(ep_id, dir, remote, proto, port, VERDICT_ALLOW, lookup_shapes(en, dir, VERDICT_ALLOW))) {
        *reason = audit ? audit : REASON_POLICY_ALLOW;
        return audit ? VERDICT_AUDIT : VERDICT_ALLOW;
    }
    *reason = REASON_DEFAULT_DENY;
    return VERDICT_DENY;
}

/* A new flow (``ct`` NULL), or one whose verdict predates the policy epoch (``ct`` its entry, found
 * by ``key``): judged as it was opened, with its original direction and port. The remote address is
 * the packet's either way (a reply's entry is keyed by the reversed tuple). A denied packet is
 * dropped (a stale flow's entry with it); an allowed new flow gets its entry (``via_host``,
 * ``given_port`` and the peer's translations in its flags) and passes; an allowed stale flow's entry
 * takes the epoch and goes on. Returns 1 when the packet is decided (the program's verdict in
 * *action), 0 to go on. One call site for the policy lookups and the event keeps the program small. */
static __always_inline int policy_step(struct __sk_buff *skb, const struct flow *f, u32 ifindex, u32 ep_id,
                                       u32 local_id, u8 dir, u8 via_host, u8 given_port, u64 epoch, u64 now,
                                       struct peer *peer, union ct_tuple *key, struct ct_value *ct, int *action)
{
    const u8 *remote = dir == DIR_EGRESS ? f->daddr : f->saddr;
    if (peer->remote_local)
        peer->remote_id = local_identity(f->family, remote);
    if (!peer->remote_id)
        peer->remote_id = cidr_identity(f->family, remote);
    u32 remote_id = peer->remote_id;
    u8 v4 = f->family == FAMILY_V4;
    u8 judged_dir = ct ? (v4 ? key->v4.direction : key->v6.direction) : dir;
    __be16 opened_port = v4 ? key->v4.dport : key->v6.dport;
    u16 judged_port = ct ? (has_ports(f->protocol) ? bpf_ntohs(opened_port) : 0) : f->policy_port;
    u8 reason = REASON_NOT_ENFORCED;
    u8 verdict = VERDICT_ALLOW;
    /* A pod reaching itself (hairpin) is always allowed, as when it connects to its own address. */
    u8 self = peer->hairpin || (ct && (ct->flags & CT_F_HAIRPIN));
    if (!self && !(ALLOW_HOST && judged_dir == DIR_INGRESS && remote_id == HOST_ID))
        verdict = policy_verdict(ep_id, judged_dir, remote_id, f->protocol, judged_port, &reason);
    if (verdict != VERDICT_ALLOW || !ct) {
        emit(ifindex, f, ep_id, local_id, remote_id, dir, verdict, reason);
        /* an audited packet passes: it is not counted as the drop its reason names */
        count(ep_id, verdict == VERDICT_AUDIT ? REASON_NOT_ENFORCED : reason, dir, skb->len);
    }
    if (verdict == VERDICT_DENY) {
        if (ct)
            ct_forget(f->family, key);
        *action = TC_ACT_SHOT;
        return 1;
    }
    if (!ct) {
        struct ct_value nv = {};
        nv.closing = (f->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) ? 1 : 0;
        nv.expires_ns = now + ct_lifetime(f->protocol, nv.closing);
        nv.epoch = epoch;
        nv.remote_identity = remote_id;
        nv.rev_nat = peer->rev_nat;
        nv.flags = (via_host ? CT_F_VIA_HOST : 0) | (given_port ? CT_F_SNAT : 0) | (peer->hairpin ? CT_F_HAIRPIN : 0);
        ct_key_of(f, ep_id, peer->hairpin ? DIR_INGRESS : dir, 0, key);
        ct_store(f->family, key, &nv);
        *action = TC_ACT_OK;
        return 1;
    }
    ct->epoch = epoch;
    ct->remote_identity = remote_id;
    return 0;
}

#endif /* PALISADE_POLICY_H */
