/*
 * Staged bytes on storage: STORE_STAGED and FETCH_STAGED (protocol.h,
 * specs/criu.md).
 *
 * When a checkpoint must outlive the processes (the CRIU verbs), the GPU
 * bytes that SAVE_ALLOCATIONS staged in host memory would otherwise go into
 * CRIU's images, written by one CRIU thread (2.3-2.5 GB/s on the H200). The
 * coordinator instead hands each shim open files of the checkpoint directory
 * (descriptors, over the control socket: no path crosses mount namespaces)
 * and the shim writes its staged copies into them with a pool of threads,
 * then frees the host memory they took, before `criu dump`: the images hold
 * only host state. After `criu restore` the coordinator hands the files
 * again and the shim reads the copies back into fresh staging memory;
 * LOAD_ALLOCATIONS then runs as after an in-memory suspend. The copy path of
 * content.c and staging.c is the same either way.
 *
 * Several files, not one: buffered writes to one file serialize on its inode
 * lock (ext4, xfs, tmpfs and overlayfs all take it exclusively), so 16
 * threads writing one file ran at a tenth of what the same storage took from
 * 16 writers into 16 files (1.94 against 20.1 GB/s on the H200). The bytes
 * are one stream striped across the parts (protocol.h), so that even one
 * large allocation spreads over all of them; each writer thread takes a
 * whole part at a time and no two write one file at once. Reads of one file
 * do not serialize: the readers take pieces of any part.
 *
 * The files are hostile input at FETCH: every part is first held to the
 * checkpoint directory's trust rule (a regular file, root's or ours, writable
 * by nobody else: the coordinator checked its name is no link); then its
 * header (magic, version, its index against its place among the
 * descriptors, the part count against their number, the writer's
 * participant id, the dump's identity against the one this shim stored and
 * the one the coordinator expects, the count, the bytes, its stripes, the
 * data offset), every entry of part 0's table against what this shim staged
 * (id, size and stream offset in table order), and every part's exact size
 * are checked before a byte is read into memory; then every stripe's sum is
 * checked as it is read, and a short read fails the op. Nothing changes on
 * any failure: STORE keeps the host copies (the files are the coordinator's
 * to remove), FETCH maps nothing.
 *
 * The sums are XXH64 per stripe: they are there for what goes wrong by
 * accident (a flipped bit on a disk or a network copy, a stripe of an older
 * store put back beside the newer ones: the seed is the identity and the
 * stripe's index), not against someone who may write the files, who could
 * write the sums too; the trust rule keeps that one out. XXH64 is portable C
 * (xxh64.h: no SSE4.2 nor ARMv8 CRC extension to probe for), 64 bits where
 * CRC32C has 32, and one core sums faster than one thread moves a stripe
 * through the page cache (specs/criu.md, "The stored format": measured), so
 * each thread sums the 1 MiB it just moved, while it is in its cache.
 *
 * Both run on the connection's thread with the phase op flag (g.busy) held,
 * in PREPARED only: the application is held and no other op runs. STORE makes
 * no CUDA call and writes no pinned memory (the SAVE zeroed the bounce
 * buffers: staging.c), so the coordinator runs it while the driver locks and
 * checkpoints the process.
 */
#include "shim.h"
#include "xxh64.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define STRIPE ((uint64_t)CUIP_STORED_STRIPE)
#define ERR_LEN 320
/* A piece moves and is summed this many bytes at a time: the sum reads what
 * the copy just touched, from the cache. */
#define SUM_CHUNK ((size_t)1 << 20)

/* CUIP_STORED_NO_SUMS (cmake -DCUINTERPOSE_STORED_NO_SUMS=ON): a measurement build
 * for bench/stored_sums.py only, whose parts hold zero sums and whose FETCH checks
 * none; it says so in every STORE and FETCH log line. */
#ifdef CUIP_STORED_NO_SUMS
#define SUMS 0
#define SUMS_SAID " (a measurement build: no sums)"
#else
#define SUMS 1
#define SUMS_SAID ""
#endif

_Static_assert(CUIP_STORED_STRIPE % CUIP_STORED_ALIGN == 0, "stripes keep the alignment");
_Static_assert(CUIP_STORED_MAX_PARTS <= UINT16_MAX, "a part index fits the header");

/* The identity of the last STORE: FETCH reads back no other dump's parts. Held
 * under g.busy, as the objects' `stored` flags are. */
