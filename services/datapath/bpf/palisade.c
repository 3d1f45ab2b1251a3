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
 *      connection's backend (lb_conntrack), else one chosen (ClientIP affinity, else at
 *      random), is written into the packet (DNAT) before anything else, so policy
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
#define SNAT_TRIES 6

/* REASON_NO_PORT: a clashing connection found no free port (counted in its direction's slot 0).
 * EP_GENERATION: the generation of these programs (delivery_value.generation), see the delivery map.
 * ALLOW_HOST: new flows into a pod from its own node (the reserved host identity HOST_ID: kubelet's
 * probes) are allowed whatever the policy, as Kubernetes specifies and Cilium's allow-localhost=always
 * does; 0 judges them by policy like any other peer (allow-localhost=policy). */
#define NSEC 1000000000ULL
#define CT_REFRESH_NS NSEC

/* The source a pod sees on a connection it made to itself through a ClusterIP (hairpin_snat):
 * Cilium's service loopback address 169.254.42.1 (IPv4 link-local) and, for IPv6, 100::42 of the
 * discard-only prefix (RFC 6666). Both leave the pod by its default route, so its replies come back
 * to from_container. */

/* What handle() tells its caller, in *out. */
#define OUT_VIA_HOST 1  /* the flow entered the endpoint through the host */
#define OUT_HAIRPIN 2   /* a hairpin packet: back into the pod it came from */

/* Branch hints: clang lays the unlikely blocks out after the hot path, so an established
 * packet runs through fewer instruction cache lines. */
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10

struct ipcache_key {
    u32 prefixlen;
    u8 family;
    u8 pad[3];
    u8 addr[16];
};
struct ipcache_value {
    u32 identity;
    u32 flags;
};

struct endpoint_key {
    u32 ifindex; /* set for the endpoint's veth key, 0 for address keys */
    u8 family;
    u8 pad[3];
    u8 addr[16];
};
struct endpoint_value {
    u32 ep_id;
    u32 identity;
    u32 ifindex;
    u32 flags;
};

/* Local delivery targets (maps/deliverymap.py), written by the agent once the endpoint's programs
 * are attached and its Ethernet address is known. A program delivers only to a veth running its own
 * generation: "deliver" runs the destination's ingress half with this program's maps, and a
 * destination still on an older agent's programs (during an upgrade) keeps its state where those
 * look. A change to a map layout the ingress half uses takes the next generation. */
struct delivery_key {
    u8 family;
    u8 pad[3];
    u8 addr[16];
};
struct delivery_value {
    u32 ifindex;     /* the destination's host veth */
    u8 generation;
    u8 pad;
    u8 dmac[6];      /* the pod's Ethernet address */
    u8 smac[6];      /* the host veth's */
    u16 pad2;
};

struct policy_key {
    u32 prefixlen;
    u32 ep_id;
    u32 identity;  /* 0 = any */
    u8 direction;
    u8 protocol;   /* 0 = any */
    u8 verdict;    /* in the key so allow and deny never shadow each other */
    u8 pad;
    __be16 dport;  /* network order: the trie matches its high bits first */
    u16 pad2;
};
struct policy_value {
    u16 port_low;  /* the owning entry's range, for dumps */
    u16 port_high;
    u32 flags;
};

struct enforcement_key {
    u32 ep_id;
};
struct enforcement_value {
    u32 flags;
};

struct state_key {
    u32 index;
};
struct state_value {
    u64 policy_epoch;
};

/* Conntrack keys, one map per family: a key's size is what every lookup hashes and compares, and
 * an IPv4 key is 20 bytes where the IPv6 one is 44. IPv6 flows keep the map and key layout that
 * once held every family ("conntrack"); the agent moves IPv4 entries left there by an older
 * program into "conntrack4" (CtMap.migrate). */
struct ct_key {
    u8 saddr[16];
    u8 daddr[16];
    __be16 sport;
    __be16 dport;
    u32 ep_id;
    u8 family;
    u8 protocol;
    u8 direction;  /* direction the connection was opened in */
    u8 pad;
};
struct ct4_key {
    __be32 saddr;
    __be32 daddr;
    __be16 sport;
    __be16 dport;
    u32 ep_id;
    u8 protocol;
    u8 direction;  /* direction the connection was opened in */
    u16 pad;
};
union ct_tuple {
    struct ct4_key v4;
    struct ct_key v6;
};
struct ct_value {
    u64 expires_ns;
    u64 epoch;
    u32 remote_identity;
    u8 closing;
    u8 flags;      /* CT_F_*; a byte older programs left zero */
    u16 rev_nat;   /* the service a connection was opened to (0: none), for reverse NAT */
};
/* ct_value.flags:
 * CT_F_VIA_HOST: the flow entered the endpoint through the host (to_container opened it): its replies
 *   go back through the host too, never by local delivery, so whatever the host did to it (a
 *   kube-proxy DNAT to a NodePort or an external IP, netfilter conntrack) sees them and can undo it.
 * CT_F_SNAT: the flow left with a source port Palisade gave it (the snat map holds the client's own):
 *   another live flow of the endpoint held its tuple as translated. A packet whose own port finds
 *   this entry belongs to another flow; the flow's replies get the client's port back.
 * CT_F_HAIRPIN: a pod reaching itself through a ClusterIP (hairpin): the connection's source is the
 *   hairpin address (the pod would drop a packet from its own address arriving from outside), the
 *   entry is keyed as the pod receives it (direction ingress) and both ways are put straight back
 *   into the pod. */

