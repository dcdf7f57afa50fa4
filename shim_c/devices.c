/*
 * The GPUs this process uses: STATUS's devices report (CUIP_ASK_DEVICES),
 * their UUIDs as the capture's QUIESCE found them, and LOAD_ALLOCATIONS' check
 * of the GPU mapping its request carries.
 *
 * A GPU is used when an allocation the shim tracks lives there or is
 * accessible from it, or when its primary context is active. The native
 * restore with gpuPairs keeps the process's ordinals and changes the GPU
 * behind each (specs/records/2026-12-01-gpu-remap.md), so LOAD re-creates
 * every allocation, mapping, access descriptor, peer access and multicast
 * device list at its recorded ordinal, and that is the mapped GPU only when
 * the ordinal names it now: checked here, for every used ordinal, before
 * LOAD changes anything. A driver that moved a GPU to another ordinal, or a
 * restore without the mapping onto other GPUs, is refused by name.
 */
#include "shim.h"

#include <stdio.h>
#include <string.h>

#define UUID_TEXT_LEN 40 /* "GPU-" and 8-4-4-4-12 hex digits */

/* Written once QUIESCE is done, read by LOAD, both on the control thread. */
static struct {
    bool known;
    uint64_t used; /* bit per ordinal (MAX_DEVICES: shim.h) */
    int count;
    CUuuid uuid[MAX_DEVICES];
} saved;

static void uuid_text(const CUuuid *u, char out[UUID_TEXT_LEN + 1])
{
    const unsigned char *b = (const unsigned char *)u->bytes;

    snprintf(out, UUID_TEXT_LEN + 1,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* "GPU-" and 8-4-4-4-12 lowercase hex digits, exactly. */
static bool uuid_parse(const char *s, CUuuid *u)
{
    char hex[2 * sizeof u->bytes];
    size_t k = 0;

    if (strncmp(s, "GPU-", 4) != 0)
        return false;
    for (int i = 4; i < UUID_TEXT_LEN; i++) {
        bool dash = i == 12 || i == 17 || i == 22 || i == 27;

        if (s[i] == '\0' || dash != (s[i] == '-'))
            return false;
        if (!dash)
            hex[k++] = s[i];
    }
    return k == sizeof hex && shim_unhex((uint8_t *)u->bytes, hex, sizeof hex);
}

static int device_count(void)
{
    int n = 0;

    if (!real.cuDeviceGetCount || real.cuDeviceGetCount(&n) != CUDA_SUCCESS || n < 0)
        return 0;
    return n < MAX_DEVICES ? n : MAX_DEVICES;
}

/* The ordinals in use and the bytes this process created on each; false when
 * `idle_only` and a phase op runs (it changes the tables without g.lock). */
static bool used_now(uint64_t bytes[MAX_DEVICES], bool idle_only, uint64_t *out)
{
    uint64_t used = 0;

    pthread_mutex_lock(&g.lock);
    if (idle_only && g.busy) {
        pthread_mutex_unlock(&g.lock);
        return false;
    }
    for (uint32_t i = 0; i < obj_count(); i++) {
        const struct obj *o = obj_at(i);
        int dev;

        if (!o || o->kind != OBJ_ALLOC)
            continue;
        dev = o->prop.location.id;
        if (o->prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE && dev >= 0 &&
            dev < MAX_DEVICES) {
            used |= 1ull << dev;
            if (o->is_creator && bytes)
                bytes[dev] += o->size;
        }
        for (uint32_t m = 0; m < o->nmaps; m++)
            for (uint32_t a = 0; a < o->maps[m].access_count; a++) {
                const struct cuip_access *d = &o->maps[m].access[a];

                if (d->location_type == CU_MEM_LOCATION_TYPE_DEVICE && d->location_id >= 0 &&
                    d->location_id < MAX_DEVICES)
                    used |= 1ull << d->location_id;
            }
    }
    pthread_mutex_unlock(&g.lock);
    for (int d = 0, n = device_count(); d < n; d++) {
        unsigned flags = 0;
        int active = 0;

        if (real.cuDevicePrimaryCtxGetState &&
            real.cuDevicePrimaryCtxGetState(d, &flags, &active) == CUDA_SUCCESS && active)
            used |= 1ull << d;
    }
    *out = used;
    return true;
}

void devices_remember(void)
{
    int n = device_count();
    uint64_t used = 0;

    memset(&saved, 0, sizeof saved);
    (void)used_now(NULL, false, &used); /* the control thread, in its own op */
    saved.used = used & (n < MAX_DEVICES ? (1ull << n) - 1u : ~0ull);
    for (int d = 0; d < n; d++)
        if (!real.cuDeviceGetUuid || real.cuDeviceGetUuid(&saved.uuid[d], d) != CUDA_SUCCESS)
            return; /* not known: LOAD refuses a mapping it cannot check */
    saved.count = n;
    saved.known = true;
}

/* The driver's path as the first line of a report that asks for both: a
 * newline in it would shift every line after it, so it is refused. */
static int driver_line(char *text, size_t size, size_t *len, struct reply *r)
{
    const char *driver = shim_driver_path();
    int k;

    if (!driver)
        driver = "";
    if (strchr(driver, '\n')) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "the driver's path holds a newline");
        return -1;
    }
    k = snprintf(text, size, "%s\n", driver);
    if (k < 0 || (size_t)k >= size) {
        reply_msg(r, CUIP_STATUS_INTERNAL, "the driver's path exceeds %u bytes",
                  CUIP_MESSAGE_MAX);
        return -1;
    }
    *len = (size_t)k;
    return 0;
}