static uint8_t stored_identity[CUIP_ID_LEN];

/* ------------------------------------------------------------ layout */
struct layout {
    uint32_t count;   /* entries */
    uint32_t parts;
    uint64_t len;     /* the stream's bytes */
    uint64_t stripes; /* the stream's stripes */
};

static uint64_t align_up(uint64_t v)
{
    return (v + CUIP_STORED_ALIGN - 1) / CUIP_STORED_ALIGN * CUIP_STORED_ALIGN;
}

static struct layout layout_of(uint32_t count, uint32_t parts, uint64_t len)
{
    return (struct layout){count, parts, len, (len + STRIPE - 1) / STRIPE};
}

/* The stripes part k holds. */
static uint64_t mine(const struct layout *l, uint32_t k)
{
    return k < l->stripes ? (l->stripes - 1 - k) / l->parts + 1 : 0;
}

/* Where part k's sums start: after its header and, in part 0, the table. */
static uint64_t sums_at(const struct layout *l, uint32_t k)
{
    return sizeof(struct cuip_stored_header) +
           (k == 0 ? (uint64_t)l->count * sizeof(struct cuip_stored_entry) : 0);
}

static uint64_t head_end(const struct layout *l, uint32_t k)
{
    return sums_at(l, k) + mine(l, k) * sizeof(uint64_t);
}

static uint64_t data_offset(const struct layout *l, uint32_t k)
{
    return align_up(head_end(l, k));
}

/* The stream's bytes in part k. */
static uint64_t data_bytes(const struct layout *l, uint32_t k)
{
    uint64_t n = mine(l, k), bytes = n * STRIPE;

    if (!n)
        return 0;
    if ((l->stripes - 1) % l->parts == k)
        bytes -= l->stripes * STRIPE - l->len; /* the stream's last stripe is short */
    return bytes;
}

/* What part k must measure: its header (table, sums) alone, or up to its last
 * stripe's end. */
static uint64_t part_size(const struct layout *l, uint32_t k)
{
    uint64_t bytes = data_bytes(l, k);
    return bytes ? data_offset(l, k) + bytes : head_end(l, k);
}

/* Stripe s's first byte in its part's file. */
static uint64_t stripe_at(const struct layout *l, uint64_t s)
{
    return data_offset(l, (uint32_t)(s % l->parts)) + s / l->parts * STRIPE;
}

/* Each allocation's place in the stream, in table order; the stream's end. */
static uint64_t stream_offsets(struct obj **list, uint32_t count, uint64_t *offsets)
{
    uint64_t at = 0, end = 0;
    for (uint32_t i = 0; i < count; i++) {
        offsets[i] = at;
        end = at + list[i]->size;
        at = align_up(end);
    }
    return end;
}

/* ------------------------------------------------------------ the pool */
/* One pread/pwrite of a stripe's bytes of one allocation, at `at` in `part`. */
struct piece {
    char *host;
    uint64_t at;  /* in the part's file */
    uint64_t pos; /* in the stream */
    size_t len;
    uint32_t part;
};

struct io_pool {
    const int *fds;             /* part k's file: fds[k] */
    struct layout l;
    bool writing;
    const uint8_t *identity;    /* the dump's: the sums' seed */
    struct piece *pieces;       /* part by part, each in stream order */
    size_t *first;              /* part k's pieces: first[k] up to first[k + 1] */
    size_t *stripe_first;       /* stripe s's pieces: stripe_first[s] up to stripe_end[s] */
    size_t *stripe_end;
    uint64_t *sums;             /* stripe s's: computed (STORE) or recorded (FETCH) */
    size_t count;
    size_t next;                /* atomic: the next part (writing) or stripe (reading) */
    int failed;                 /* atomic: set once, by the first error */
    char err[ERR_LEN];          /* written only by the thread that set `failed` */
};

