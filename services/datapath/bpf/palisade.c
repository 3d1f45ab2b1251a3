// SPDX-License-Identifier: GPL-2.0
/*
 * Palisade datapath: identity-based policy at tc on the host side of each pod's veth.
 *
 *   from_container  tc ingress of the host veth: packets leaving the pod (egress policy)
 *   to_container    tc egress of the host veth: packets entering the pod (ingress policy)
 *   deliver         tail-called by from_container for a packet to another local endpoint:
 *                   that endpoint's ingress policy, then straight into its namespace
 *                   (bpf_redirect_peer), past the host's routing and the veth pair
 *   sctp_csum       tail-called by the three above for an SCTP packet whose ports they rewrote:
 *                   its CRC32c (lb_sctp.h), then on where the caller would have sent it
 *
 * One compiled object serves every endpoint: the program finds its endpoint
 * from skb->ifindex in the endpoints map, so nothing per endpoint is compiled in.
 * All maps are created and pinned by the agent (services/datapath/maps/); this
 * file refers to them by pin path. The loader appends static asserts that pin
 * each struct below to its ctypes mirror.
 *
 * Per packet:
 *   0. Leaving a pod (egress), TCP/UDP/SCTP to a service frontend (ClusterIP, port): the
 *      connection's backend (lb_conntrack: its address while the service's revision is the
 *      entry's), else one chosen (ClientIP affinity, else at random), is written into the
 *      packet (DNAT) before anything else (a port lb_ports names asks the service map before
 *      the reversed conntrack tuple), so policy
 *      judges the backend's identity and port. A pod whose chosen backend is itself (hairpin)
 *      gets the connection from the hairpin address (169.254.42.1, 100::42), allowed as any
 *      connection of a pod to itself, both ways put straight back into the pod (CT_F_HAIRPIN).
 *      A frontend with no backend answers with ICMP port unreachable, as kube-proxy does. Replies entering the client are
 *      reverse-NATed (the conntrack entry names the service) so it sees the ClusterIP. An SCTP
 *      packet whose ports were rewritten gets its CRC32c updated in sctp_csum.
 *   1. Not an endpoint's veth, or not IPv4/IPv6 (ARP...): pass.
 *      IPv6 neighbour discovery / MLD and ICMP error messages: pass.
 *   2. Conntrack: the packet's own tuple (an established flow), else the
 *      reversed tuple with the opposite direction (a reply); a SYN-ACK tries the
 *      reversed tuple first, a bare SYN only its own, and a bare SYN on a closing
 *      entry opens a new flow in its place. Leaving a pod, an entry of another
 *      translation belongs to another connection: this one gets a source port of
 *      its own (snat_resolve; its replies get the client's port back). A live entry
 *      passes if its verdict is from the current policy epoch; otherwise
 *      the flow is re-checked as in 4 with its original direction, identity
 *      and port, then kept (epoch refreshed) or deleted and dropped.
 *   3. Remote identity: a local endpoint's address (endpoints map), else the
 *      longest ipcache prefix, else WORLD_ID.
 *   4. Policy for a new flow, in this order:
 *        deny  (identity, proto, port) (identity, any)  -> drop
 *              (any, proto, port)      (any, any)
 *        direction not enforced for the endpoint        -> allow
 *        allow the same four lookups                     -> pass
 *        nothing matched                                 -> default deny
 *      Lookups the endpoint's hints (enforcement map) say cannot match are skipped.
 *      ICMP/ICMPv6 echo follows policy with port 0 (matched by L3-only and
 *      all-ports ICMP entries); the echo id stands in for ports in conntrack.
 *      Into a pod from its own node (remote identity host) is allowed as not enforced, before
 *      any lookup, unless ALLOW_HOST is 0 (allow-localhost=policy).
 *   5. A new allowed flow gets a conntrack entry and one flow event; every
 *      drop gets a flow event (the reader is woken only past a backlog mark,
 *      it polls otherwise). Counters by endpoint/reason/direction. An
 *      established packet refreshes its entry's expiry at most once a second.
 *   6. Local delivery (LOCAL_DELIVERY, Cilium's BPF host routing): a packet from_container
 *      passed whose destination is in the delivery map (a local pod on these programs, its
 *      Ethernet address known) and whose TTL / hop limit allows forwarding, is judged by the
 *      destination's ingress policy in "deliver" (steps 1-5 for that endpoint, as to_container
 *      would) and put into the destination's namespace with the addresses and TTL the host's
 *      forwarding would give it. The host's routing,
 *      netfilter and the veth's transmit path (where to_container runs) never see it.
 *      Anything else, or a failed tail call, goes through the host as before, and so do the
 *      replies of a flow that entered its endpoint through the host (CT_F_VIA_HOST).
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/pkt_cls.h>

/* The loader (services/datapath/loader.py) defines, and this file never does:
 *   - the configuration (ProgramConfig.cflags): PIN_DIR, WORLD_ID, LOCAL_DELIVERY, ALLOW_HOST,
 *     CT_TCP_LIFETIME_S, CT_CLOSING_LIFETIME_S, CT_OTHER_LIFETIME_S, the map sizes (*_MAX),
 *     EVENTS_BYTES and EVENTS_WAKEUP_BYTES;
 *   - the numbers shared with the agent, generated from Python (maps/constants.py) and each asserted
 *     at the end of the source, so a definition here or in a header that says otherwise fails the
 *     build: DIR_*, VERDICT_*, REASON_*, METRICS_SLOTS, METRICS_DIR_SLOTS, METRICS_LOST_SLOT,
 *     ENFORCE_*, HINTS_*, FAMILY_V4 / FAMILY_V6, CT_F_*, SNAT_FORWARD / SNAT_REVERSE,
 *     SNAT_PORT_MIN / SNAT_PORT_MAX, SVC_FLAG_AFFINITY, IPCACHE_HEADER_BITS, POLICY_FULL_PREFIX,
 *     EP_GENERATION, HOST_ID, CALL_DELIVER, CALL_SCTP_CSUM and CALL_SLOTS. */
