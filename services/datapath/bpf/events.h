// SPDX-License-Identifier: GPL-2.0
/*
 * Counters and flow events (included by palisade.c): per-CPU counters by endpoint, direction and
 * reason, and the flow events ring the agent reads.
 */
#ifndef PALISADE_EVENTS_H
#define PALISADE_EVENTS_H

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

/* A dropped packet's flow event and its counter (the caller returns TC_ACT_SHOT, or sends the
 * reply it made of the packet). */
static __always_inline void drop_event(struct __sk_buff *skb, u32 ifindex, const struct flow *f, u32 ep_id,
                                       u32 local_id, u32 remote_id, u8 dir, u8 reason)
{
    emit(ifindex, f, ep_id, local_id, remote_id, dir, VERDICT_DENY, reason);
    count(ep_id, reason, dir, skb->len);
}

#endif /* PALISADE_EVENTS_H */
