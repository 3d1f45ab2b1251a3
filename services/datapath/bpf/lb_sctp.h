// SPDX-License-Identifier: GPL-2.0
/*
 * SCTP through Services: the CRC32c of a translated packet (included by palisade.c).
 *
 * TCP and UDP checksums are ones' complement sums that bpf_l4_csum_replace updates for a changed
 * field; SCTP's is a CRC32c over the whole SCTP packet (RFC 9260 6.8, no pseudo-header), which no
 * helper updates. A translation changes only the ports (addresses are not covered), and a CRC is
 * linear over GF(2): with the ports' XOR pattern D (the first 4 bytes of the packet) and n bytes
 * after them,
 *
 *     crc(new) = crc(old) ^ (D fed through the CRC register from zero) * x^(8n)  mod P
 *
 * (the initial value and the final inversion cancel between two messages of one length). So the
 * new checksum needs only the packet's length, never its payload: a 32-step register run for D and
 * a product with x^(8n), itself the product of the x^(2^(j+3)) below for the bits j of n (zlib's
 * crc32_combine, with the constants unrolled: every step is a shift, a mask and an XOR, no branch
 * on packet data and no loop for the verifier to walk).
 *
 * This runs in a program of its own, sctp_csum, which the three programs tail-call for an SCTP packet
 * whose ports they changed (translated through a Service, reverse-translated, or given a port of its
 * own), telling it in a per-CPU scratch slot what to do next. Inlined where the ports change, the
 * few thousand instructions below would be walked by the verifier once for every path through
 * handle(), past its 1 M instruction budget. Other packets pay one flag test where the programs
 * exit; SCTP's ports are noted (sctp_note_once) only on the paths that may translate.
 *
 * A checksum field of zero is left alone: that is how the kernel's SCTP hands a packet to a device
 * with CRC offload (CHECKSUM_PARTIAL with csum_not_inet; veth has NETIF_F_SCTP_CRC, so pods with a
 * kernel SCTP send these) and how it builds a GSO packet. Whoever computes it later (the device, or
 * skb_crc32c_csum_help / the GSO segmentation) does so over the rewritten packet, with the field as
 * found: an XOR pattern written into it would end up in the result. A real CRC32c of zero is one
 * packet in 2^32; such a packet keeps a wrong checksum and is dropped by its receiver as corrupt.
 *
 * A packet whose length cannot be known from its first bytes (an IPv4 fragment, IPv6 with
 * extension headers, whose fragment header may hide a larger packet) cannot be fixed: a translated
 * one is dropped as invalid.
 */
#ifndef PALISADE_LB_SCTP_H
#define PALISADE_LB_SCTP_H

/* CALL_SCTP_CSUM, sctp_csum's slot in "calls", and CALL_SLOTS, the array's size, come from the
 * loader (loader.CALL_SCTP_CSUM, loader.CALL_SLOTS) with the other shared numbers. */

/* Where sctp_csum sends the packet once its checksum is right: what its caller would have done. */
#define SCTP_NEXT_PASS 0      /* TC_ACT_OK: on through the host */
#define SCTP_NEXT_HAIRPIN 1   /* back into the pod it left (hairpin_back) */
#define SCTP_NEXT_DELIVER 2   /* local delivery: tail call "deliver" (skb->cb holds the delivery) */
#define SCTP_NEXT_REDIRECT 3  /* delivered: into the namespace behind veth ``ifindex`` */

#define SCTP_CSUM_OFF 8
/* Castagnoli, bit-reflected (x^0 is bit 31). */
#define CRC32C_POLY 0x82F63B78u
#define CRC32C_ONE 0x80000000u

/* x^(2^(j+3)) mod P, j = 0..15: x^(8 * 2^j), one per bit of a byte count below 65536. Derived by
 * repeated squaring of x (tests/datapath/test_sctp_services.py checks them against Python's CRC). */
