/*
 * The chunk hash of the kept host copy (specs/shim.md, "Kept host copy"):
 * one definition for the GPU kernel (kernels/keep_hash.cu, whose PTX the
 * shim carries), its C twin in the simulated driver, and the tests.
 *
 * A chunk (KH_CHUNK bytes, the allocation's last one shorter) is read as
 * little-endian 64-bit words by KH_THREADS lanes: lane t takes words t,
 * t + KH_THREADS, t + 2 KH_THREADS, ... in that order and folds each into two
 * 64-bit states, a = mix_a(a ^ w) and b = mix_b(b + w). Both mixers are
 * bijections of 64 bits (xor-shifts and odd multiplications), so for fixed
 * other words each step maps distinct words to distinct states, and so does
 * every step after it: a change of one word (of any number of words of one
 * lane) always changes that lane's final state, not just with high
 * probability. The lanes' finalized states are combined by XOR, one 64-bit
 * half of the hash per state: changes in several lanes cancel only if their
 * 128-bit differences sum to zero, about 2^-128 for independent mixers.
 *
 * KH_FN is the caller's: `static inline` in C, `static __device__
 * __forceinline__` in CUDA.
 */
#ifndef CUINTERPOSE_KEEPHASH_H
#define CUINTERPOSE_KEEPHASH_H

#ifndef KH_FN
#define KH_FN static inline
#endif

#define KH_THREADS 256u
#define KH_CHUNK ((unsigned long long)2 << 20)
#define KH_WORDS (KH_CHUNK / 8)
/* The kernel's entry point: the simulated driver recognizes the shim's
 * module by it. */
#define KH_ENTRY "cuip_keep_hash"

/* The chunks of an allocation of `size` bytes (the last one shorter). */
KH_FN unsigned long long kh_chunks(unsigned long long size)
{
    return (size + KH_CHUNK - 1) / KH_CHUNK;
}

KH_FN unsigned long long kh_mix_a(unsigned long long x)
{
    /* splitmix64's finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

KH_FN unsigned long long kh_mix_b(unsigned long long x)
{
    /* MurmurHash3's fmix64 */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

KH_FN void kh_lane_init(unsigned t, unsigned long long *a, unsigned long long *b)
{
    *a = 0x243f6a8885a308d3ull ^ (unsigned long long)t;
    *b = 0x13198a2e03707344ull ^ ((unsigned long long)t << 32);
}

KH_FN void kh_lane_step(unsigned long long *a, unsigned long long *b, unsigned long long w)
{
    *a = kh_mix_a(*a ^ w);
    *b = kh_mix_b(*b + w);
}

KH_FN void kh_lane_final(unsigned t, unsigned long long *a, unsigned long long *b)
{
    unsigned long long k = (unsigned long long)t + 1;
    *a = kh_mix_a(*a + k * 0x9e3779b97f4a7c15ull);
    *b = kh_mix_b(*b ^ (k * 0xc2b2ae3d27d4eb4full));
}

#endif