static bool io_claim(struct io_pool *p)
{
    int expect = 0;
    return __atomic_compare_exchange_n(&p->failed, &expect, 1, false, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

static void io_fail(struct io_pool *p, const struct piece *pc, const char *what, int e)
{
    if (!io_claim(p))
        return;
    snprintf(p->err, sizeof p->err, "part %u: %s of %zu bytes at file offset %llu failed: %s",
             pc->part, what, pc->len, (unsigned long long)pc->at,
             e ? strerror(e) : "end of file");
}

static bool io_failed(struct io_pool *p)
{
    return __atomic_load_n(&p->failed, __ATOMIC_ACQUIRE) != 0;
}

static int full_pio(int fd, void *buf, size_t len, uint64_t at, bool writing)
{
    size_t done = 0;
    while (done < len) {
        ssize_t n = writing ? pwrite(fd, (char *)buf + done, len - done, (off_t)(at + done))
                            : pread(fd, (char *)buf + done, len - done, (off_t)(at + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            if (n == 0)
                errno = 0;
            return -1;
        }
        done += (size_t)n;
    }
    return 0;
}

/* One piece moved and summed, SUM_CHUNK bytes at a time: summed before it is
 * written, after it is read. */
static int io_piece(struct io_pool *p, const struct piece *pc, struct xxh64 *h)
{
    int fd = p->fds[pc->part];

    for (size_t off = 0; off < pc->len;) {
        size_t n = pc->len - off < SUM_CHUNK ? pc->len - off : SUM_CHUNK;
        if (SUMS && p->writing)
            xxh64_update(h, pc->host + off, n);
        if (full_pio(fd, pc->host + off, n, pc->at + off, p->writing) != 0) {
            io_fail(p, pc, p->writing ? "pwrite" : "pread", errno);
            return -1;
        }
        if (SUMS && !p->writing)
            xxh64_update(h, pc->host + off, n);
        off += n;
    }
    return 0;
}

/* Stripe s moved; its sum kept (writing) or checked against the part's. */
static void io_stripe(struct io_pool *p, uint64_t s)
{
    uint64_t pos = s * STRIPE, end = (s + 1) * STRIPE < p->l.len ? (s + 1) * STRIPE : p->l.len;
    uint64_t sum;
    struct xxh64 h;

    xxh64_init(&h, cuip_stored_seed(p->identity, s));
    for (size_t i = p->stripe_first[s]; i < p->stripe_end[s]; i++) {
        const struct piece *pc = &p->pieces[i];
        if (SUMS)
            xxh64_zeros(&h, pc->pos - pos); /* an alignment gap: zeros in the file */
        if (io_piece(p, pc, &h) != 0)
            return;
        pos = pc->pos + pc->len;
    }
    if (SUMS)
        xxh64_zeros(&h, end - pos);
    sum = SUMS ? xxh64_digest(&h) : 0;
    if (p->writing) {
        p->sums[s] = sum;
    } else if (sum != p->sums[s] && io_claim(p)) {
        snprintf(p->err, sizeof p->err, "part %u: stripe %llu (file offset %llu, %llu bytes): "
                 "its bytes sum to %016llx, the part records %016llx: they changed since "
                 "they were stored", (unsigned)(s % p->l.parts), (unsigned long long)s,
                 (unsigned long long)stripe_at(&p->l, s), (unsigned long long)(end - s * STRIPE),
                 (unsigned long long)sum, (unsigned long long)p->sums[s]);
    }
}

/* Part k's sums written after its stripes: its stripes in order. */
static void io_sums(struct io_pool *p, uint32_t k)
{
    uint64_t n = mine(&p->l, k), *out = calloc(n ? n : 1, sizeof *out);
    struct piece where = {.at = sums_at(&p->l, k), .len = (size_t)(n * sizeof *out), .part = k};

    if (!out) {
        if (io_claim(p))
            snprintf(p->err, sizeof p->err, "part %u: out of memory for its sums", k);
        return;
    }
    for (uint64_t i = 0; i < n; i++)
        out[i] = p->sums[k + i * p->l.parts];
    if (n && full_pio(p->fds[k], out, where.len, where.at, true) != 0)
        io_fail(p, &where, "pwrite of the sums", errno);
    free(out);
}

/* Writing, a thread takes a whole part (one writer per file: the inode lock)
 * and writes its sums last; reading, any stripe of any part. */
static void *io_worker(void *arg)
{
    struct io_pool *p = arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (io_failed(p) || i >= (p->writing ? p->l.parts : p->l.stripes))
            return NULL;
        if (!p->writing) {
            io_stripe(p, i);
            continue;
        }
        for (uint64_t s = i; s < p->l.stripes && !io_failed(p); s += p->l.parts)
            io_stripe(p, s);
        if (!io_failed(p))
            io_sums(p, (uint32_t)i);
    }
}

/* Every stripe, by up to SNAPSHOT_SHIM_COPY_THREADS threads (at most one per
 * part when writing); 0, or -1 and the first error. */
static int io_run(struct io_pool *p, char *msg, size_t n)
{
    size_t want = shim_settings()->copy_threads;
    size_t work = p->writing ? p->l.parts : (size_t)p->l.stripes;
    unsigned started = 0;
    pthread_t tids[64];
    sigset_t all, old;

    if (want > work)
        want = work;
    if (want > sizeof tids / sizeof *tids)
        want = sizeof tids / sizeof *tids;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; started + 1 < want; started++) /* the caller is the last worker */
        if (pthread_create(&tids[started], NULL, io_worker, p) != 0)
            break; /* fewer threads: the work is shared, the caller works too */
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    io_worker(p);
    for (unsigned i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    if (p->failed) {
        snprintf(msg, n, "%s", p->err);
        return -1;
    }
    return 0;
}

/* The objects whose copies move: `stored` false: staged in host memory now
 * (STORE); true: in the files (FETCH). In table order. */
static struct obj **moving(bool stored, uint32_t *count, uint64_t *bytes)
{
    struct obj **list = calloc(obj_count() ? obj_count() : 1, sizeof *list);
    *count = 0;
    *bytes = 0;
    if (!list)
        return NULL;
    for (uint32_t i = 0; i < obj_count(); i++) {
        struct obj *o = obj_at(i);
        if (!o || !obj_staged(o) || o->live)
            continue;
        if (stored ? o->stored : o->host != NULL) {
            list[(*count)++] = o;
            *bytes += o->size;
        }
    }
    return list;
}

/* The pieces of every copy, each within one stripe: counted per part into
 * fill[] (out NULL), or placed at out[fill[part]++]. */
static void walk(const struct layout *l, struct obj **list, char *const *hosts,
                 const uint64_t *offsets, struct piece *out, size_t *fill)
{
    for (uint32_t i = 0; i < l->count; i++) {
        for (uint64_t off = 0; off < list[i]->size;) {
            uint64_t pos = offsets[i] + off, s = pos / STRIPE;
            uint64_t room = (s + 1) * STRIPE - pos, left = list[i]->size - off;
            size_t len = (size_t)(left < room ? left : room);
            uint32_t part = (uint32_t)(s % l->parts);

            if (out)
                out[fill[part]] = (struct piece){hosts[i] + off,
                                                 stripe_at(l, s) + pos % STRIPE, pos, len, part};
            fill[part]++;
            off += len;
        }
    }
}

/* The pool's pieces, part by part, and each stripe's among them; 0, or -1 out
 * of memory. */
static int cut(struct io_pool *p, struct obj **list, char *const *hosts, const uint64_t *offsets)
{
    size_t *fill = calloc(p->l.parts + 1, sizeof *fill), stripes = (size_t)p->l.stripes;

    p->first = calloc(p->l.parts + 1, sizeof *p->first);
    p->stripe_first = calloc(stripes ? stripes : 1, sizeof *p->stripe_first);
    p->stripe_end = calloc(stripes ? stripes : 1, sizeof *p->stripe_end);
    if (!p->sums)
        p->sums = calloc(stripes ? stripes : 1, sizeof *p->sums);
    if (!fill || !p->first || !p->stripe_first || !p->stripe_end || !p->sums)
        goto fail;
    walk(&p->l, list, hosts, offsets, NULL, fill);
    for (uint32_t k = 0; k < p->l.parts; k++) {
        p->first[k + 1] = p->first[k] + fill[k];
        fill[k] = p->first[k];
    }
    p->count = p->first[p->l.parts];
    p->pieces = calloc(p->count ? p->count : 1, sizeof *p->pieces);
    if (!p->pieces)
        goto fail;
    walk(&p->l, list, hosts, offsets, p->pieces, fill);
    for (size_t i = 0; i < p->count; i++) { /* a stripe's pieces lie together */
        uint64_t s = p->pieces[i].pos / STRIPE;
        if (p->stripe_end[s] == 0)
            p->stripe_first[s] = i;
        p->stripe_end[s] = i + 1;
    }
    free(fill);
    return 0;
fail:
    free(fill);
    return -1;
}

static void pool_free(struct io_pool *p)
{
    free(p->pieces);
    free(p->first);
    free(p->stripe_first);
    free(p->stripe_end);
    free(p->sums);
}

static void name_id(char out[2 * CUIP_ID_LEN + 1], const uint8_t *id)
{
    shim_hex(out, id, CUIP_ID_LEN);
    out[2 * CUIP_ID_LEN] = 0;
}

/* ------------------------------------------------------------ STORE */
/* Every descriptor an empty regular file, no two the same file. */
static int check_empty(struct reply *r, const struct request_fds *fds)
{
    struct stat st[CUIP_STORED_MAX_PARTS];

    for (unsigned k = 0; k < fds->n; k++) {
        if (fstat(fds->fd[k], &st[k]) != 0 || !S_ISREG(st[k].st_mode) || st[k].st_size != 0) {
            reply_msg(r, CUIP_STATUS_REFUSED, "STORE_STAGED: part %u: the descriptor handed "
                      "is not an empty regular file", k);
            return -1;
        }
        for (unsigned j = 0; j < k; j++) {
            if (st[j].st_dev == st[k].st_dev && st[j].st_ino == st[k].st_ino) {
                reply_msg(r, CUIP_STATUS_REFUSED, "STORE_STAGED: part %u is the same file as "
                          "part %u", k, j);
                return -1;
            }
        }
    }
    return 0;
}

/* Every part's header (part 0's with the table after it) and its final size;
 * the sums are written after the stripes. */
static int write_heads(struct reply *r, const struct request_fds *fds, const struct layout *l,
                       struct cuip_stored_header *h)
{
    for (uint32_t k = 0; k < fds->n; k++) {
        uint64_t size = part_size(l, k);
        h->part = (uint16_t)k;
        h->stripes = mine(l, k);
        h->data_offset = data_offset(l, k);
        if (full_pio(fds->fd[k], h, (size_t)sums_at(l, k), 0, true) != 0 ||
            ftruncate(fds->fd[k], (off_t)size) != 0) {
            reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: part %u: writing its header or "
                      "setting its size (%llu bytes) failed: %s; the staged bytes stay in "
                      "memory", k, (unsigned long long)size,
                      errno ? strerror(errno) : "no progress");
            return -1;
        }
    }
    return 0;
}

/* Refused when a staged copy is stored already or gone. */
static int check_staged(struct reply *r)
{
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        char id[2 * CUIP_ID_LEN + 1];
        if (!o || !obj_staged(o) || o->live || o->host)
            continue;
        name_id(id, o->id);
        reply_msg(r, CUIP_STATUS_REFUSED, "STORE_STAGED: allocation %s's staged bytes are %s",
                  id, o->stored ? "stored already (FETCH_STAGED first)" : "gone");
        return -1;
    }
    return 0;
}