#define CRC32C_X8_0 0x00800000u
#define CRC32C_X8_1 0x00008000u
#define CRC32C_X8_2 0x82f63b78u
#define CRC32C_X8_3 0x6ea2d55cu
#define CRC32C_X8_4 0x18b8ea18u
#define CRC32C_X8_5 0x510ac59au
#define CRC32C_X8_6 0xb82be955u
#define CRC32C_X8_7 0xb8fdb1e7u
#define CRC32C_X8_8 0x88e56f72u
#define CRC32C_X8_9 0x74c360a4u
#define CRC32C_X8_10 0xe4172b16u
#define CRC32C_X8_11 0x0d65762au
#define CRC32C_X8_12 0x35d73a62u
#define CRC32C_X8_13 0x28461564u
#define CRC32C_X8_14 0xbf455269u
#define CRC32C_X8_15 0xe2ea32dcu

/* Bit j of x as 0 or 1, opaque to clang, which then multiplies by it. Written as a mask (0 - bit) & v,
 * or left for clang to turn into one or a select, it makes the verifier fork its state on the two
 * values at every step: 2^n paths for n steps. */
static __always_inline u32 crc32c_bit(u32 x, const int j)
{
    u64 bit = (x >> j) & 1;
    asm volatile("" : "+r"(bit));
    return (u32)bit;
}

/* One step of the register: multiply by x modulo P. */
static __always_inline u32 crc32c_times_x(u32 b)
{
    return (b >> 1) ^ (CRC32C_POLY * crc32c_bit(b, 0));
}

/* a * b mod P with a a constant: clang unrolls the loop and drops the tests on a's bits, leaving
 * straight-line shifts and XORs. */
static __always_inline u32 crc32c_mul_const(const u32 a, u32 b)
{
    u32 p = 0;
#pragma unroll
    for (int i = 31; i >= 0; i--) {
        if (a & (1u << i))
            p ^= b;
        if (!(a & ((1u << i) - 1)))
            break;
        b = crc32c_times_x(b);
    }
    return p;
}

