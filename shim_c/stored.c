/*
 * Staged bytes on storage: STORE_STAGED and FETCH_STAGED (protocol.h,
 * specs/criu.md).
 *
 * When a checkpoint must outlive the processes (the CRIU verbs), the GPU
 * bytes that SAVE_ALLOCATIONS staged in host memory would otherwise go into
 * CRIU's images, written by one CRIU thread (2.3-2.5 GB/s on the H200). The
 * coordinator instead hands each shim an open file in the checkpoint
 * directory (a descriptor, over the control socket: no path crosses mount
 * namespaces) and the shim writes its staged copies into it with a pool of
 * threads, then frees the host memory they took, before `criu dump`: the
 * images hold only host state. After `criu restore` the coordinator hands the
 * file again and the shim reads the copies back into fresh staging memory;
 * LOAD_ALLOCATIONS then runs as after an in-memory suspend. The copy path of
 * content.c and staging.c is the same either way.
 *
 * The file is hostile input at FETCH: every field of the header and of every
 * entry is checked against what this shim staged (the writer's participant
 * id, the count, each allocation's id, size and offset in table order, the
 * file's size) before a byte is read into memory, and a short read fails
 * the op. Nothing changes on any failure: STORE keeps the host copies (the
 * file is the coordinator's to remove), FETCH maps nothing.
 *
 * Both run on the connection's thread with the phase op flag (g.busy) held,
 * in PREPARED only: the application is held and no other op runs.
 */
#include "shim.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PIECE ((size_t)64 << 20)
#define ERR_LEN 256

/* One pread/pwrite of at most PIECE bytes. */
struct piece {
    char *host;
    uint64_t at;
    size_t len;
};

struct io_pool {
    int fd;
    bool writing;
    struct piece *pieces;
    uint32_t count;
    uint32_t next;              /* atomic */
    int failed;                 /* atomic: set once, by the first error */
    char err[ERR_LEN];          /* written only by the thread that set `failed` */
};

static void io_fail(struct io_pool *p, const struct piece *pc, const char *what, int e)
{
    int expect = 0;
    if (!__atomic_compare_exchange_n(&p->failed, &expect, 1, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return;
    snprintf(p->err, sizeof p->err, "%s of %zu bytes at file offset %llu failed: %s", what,
             pc->len, (unsigned long long)pc->at, e ? strerror(e) : "end of file");
}

static void io_piece(struct io_pool *p, const struct piece *pc)
{
    size_t done = 0;

    while (done < pc->len) {
        ssize_t n = p->writing
                        ? pwrite(p->fd, pc->host + done, pc->len - done, (off_t)(pc->at + done))
                        : pread(p->fd, pc->host + done, pc->len - done, (off_t)(pc->at + done));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            io_fail(p, pc, p->writing ? "pwrite" : "pread", n < 0 ? errno : 0);
            return;
        }
        done += (size_t)n;
    }
}

static void *io_worker(void *arg)
{
    struct io_pool *p = arg;
    for (;;) {
        uint32_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= p->count || __atomic_load_n(&p->failed, __ATOMIC_ACQUIRE))
            return NULL;
        io_piece(p, &p->pieces[i]);
    }
}

/* Every piece, by up to SNAPSHOT_SHIM_COPY_THREADS threads (page cache or
 * storage: both take parallel writers); 0, or -1 and the first error. */
static int io_run(struct io_pool *p, char *msg, size_t n)
{
    unsigned want = shim_settings()->copy_threads, started = 0;
    pthread_t tids[64];
    sigset_t all, old;

    if (want > p->count)
        want = p->count;
    if (want > sizeof tids / sizeof *tids)
        want = sizeof tids / sizeof *tids;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; started < want; started++)
        if (pthread_create(&tids[started], NULL, io_worker, p) != 0)
            break; /* fewer threads: the pieces are shared, the caller works too */
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

static uint64_t align_up(uint64_t v)
{
    return (v + CUIP_STORED_ALIGN - 1) / CUIP_STORED_ALIGN * CUIP_STORED_ALIGN;
}

/* The objects whose copies move: `stored` false: staged in host memory now
 * (STORE); true: in the file (FETCH). In table order. */
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

