/*
 * XXH64 (github.com/Cyan4973/xxHash, doc/xxhash_spec.md), streaming: the
 * stored parts' stripe sums (stored.c), a header of its own so that
 * bench/xxh64_rate.c measures the same code. Little-endian hosts only
 * (x86-64 and aarch64, where the shim runs).
 */
#ifndef CUIP_XXH64_H
#define CUIP_XXH64_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define XP1 0x9E3779B185EBCA87ULL
#define XP2 0xC2B2AE3D27D4EB4FULL
#define XP3 0x165667B19E3779F9ULL
#define XP4 0x85EBCA77C2B2AE63ULL
#define XP5 0x27D4EB2F165667C5ULL

struct xxh64 {
    uint64_t v[4];
    uint64_t total;
    uint64_t seed;
    unsigned char buf[32];
    unsigned buffered;
};

static inline uint64_t rotl64(uint64_t x, unsigned r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v); /* little-endian hosts only: x86-64 and aarch64 */
    return v;
}

static inline uint64_t xround(uint64_t acc, uint64_t in)
{
    return rotl64(acc + in * XP2, 31) * XP1;
}

static inline uint64_t xmerge(uint64_t acc, uint64_t v)
{
    return (acc ^ xround(0, v)) * XP1 + XP4;
}

static inline void xxh64_init(struct xxh64 *h, uint64_t seed)
{
    *h = (struct xxh64){.v = {seed + XP1 + XP2, seed + XP2, seed, seed - XP1}, .seed = seed};
}

static inline const unsigned char *xxh64_blocks(struct xxh64 *h, const unsigned char *p,
                                         const unsigned char *end)
{
    uint64_t v0 = h->v[0], v1 = h->v[1], v2 = h->v[2], v3 = h->v[3];
    for (; end - p >= 32; p += 32) {
        v0 = xround(v0, read64(p));
        v1 = xround(v1, read64(p + 8));
        v2 = xround(v2, read64(p + 16));
        v3 = xround(v3, read64(p + 24));
    }
    h->v[0] = v0, h->v[1] = v1, h->v[2] = v2, h->v[3] = v3;
    return p;
}

static inline void xxh64_update(struct xxh64 *h, const void *data, size_t len)
{
    const unsigned char *p = data, *end = p + len;

    h->total += len;
    if (h->buffered + len < 32) {
        memcpy(h->buf + h->buffered, p, len);
        h->buffered += (unsigned)len;
        return;
    }
    if (h->buffered) {
        size_t fill = 32 - h->buffered;
        memcpy(h->buf + h->buffered, p, fill);
        xxh64_blocks(h, h->buf, h->buf + 32);
        p += fill;
        h->buffered = 0;
    }
    p = xxh64_blocks(h, p, end);
    memcpy(h->buf, p, (size_t)(end - p));
    h->buffered = (unsigned)(end - p);
}

static inline void xxh64_zeros(struct xxh64 *h, uint64_t len)
{
    static const unsigned char zero[4096];
    while (len) {
        size_t n = len < sizeof zero ? (size_t)len : sizeof zero;
        xxh64_update(h, zero, n);
        len -= n;
    }
}

static inline uint64_t xxh64_digest(const struct xxh64 *h)
{
    const unsigned char *p = h->buf, *end = p + h->buffered;
    uint64_t v = h->total >= 32
                     ? rotl64(h->v[0], 1) + rotl64(h->v[1], 7) + rotl64(h->v[2], 12) +
                           rotl64(h->v[3], 18)
                     : h->seed + XP5;

    if (h->total >= 32)
        for (int i = 0; i < 4; i++)
            v = xmerge(v, h->v[i]);
    v += h->total;
    for (; end - p >= 8; p += 8)
        v = rotl64(v ^ xround(0, read64(p)), 27) * XP1 + XP4;
    if (end - p >= 4) {
        uint32_t w;
        memcpy(&w, p, sizeof w);
        v = rotl64(v ^ (uint64_t)w * XP1, 23) * XP2 + XP3;
        p += 4;
    }
    for (; p < end; p++)
        v = rotl64(v ^ *p * XP5, 11) * XP1;
    v ^= v >> 33;
    v *= XP2;
    v ^= v >> 29;
    v *= XP3;
    return v ^ (v >> 32);
}

#endif