static void store(struct reply *r, const uint8_t *identity, const struct request_fds *fds)
{
    struct obj **list = NULL;
    uint32_t count = 0;
    uint64_t bytes = 0, t0 = shim_now_ns(), *offsets = NULL;
    struct cuip_stored_header *h = NULL;
    struct cuip_stored_entry *e;
    char **hosts = NULL;
    struct io_pool pool = {.fds = fds->fd, .writing = true, .identity = identity};
    char msg[ERR_LEN];

    if (check_staged(r) != 0 || check_empty(r, fds) != 0)
        return;
    list = moving(false, &count, &bytes);
    pool.l = layout_of(count, fds->n, 0);
    h = calloc(1, (size_t)sums_at(&pool.l, 0));
    hosts = calloc(count ? count : 1, sizeof *hosts);
    offsets = calloc(count ? count : 1, sizeof *offsets);
    if (!list || !h || !hosts || !offsets)
        goto oom;
    pool.l = layout_of(count, fds->n, stream_offsets(list, count, offsets));
    *h = (struct cuip_stored_header){.magic = CUIP_STORED_MAGIC,
                                     .version = CUIP_STORED_VERSION,
                                     .count = count,
                                     .parts = (uint16_t)fds->n,
                                     .bytes = bytes};
    memcpy(h->participant, g.participant, CUIP_PARTICIPANT_LEN);
    memcpy(h->identity, identity, CUIP_ID_LEN);
    e = (struct cuip_stored_entry *)(h + 1);
    for (uint32_t i = 0; i < count; i++) {
        memcpy(e[i].id, list[i]->id, CUIP_ID_LEN);
        e[i].size = list[i]->size;
        e[i].offset = offsets[i];
        hosts[i] = list[i]->host;
    }
    if (cut(&pool, list, hosts, offsets) != 0)
        goto oom;
    if (write_heads(r, fds, &pool.l, h) != 0)
        goto out;
    if (io_run(&pool, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: %s; the staged bytes stay in memory",
                  msg);
        goto out;
    }
    for (uint32_t i = 0; i < count; i++)
        list[i]->stored = true;
    memcpy(stored_identity, identity, CUIP_ID_LEN);
    content_free_staged(); /* every staged copy was in `list` */
    content_drop_resident();
    r->h.status = CUIP_STATUS_OK;
    r->h.stat_count = count;
    r->h.stat_bytes = bytes;
    r->h.stat_copy_ns = shim_now_ns() - t0;
    shim_log(LOG_INFO, "STORE_STAGED: %u allocations, %llu bytes in %u files in %.3f s%s",
             count, (unsigned long long)bytes, fds->n, (double)r->h.stat_copy_ns / 1e9,
             SUMS_SAID);
    goto out;
oom:
    reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: out of memory for %u allocations", count);
out:
    pool_free(&pool);
    free(offsets);
    free(hosts);
    free(h);
    free(list);
}