/* Pieces of each object's copy at its offset in the file. */
static struct piece *cut(struct obj **list, uint32_t count, char *const *hosts,
                         uint64_t data_offset, uint32_t *npieces)
{
    uint64_t at = data_offset, total = 0;
    struct piece *pcs;
    uint32_t k = 0;

    for (uint32_t i = 0; i < count; i++)
        total += (list[i]->size + PIECE - 1) / PIECE;
    pcs = calloc(total ? total : 1, sizeof *pcs);
    if (!pcs)
        return NULL;
    for (uint32_t i = 0; i < count; i++) {
        for (uint64_t off = 0; off < list[i]->size; off += PIECE) {
            size_t len = list[i]->size - off < PIECE ? (size_t)(list[i]->size - off) : PIECE;
            pcs[k++] = (struct piece){hosts[i] + off, at + off, len};
        }
        at = align_up(at + list[i]->size);
    }
    *npieces = k;
    return pcs;
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

static void name_id(char out[2 * CUIP_ID_LEN + 1], const uint8_t *id)
{
    shim_hex(out, id, CUIP_ID_LEN);
    out[2 * CUIP_ID_LEN] = 0;
}

/* ------------------------------------------------------------ STORE */
static void store(struct reply *r, int fd)
{
    struct stat st;
    struct obj **list;
    uint32_t count = 0, npieces = 0;
    uint64_t bytes = 0, t0 = shim_now_ns();
    struct cuip_stored_header *h = NULL;
    size_t table;
    char **hosts = NULL;
    struct piece *pcs = NULL;
    struct io_pool pool;
    char msg[ERR_LEN];

    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        char id[2 * CUIP_ID_LEN + 1];
        if (!o || !obj_staged(o) || o->live || o->host)
            continue;
        name_id(id, o->id);
        reply_msg(r, CUIP_STATUS_REFUSED, "STORE_STAGED: allocation %s's staged bytes are %s",
                  id, o->stored ? "stored already (FETCH_STAGED first)" : "gone");
        return;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "STORE_STAGED: the descriptor handed is not an "
                  "empty regular file");
        return;
    }
    list = moving(false, &count, &bytes);
    table = sizeof *h + (size_t)count * sizeof(struct cuip_stored_entry);
    h = calloc(1, table);
    hosts = calloc(count ? count : 1, sizeof *hosts);
    if (!list || !h || !hosts)
        goto oom;
    h->magic = CUIP_STORED_MAGIC;
    h->version = CUIP_STORED_VERSION;
    h->count = count;
    h->bytes = bytes;
    h->data_offset = align_up(table);
    memcpy(h->participant, g.participant, CUIP_PARTICIPANT_LEN);
    {
        struct cuip_stored_entry *e = (struct cuip_stored_entry *)(h + 1);
        uint64_t at = h->data_offset;
        for (uint32_t i = 0; i < count; i++) {
            memcpy(e[i].id, list[i]->id, CUIP_ID_LEN);
            e[i].size = list[i]->size;
            e[i].offset = at;
            at = align_up(at + list[i]->size);
            hosts[i] = list[i]->host;
        }
    }
    pcs = cut(list, count, hosts, h->data_offset, &npieces);
    if (!pcs)
        goto oom;
    if (full_pio(fd, h, table, 0, true) != 0) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: writing the file's table failed: %s; "
                  "the staged bytes stay in memory", errno ? strerror(errno) : "no progress");
        goto out;
    }
    memset(&pool, 0, sizeof pool);
    pool.fd = fd;
    pool.writing = true;
    pool.pieces = pcs;
    pool.count = npieces;
    if (io_run(&pool, msg, sizeof msg) != 0) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: %s; the staged bytes stay in memory",
                  msg);
        goto out;
    }
    for (uint32_t i = 0; i < count; i++)
        list[i]->stored = true;
    content_free_staged(); /* every staged copy was in `list` */
    content_drop_resident();
    staging_scrub_bounces();
    r->h.status = CUIP_STATUS_OK;
    r->h.stat_count = count;
    r->h.stat_bytes = bytes;
    r->h.stat_copy_ns = shim_now_ns() - t0;
    shim_log(LOG_INFO, "STORE_STAGED: %u allocations, %llu bytes in %.3f s", count,
             (unsigned long long)bytes, (double)r->h.stat_copy_ns / 1e9);
    goto out;
oom:
    reply_msg(r, CUIP_STATUS_INTERNAL, "STORE_STAGED: out of memory for %u allocations", count);
out:
    free(pcs);
    free(hosts);
    free(h);
    free(list);
}

/* ------------------------------------------------------------ FETCH */
/* Every field of the file's header and table against `list`; 0, or -1 and
 * the reply says which. */