#if !defined(PIN_DIR) || !defined(WORLD_ID) || !defined(DIR_INGRESS)
#error "compile through services/datapath/loader.py: it defines the configuration and the shared numbers"
#endif

/* EP_GENERATION: the generation of these programs (delivery_value.generation), see the delivery map.
 * ALLOW_HOST: new flows into a pod from its own node (the reserved host identity HOST_ID: kubelet's
 * probes) are allowed whatever the policy, as Kubernetes specifies and Cilium's allow-localhost=always
 * does; 0 judges them by policy like any other peer (allow-localhost=policy). */

/* What handle() tells its caller, in *out (OUT_SCTP: lb_sctp.h). */
#define OUT_VIA_HOST 1  /* the flow entered the endpoint through the host */
#define OUT_HAIRPIN 2   /* a hairpin packet: back into the pod it came from */

/* The parts, by concern, each after those it uses (as Cilium's bpf/lib). The loader puts each one's
 * text in place (bcc rewrites map calls in its main file only); the template hash covers them all. */
#include "common.h"     /* branch hints, TCP flags, time units */
#include "maps.h"       /* the pinned maps: keys and values mirrored in maps/ */
#include "parse.h"      /* the packet's flow: addresses, protocol, ports, header offsets */
#include "endpoint.h"   /* the endpoint of a veth (per-CPU cache), the clock, identities of addresses */
#include "events.h"     /* counters and flow events */
#include "conntrack.h"  /* conntrack keys, lookups, lifetimes */
#include "policy.h"     /* the policy epoch, the verdict for a new flow */
#include "lb_sctp.h"    /* SCTP's CRC32c after a translation (tail call sctp_csum) */
#include "lb.h"         /* services: address rewrites, DNAT to a backend, reverse NAT */
#include "icmp.h"       /* ICMP port unreachable for a frontend without backends */
#include "hairpin.h"    /* a pod reaching itself through a ClusterIP */
#include "snat.h"       /* a port of Palisade's for a clashing tuple */
#include "delivery.h"   /* local delivery: straight into another local pod */
#include "translate.h"  /* handle()'s steps for services, clashing tuples and replies */
#include "dns.h"        /* DNS queries policy passed, to the node's DNS proxy */

