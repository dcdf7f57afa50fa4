/*
 * The kept host copy's chunk hash on the GPU (keephash.h defines it). One
 * block of KH_THREADS threads per chunk: thread t folds words t,
 * t + KH_THREADS, ... (a warp reads 256 consecutive bytes at a time), the
 * block XORs its threads' finalized states, thread 0 writes the chunk's two
 * words. Launched by the shim (shim_c/keep.c) with blockDim.x = KH_THREADS and
 * one block per chunk of the allocation; `words` is the allocation's size
 * / 8, `out` two words per chunk.
 *
 * The shim carries the PTX of this file (keep_hash_ptx.h, made by
 * tools/gen_keep_hash_ptx.sh; tests/shim/test_keep_hash.py checks it is current
 * where nvcc is found).
 */
#define KH_FN static __device__ __forceinline__
#include "../keephash.h"

extern "C" __global__ void __launch_bounds__(KH_THREADS)
    cuip_keep_hash(const unsigned long long *__restrict__ base, unsigned long long words,
                   unsigned long long *__restrict__ out)
{
    __shared__ unsigned long long sa[KH_THREADS / 32], sb[KH_THREADS / 32];
    unsigned t = threadIdx.x;
    unsigned long long chunk = blockIdx.x;
    unsigned long long first = chunk * KH_WORDS;
    unsigned long long n = words - first < KH_WORDS ? words - first : KH_WORDS;
    const unsigned long long *p = base + first;
    unsigned long long a, b;

    kh_lane_init(t, &a, &b);
    for (unsigned long long i = t; i < n; i += KH_THREADS)
        kh_lane_step(&a, &b, p[i]);
    kh_lane_final(t, &a, &b);
    for (int d = 16; d > 0; d >>= 1) {
        a ^= __shfl_xor_sync(0xffffffffu, a, d);
        b ^= __shfl_xor_sync(0xffffffffu, b, d);
    }
    if ((t & 31u) == 0) {
        sa[t >> 5] = a;
        sb[t >> 5] = b;
    }
    __syncthreads();
    if (t == 0) {
        for (unsigned k = 1; k < KH_THREADS / 32; k++) {
            a ^= sa[k];
            b ^= sb[k];
        }
        out[2 * chunk] = a;
        out[2 * chunk + 1] = b;
    }
}
