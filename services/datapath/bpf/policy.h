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
static __always_inline u32 lookup_shapes(const struct enforcement_value *en, u8 dir, u8 verdict)
{
    if (!en || !(en->flags & HINTS_VALID))
        return 0xf;
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
    if ((shapes & SHAPE_BIT(0)) && policy.lookup(&k))
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
    if (!en || !(en->flags & bit)) {
        *reason = REASON_NOT_ENFORCED;
        return VERDICT_ALLOW;
    }
    if (policy_match(ep_id, dir, remote, proto, port, VERDICT_ALLOW, lookup_shapes(en, dir, VERDICT_ALLOW))) {
        *reason = REASON_POLICY_ALLOW;
        return VERDICT_ALLOW;
    }
    *reason = REASON_DEFAULT_DENY;
    return VERDICT_DENY;
}

#endif /* PALISADE_POLICY_H */