/* ------------------------------------------------------------ FETCH */
static int differs(struct reply *r, uint32_t k, const char *field, uint64_t got, uint64_t want)
{
    if (got == want)
        return 0;
    reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: its %s is %llu, expected %llu",
              k, field, (unsigned long long)got, (unsigned long long)want);
    return -1;
}

/* Part k held to the checkpoint directory's rule, before a byte of it is read:
 * a regular file, root's or ours, writable by nobody else. */
static int check_trust(struct reply *r, int fd, uint32_t k, struct stat *st)
{
    const char *why = NULL;

    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the descriptor handed is "
                  "not a regular file", k);
        return -1;
    }
    if (!shim_trusted_uid(st->st_uid))
        why = "is owned by another user than root or this process's";
    else if (st->st_mode & (S_IWGRP | S_IWOTH))
        why = "is writable by group or others";
    if (!why)
        return 0;
    reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the file %s (uid %d, mode %04o): "
              "not trusted, nothing of it was read", k, why, (int)st->st_uid,
              (unsigned)(st->st_mode & 07777));
    return -1;
}

/* Part k's header against what this shim stored and the parts handed. */
static int check_head(struct reply *r, const struct request_fds *fds, uint32_t k,
                      const struct layout *l, uint64_t bytes)
{
    struct stat st;
    struct cuip_stored_header h;
    char got[2 * CUIP_ID_LEN + 1], want[2 * CUIP_ID_LEN + 1];

    if (check_trust(r, fds->fd[k], k, &st) != 0)
        return -1;
    if ((uint64_t)st.st_size < sizeof h || full_pio(fds->fd[k], &h, sizeof h, 0, false) != 0) {
        if ((uint64_t)st.st_size >= 8 && full_pio(fds->fd[k], &h, 8, 0, false) == 0 &&
            h.magic == CUIP_STORED_MAGIC && h.version != CUIP_STORED_VERSION)
            goto version;
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the file is shorter than its "
                  "header (%lld bytes)", k, (long long)st.st_size);
        return -1;
    }
    if (h.magic != CUIP_STORED_MAGIC) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: not a stored file (magic "
                  "%#x)", k, h.magic);
        return -1;
    }
    if (h.version != CUIP_STORED_VERSION)
        goto version;
    if (differs(r, k, "part index (the parts are handed in order)", h.part, k) ||
        differs(r, k, "part count (the files handed)", h.parts, fds->n))
        return -1;
    if (memcmp(h.participant, g.participant, CUIP_PARTICIPANT_LEN) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the file was written by "
                  "participant %.32s, not this one (%s)", k, h.participant, g.participant);
        return -1;
    }
    if (memcmp(h.identity, stored_identity, CUIP_ID_LEN) != 0) {
        name_id(got, h.identity);
        name_id(want, stored_identity);
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the file is of dump %s, not "
                  "of dump %s, the one this process stored last (an earlier store's part?)",
                  k, got, want);
        return -1;
    }
    if (differs(r, k, "allocation count (this process stored)", h.count, l->count) ||
        differs(r, k, "byte count (this process stored)", h.bytes, bytes) ||
        differs(r, k, "stripe count", h.stripes, mine(l, k)) ||
        differs(r, k, "data offset", h.data_offset, data_offset(l, k)))
        return -1;
    return 0;