/* Service frontends, Cilium's layout: slot 0 is the service, slots 1..count its backends. */
struct lb_service_key {
    u8 addr[16];
    __be16 port;
    u16 slot;
    u8 family;
    u8 protocol;
    u8 pad[2];
};
struct lb_service_value {
    u32 backend_id;  /* slot > 0 */
    u16 count;       /* slot 0: number of backends (0: reject) */
    u16 rev_nat;     /* slot 0: service id, the reverse NAT index */
    u32 affinity_s;  /* slot 0: ClientIP affinity timeout */
    u32 flags;
};
/* A backend id is per service: removing a backend from its service removes the id. */
struct lb_backend_key {
    u32 id;
};
struct lb_backend_value {
    u8 addr[16];
    __be16 port;
    u8 family;
    u8 pad;
};
struct lb_revnat_key {
    u16 id;
    u16 pad;
};
struct lb_revnat_value {
    u8 addr[16];
    __be16 port;
    u8 family;
    u8 pad;
};
struct lb_affinity_key {
    u8 client[16];
    u16 rev_nat;
    u8 family;
    u8 pad;
};
struct lb_affinity_value {
    u64 last_ns;
    u32 backend_id;
    u32 pad;
};
/* A connection to a frontend, keyed as the client sent it: which backend it has. */
struct lb_ct_key {
    u8 saddr[16];
    u8 vaddr[16];
    __be16 sport;
    __be16 vport;
    u32 ep_id;
    u8 family;
    u8 protocol;
    u8 pad[2];
};
struct lb_ct_value {
    u64 expires_ns;
    u32 backend_id;
    u16 rev_nat;
    u8 closing;
    u8 pad;
};

/* Ports given to clashing connections (CT_F_SNAT), both ways: SNAT_FORWARD keys a connection as its
 * client sent it after any DNAT (sport: the client's port) to the port given; SNAT_REVERSE keys it
 * with the port given to the client's port. rev_nat (the connection's service, 0 for none) is part
 * of the key: a connection through a ClusterIP and a direct one from one port are two connections.
 * An entry is trusted only while both directions agree and the given tuple's conntrack entry lives,
 * so stale entries are harmless and the LRU reclaims them. */
struct snat_key {
    u8 saddr[16];
    u8 daddr[16];
    __be16 sport;
    __be16 dport;
    u32 ep_id;
    u16 rev_nat;
    u8 family;
    u8 protocol;
    u8 kind;
    u8 pad[3];
};
struct snat_value {
    __be16 port;
    u16 pad;
};

/* Counters are a per-CPU array: endpoint ep_id owns slots ep_id * METRICS_SLOTS + (direction
 * egress ? METRICS_DIR_SLOTS : 0) + reason; slot METRICS_LOST_SLOT (endpoint 0 is never an endpoint)
 * counts lost flow events. The agent hands out no endpoint id past the slots METRICS_MAX holds.
 * An array slot is an index, not a hashed key: the cheapest map access there is. */
struct metrics_value {
    u64 packets;
    u64 bytes;
};

struct flow_event {
    u64 ts_ns;
    u32 ep_id;
    u32 ifindex;
    u32 src_identity;
    u32 dst_identity;
    u8 saddr[16];
    u8 daddr[16];
    u16 sport;
    u16 dport;
    u8 family;
    u8 protocol;
    u8 direction;
    u8 verdict;
    u8 reason;
    u8 pad[7];
};

BPF_TABLE_PINNED("lpm_trie", struct ipcache_key, struct ipcache_value, ipcache, IPCACHE_MAX,
                 PIN_DIR "/ipcache", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct endpoint_key, struct endpoint_value, endpoints, ENDPOINTS_MAX,
                 PIN_DIR "/endpoints");
BPF_TABLE_PINNED("hash", struct delivery_key, struct delivery_value, delivery, ENDPOINTS_MAX,
                 PIN_DIR "/delivery");
BPF_TABLE_PINNED("lpm_trie", struct policy_key, struct policy_value, policy, POLICY_MAX,
                 PIN_DIR "/policy", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct enforcement_key, struct enforcement_value, enforcement, ENDPOINTS_MAX,
                 PIN_DIR "/enforcement");
BPF_TABLE_PINNED("array", struct state_key, struct state_value, state, 1, PIN_DIR "/state");
BPF_TABLE_PINNED("lru_hash", struct ct_key, struct ct_value, conntrack, CT_MAX, PIN_DIR "/conntrack");
BPF_TABLE_PINNED("lru_hash", struct ct4_key, struct ct_value, conntrack4, CT_MAX, PIN_DIR "/conntrack4");
BPF_TABLE_PINNED("hash", struct lb_service_key, struct lb_service_value, lb_services, LB_SERVICES_MAX,
                 PIN_DIR "/lb_services");
BPF_TABLE_PINNED("hash", struct lb_backend_key, struct lb_backend_value, lb_backends, LB_BACKENDS_MAX,
                 PIN_DIR "/lb_backends");
BPF_TABLE_PINNED("hash", struct lb_revnat_key, struct lb_revnat_value, lb_revnat, LB_REVNAT_MAX,
                 PIN_DIR "/lb_revnat");
BPF_TABLE_PINNED("lru_hash", struct lb_affinity_key, struct lb_affinity_value, lb_affinity, LB_AFFINITY_MAX,
                 PIN_DIR "/lb_affinity");
BPF_TABLE_PINNED("lru_hash", struct lb_ct_key, struct lb_ct_value, lb_conntrack, LB_CT_MAX,
                 PIN_DIR "/lb_conntrack");
