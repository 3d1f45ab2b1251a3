// SPDX-License-Identifier: GPL-2.0
/*
 * The pinned maps and their keys and values (included by palisade.c). Each struct mirrors a ctypes
 * struct of services/datapath/maps/ (the loader appends static asserts that pin sizes and offsets);
 * the agent creates and pins every map, the programs find them by pin path. The per-CPU endpoint
 * cache (endpoint.h), the event ring (events.h) and SCTP's scratch slot (lb_sctp.h) sit with their
 * users.
 */
#ifndef PALISADE_MAPS_H
#define PALISADE_MAPS_H

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
    union {
        u32 backend_id;  /* slot > 0 */
        u32 revision;    /* slot 0: changes whenever a backend leaves the service (lb_ct_value.revision) */
    };
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
/* Frontend ports (lbportmap.py): port p (host order) is bit p % 64 of word p / 64, set while some
 * frontend listens on p. A hint only (see handle()): it lets an established service connection skip
 * the reversed conntrack lookup. */
#define LB_PORT_WORDS 1024
struct lb_port_key {
    u32 word;
};
struct lb_port_value {
    u64 bits;
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
/* The backend's address and port are kept in the entry: while the service's revision is the one the
 * entry was written at, no backend of the service has left, so an established packet rewrites from
 * the entry alone (no backend lookup). */
struct lb_ct_value {
    u64 expires_ns;
    u32 backend_id;
    u16 rev_nat;
    u8 closing;
    u8 pad;
    u8 addr[16];    /* the backend's, as lb_backend_value */
    __be16 port;
    u16 pad2;
    u32 revision;   /* lb_service_value.revision when addr and port were read */
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
BPF_TABLE_PINNED("array", struct lb_port_key, struct lb_port_value, lb_ports, LB_PORT_WORDS, PIN_DIR "/lb_ports");
BPF_TABLE_PINNED("lru_hash", struct lb_ct_key, struct lb_ct_value, lb_conntrack, LB_CT_MAX,
                 PIN_DIR "/lb_conntrack");
BPF_TABLE_PINNED("lru_hash", struct snat_key, struct snat_value, snat, SNAT_MAX, PIN_DIR "/snat");
BPF_TABLE_PINNED("percpu_array", u32, struct metrics_value, metrics, METRICS_MAX, PIN_DIR "/metrics");

/* The template's tail-call targets, a program array filled and pinned by the loader beside the
 * programs: "deliver" (local delivery, slot CALL_DELIVER) and "sctp_csum" (CALL_SCTP_CSUM). An empty
 * slot makes the tail call fail: a packet for "deliver" then takes the host's path; one for
 * "sctp_csum" is dropped (it would leave with a checksum its receiver rejects). */
BPF_PROG_ARRAY(calls, CALL_SLOTS);

#endif /* PALISADE_MAPS_H */