version:
    reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: stored format version %u, this "
              "shim reads version %u only (version 2 carries no dump identity and no sums): "
              "fetch it with the cuinterpose that stored it", k, h.version,
              CUIP_STORED_VERSION);
    return -1;
}

/* Part 0's table against `list`, each entry at the offset the layout gives. */
static int check_table(struct reply *r, int fd, struct obj **list, const struct layout *l,
                       const uint64_t *offsets)
{
    struct cuip_stored_entry *e = calloc(l->count ? l->count : 1, sizeof *e);
    char id[2 * CUIP_ID_LEN + 1];
    int rc = -1;

    if (!e) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory for %u entries",
                  l->count);
        return -1;
    }
    if (full_pio(fd, e, (size_t)l->count * sizeof *e, sizeof(struct cuip_stored_header),
                 false)) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part 0: the file's table is cut "
                  "short");
        goto out;
    }
    for (uint32_t i = 0; i < l->count; i++) {
        if (memcmp(e[i].id, list[i]->id, CUIP_ID_LEN) != 0 || e[i].size != list[i]->size ||
            e[i].offset != offsets[i]) {
            name_id(id, list[i]->id);
            reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part 0: entry %u of the table is "
                      "not allocation %s of %llu bytes at stream offset %llu", i, id,
                      (unsigned long long)list[i]->size, (unsigned long long)offsets[i]);
            goto out;
        }
    }
    rc = 0;