BPF_TABLE_PINNED("lru_hash", struct snat_key, struct snat_value, snat, SNAT_MAX, PIN_DIR "/snat");
BPF_TABLE_PINNED("percpu_array", u32, struct metrics_value, metrics, METRICS_MAX, PIN_DIR "/metrics");

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

/* BPF_RINGBUF_OUTPUT has no pinned form; this is its expansion with a pin path. */
struct events_table_t {
    int key;
    u32 leaf;
    int (*ringbuf_output)(void *, u64, u64);
    void *(*ringbuf_reserve)(u64);
    void (*ringbuf_discard)(void *, u64);
    void (*ringbuf_submit)(void *, u64);
    u32 max_entries;
};
__attribute__((section("maps/ringbuf:" PIN_DIR "/events")))
struct events_table_t events = {.max_entries = EVENTS_BYTES};

/* A parsed packet; addresses and ports in network order. */
struct flow {
    u8 saddr[16];
    u8 daddr[16];
    __be16 sport;         /* conntrack ports (ICMP echo: id and 0) */
    __be16 dport;
    u16 policy_port;      /* destination port for policy, host order; 0 without ports */
    u8 family;
    u8 protocol;
    u8 tcp_flags;
    u8 has_l4;            /* the L4 header was parsed (not a later fragment) */
    u16 l4_off;           /* offset of the L4 header */
};

#define PARSE_OK 0
#define PARSE_PASS 1     /* not ours to judge: non-IP, ND, ICMP errors */
#define PARSE_INVALID 2  /* an IP packet too short to parse */

static __always_inline int has_ports(u8 proto)
{
    return proto == IPPROTO_TCP || proto == IPPROTO_UDP || proto == IPPROTO_SCTP;
}

/* Copy len bytes at off: straight from the packet when they are in its linear part (direct
 * access, no helper call: the common case), else through bpf_skb_load_bytes. len must be a
 * constant; off is bounded first so the verifier can check the access. */
#define LOAD_DIRECT_MAX_OFF 255
static __always_inline int load(struct __sk_buff *skb, u32 off, void *to, const u32 len)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    if (likely(off <= LOAD_DIRECT_MAX_OFF)) {
        void *from = data + off;
        if (likely(from + len <= data_end)) {
            __builtin_memcpy(to, from, len);
            return 0;
        }
    }
    return bpf_skb_load_bytes(skb, off, to, len);
}

static __always_inline int parse_l4(struct __sk_buff *skb, u32 off, struct flow *f, int first_fragment)
{
    if (!first_fragment)
        return PARSE_OK;  /* later fragments carry no ports: judged with port 0 */
    f->has_l4 = 1;
    f->l4_off = off;
    if (has_ports(f->protocol)) {
        struct {
            __be16 sport;
            __be16 dport;
            u32 seq;
            u32 ack;
            u8 doff;
            u8 flags;
        } l4 = {};
        int loaded = f->protocol == IPPROTO_TCP ? load(skb, off, &l4, 14) : load(skb, off, &l4, 4);
        if (loaded < 0)
            return PARSE_INVALID;
        f->sport = l4.sport;
        f->dport = l4.dport;
        f->policy_port = bpf_ntohs(l4.dport);
        if (f->protocol == IPPROTO_TCP)
            f->tcp_flags = l4.flags;
        return PARSE_OK;
    }
    if (f->protocol == IPPROTO_ICMP || f->protocol == IPPROTO_ICMPV6) {
        struct {
            u8 type;
            u8 code;
            u16 csum;
            __be16 id;
        } icmp = {};
        if (load(skb, off, &icmp, sizeof(icmp)) < 0)
            return PARSE_INVALID;
        u8 request = f->protocol == IPPROTO_ICMP ? 8 : 128;
        u8 reply = f->protocol == IPPROTO_ICMP ? 0 : 129;
        if (icmp.type == request) {
            f->sport = icmp.id;
        } else if (icmp.type == reply) {
            f->dport = icmp.id;  /* mirrors the request so the reversed tuple matches */
        } else if (f->protocol == IPPROTO_ICMP) {
            /* destination unreachable, time exceeded, parameter problem */
            if (icmp.type == 3 || icmp.type == 11 || icmp.type == 12)
                return PARSE_PASS;
        } else {
            /* ICMPv6 errors (1-4), MLD (130-132, 143), router/neighbour discovery (133-137) */
            if (icmp.type <= 4 || (icmp.type >= 130 && icmp.type <= 137) || icmp.type == 143)
                return PARSE_PASS;
        }
        return PARSE_OK;
    }
    return PARSE_OK;
}

