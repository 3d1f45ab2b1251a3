// SPDX-License-Identifier: GPL-2.0
/*
 * What every part uses: branch hints, TCP flag bits, time units (included first by palisade.c).
 */
#ifndef PALISADE_COMMON_H
#define PALISADE_COMMON_H

#define NSEC 1000000000ULL

/* Branch hints: clang lays the unlikely blocks out after the hot path, so an established
 * packet runs through fewer instruction cache lines. */
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

#define TCP_FLAG_FIN 0x01
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_RST 0x04
#define TCP_FLAG_ACK 0x10

#endif /* PALISADE_COMMON_H */