void devices_report(struct reply *r, bool with_driver)
{
    uint64_t bytes[MAX_DEVICES] = {0};
    uint64_t used = 0;
    char text[CUIP_MESSAGE_MAX];
    size_t len = 0;
    int n = device_count();

    if (!used_now(bytes, true, &used)) {
        reply_msg(r, CUIP_STATUS_REFUSED, "the devices report waits for the phase op in "
                  "flight to end");
        return;
    }
    text[0] = '\0';
    if (with_driver && driver_line(text, sizeof text, &len, r) != 0)
        return;
    for (int d = 0; d < n; d++) {
        CUuuid u;
        char name[64] = "", id[UUID_TEXT_LEN + 1];
        int k;

        if (!(used >> d & 1u))
            continue;
        if (!real.cuDeviceGetUuid || real.cuDeviceGetUuid(&u, d) != CUDA_SUCCESS) {
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "cuDeviceGetUuid(%d) failed", d);
            return;
        }
        if (real.cuDeviceGetName && real.cuDeviceGetName(name, sizeof name, d) != CUDA_SUCCESS)
            name[0] = '\0';
        name[sizeof name - 1] = '\0';
        for (char *c = name; *c; c++)
            if (*c == '\n' || *c == '\t')
                *c = ' ';
        uuid_text(&u, id);
        k = snprintf(text + len, sizeof text - len, "%d\t%s\t%llu\t%s\n", d, id,
                     (unsigned long long)bytes[d], name);
        if (k < 0 || (size_t)k >= sizeof text - len) {
            reply_msg(r, CUIP_STATUS_INTERNAL, "the devices report exceeds %u bytes",
                      CUIP_MESSAGE_MAX);
            return;
        }
        len += (size_t)k;
    }
    reply_msg(r, CUIP_STATUS_OK, "%s", text);
}

/* "OLD=NEW[,OLD=NEW...]", both GPU-... UUIDs; at most MAX_DEVICES pairs. */
static int parse_map(const char *text, size_t len, CUuuid old[], CUuuid new_[], int *count,
                     struct reply *r)
{
    size_t at = 0;
    int n = 0;

    while (at < len) {
        if (n == MAX_DEVICES || len - at < 2 * UUID_TEXT_LEN + 1 ||
            !uuid_parse(text + at, &old[n]) || text[at + UUID_TEXT_LEN] != '=' ||
            !uuid_parse(text + at + UUID_TEXT_LEN + 1, &new_[n]))
            goto bad;
        at += 2 * UUID_TEXT_LEN + 1;
        n++;
        if (at < len && text[at++] != ',')
            goto bad;
        if (at == len && text[len - 1] == ',')
            goto bad;
    }
    *count = n;
    return 0;
bad:
    reply_msg(r, CUIP_STATUS_BAD_REQUEST, "LOAD_ALLOCATIONS: the GPU mapping %.*s is not "
              "OLD=NEW[,OLD=NEW...] of at most %d pairs of GPU-... UUIDs", (int)len, text,
              MAX_DEVICES);
    return -1;
}

int devices_check_map(const char *text, size_t len, struct reply *r)
{
    CUuuid old[MAX_DEVICES], new_[MAX_DEVICES];
    char a[UUID_TEXT_LEN + 1], b[UUID_TEXT_LEN + 1], c[UUID_TEXT_LEN + 1];
    int n = 0;

    if (parse_map(text, len, old, new_, &n, r) != 0)
        return -1;
    if (!saved.known) {
        if (n == 0)
            return 0; /* nothing recorded, nothing asked */
        reply_msg(r, CUIP_STATUS_REFUSED, "LOAD_ALLOCATIONS refused: this process's GPUs were "
                  "not recorded at the capture, so the GPU mapping cannot be checked; "
                  "nothing was changed");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        int d = 0;

        while (d < saved.count && memcmp(&saved.uuid[d], &old[i], sizeof old[i]))
            d++;
        if (d == saved.count) {
            uuid_text(&old[i], a);
            reply_msg(r, CUIP_STATUS_REFUSED, "LOAD_ALLOCATIONS refused: the GPU mapping names "
                      "%s, which this process did not see at the capture; nothing was "
                      "changed", a);
            return -1;
        }
    }
    for (int d = 0; d < saved.count; d++) {
        CUuuid want = saved.uuid[d], now;

        if (!(saved.used >> d & 1u))
            continue;
        for (int i = 0; i < n; i++)
            if (!memcmp(&old[i], &saved.uuid[d], sizeof old[i]))
                want = new_[i];
        if (real.cuDeviceGetUuid(&now, d) != CUDA_SUCCESS) {
            reply_msg(r, CUIP_STATUS_CUDA_FAILED, "LOAD_ALLOCATIONS: cuDeviceGetUuid(%d) failed",
                      d);
            return -1;
        }
        if (memcmp(&now, &want, sizeof now)) {
            uuid_text(&saved.uuid[d], a);
            uuid_text(&want, b);
            uuid_text(&now, c);
            reply_msg(r, CUIP_STATUS_REFUSED, "LOAD_ALLOCATIONS refused: GPU ordinal %d was %s "
                      "at the capture and is to be %s, but names %s now (the native "
                      "restore did not map it there: give it the same mapping); nothing was "
                      "changed", d, a, b, c);
            return -1;
        }
    }
    return 0;
}