static __always_inline int parse(struct __sk_buff *skb, struct flow *f)
{
    if (likely(skb->protocol == bpf_htons(ETH_P_IP))) {
        struct iphdr ip;
        if (load(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
            return PARSE_INVALID;
        f->family = FAMILY_V4;
        f->protocol = ip.protocol;
        __builtin_memcpy(f->saddr, &ip.saddr, 4);
        __builtin_memcpy(f->daddr, &ip.daddr, 4);
        int first = (ip.frag_off & bpf_htons(0x1fff)) == 0;
        return parse_l4(skb, ETH_HLEN + ip.ihl * 4, f, first);
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (load(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
            return PARSE_INVALID;
        f->family = FAMILY_V6;
        __builtin_memcpy(f->saddr, &ip6.saddr, 16);
        __builtin_memcpy(f->daddr, &ip6.daddr, 16);
        u8 next = ip6.nexthdr;
        u32 off = ETH_HLEN + sizeof(ip6);
        int first = 1;
        /* Skip the extension headers that may precede the L4 header. */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (next == 0 /* hop-by-hop */ || next == 43 /* routing */ || next == 60 /* dest opts */) {
                u8 ext[2];
                if (bpf_skb_load_bytes(skb, off, ext, 2) < 0)
                    return PARSE_INVALID;
                next = ext[0];
                off += ((u32)ext[1] + 1) * 8;
            } else if (next == 44 /* fragment */) {
                struct {
                    u8 next;
                    u8 reserved;
                    __be16 frag_off;
                    u32 id;
                } frag;
                if (bpf_skb_load_bytes(skb, off, &frag, sizeof(frag)) < 0)
                    return PARSE_INVALID;
                next = frag.next;
                first = (frag.frag_off & bpf_htons(0xfff8)) == 0;
                off += 8;
            } else {
                break;
            }
        }
        f->protocol = next;
        return parse_l4(skb, off, f, first);
    }
    return PARSE_PASS;
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
    u32 audits = en && (en->flags & AUDIT_ENTRIES) ? 0xf : 0;
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

static __always_inline void count(u32 ep_id, u8 reason, u8 dir, u32 bytes)
{
    u32 slot = reason == REASON_EVENT_LOST
                   ? METRICS_LOST_SLOT
                   : ep_id * METRICS_SLOTS + (dir == DIR_EGRESS ? METRICS_DIR_SLOTS : 0) + (reason & (METRICS_DIR_SLOTS - 1));
    struct metrics_value *mv = metrics.lookup(&slot);
    if (mv) {
        /* per-CPU slot: no other CPU writes it */
        mv->packets += 1;
        mv->bytes += bytes;
    }
}

/* The reader is woken only once a backlog builds up; otherwise it finds the events when it next
 * polls (it does every few tens of milliseconds). The ring's default, a wakeup whenever the reader
 * has caught up, costs an interrupt and a context switch for nearly every new flow. bcc has no table
 * method for bpf_ringbuf_query, but it rewrites events.ringbuf_output(...) into a call of
 * bpf_ringbuf_output with the map as first argument: this macro, defined only around emit, routes
 * that call here (the parenthesized name below is the helper itself, not the macro). */
static __always_inline long ringbuf_output_batched(void *ring, void *data, u64 size)
{
    u64 wakeup = bpf_ringbuf_query(ring, BPF_RB_AVAIL_DATA) >= EVENTS_WAKEUP_BYTES ? BPF_RB_FORCE_WAKEUP
                                                                                  : BPF_RB_NO_WAKEUP;
    return (bpf_ringbuf_output)(ring, data, size, wakeup);
}
#define bpf_ringbuf_output(ring, data, size, flags) ringbuf_output_batched(ring, data, size)

static __always_inline void emit(u32 ifindex, const struct flow *f, u32 ep_id, u32 local_id,
                                 u32 remote_id, u8 dir, u8 verdict, u8 reason)
{
    struct flow_event ev = {};
    ev.ts_ns = bpf_ktime_get_ns();
    ev.ep_id = ep_id;
    ev.ifindex = ifindex;
    ev.src_identity = dir == DIR_EGRESS ? local_id : remote_id;
    ev.dst_identity = dir == DIR_EGRESS ? remote_id : local_id;
    __builtin_memcpy(ev.saddr, f->saddr, 16);
    __builtin_memcpy(ev.daddr, f->daddr, 16);
    ev.sport = bpf_ntohs(f->sport);
    ev.dport = bpf_ntohs(f->dport);
    ev.family = f->family;
    ev.protocol = f->protocol;
    ev.direction = dir;
    ev.verdict = verdict;
    ev.reason = reason;
    if (events.ringbuf_output(&ev, sizeof(ev), 0) != 0)
        count(0, REASON_EVENT_LOST, 0, 0);
}
#undef bpf_ringbuf_output

static __always_inline u64 ct_lifetime(u8 proto, int closing)
{
    if (proto == IPPROTO_TCP)
        return (closing ? CT_CLOSING_LIFETIME_S : CT_TCP_LIFETIME_S) * NSEC;
    return CT_OTHER_LIFETIME_S * NSEC;
}

static __always_inline u64 current_epoch(void)
{
    struct state_key sk = {.index = 0};
    struct state_value *sv = state.lookup(&sk);
    return sv ? sv->policy_epoch : 0;
}

/* -- services: DNAT before policy, reverse NAT for replies, reject without backends -- */

/* SCTP: the CRC32c of translated packets (sctp_csum's arithmetic and its scratch slot). */
#include "lb_sctp.h"

/* The template's tail-call targets, a program array filled and pinned by the loader beside the
 * programs: "deliver" (local delivery, slot CALL_DELIVER) and "sctp_csum" (CALL_SCTP_CSUM). An empty
 * slot makes the tail call fail: a packet for "deliver" then takes the host's path; one for
 * "sctp_csum" is dropped (it would leave with a checksum its receiver rejects). */
BPF_PROG_ARRAY(calls, CALL_SLOTS);

#define IPV4_CSUM_OFF (ETH_HLEN + 10)
#define IPV4_SADDR_OFF (ETH_HLEN + 12)
#define IPV4_DADDR_OFF (ETH_HLEN + 16)
#define IPV6_SADDR_OFF (ETH_HLEN + 8)
#define IPV6_DADDR_OFF (ETH_HLEN + 24)

/* Whether the packet's protocol is load-balanced: TCP, UDP and SCTP (whose checksum sctp_csum fixes
 * once the packet is final). */
static __always_inline int lb_l4(const struct flow *f)
{
    return f->has_l4 && (f->protocol == IPPROTO_TCP || f->protocol == IPPROTO_UDP || f->protocol == IPPROTO_SCTP);
}

/* Rewrite the destination (dst) or source address and port, keeping checksums right. SCTP's
 * checksum covers no address, and its port changes are accounted for once the packet is final
 * (sctp_fix_csum). */
static __always_inline int lb_rewrite(struct __sk_buff *skb, struct flow *f, const u8 *addr, __be16 port, int dst)
{
    u32 l4 = f->l4_off;
    u32 csum_off = l4 + (f->protocol == IPPROTO_TCP ? 16 : 6);
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
        if (l4_csum && bpf_l4_csum_replace(skb, csum_off, old_port, port, mangled | 2) < 0)
            return -1;
        if (bpf_skb_store_bytes(skb, l4 + (dst ? 2 : 0), &port, 2, store_flags) < 0)
            return -1;
    }
    __builtin_memcpy(cur, addr, 16);
    if (dst) {
        f->dport = port;
        f->policy_port = bpf_ntohs(port);
    } else {
        f->sport = port;
    }
    return 0;
}

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
        return bpf_skb_load_bytes(skb, f->l4_off, l4, 20) < 0 ? 0 : 20;
    return bpf_skb_load_bytes(skb, f->l4_off, l4, 8) < 0 ? 0 : 8;
}

static __always_inline s64 lb_quote_sum(u8 *l4, u32 quote, s64 sum)
{
    if (quote == 20)
        return bpf_csum_diff(0, 0, (void *)l4, 20, sum);
    return bpf_csum_diff(0, 0, (void *)l4, 8, sum);
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
    u8 l4[20] = {};
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
        if (bpf_skb_adjust_room(skb, 28, BPF_ADJ_ROOM_MAC, 0) < 0 ||
            bpf_skb_change_tail(skb, ETH_HLEN + 48 + quote, 0) < 0)
            return -1;
        icmp.type = 3;
        icmp.code = 3;
        s64 sum = bpf_csum_diff(0, 0, (void *)&icmp, sizeof(icmp), 0);
        sum = bpf_csum_diff(0, 0, (void *)&orig, sizeof(orig), sum);
        sum = lb_quote_sum(l4, quote, sum);
        icmp.csum = csum_fold(sum);
        struct iphdr ip = {};
        ip.version = 4;
        ip.ihl = 5;
        ip.tos = 0xc0;
        ip.tot_len = bpf_htons(48 + quote);
        ip.ttl = 64;
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
    if (bpf_skb_adjust_room(skb, 48, BPF_ADJ_ROOM_MAC, 0) < 0 ||
        bpf_skb_change_tail(skb, ETH_HLEN + 88 + quote, 0) < 0)
        return -1;
    icmp.type = 1;
    icmp.code = 4;
    struct ipv6hdr ip6 = {};
    ip6.version = 6;
    ip6.payload_len = bpf_htons(48 + quote);
    ip6.nexthdr = IPPROTO_ICMPV6;
    ip6.hop_limit = 64;
    ip6.saddr = orig6.daddr;
    ip6.daddr = orig6.saddr;
    struct {
        u32 len;
        u32 next;
    } pseudo = {.len = bpf_htonl(48 + quote), .next = bpf_htonl(IPPROTO_ICMPV6)};
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

static __always_inline int lb_egress(struct __sk_buff *skb, struct flow *f, u32 ep_id, u64 now, u16 *rev_nat)
{
    if (!lb_l4(f))
        return LB_NONE;
    struct lb_service_key sk = {};
    __builtin_memcpy(sk.addr, f->daddr, 16);
    sk.port = f->dport;
    sk.family = f->family;
    sk.protocol = f->protocol;
    struct lb_service_value *svc = lb_services.lookup(&sk);
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
    struct lb_backend_value *be = NULL;
    struct lb_ct_value *cv = lb_conntrack.lookup(&ck);
    /* A bare SYN on a closing connection's entry opens a new connection: it is balanced anew. */
    int reopens = (f->tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK)) == TCP_FLAG_SYN;
    if (cv && cv->expires_ns >= now && cv->rev_nat == svc->rev_nat && !(reopens && cv->closing)) {
        struct lb_backend_key bk = {.id = cv->backend_id};
        be = lb_backends.lookup(&bk);
    }
    u8 closing = (f->tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) ? 1 : 0;
    if (be) {
        /* The connection keeps its backend. */
        cv->closing |= closing;
        cv->expires_ns = now + ct_lifetime(f->protocol, cv->closing);
    } else {
        /* A new connection, or its backend went away: a live backend of the service
         * (the new one answers a mid-connection TCP segment with a reset: it ends cleanly). */
        if (svc->count == 0)
            return LB_REJECT;
        u32 id = lb_pick(&sk, svc, f, now);
        struct lb_backend_key bk = {.id = id};
        be = lb_backends.lookup(&bk);
        if (!be)
            return LB_DROP;
        struct lb_ct_value nv = {};
        nv.expires_ns = now + ct_lifetime(f->protocol, closing);
        nv.backend_id = id;
        nv.rev_nat = svc->rev_nat;
        nv.closing = closing;
        lb_conntrack.update(&ck, &nv);
    }
    if (lb_rewrite(skb, f, be->addr, be->port, 1) < 0)
        return LB_DROP;
    *rev_nat = svc->rev_nat;
    return LB_DNAT;
}

static __always_inline int addr_equal(const struct flow *f, const u8 *a, const u8 *b)
{
    if (f->family == FAMILY_V4)
        return *(const u32 *)a == *(const u32 *)b;
    const u64 *x = (const u64 *)a, *y = (const u64 *)b;
    return x[0] == y[0] && x[1] == y[1];
}

/* The source of a hairpin connection's packets becomes the hairpin address (its port stays). */
static __always_inline int hairpin_snat(struct __sk_buff *skb, struct flow *f)
{
    u8 addr[16] = {};
    if (f->family == FAMILY_V4) {
        addr[0] = 169;  /* 169.254.42.1 */
        addr[1] = 254;
        addr[2] = 42;
        addr[3] = 1;
    } else {
        addr[0] = 0x01;  /* 100::42 */
        addr[15] = 0x42;
    }
    return lb_rewrite(skb, f, addr, f->sport, 0);
}

/* A reply entering the client: the backend's address and port become the frontend's. */
static __always_inline int lb_reverse(struct __sk_buff *skb, struct flow *f, u16 rev_nat)
{
    struct lb_revnat_key rk = {.id = rev_nat};
    struct lb_revnat_value *rv = lb_revnat.lookup(&rk);
    if (!rv)
        return -1;
    return lb_rewrite(skb, f, rv->addr, rv->port, 0);
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

/* The policy of endpoint veth ``ifindex`` (skb->ifindex, or the destination's in "deliver") for
 * the packet in direction ``dir``. ``via_host``: the packet came through the host (to_container);
 * ``*host_flow`` is set when its conntrack entry says the flow did. Before a translation, an SCTP
 * packet's header offset and ports are noted in sctp_scratch (OUT_SCTP; see sctp_hand_off). */
static __always_inline int handle(struct __sk_buff *skb, u8 dir, u32 ifindex, u8 via_host, u8 *host_flow)
{
    u64 epoch = current_epoch();
    u32 slot = ifindex % EP_CACHE_SLOTS;
    struct ep_cache_value *cached = ep_cache.lookup(&slot);
    u32 ep_id, local_id;
    if (likely(cached && cached->ifindex == ifindex && cached->epoch == epoch && epoch)) {
        ep_id = cached->ep_id;
        local_id = cached->identity;
    } else {
        struct endpoint_key self = {};
        self.ifindex = ifindex;
        struct endpoint_value *ep = endpoints.lookup(&self);
        if (!ep)
            return TC_ACT_OK;  /* not an endpoint's veth (or being detached) */
        ep_id = ep->ep_id;
        local_id = ep->identity;
        if (cached) {
            cached->ifindex = ifindex;
            cached->ep_id = ep_id;
            cached->identity = local_id;
            cached->epoch = epoch;
        }
    }

    struct flow f = {};
    int parsed = parse(skb, &f);
    if (unlikely(parsed == PARSE_PASS))
        return TC_ACT_OK;
    if (unlikely(parsed == PARSE_INVALID)) {
        /* Too short to judge; the event carries whatever was parsed. */
        emit(ifindex, &f, ep_id, local_id, 0, dir, VERDICT_DENY, REASON_INVALID);
        count(ep_id, REASON_INVALID, dir, skb->len);
        return TC_ACT_SHOT;
    }

    /* Lifetimes are seconds: the coarse clock (CLOCK_MONOTONIC_COARSE, a tick or two behind at
     * most) is precise enough and costs a fraction of the precise one on every packet. */
    u64 now = coarse_now(cached);
    /* One key on the stack (the program's stack is small): the packet's tuple, then, for a
     * reply, the reversed one; ``origin`` is the entry's key while it is in use. */
    union ct_tuple key;
    union ct_tuple *origin = &key;
    /* Which tuple first: a SYN-ACK answers an opened flow, so its entry is the reversed tuple's; a
     * bare SYN opens a flow, so only its own tuple can hold it (matched to the reversed tuple of a
     * closing flow, it would open a connection the other way without a verdict). Anything else
     * tries its own tuple, then the reversed one. A reply's peer opened the flow, so a reply never
     * goes to a service frontend (a frontend is no pod's source address): no service lookup. */
    u8 syn = f.tcp_flags & (TCP_FLAG_SYN | TCP_FLAG_ACK);
    int reversed = syn == (TCP_FLAG_SYN | TCP_FLAG_ACK);
    ct_key_of(&f, ep_id, dir, reversed, &key);
    struct ct_value *ct = ct_lookup(f.family, &key, now);
    if (!ct && syn != TCP_FLAG_SYN) {
        reversed = !reversed;
        ct_key_of(&f, ep_id, dir, reversed, &key);
        ct = ct_lookup(f.family, &key, now);
    }
    int reply = ct && reversed;
    u16 rev_nat = 0;
    u32 remote_id = 0;      /* the remote identity, once looked up */
    int remote_local = 1;   /* whether it may be a local endpoint's address still to look up */
    u8 hairpin = 0;         /* a pod's connection to itself through a ClusterIP (CT_F_HAIRPIN) */
    if (unlikely(!ct && dir == DIR_EGRESS)) {
        /* Not established either way: a connection to a service frontend is translated first
         * (established service flows are keyed by their backend, so they come here too). A local
         * endpoint's address is never a frontend: its identity is needed anyway, and found first. */
        remote_id = local_identity(f.family, f.daddr);
        remote_local = 0;
        sctp_note_once(&f, ep_id, dir, host_flow);
        int lb = remote_id ? LB_NONE : lb_egress(skb, &f, ep_id, now, &rev_nat);
        if (lb == LB_REJECT || lb == LB_DROP) {
            emit(ifindex, &f, ep_id, local_id, WORLD_ID, dir, VERDICT_DENY, REASON_NO_BACKEND);
            count(ep_id, REASON_NO_BACKEND, dir, skb->len);
            if (lb == LB_REJECT && lb_reject(skb, &f) == 0)
                return bpf_redirect_peer(skb->ifindex, 0);
            return TC_ACT_SHOT;
        }
        if (lb == LB_DNAT) {
            remote_local = 1;  /* the backend's address is another one */
            u8 ct_dir = dir;
            if (unlikely(addr_equal(&f, f.saddr, f.daddr))) {
                /* The pod's own backend: it sees the connection come from the hairpin address. */
                if (hairpin_snat(skb, &f) < 0) {
                    emit(ifindex, &f, ep_id, local_id, local_id, dir, VERDICT_DENY, REASON_NO_BACKEND);
                    count(ep_id, REASON_NO_BACKEND, dir, skb->len);
                    return TC_ACT_SHOT;
                }
                hairpin = 1;
                ct_dir = DIR_INGRESS;
                *host_flow |= OUT_HAIRPIN;
            }
            ct_key_of(&f, ep_id, ct_dir, 0, &key);
            ct = ct_lookup(f.family, &key, now);
        }
    }
    u8 given_port = 0;
    if (dir == DIR_EGRESS && !reply && !hairpin && lb_l4(&f) &&
        unlikely(ct ? ct->rev_nat != rev_nat || (ct->flags & CT_F_SNAT) || (syn == TCP_FLAG_SYN && ct->closing)
                    : syn != TCP_FLAG_SYN)) {
        /* Not this flow's entry, or none where a connection may have been given a port. */
        sctp_note_once(&f, ep_id, dir, host_flow);
        int resolved = snat_resolve(skb, &f, ep_id, rev_nat, syn, now, &key, &ct);
        if (resolved == SNAT_FAILED) {
            u32 remote = remote_id ? remote_id : local_identity(f.family, f.daddr);
            if (!remote)
                remote = cidr_identity(f.family, f.daddr);
            emit(ifindex, &f, ep_id, local_id, remote, dir, VERDICT_DENY, REASON_NO_PORT);
            count(ep_id, REASON_NO_PORT, dir, skb->len);
            return TC_ACT_SHOT;
        }
        given_port = resolved == SNAT_GIVEN;
    } else if (ct && !reversed && syn == TCP_FLAG_SYN && ct->closing && !(ct->flags & CT_F_SNAT)) {
        ct = NULL;  /* the tuple opens again (a SYN on its closing entry): a new flow, judged anew */
    }

    if (unlikely(!ct || ct->epoch != epoch)) {
        /* A new flow, or one whose verdict predates the policy: judged as it was opened. The remote
         * address is the packet's either way (a reply's entry is keyed by the reversed tuple). One
         * call site for the policy lookups and the event keeps the program small. */
        const u8 *remote = dir == DIR_EGRESS ? f.daddr : f.saddr;
        if (remote_local)
            remote_id = local_identity(f.family, remote);
        if (!remote_id)
            remote_id = cidr_identity(f.family, remote);
        u8 v4 = f.family == FAMILY_V4;
        u8 judged_dir = ct ? (v4 ? origin->v4.direction : origin->v6.direction) : dir;
        __be16 opened_port = v4 ? origin->v4.dport : origin->v6.dport;
        u16 judged_port = ct ? (has_ports(f.protocol) ? bpf_ntohs(opened_port) : 0) : f.policy_port;
        u8 reason = REASON_NOT_ENFORCED;
        u8 verdict = VERDICT_ALLOW;
        /* A pod reaching itself (hairpin) is always allowed, as when it connects to its own address. */
        u8 self = hairpin || (ct && (ct->flags & CT_F_HAIRPIN));
        if (!self && !(ALLOW_HOST && judged_dir == DIR_INGRESS && remote_id == HOST_ID))
            verdict = policy_verdict(ep_id, judged_dir, remote_id, f.protocol, judged_port, &reason);
        if (verdict != VERDICT_ALLOW || !ct) {
            emit(ifindex, &f, ep_id, local_id, remote_id, dir, verdict, reason);
            /* an audited packet passes: it is not counted as the drop its reason names */
            count(ep_id, verdict == VERDICT_AUDIT ? REASON_NOT_ENFORCED : reason, dir, skb->len);
        }
        if (verdict == VERDICT_DENY) {
            if (ct)
                ct_forget(f.family, origin);
            return TC_ACT_SHOT;
        }
        if (!ct) {
            struct ct_value nv = {};
            nv.closing = (f.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) ? 1 : 0;
            nv.expires_ns = now + ct_lifetime(f.protocol, nv.closing);
            nv.epoch = epoch;
            nv.remote_identity = remote_id;
            nv.rev_nat = rev_nat;
            nv.flags = (via_host ? CT_F_VIA_HOST : 0) | (given_port ? CT_F_SNAT : 0) | (hairpin ? CT_F_HAIRPIN : 0);
            ct_key_of(&f, ep_id, hairpin ? DIR_INGRESS : dir, 0, &key);
            ct_store(f.family, &key, &nv);
            return TC_ACT_OK;
        }
        ct->epoch = epoch;
        ct->remote_identity = remote_id;
    }

    *host_flow |= ct->flags & CT_F_VIA_HOST;
    if (unlikely((f.tcp_flags & (TCP_FLAG_FIN | TCP_FLAG_RST)) && !ct->closing)) {
        ct->closing = 1;
        ct->expires_ns = now + ct_lifetime(f.protocol, 1);
    } else {
        /* At most once a second (lifetimes are 10 s or more): most packets only read the entry. */
        u64 expires = now + ct_lifetime(f.protocol, ct->closing);
        if (unlikely(ct->expires_ns + CT_REFRESH_NS < expires))
            ct->expires_ns = expires;
    }
    if (unlikely(reply && (ct->rev_nat || (ct->flags & CT_F_SNAT)))) {
        sctp_note_once(&f, ep_id, dir, host_flow);
        /* A reply to a translated connection: the client's own port back, the frontend as source. */
        int undone = 0;
        if (ct->flags & CT_F_SNAT) {
            struct snat_key rk = {};
            snat_key_of(&f, ep_id, ct->rev_nat, SNAT_REVERSE, 1, &rk);
            struct snat_value *back = snat.lookup(&rk);
            undone = back ? lb_rewrite(skb, &f, f.daddr, back->port, 1) : -1;
        }
        if (undone == 0 && (ct->flags & CT_F_HAIRPIN)) {
            /* The pod answering itself: back to its own address, then from the frontend. */
            undone = lb_rewrite(skb, &f, f.saddr, f.dport, 1);
            *host_flow |= OUT_HAIRPIN;
        }
        if (undone == 0 && ct->rev_nat)
            undone = lb_reverse(skb, &f, ct->rev_nat);
        if (undone < 0) {
            /* The service or the port's record is gone: the client could not match the reply. */
            emit(ifindex, &f, ep_id, local_id, ct->remote_identity, dir, VERDICT_DENY, REASON_NO_BACKEND);
            count(ep_id, REASON_NO_BACKEND, dir, skb->len);
            return TC_ACT_SHOT;
        }
    }
    count(ep_id, REASON_ESTABLISHED, dir, skb->len);
    return TC_ACT_OK;
}

/* -- local delivery ------------------------------------------------------------------------- */

/* What from_container found for "deliver", in skb->cb (kept across a tail call): the destination
 * veth, then the Ethernet addresses the host's forwarding would give the packet. */
struct delivery {
    u32 ifindex;
    u8 dmac[6];
    u8 smac[6];
};

/* Whether the packet goes to another local endpoint that can be delivered to directly; if so, the
 * delivery is written to skb->cb. Read from the packet as it leaves from_container (after DNAT).
 * One hash lookup: the agent wrote the Ethernet addresses the host's forwarding would use (a FIB
 * and neighbour lookup here, bpf_fib_lookup, costs about 90 ns a packet). */
static __always_inline int delivery_of(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct delivery_key dk = {};
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
            return 0;  /* expiring: the host's forwarding answers with ICMP time exceeded */
        dk.family = FAMILY_V4;
        __builtin_memcpy(dk.addr, &ip->daddr, 4);
    } else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end || ip6->hop_limit <= 1)
            return 0;
        dk.family = FAMILY_V6;
        __builtin_memcpy(dk.addr, &ip6->daddr, 16);
    } else {
        return 0;
    }
    struct delivery_value *dv = delivery.lookup(&dk);
    if (!dv || dv->generation != EP_GENERATION || dv->ifindex == skb->ifindex)
        return 0;  /* no local pod's, not on these programs yet, or the pod itself (hairpin) */
    struct delivery d = {};
    d.ifindex = dv->ifindex;
    __builtin_memcpy(d.dmac, dv->dmac, 6);
    __builtin_memcpy(d.smac, dv->smac, 6);
    u32 words[4];
    __builtin_memcpy(words, &d, sizeof(words));
    skb->cb[0] = words[0];
    skb->cb[1] = words[1];
    skb->cb[2] = words[2];
    skb->cb[3] = words[3];
    return 1;
}