out:
    free(e);
    return rc;
}

/* Part k's recorded sums into sums[] at its stripes. */
static int read_sums(struct reply *r, int fd, uint32_t k, const struct layout *l,
                     uint64_t *sums)
{
    uint64_t n = mine(l, k), *in = calloc(n ? n : 1, sizeof *in);
    int rc = -1;

    if (!in) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory for part %u's sums", k);
        return -1;
    }
    if (full_pio(fd, in, (size_t)(n * sizeof *in), sums_at(l, k), false) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: its sums are cut short", k);
        goto out;
    }
    for (uint64_t i = 0; i < n; i++)
        sums[k + i * l->parts] = in[i];
    rc = 0;
out:
    free(in);
    return rc;
}

/* Every part's trust and header, the table, every part's size, then the sums
 * (into p->sums): 0, or -1 and the reply says which part, which field and
 * both values. */
static int check_parts(struct reply *r, const struct request_fds *fds, struct obj **list,
                       struct io_pool *p, uint64_t bytes, const uint64_t *offsets)
{
    for (uint32_t k = 0; k < fds->n; k++)
        if (check_head(r, fds, k, &p->l, bytes) != 0)
            return -1;
    if (check_table(r, fds->fd[0], list, &p->l, offsets) != 0)
        return -1;
    for (uint32_t k = 0; k < fds->n; k++) {
        struct stat st;
        uint64_t want = part_size(&p->l, k);
        if (fstat(fds->fd[k], &st) != 0 || (uint64_t)st.st_size != want) {
            reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: part %u: the file has %lld bytes, "
                      "the layout says %llu", k, (long long)st.st_size,
                      (unsigned long long)want);
            return -1;
        }
    }
    p->sums = calloc(p->l.stripes ? (size_t)p->l.stripes : 1, sizeof *p->sums);
    if (!p->sums) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory for the sums");
        return -1;
    }
    for (uint32_t k = 0; k < fds->n; k++)
        if (read_sums(r, fds->fd[k], k, &p->l, p->sums) != 0)
            return -1;
    return 0;
}

/* The dump the coordinator names is the one this shim stored. */
static int check_identity(struct reply *r, const uint8_t *identity)
{
    char got[2 * CUIP_ID_LEN + 1], want[2 * CUIP_ID_LEN + 1];

    if (memcmp(identity, stored_identity, CUIP_ID_LEN) == 0)
        return 0;
    name_id(got, identity);
    name_id(want, stored_identity);
    reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the coordinator asks for the parts of "
              "dump %s; this process stored dump %s", got, want);
    return -1;
}