/* The policy of endpoint veth ``ifindex`` (skb->ifindex, or the destination's in "deliver") for
 * the packet in direction ``dir``, in the steps of the header comment: the endpoint, the packet's
 * flow, its conntrack entry; leaving a pod, a service's translation (service_step) and a clashing
 * tuple's port (snat_step); the policy for a new or stale flow (policy_step); the entry kept alive;
 * a reply's translations undone (reply_step). A step returns 1 when it has decided the packet, its
 * verdict in ``action`` (TC_ACT_SHOT, TC_ACT_OK for a new flow, a redirect for an ICMP reject).
 * ``via_host``: the packet came through the host (to_container); ``*host_flow`` is set when its
 * conntrack entry says the flow did. Before a translation, an SCTP packet's header offset and ports
 * are noted in sctp_scratch (OUT_SCTP; see sctp_hand_off). */
static __always_inline int handle(struct __sk_buff *skb, u8 dir, u32 ifindex, u8 via_host, u8 *host_flow)
{
    u64 epoch = current_epoch();
    u32 slot = ifindex % EP_CACHE_SLOTS;
    struct ep_cache_value *cached = ep_cache.lookup(&slot);
    u32 ep_id, local_id;
    if (!endpoint_of(cached, ifindex, epoch, &ep_id, &local_id))
        return TC_ACT_OK;  /* not an endpoint's veth (or being detached) */

    struct flow f = {};
    int parsed = parse(skb, &f);
    if (unlikely(parsed == PARSE_PASS))
        return TC_ACT_OK;
    if (unlikely(parsed == PARSE_INVALID)) {
        /* Too short to judge; the event carries whatever was parsed. */
        drop_event(skb, ifindex, &f, ep_id, local_id, 0, dir, REASON_INVALID);
        return TC_ACT_SHOT;
    }
    /* For from_container's DNS check, in the context (a branch here would double the paths the
     * verifier walks through the rest of handle()). */
    skb->cb[DNS_CB_PORT] = f.dport;

    /* Lifetimes are seconds: the coarse clock (CLOCK_MONOTONIC_COARSE, a tick or two behind at
     * most) is precise enough and costs a fraction of the precise one on every packet. */
    u64 now = coarse_now(cached);
    /* One key on the stack (the program's stack is small): the packet's tuple, then, for a
     * reply, the reversed one; later the tuple the flow is tracked by. */
    union ct_tuple key;
    /* Which tuple first: a SYN-ACK answers an opened flow, so its entry is the reversed tuple's; a
     * bare SYN opens a flow, so only its own tuple can hold it (matched to the reversed tuple of a
     * closing flow, it would open a connection the other way without a verdict). Anything else
     * tries its own tuple, then the reversed one. A reply's peer opened the flow, so a reply never
     * goes to a service frontend (a frontend is no pod's source address): no service lookup. */
    u8 syn = f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK);
    int reversed = syn == (TCP_FLAG_SYN | TCP_FLAG_ACK);
    ct_key_of(&f, ep_id, dir, reversed, &key);
    struct ct_value *ct = ct_lookup(f.family, &key, now);
    /* Leaving a pod, a packet its own tuple does not know whose destination port is a frontend's
     * (lb_ports) asks the service map before the reversed tuple: a frontend is no pod's source
     * address, so a packet to one is no reply, and an established service connection's packets
     * (keyed by their backend in conntrack, by their frontend in lb_conntrack) skip that lookup. */
    struct lb_service_value *svc = NULL;
    int svc_looked_up = 0;
    if (!ct && syn != TCP_FLAG_SYN) {
        if (dir == DIR_EGRESS && !reversed && lb_l4(&f)) {
            svc = lb_hinted_frontend(&f, &svc_looked_up);
        }
        if (!svc) {
            reversed = !reversed;
            ct_key_of(&f, ep_id, dir, reversed, &key);
            ct = ct_lookup(f.family, &key, now);
        }
    }
    int reply = ct && reversed;
    struct peer peer = {.remote_local = 1};
    int action = TC_ACT_SHOT;  /* set by a step that decides the packet */
    if (unlikely(!ct && dir == DIR_EGRESS) &&
        service_step(skb, &f, ifindex, ep_id, local_id, dir, now, host_flow, &peer, &key, &ct, svc,
                     svc_looked_up, &action))
        return action;  /* not established either way: a service's frontend is translated first */
    u8 given_port = 0;
    if (dir == DIR_EGRESS && !reply && !peer.hairpin && lb_l4(&f) &&
        unlikely(ct ? ct->rev_nat != peer.rev_nat || (ct->flags & CT_F_SNAT) || (syn == TCP_FLAG_SYN && ct->closing)
                    : syn != TCP_FLAG_SYN)) {
        /* Not this flow's entry, or none where a connection may have been given a port. */
        if (snat_step(skb, &f, ifindex, ep_id, local_id, dir, syn, now, host_flow, &peer, &key, &ct, &given_port,
                      &action))
            return action;
    } else if (ct && !reversed && syn == TCP_FLAG_SYN && ct->closing && !(ct->flags & CT_F_SNAT)) {
        ct = NULL;  /* the tuple opens again (a SYN on its closing entry): a new flow, judged anew */
    }

    if (unlikely(!ct || ct->epoch != epoch) &&
        policy_step(skb, &f, ifindex, ep_id, local_id, dir, via_host, given_port, epoch, now, &peer, &key, ct,
                    &action))
        return action;  /* a new flow, or one whose verdict predates the policy */

    *host_flow |= ct->flags & CT_F_VIA_HOST;
    ct_refresh(&f, ct, now);
    if (unlikely(reply && (ct->rev_nat || (ct->flags & CT_F_SNAT))) &&
        reply_step(skb, &f, ifindex, ep_id, local_id, dir, via_host, host_flow, ct, &action))
        return action;  /* a reply to a translated connection whose translation cannot be undone */
    count(ep_id, REASON_ESTABLISHED, dir, skb->len);
    return TC_ACT_OK;
}