/* What the host's forwarding would have done: the Ethernet addresses of the destination's link,
 * TTL or hop limit one less (the IPv4 checksum updated as ip_decrease_ttl does). */
static __always_inline int forward_rewrite(struct __sk_buff *skb, const struct delivery *d)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end)
        return -1;
    if (eth->h_proto == bpf_htons(ETH_P_IP)) {
        struct iphdr *ip = data + ETH_HLEN;
        if ((void *)(ip + 1) > data_end)
            return -1;
        u32 check = ip->check;
        check += bpf_htons(0x0100);
        ip->check = (u16)(check + (check >= 0xFFFF));
        ip->ttl--;
    } else {
        struct ipv6hdr *ip6 = data + ETH_HLEN;
        if ((void *)(ip6 + 1) > data_end)
            return -1;
        ip6->hop_limit--;
    }
    __builtin_memcpy(eth->h_dest, d->dmac, 6);
    __builtin_memcpy(eth->h_source, d->smac, 6);
    return 0;
}

/* A hairpin packet goes back into the pod it left: the Ethernet addresses swapped, as the host's
 * forwarding would give it (the pod's address as destination, the host veth's as source). */
static __always_inline int hairpin_back(struct __sk_buff *skb)
{
    void *data = (void *)(long)skb->data;
    void *data_end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end)
        return TC_ACT_SHOT;
    u8 mac[ETH_ALEN];
    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    return bpf_redirect_peer(skb->ifindex, 0);
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
