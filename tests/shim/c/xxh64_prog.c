/*
 * shim_c/xxh64.h on argv: for each "LEN:SEED:SPLIT", XXH64 of the LEN bytes
 * i * 131 + 7 (mod 256), fed in pieces of SPLIT bytes (0: zeros fed by
 * xxh64_zeros instead of the bytes), one hex digest a line, for
 * tests/shim/test_stored.py to hold against the reference library.
 */
#include "xxh64.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
    for (int a = 1; a < argc; a++) {
        unsigned long long len, seed, split;
        struct xxh64 h;
        unsigned char *buf;

        if (sscanf(argv[a], "%llu:%llu:%llu", &len, &seed, &split) != 3)
            return 2;
        buf = malloc(len ? len : 1);
        if (!buf)
            return 1;
        for (unsigned long long i = 0; i < len; i++)
            buf[i] = (unsigned char)(i * 131 + 7);
        xxh64_init(&h, seed);
        if (split == 0)
            xxh64_zeros(&h, len);
        for (unsigned long long at = 0; split && at < len; at += split)
            xxh64_update(&h, buf + at, (size_t)(len - at < split ? len - at : split));
        printf("%016" PRIx64 "\n", xxh64_digest(&h));
        free(buf);
    }
    return 0;
}