/* An SCTP packet whose ports changed (``fix``, from sctp_changed) goes to sctp_csum for its
 * checksum, then on as ``next`` says. It never leaves with a checksum its receiver would reject: if
 * sctp_csum cannot run, it is dropped. */
static __always_inline int sctp_hand_off(struct __sk_buff *skb, struct sctp_fix *fix, u8 next, u32 ifindex)
{
    fix->next = next;
    fix->ifindex = ifindex;
    u32 ep_id = fix->ep_id;
    u8 dir = fix->dir;
    calls.call(skb, CALL_SCTP_CSUM);  /* returns only if the slot is empty */
    count(ep_id, REASON_INVALID, dir, skb->len);
    return TC_ACT_SHOT;
}

int from_container(struct __sk_buff *skb)
{
    u8 host_flow = 0;
    int verdict = handle(skb, DIR_EGRESS, skb->ifindex, 0, &host_flow);
    if (unlikely(host_flow & OUT_SCTP) && verdict == TC_ACT_OK) {
        /* SCTP with rewritten ports: sctp_csum goes on as below once its checksum is right. */
        struct sctp_fix *fix = sctp_changed(skb);
        if (fix) {
            u8 next = SCTP_NEXT_PASS;
            if (host_flow & OUT_HAIRPIN)
                next = SCTP_NEXT_HAIRPIN;
#if LOCAL_DELIVERY
            else if (!(host_flow & OUT_VIA_HOST) && delivery_of(skb))
                next = SCTP_NEXT_DELIVER;
#endif
            return sctp_hand_off(skb, fix, next, 0);
        }
        host_flow &= ~OUT_SCTP;
    }
    if (unlikely(verdict == TC_ACT_OK && (host_flow & OUT_HAIRPIN)))
        return hairpin_back(skb);
    if (unlikely(verdict == TC_ACT_OK && !host_flow && skb->cb[DNS_CB_PORT] == bpf_htons(DNS_PORT)))
        calls.call(skb, CALL_DNS_STEER);  /* returns only if the slot is empty */
#if LOCAL_DELIVERY
    if (verdict == TC_ACT_OK && !host_flow && delivery_of(skb))
        calls.call(skb, CALL_DELIVER);  /* returns only if the slot is empty */
#endif
    return verdict;
}