static void fetch(struct reply *r, const uint8_t *identity, const struct request_fds *fds)
{
    struct obj **list;
    uint32_t count = 0;
    uint64_t bytes = 0, t0 = shim_now_ns(), *offsets = NULL;
    size_t arena_len = 0, off = 0;
    char *arena = NULL, **hosts = NULL;
    struct io_pool pool = {.fds = fds->fd, .identity = identity};
    char msg[ERR_LEN];

    list = moving(true, &count, &bytes);
    if (!list) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        return;
    }
    if (count == 0) {
        /* Nothing of this process is in files (never stored, or fetched already):
         * nothing to read, the files are not looked at. The resume fetches whenever
         * the checkpoint directory holds files, whichever suspend wrote them. */
        r->h.status = CUIP_STATUS_OK;
        goto out;
    }
    if (check_identity(r, identity) != 0)
        goto out;
    offsets = calloc(count, sizeof *offsets);
    hosts = calloc(count, sizeof *hosts);
    if (!offsets || !hosts) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        goto out;
    }
    pool.l = layout_of(count, fds->n, stream_offsets(list, count, offsets));
    if (check_parts(r, fds, list, &pool, bytes, offsets) != 0)
        goto out;
    for (uint32_t i = 0; i < count; i++)
        arena_len += staging_len(list[i]->size);
    arena = staging_alloc(arena_len, msg, sizeof msg);
    if (!arena) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: %s", msg);
        goto out;
    }
    for (uint32_t i = 0; i < count; i++) {
        hosts[i] = arena + off;
        off += staging_len(list[i]->size);
    }
    if (cut(&pool, list, hosts, offsets) != 0) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        goto fail_arena;
    }
    if (io_run(&pool, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: %s", msg);
        goto fail_arena;
    }
    for (uint32_t i = 0; i < count; i++) {
        list[i]->host = hosts[i];
        list[i]->host_len = staging_len(list[i]->size);
        list[i]->stored = false;
    }
    r->h.status = CUIP_STATUS_OK;
    r->h.stat_count = count;
    r->h.stat_bytes = bytes;
    r->h.stat_copy_ns = shim_now_ns() - t0;
    shim_log(LOG_INFO, "FETCH_STAGED: %u allocations, %llu bytes from %u files in %.3f s%s",
             count, (unsigned long long)bytes, fds->n, (double)r->h.stat_copy_ns / 1e9,
             SUMS_SAID);
    goto out;
fail_arena:
    if (munmap(arena, arena_len) != 0)
        shim_log(LOG_WARN, "munmap of staging memory failed: %s", strerror(errno));
out:
    pool_free(&pool);
    free(hosts);
    free(offsets);
    free(list);
}

void stored_serve(const struct cuip_header *q, const struct request_fds *fds, struct reply *r)
{
    uint16_t op = q->op;
    uint8_t identity[CUIP_ID_LEN];

    memcpy(identity, q->resource_id, CUIP_ID_LEN);
    pthread_mutex_lock(&g.lock);
    if (g.busy) {
        reply_msg(r, CUIP_STATUS_REFUSED, "another phase op is running");
        pthread_mutex_unlock(&g.lock);
        return;
    }
    if (!cuip_op_served_in(op, g.phase)) {
        reply_msg(r, CUIP_STATUS_WRONG_PHASE, "%s is not served in phase %u", cuip_op_name(op),
                  g.phase);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    if (fds->n == 0 || fds->too_many) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s must carry 1 to %u file descriptors "
                  "(SCM_RIGHTS), the parts in order; it carried %s", cuip_op_name(op),
                  CUIP_STORED_MAX_PARTS, fds->too_many ? "more" : "none");
        pthread_mutex_unlock(&g.lock);
        return;
    }
    if (shim_is_zero(identity, CUIP_ID_LEN)) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s must name the dump (its identity, in "
                  "resource_id); it named none", cuip_op_name(op));
        pthread_mutex_unlock(&g.lock);
        return;
    }
    g.busy = true;
    g.op_in_flight = op;
    g.op_started_ns = shim_now_ns();
    pthread_mutex_unlock(&g.lock);
    content_settle(); /* FETCH maps staging memory: not beside a LOAD's release */
    if (op == CUIP_OP_STORE_STAGED)
        store(r, identity, fds);
    else
        fetch(r, identity, fds);
    pthread_mutex_lock(&g.lock);
    g.busy = false;
    g.op_in_flight = 0;
    pthread_mutex_unlock(&g.lock);
}
