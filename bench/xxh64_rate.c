/*
 * One core's XXH64 rate (shim_c/xxh64.h, the stored parts' stripe sums) over an
 * 8 MiB stripe in memory, summed 1 MiB at a time as stored.c does:
 *
 *   cc -O2 -I shim_c bench/xxh64_rate.c -o /tmp/xxh64_rate && /tmp/xxh64_rate [GiB]
 */
#include "xxh64.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv)
{
    double gib = argc > 1 ? atof(argv[1]) : 4.0;
    size_t stripe = (size_t)8 << 20, chunk = (size_t)1 << 20;
    unsigned char *buf = malloc(stripe);
    uint64_t total = (uint64_t)(gib * (1 << 30)), done = 0, sink = 0;
    struct timespec a, b;

    if (!buf)
        return 1;
    for (size_t i = 0; i < stripe; i++)
        buf[i] = (unsigned char)(i * 2654435761u >> 13);
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (uint64_t s = 0; done < total; s++, done += stripe) {
        struct xxh64 h;
        xxh64_init(&h, s);
        for (size_t off = 0; off < stripe; off += chunk)
            xxh64_update(&h, buf + off, chunk);
        sink ^= xxh64_digest(&h);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double sec = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    printf("xxh64: %.2f GB/s on one core (%.2f GiB in %.3f s; %016llx)\n",
           (double)done / sec / 1e9, (double)done / (1 << 30), sec, (unsigned long long)sink);
    free(buf);
    return 0;
}