/* p * x^(8n) mod P when bit j of n is set, else p: no branch. */
#define CRC32C_SHIFT_BIT(p, n, j)                                                                  \
    do {                                                                                           \
        u32 shifted_ = crc32c_mul_const(CRC32C_X8_##j, p);                                         \
        p ^= (shifted_ ^ p) * crc32c_bit(n, j);                                                    \
    } while (0)

/* The CRC32c change of a packet whose first 4 bytes change by the XOR pattern ``diff`` (as loaded,
 * little-endian: the register's byte order) with ``after`` bytes after them. */
static __always_inline u32 crc32c_port_delta(u32 diff, u32 after)
{
    u32 p = diff;
#pragma unroll
    for (int i = 0; i < 32; i++)
        p = crc32c_times_x(p);
    CRC32C_SHIFT_BIT(p, after, 0);
    CRC32C_SHIFT_BIT(p, after, 1);
    CRC32C_SHIFT_BIT(p, after, 2);
    CRC32C_SHIFT_BIT(p, after, 3);
    CRC32C_SHIFT_BIT(p, after, 4);
    CRC32C_SHIFT_BIT(p, after, 5);
    CRC32C_SHIFT_BIT(p, after, 6);
    CRC32C_SHIFT_BIT(p, after, 7);
    CRC32C_SHIFT_BIT(p, after, 8);
    CRC32C_SHIFT_BIT(p, after, 9);
    CRC32C_SHIFT_BIT(p, after, 10);
    CRC32C_SHIFT_BIT(p, after, 11);
    CRC32C_SHIFT_BIT(p, after, 12);
    CRC32C_SHIFT_BIT(p, after, 13);
    CRC32C_SHIFT_BIT(p, after, 14);
    CRC32C_SHIFT_BIT(p, after, 15);
    return p;
}

#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define sctp_le32(x) __builtin_bswap32(x)
#else
#define sctp_le32(x) (x)
#endif

/* What handle() saw of an SCTP packet before translating it: where its SCTP header is and its ports
 * then (l4_off 0: not SCTP, nothing to fix); then, handed to sctp_csum, what to do next. */
struct sctp_fix {
    u32 ports;    /* source and destination port, as in the packet */
    u32 ep_id;    /* for the counters, should it be dropped */
    u32 ifindex;  /* SCTP_NEXT_REDIRECT: the destination's veth */
    u16 l4_off;
    u8 dir;
    u8 next;      /* SCTP_NEXT_* */
};

/* sctp_csum's instructions from its caller. Per CPU: a tail call runs on the CPU that made it, with
 * nothing else of this program in between. Not pinned: it lives with the programs. */
BPF_PERCPU_ARRAY(sctp_scratch, struct sctp_fix, 1);

/* handle() tells its caller, in *out, that it noted an SCTP packet in sctp_scratch (beside OUT_*). */
#define OUT_SCTP 4

/* Note an SCTP packet's header offset and ports before any translation; 0 when noted. In the scratch
 * slot, not on the stack: from_container's stack is nearly full. */
static __always_inline int sctp_note(const struct flow *f, u32 ep_id, u8 dir)
{
    u32 zero = 0;
    struct sctp_fix *fix = sctp_scratch.lookup(&zero);
    if (!fix)
        return -1;
    fix->l4_off = f->l4_off;
    fix->ep_id = ep_id;
    fix->dir = dir;
    __builtin_memcpy(&fix->ports, &f->sport, sizeof(fix->ports));
    return 0;
}

/* Before anything may rewrite a packet's ports (a translation): an SCTP packet's are noted, once per
 * program run (OUT_SCTP in *out). Only translation paths call this: other packets never pay for it. */
static __always_inline void sctp_note_once(const struct flow *f, u32 ep_id, u8 dir, u8 *out)
{
    if (unlikely(f->protocol == IPPROTO_SCTP) && f->has_l4 && !(*out & OUT_SCTP) && sctp_note(f, ep_id, dir) == 0)
        *out |= OUT_SCTP;
}

/* The noted packet, if its ports changed since (its checksum then needs sctp_csum); NULL if not. */
static __always_inline struct sctp_fix *sctp_changed(struct __sk_buff *skb)
{
    u32 zero = 0;
    struct sctp_fix *fix = sctp_scratch.lookup(&zero);
    if (!fix)
        return NULL;
    u32 ports;
    if (bpf_skb_load_bytes(skb, fix->l4_off, &ports, sizeof(ports)) == 0 && ports == fix->ports)
        return NULL;  /* unchanged (or unreadable: sctp_csum finds out, and drops it) */
    return fix;
}

/* Bring the packet's CRC32c in line with the ports it leaves with; -1 if it cannot be (the packet
 * must be dropped: its receiver would). */
static __always_inline int sctp_fix_csum(struct __sk_buff *skb, const struct sctp_fix *fix)
{
    u32 off = fix->l4_off;
    if (!off)
        return 0;
    u32 ports;
    if (bpf_skb_load_bytes(skb, off, &ports, sizeof(ports)) < 0)
        return -1;
    u32 diff = ports ^ fix->ports;
    if (!diff)
        return 0;
    u32 csum;
    if (bpf_skb_load_bytes(skb, off + SCTP_CSUM_OFF, &csum, sizeof(csum)) < 0)
        return -1;
    if (!csum)
        return 0;  /* left to the offload: computed later over the rewritten packet */
    u32 end;
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct {
            u8 vihl;
            u8 tos;
            __be16 tot_len;
            __be16 id;
            __be16 frag_off;
        } ip;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
            return -1;
        if (ip.frag_off & bpf_htons(0x3fff))
            return -1;  /* a fragment: the SCTP packet's length is not known here */
        end = ETH_HLEN + bpf_ntohs(ip.tot_len);
    } else {
        struct {
            u32 flow;
            __be16 payload_len;
            u8 nexthdr;
            u8 hop_limit;
        } ip6;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
            return -1;
        if (ip6.nexthdr != IPPROTO_SCTP || off != ETH_HLEN + sizeof(struct ipv6hdr))
            return -1;  /* extension headers: maybe a fragment */
        end = ETH_HLEN + sizeof(struct ipv6hdr) + bpf_ntohs(ip6.payload_len);
    }
    if (end > skb->len || end < off + 12)
        return -1;
    u32 delta = crc32c_port_delta(sctp_le32(diff), end - off - 4);
    csum ^= sctp_le32(delta);
    if (bpf_skb_store_bytes(skb, off + SCTP_CSUM_OFF, &csum, sizeof(csum), BPF_F_RECOMPUTE_CSUM) < 0)
        return -1;
    return 0;
}

#endif /* PALISADE_LB_SCTP_H */