int to_container(struct __sk_buff *skb)
{
    u8 host_flow = 0;
    int verdict = handle(skb, DIR_INGRESS, skb->ifindex, 1, &host_flow);
    if (unlikely(host_flow & OUT_SCTP) && verdict == TC_ACT_OK) {
        struct sctp_fix *fix = sctp_changed(skb);
        if (fix)
            return sctp_hand_off(skb, fix, SCTP_NEXT_PASS, 0);
    }
    return verdict;
}

/* The destination's ingress policy for a packet from_container passed, then into its namespace. */
int deliver(struct __sk_buff *skb)
{
    struct delivery d;
    u32 words[4] = {skb->cb[0], skb->cb[1], skb->cb[2], skb->cb[3]};
    __builtin_memcpy(&d, words, sizeof(d));
    u8 host_flow = 0;
    int verdict = handle(skb, DIR_INGRESS, d.ifindex, 0, &host_flow);
    if (verdict != TC_ACT_OK)
        return verdict;
    if (forward_rewrite(skb, &d) < 0)
        return TC_ACT_SHOT;  /* judged already: the host must not judge it again */
    if (unlikely(host_flow & OUT_SCTP)) {
        struct sctp_fix *fix = sctp_changed(skb);
        if (fix)
            return sctp_hand_off(skb, fix, SCTP_NEXT_REDIRECT, d.ifindex);
    }
    return bpf_redirect_peer(d.ifindex, 0);
}

/* A packet to port DNS_PORT from_container passed (nothing else to do with it): to the DNS proxy when
 * dns_steer names its endpoint (tail-called, slot CALL_DNS_STEER), else on as from_container goes. */
int dns_steer(struct __sk_buff *skb)
{
    int steered = dns_steer_to_proxy(skb);
    if (steered != DNS_PASS)
        return steered;
#if LOCAL_DELIVERY
    if (delivery_of(skb))
        calls.call(skb, CALL_DELIVER);  /* returns only if the slot is empty: the host's path */
#endif
    return TC_ACT_OK;
}

/* A translated SCTP packet's checksum (tail-called, slot CALL_SCTP_CSUM, with what to do next in
 * sctp_scratch), then where its caller would have sent it. Its own program: the CRC arithmetic is a
 * few thousand instructions, which the verifier would walk once for every path through handle(). */
int sctp_csum(struct __sk_buff *skb)
{
    u32 zero = 0;
    struct sctp_fix *fix = sctp_scratch.lookup(&zero);
    if (!fix)
        return TC_ACT_SHOT;
    if (sctp_fix_csum(skb, fix) < 0) {
        count(fix->ep_id, REASON_INVALID, fix->dir, skb->len);
        return TC_ACT_SHOT;
    }
    if (fix->next == SCTP_NEXT_HAIRPIN)
        return hairpin_back(skb);
    if (fix->next == SCTP_NEXT_REDIRECT)
        return bpf_redirect_peer(fix->ifindex, 0);
    if (fix->next == SCTP_NEXT_DELIVER)
        calls.call(skb, CALL_DELIVER);  /* returns only if the slot is empty: the host's path */
    return TC_ACT_OK;
}