static int check_file(struct reply *r, int fd, struct obj **list, uint32_t count,
                      uint64_t bytes)
{
    struct stat st;
    struct cuip_stored_header h;
    struct cuip_stored_entry *e = NULL;
    size_t table = sizeof h + (size_t)count * sizeof *e;
    uint64_t at = align_up(table), end;
    char id[2 * CUIP_ID_LEN + 1];
    int rc = -1;

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the descriptor handed is not a "
                  "regular file");
        return -1;
    }
    if ((uint64_t)st.st_size < sizeof h || full_pio(fd, &h, sizeof h, 0, false) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the file is shorter than its header "
                  "(%lld bytes)", (long long)st.st_size);
        return -1;
    }
    if (h.magic != CUIP_STORED_MAGIC || h.version != CUIP_STORED_VERSION || h.reserved) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: not a stored file of version %u "
                  "(magic %#x, version %u)", CUIP_STORED_VERSION, h.magic, h.version);
        return -1;
    }
    if (memcmp(h.participant, g.participant, CUIP_PARTICIPANT_LEN) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the file was written by participant "
                  "%.32s, not this one (%s)", h.participant, g.participant);
        return -1;
    }
    if (h.count != count || h.bytes != bytes || h.data_offset != at) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the file holds %u allocations, %llu "
                  "bytes from offset %llu; this process stored %u, %llu bytes from %llu",
                  h.count, (unsigned long long)h.bytes, (unsigned long long)h.data_offset,
                  count, (unsigned long long)bytes, (unsigned long long)at);
        return -1;
    }
    e = calloc(count ? count : 1, sizeof *e);
    if (!e) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory for %u entries", count);
        return -1;
    }
    if (full_pio(fd, e, (size_t)count * sizeof *e, sizeof h, false) != 0) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the file's table is cut short");
        goto out;
    }
    for (uint32_t i = 0; i < count; i++) {
        if (memcmp(e[i].id, list[i]->id, CUIP_ID_LEN) != 0 || e[i].size != list[i]->size ||
            e[i].offset != at) {
            name_id(id, list[i]->id);
            reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: entry %u of the file is not "
                      "allocation %s of %llu bytes at offset %llu", i, id,
                      (unsigned long long)list[i]->size, (unsigned long long)at);
            goto out;
        }
        at = align_up(at + list[i]->size);
    }
    /* What STORE wrote: the table, then the last allocation's end. */
    end = count ? e[count - 1].offset + e[count - 1].size : table;
    if ((uint64_t)st.st_size != end) {
        reply_msg(r, CUIP_STATUS_REFUSED, "FETCH_STAGED: the file has %lld bytes, its table "
                  "says %llu", (long long)st.st_size, (unsigned long long)end);
        goto out;
    }
    rc = 0;
out:
    free(e);
    return rc;
}

static void fetch(struct reply *r, int fd)
{
    struct obj **list;
    uint32_t count = 0, npieces = 0;
    uint64_t bytes = 0, t0 = shim_now_ns();
    size_t len = 0, off = 0;
    char *arena = NULL, **hosts = NULL;
    struct piece *pcs = NULL;
    struct io_pool pool;
    char msg[ERR_LEN];

    list = moving(true, &count, &bytes);
    if (!list) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        return;
    }
    if (count == 0) {
        /* Nothing of this process is in a file (never stored, or fetched already):
         * nothing to read, the file is not looked at. The resume fetches whenever
         * the checkpoint directory holds files, whichever suspend wrote them. */
        r->h.status = CUIP_STATUS_OK;
        goto out;
    }
    if (check_file(r, fd, list, count, bytes) != 0)
        goto out;
    for (uint32_t i = 0; i < count; i++)
        len += staging_len(list[i]->size);
    hosts = calloc(count ? count : 1, sizeof *hosts);
    if (!hosts) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        goto out;
    }
    if (count) {
        arena = staging_alloc(len, msg, sizeof msg);
        if (!arena) {
            reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: %s", msg);
            goto out;
        }
    }
    for (uint32_t i = 0; i < count; i++) {
        hosts[i] = arena + off;
        off += staging_len(list[i]->size);
    }
    pcs = cut(list, count, hosts, align_up(sizeof(struct cuip_stored_header) +
                                           (size_t)count * sizeof(struct cuip_stored_entry)),
              &npieces);
    if (!pcs) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "FETCH_STAGED: out of memory");
        goto fail_arena;
    }
    memset(&pool, 0, sizeof pool);
    pool.fd = fd;
    pool.pieces = pcs;
    pool.count = npieces;
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
    shim_log(LOG_INFO, "FETCH_STAGED: %u allocations, %llu bytes in %.3f s", count,
             (unsigned long long)bytes, (double)r->h.stat_copy_ns / 1e9);
    goto out;
fail_arena:
    if (arena && munmap(arena, len) != 0)
        shim_log(LOG_WARN, "munmap of staging memory failed: %s", strerror(errno));
out:
    free(pcs);
    free(hosts);
    free(list);
}

void stored_serve(uint16_t op, int fd, struct reply *r)
{
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
    if (fd < 0) {
        reply_msg(r, CUIP_STATUS_BAD_REQUEST, "%s must carry a file descriptor (SCM_RIGHTS)",
                  cuip_op_name(op));
        pthread_mutex_unlock(&g.lock);
        return;
    }
    g.busy = true;
    g.op_in_flight = op;
    g.op_started_ns = shim_now_ns();
    pthread_mutex_unlock(&g.lock);
    if (op == CUIP_OP_STORE_STAGED)
        store(r, fd);
    else
        fetch(r, fd);
    pthread_mutex_lock(&g.lock);
    g.busy = false;
    g.op_in_flight = 0;
    pthread_mutex_unlock(&g.lock);
}
