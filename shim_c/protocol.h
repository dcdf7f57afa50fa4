/*
 * cuinterpose control protocol, version 2: the single source of truth.
 *
 * The coordinator engine (engine/wire.py) is pinned to this header by a test
 * that compiles a program printing every size and offset below. Any change to
 * a layout or a value bumps CUIP_VERSION. All integers are little-endian;
 * strings are ASCII, fixed width, no NUL terminator needed.
 */
#ifndef CUINTERPOSE_PROTOCOL_H
#define CUINTERPOSE_PROTOCOL_H

#include <stdint.h>

#define CUIP_MAGIC 0x50495543u   /* bytes "CUIP" */
#define CUIP_VERSION 2u

/* Limits. */
#define CUIP_PARTICIPANT_LEN 32      /* lowercase hex, no NUL */
#define CUIP_ID_LEN 16               /* resource ids: random, never all zero */
#define CUIP_AUTH_LEN 16
#define CUIP_MESSAGE_MAX 1024u       /* UTF-8 text after the header */
#define CUIP_RECORDS_MAX 65536u      /* records in one reply */
#define CUIP_ACCESS_MAX 8u           /* access descriptors in one record */
#define CUIP_SOCKET_PREFIX "cuinterpose-"
#define CUIP_SOCKET_SUFFIX ".sock"
#define CUIP_CONTROL_DIR_DEFAULT "/snapshot-control"
/* The control dir's path, in bytes, at most: a socket's path is at most 107
 * bytes (sun_path), and the longest name the shim binds in the dir,
 * "/.cuinterpose-<pid>.<8 hex>.tmp", takes up to 37; the rest is margin.
 * Checked where the path is chosen: launch, the shim, the coordinator. */
#define CUIP_CONTROL_DIR_MAX 60u
#define CUIP_CONTROL_DIR_ENV "SNAPSHOT_CONTROL_DIR"
#define CUIP_PARTICIPANT_ENV "SNAPSHOT_PARTICIPANT_ID"

/* The shim's phase, reported in every reply. */
enum cuip_phase {
    CUIP_PHASE_ACTIVE = 1,
    CUIP_PHASE_MULTICAST_DETACHED = 2,
    CUIP_PHASE_ALLOCATIONS_SAVED = 3,
    CUIP_PHASE_PREPARED = 4,
    CUIP_PHASE_ALLOCATIONS_LOADED = 5,
    CUIP_PHASE_UNICAST_RESTORED = 6,
    CUIP_PHASE_MULTICAST_CREATED = 7,
    CUIP_PHASE_MULTICAST_IMPORTED = 8,
    CUIP_PHASE_MULTICAST_JOINED = 9,
    CUIP_PHASE_ROLLBACK_LOADED = 10,
    /* The gate is closed and every context of the process idle; nothing is
     * torn down yet. The gate stays closed until the phase is ACTIVE again. */
    CUIP_PHASE_QUIESCED = 11,
    CUIP_PHASE_FAILED = 15,
};

/* A set of phases: bit p for phase p. */
#define CUIP_IN(p) (1u << CUIP_PHASE_##p)
#define CUIP_EVERY_PHASE                                                       \
    (CUIP_IN(ACTIVE) | CUIP_IN(MULTICAST_DETACHED) | CUIP_IN(ALLOCATIONS_SAVED) | \
     CUIP_IN(PREPARED) | CUIP_IN(ALLOCATIONS_LOADED) | CUIP_IN(UNICAST_RESTORED) | \
     CUIP_IN(MULTICAST_CREATED) | CUIP_IN(MULTICAST_IMPORTED) |                \
     CUIP_IN(MULTICAST_JOINED) | CUIP_IN(ROLLBACK_LOADED) | CUIP_IN(QUIESCED) |  \
     CUIP_IN(FAILED))

/* Every op, once: X(name, number, served_in, tears_down), numbered 1 up in
 * order. `served_in` is the set of phases the shim serves it in (any other
 * answers WRONG_PHASE); `tears_down` 1 when a run that stops after it needs
 * a rollback (it took something of the application's apart; QUIESCE only
 * holds the application at its gate, which the lease's end opens again).
 * Every op goes to every participant; one with nothing to do answers OK.
 * The enum below, the shim's op names and phase checks, and the engine's
 * table (phases/ops.py OPS, pinned to this one) come from here.
 *
 * INSPECT: QUIESCED for a capture (the gate keeps the records still),
 * PREPARED for a restore's comparison with its state file.
 * EXPORT: wherever a creator's allocations are live for its importers (a
 * peer's import may still be in flight in QUIESCED; ROLLBACK_LOADED:
 * importers import again).
 * ROLLBACK_ALLOCATIONS: any phase (FAILED while the staged bytes are all
 * there; again in ROLLBACK_LOADED after an interrupted rollback).
 * RELEASE ends the coordinator's lease (see `authorization`).
 * STATUS is read-only and served while a phase op runs (never a phase op,
 * changes nothing, binds nothing; the participant may be all zero): its
 * reply's stat fields say what is in flight (cuip_status_*, after the header).
 * QUIESCE, the first op of a capture, closes the gate that the
 * application's driver calls pass until the process is quiet
 * (specs/quiesce.md); its request carries a deadline and a round flag
 * (cuip_quiesce_deadline_ns, cuip_quiesce_round): a process not quiet when
 * that time is up answers PENDING and keeps its gate closed, instead of
 * being refused, until the shim's own deadline counted from the first
 * round. Sent again to a QUIESCED process it lets every thread held at a
 * synchronizing call make that one call, then quiets the process again: an
 * advance. Its reply carries the number of threads held at the gate
 * (cuip_quiesce_held).
 * STORE_STAGED and FETCH_STAGED (PREPARED, after a complete capture: the
 * CRIU verbs, specs/criu.md) carry 1 to CUIP_STORED_MAX_PARTS open file
 * descriptors, the parts in order (SCM_RIGHTS with the request's header; a
 * request with none, or more, is BAD_REQUEST): STORE_STAGED writes every
 * staged copy of the process into them (the stored files below) and frees
 * the host memory they took, FETCH_STAGED reads them back into fresh host
 * memory, checking every field of every part first (with nothing stored it
 * answers OK at once, the files unread). Neither
 * changes the phase; the reply's stat_count/stat_bytes say how many
 * allocations (bytes) moved, stat_copy_ns how long the I/O took.
 * HOST_COPY (ACTIVE, no op in flight) asks for the kept host copy
 * (specs/shim.md): CUIP_HOST_COPY_KEEP turns it on in a running process (the
 * copies are pinned in the background from then on, as with
 * SNAPSHOT_SHIM_KEEP_HOST_COPY=1 at start), CUIP_HOST_COPY_GIVE_BACK frees
 * every copy and turns it off (cuip_host_copy_request); the reply carries one
 * HOST_COPY record, what is held after it. Not a phase op. */
#define CUIP_OPS(X)                                                            \
    X(HANDSHAKE, 1, CUIP_EVERY_PHASE, 0)                                       \
    X(INSPECT, 2, CUIP_IN(ACTIVE) | CUIP_IN(PREPARED) | CUIP_IN(QUIESCED), 0)  \
    X(PREPARE_MULTICAST, 3, CUIP_IN(QUIESCED), 1)                              \
    X(SAVE_ALLOCATIONS, 4, CUIP_IN(MULTICAST_DETACHED), 1)                     \
    X(PREPARE_UNICAST, 5, CUIP_IN(ALLOCATIONS_SAVED), 1)                       \
    X(LOAD_ALLOCATIONS, 6, CUIP_IN(PREPARED), 1)                               \
    X(RESTORE_UNICAST, 7, CUIP_IN(ALLOCATIONS_LOADED), 1)                      \
    X(RESTORE_MULTICAST_CREATORS, 8, CUIP_IN(UNICAST_RESTORED), 1)             \
    X(RESTORE_MULTICAST_IMPORTERS, 9, CUIP_IN(MULTICAST_CREATED), 1)           \
    X(RESTORE_MULTICAST_DEVICES, 10, CUIP_IN(MULTICAST_IMPORTED), 1)           \
    X(RESTORE_MULTICAST_BINDINGS, 11, CUIP_IN(MULTICAST_JOINED), 1)            \
    X(EXPORT, 12,                                                              \
      CUIP_IN(ACTIVE) | CUIP_IN(ALLOCATIONS_LOADED) | CUIP_IN(UNICAST_RESTORED) |  \
          CUIP_IN(MULTICAST_CREATED) | CUIP_IN(MULTICAST_IMPORTED) |           \
          CUIP_IN(MULTICAST_JOINED) | CUIP_IN(ROLLBACK_LOADED) | CUIP_IN(QUIESCED), \
      0)                                                                       \
    X(ROLLBACK_ALLOCATIONS, 13, CUIP_EVERY_PHASE, 1)                           \
    X(ROLLBACK_IMPORTS, 14, CUIP_IN(ROLLBACK_LOADED), 1)                       \
    X(RELEASE, 15, CUIP_EVERY_PHASE, 0)                                        \
    X(STATUS, 16, CUIP_EVERY_PHASE, 0)                                         \
    X(QUIESCE, 17, CUIP_IN(ACTIVE) | CUIP_IN(QUIESCED), 0)                    \
    X(STORE_STAGED, 18, CUIP_IN(PREPARED), 0)                                  \
    X(FETCH_STAGED, 19, CUIP_IN(PREPARED), 0)                                  \
    X(HOST_COPY, 20, CUIP_IN(ACTIVE), 0)

enum cuip_op {
#define CUIP_OP_ENUM(name, number, served_in, tears_down) CUIP_OP_##name = number,
    CUIP_OPS(CUIP_OP_ENUM)
#undef CUIP_OP_ENUM
};
#define CUIP_OP_COUNT_ONE(name, number, served_in, tears_down) +1
enum { cuip_op_count = 0 CUIP_OPS(CUIP_OP_COUNT_ONE) };
#undef CUIP_OP_COUNT_ONE
#define CUIP_OP_MAX ((uint32_t)cuip_op_count)
/* Numbered 1 up without a gap: each number is at most the count, and no two
 * are equal (cuip_op_name's switch would not compile). */
#define CUIP_OP_NUMBERED(name, number, served_in, tears_down) \
    _Static_assert((number) >= 1 && (number) <= CUIP_OP_MAX, #name " numbered 1 up, no gap");
CUIP_OPS(CUIP_OP_NUMBERED)
#undef CUIP_OP_NUMBERED

/* An op's name (the CUIP_OP_ suffix), "?" for a number that is none. */
static inline const char *cuip_op_name(uint32_t op)
{
    switch (op) {
#define CUIP_OP_NAME(name, number, served_in, tears_down) \
    case CUIP_OP_##name:                                  \
        return #name;
        CUIP_OPS(CUIP_OP_NAME)
#undef CUIP_OP_NAME
    }
    return "?";
}

/* Whether the shim serves `op` in `phase`. */
static inline int cuip_op_served_in(uint32_t op, uint32_t phase)
{
    uint32_t set = 0;

    switch (op) {
#define CUIP_OP_SERVED(name, number, served_in, tears_down) \
    case CUIP_OP_##name:                                    \
        set = (served_in);                                  \
        break;
        CUIP_OPS(CUIP_OP_SERVED)
#undef CUIP_OP_SERVED
    }
    return phase < 32 && (set >> phase) & 1u;
}

/* A STATUS request asking CUIP_ASK_DRIVER (cuip_status_ask) asks which
 * driver the process runs on: the reply's message is then the path of the
 * libcuda.so.1 the shim loaded (empty while none is loaded), instead of the
 * stored failure reason, so that the coordinator's native checkpoint calls
 * load the same one. What a STATUS reply's stat fields carry: below the
 * header, cuip_status_*. */
#define CUIP_ASK_DRIVER 1u
/* A STATUS request asking CUIP_ASK_DEVICES asks which GPUs the process
 * uses (an allocation the shim tracks lives there or is accessible from
 * it, or its primary context is active): the reply's message is one line a
 * GPU, "<ordinal>\t<GPU-uuid>\t<bytes it created there>\t<name>\n";
 * REFUSED while a phase op runs. */
#define CUIP_ASK_DEVICES 2u
/* The asks are bits: asking both (CUIP_ASK_DRIVER | CUIP_ASK_DEVICES) is
 * one round for what a suspend records, and its message is the driver's
 * path on a line of its own ("\n" alone while none is loaded) followed by
 * the devices report; INTERNAL when the path holds a newline or the whole
 * does not fit CUIP_MESSAGE_MAX. The values 1 and 2 alone keep their
 * meaning. */
#define CUIP_ASK_ALL (CUIP_ASK_DRIVER | CUIP_ASK_DEVICES)
/* A LOAD_ALLOCATIONS request may carry text (message_length bytes, at most
 * CUIP_MESSAGE_MAX): the GPU mapping of the native restore,
 * "GPU-old=GPU-new[,GPU-old=GPU-new...]"; the shim checks that each GPU it
 * used is now the one the mapping names (its own when unnamed) before it
 * re-creates anything, and refuses naming the GPU otherwise. */


/* The phase machine: X(op, reaches, transfers) for every phase op, in order
 * (the phases each is served in: CUIP_OPS). `reaches` is the phase every
 * successful reply reports, `transfers` 1 when the reply carries the byte
 * and allocation statistics. Names are the CUIP_OP_ and CUIP_PHASE_
 * suffixes; the engine's table (phases/ops.py) is pinned to this one. */
#define CUIP_PHASE_OPS(X)                                                      \
    X(QUIESCE, QUIESCED, 0)                                                    \
    X(PREPARE_MULTICAST, MULTICAST_DETACHED, 0)                                \
    X(SAVE_ALLOCATIONS, ALLOCATIONS_SAVED, 1)                                  \
    X(PREPARE_UNICAST, PREPARED, 0)                                            \
    X(LOAD_ALLOCATIONS, ALLOCATIONS_LOADED, 1)                                 \
    X(RESTORE_UNICAST, UNICAST_RESTORED, 0)                                    \
    X(RESTORE_MULTICAST_CREATORS, MULTICAST_CREATED, 0)                        \
    X(RESTORE_MULTICAST_IMPORTERS, MULTICAST_IMPORTED, 0)                      \
    X(RESTORE_MULTICAST_DEVICES, MULTICAST_JOINED, 0)                          \
    X(RESTORE_MULTICAST_BINDINGS, ACTIVE, 0)

/* The way back to ACTIVE from any phase short of the native checkpoint, as
 * above. ROLLBACK_ALLOCATIONS re-creates and refills the creators'
 * torn-down allocations from their staged bytes; ROLLBACK_IMPORTS then
 * imports every import again and frees the staged bytes. Pinned to the
 * engine's ROLLBACK_OPS (phases/ops.py). */
#define CUIP_ROLLBACK_OPS(X)                                                   \
    X(ROLLBACK_ALLOCATIONS, ROLLBACK_LOADED, 1)                                \
    X(ROLLBACK_IMPORTS, ACTIVE, 0)

enum cuip_status {
    CUIP_STATUS_OK = 0,
    CUIP_STATUS_BAD_REQUEST = 1,
    CUIP_STATUS_WRONG_PARTICIPANT = 2,
    CUIP_STATUS_WRONG_PHASE = 3,
    CUIP_STATUS_CUDA_FAILED = 4,     /* message names the CUDA call and the CUresult name */
    CUIP_STATUS_REFUSED = 5,
    CUIP_STATUS_UNAUTHORIZED = 6,
    CUIP_STATUS_NOT_FOUND = 7,
    CUIP_STATUS_INTERNAL = 8,
    /* Transient (the driver said CUDA_ERROR_OUT_OF_MEMORY): nothing of the
     * failed step was kept, the phase is unchanged, the op may be sent again. */
    CUIP_STATUS_RETRY = 9,
    /* QUIESCE rounds only: not quiet yet; the phase is ACTIVE with the gate
     * still closed (synchronizing calls held, launches flowing) until the
     * next QUIESCE, RELEASE, or the shim's own deadline. */
    CUIP_STATUS_PENDING = 10,
};

/* EXPORT's resource_kind. */
enum cuip_resource_kind {
    CUIP_RESOURCE_UNICAST = 1,
    CUIP_RESOURCE_MULTICAST = 2,
};

/* Header: 128 bytes, followed by message_length bytes of text, then count records. */
struct cuip_header {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    int32_t status;                          /* 0 in requests */
    uint32_t count;                          /* records following; 0 in requests */
    char participant[CUIP_PARTICIPANT_LEN];  /* all zero in a HANDSHAKE request */
    uint8_t resource_id[CUIP_ID_LEN];        /* EXPORT; STORE/FETCH_STAGED: the dump */
    /* EXPORT: the capability's authorization. Every other request: the
     * coordinator's lease token (16 random bytes, one per run; all zero: a
     * client outside any lease, served only while no lease is held). */
    uint8_t authorization[CUIP_AUTH_LEN];
    uint32_t resource_kind;                  /* EXPORT only: enum cuip_resource_kind */
    /* <= CUIP_MESSAGE_MAX. Requests: 0, except LOAD_ALLOCATIONS (its GPU
     * mapping, CUIP_ASK_DEVICES above) and EXPORT, which carries the
     * requesting participant's id (CUIP_PARTICIPANT_LEN) so that the creator
     * knows who fetched (FETCH records). */
    uint32_t message_length;
    uint32_t pid;                            /* reply: the shim's getpid() */
    uint16_t phase;                          /* reply: enum cuip_phase after the op */
    uint16_t flags;                          /* reply: CUIP_REPLY_ bits; 0 in requests */
    /* The stat fields: a transfer's statistics (SAVE/LOAD/ROLLBACK_ALLOCATIONS,
     * INSPECT), or what the op names below make of them (QUIESCE, EXPORT, STATUS). */
    uint64_t stat_count;                     /* allocations moved */
    uint64_t stat_bytes;                     /* bytes moved */
    uint64_t stat_elapsed_ns;                /* time inside the shim for the whole op */
    uint64_t stat_copy_ns;                   /* time spent in device copies */
};

/* The reply's flags. NOT_QUIET: a QUIESCE refused (REFUSED) because the
 * process did not get quiet within its deadline; nothing changed, its gate
 * is open again, and a capture may start over. The message says the same
 * for humans; code decides on the flag. */
#define CUIP_REPLY_NOT_QUIET 0x1u

/* The stat fields whose meaning is the op's, by name: code reads and writes
 * them through these only. */

/* QUIESCE request: the longest the coordinator lets it take (ns; 0: the
 * shim's own deadline, which also bounds it). */
static inline uint64_t cuip_quiesce_deadline_ns(const struct cuip_header *h)
{
    return h->stat_elapsed_ns;
}
static inline void cuip_set_quiesce_deadline_ns(struct cuip_header *h, uint64_t ns)
{
    h->stat_elapsed_ns = ns;
}

/* QUIESCE request: 1 for a round (PENDING instead of a refusal). */
static inline uint64_t cuip_quiesce_round(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline void cuip_set_quiesce_round(struct cuip_header *h, uint64_t round)
{
    h->stat_count = round;
}

/* QUIESCE reply: the number of threads held at the gate. */
static inline uint64_t cuip_quiesce_held(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline void cuip_set_quiesce_held(struct cuip_header *h, uint64_t threads)
{
    h->stat_count = threads;
}

/* EXPORT request: the size of what the importer was handed (a capability's
 * size, a legacy IPC handle's range): the creator serves only what it
 * handed out, and refuses any other size before recording the fetch. */
static inline uint64_t cuip_export_size(const struct cuip_header *h)
{
    return h->stat_bytes;
}
static inline void cuip_set_export_size(struct cuip_header *h, uint64_t size)
{
    h->stat_bytes = size;
}

/* EXPORT request: CUIP_EXPORT_WITHDRAW when the importer's open failed after
 * its fetch: the creator forgets that fetch (the FETCH record of this
 * participant and pid) and answers without a file descriptor; else 0. */
#define CUIP_EXPORT_WITHDRAW 1u
static inline uint64_t cuip_export_withdraw(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline void cuip_set_export_withdraw(struct cuip_header *h, uint64_t withdraw)
{
    h->stat_count = withdraw;
}

/* STATUS request: CUIP_ASK_DRIVER (the driver's path), CUIP_ASK_DEVICES
 * (the GPUs used), both (CUIP_ASK_ALL), else 0. */
static inline uint64_t cuip_status_ask(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline void cuip_set_status_ask(struct cuip_header *h, uint64_t ask)
{
    h->stat_count = ask;
}

/* HOST_COPY request: what it asks (stat_count). */
#define CUIP_HOST_COPY_KEEP 1u
#define CUIP_HOST_COPY_GIVE_BACK 2u
static inline uint64_t cuip_host_copy_request(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline void cuip_set_host_copy_request(struct cuip_header *h, uint64_t what)
{
    h->stat_count = what;
}

/* STATUS reply: the op in flight (enum cuip_op, 0 when none), the bytes it
 * has copied so far, the bytes it copies in all (0 when it copies nothing),
 * how long it has run. */
static inline uint64_t cuip_status_op(const struct cuip_header *h)
{
    return h->stat_count;
}
static inline uint64_t cuip_status_bytes_done(const struct cuip_header *h)
{
    return h->stat_bytes;
}
static inline uint64_t cuip_status_bytes_total(const struct cuip_header *h)
{
    return h->stat_copy_ns;
}
static inline uint64_t cuip_status_elapsed_ns(const struct cuip_header *h)
{
    return h->stat_elapsed_ns;
}
static inline void cuip_set_status_in_flight(struct cuip_header *h, uint64_t op,
                                             uint64_t bytes_done, uint64_t bytes_total,
                                             uint64_t elapsed_ns)
{
    h->stat_count = op;
    h->stat_bytes = bytes_done;
    h->stat_copy_ns = bytes_total;
    h->stat_elapsed_ns = elapsed_ns;
}

/* Record kinds. */
enum cuip_record_kind {
    CUIP_RECORD_ALLOCATION = 1,
    CUIP_RECORD_MAPPING = 2,
    CUIP_RECORD_MC_OBJECT = 3,
    CUIP_RECORD_MC_DEVICE = 4,
    CUIP_RECORD_MC_BINDING = 5,
    CUIP_RECORD_MC_MAPPING = 6,
    CUIP_RECORD_RAW_IMPORT = 7,
    CUIP_RECORD_UNSUPPORTED_EXPORTABLE = 8,
    /* A creator's note that a participant fetched one of its allocations
     * (EXPORT): id, creator (this participant), member_id the fetching
     * participant's id as its 16 bytes (the 32 hex digits decoded), pid the
     * fetching process as SO_PEERCRED showed it to the creator. Not part of
     * the topology: it says who must be in the team. */
    CUIP_RECORD_FETCH = 9,
    /* Sharing the shim does not own, and so cannot rebuild: op_flags the way
     * (enum cuip_unowned), address and size the memory where known,
     * handle_count how many are live. Refuses the capture, like RAW_IMPORT. */
    CUIP_RECORD_UNOWNED_SHARING = 10,
    /* The kept host copy (SNAPSHOT_SHIM_KEEP_HOST_COPY, specs/shim.md): one
     * in the reply of SAVE_ALLOCATIONS, LOAD_ALLOCATIONS and
     * ROLLBACK_ALLOCATIONS of a process in that mode, and of STATUS (asked
     * for nothing else) of one that is in it or still holds copies. Not part
     * of the topology. Its fields by name: cuip_host_copy_* below. */
    CUIP_RECORD_HOST_COPY = 11,
};

/* HOST_COPY's hash state (in op_flags): how SAVE chose what to copy. */
enum cuip_hash {
    CUIP_HASH_NOT_SAVED = 0,   /* not a SAVE, or no kept copy in it */
    CUIP_HASH_COMPARED = 1,    /* every kept copy's chunks compared: only changed ones copied */
    CUIP_HASH_FIRST = 2,       /* hashed; some copies had no earlier hash: copied whole */
    CUIP_HASH_UNAVAILABLE = 3, /* the hash kernel failed: everything copied; the message says why */
};

/* UNOWNED_SHARING's op_flags: which call made the sharing. */
enum cuip_unowned {
    /* cuIpcGetMemHandle of memory the driver allocated (ownership off): the
     * handle stops opening once the process went through the native
     * checkpoint. */
    CUIP_UNOWNED_IPC_EXPORT = 1,
    /* cuIpcOpenMemHandle of a driver handle (not one of the shim's): the
     * native restore of the opening process fails. */
    CUIP_UNOWNED_IPC_OPEN = 2,
    /* cuMemPoolExportToShareableHandle / cuMemPoolExportPointer of a pool. */
    CUIP_UNOWNED_POOL_EXPORT = 3,
    /* cuMemPoolImportFromShareableHandle / cuMemPoolImportPointer. */
    CUIP_UNOWNED_POOL_IMPORT = 4,
};

/* Record flags. */
#define CUIP_FLAG_CREATOR 0x1u
#define CUIP_FLAG_HANDLE_LIVE 0x2u
#define CUIP_FLAG_CONTENT 0x4u          /* this participant saves and loads the bytes */

/* MC_BINDING's binding_kind. */
enum cuip_binding_kind {
    CUIP_BIND_MEM = 1,
    CUIP_BIND_ADDR = 2,
};

struct cuip_access {
    int32_t location_type;
    int32_t location_id;
    uint64_t flags;
};

/* Record: 288 bytes. Unused fields and access slots are zero so that records
 * compare bytewise between a capture and a restore. */
struct cuip_record {
    uint16_t kind;
    uint16_t flags;
    uint32_t access_count;                   /* <= CUIP_ACCESS_MAX */
    uint8_t id[CUIP_ID_LEN];
    uint8_t member_id[CUIP_ID_LEN];
    char creator[CUIP_PARTICIPANT_LEN];
    uint64_t address;
    uint64_t size;
    uint64_t offset;
    uint64_t member_offset;
    uint64_t op_flags;
    uint64_t handle_types;
    uint64_t object_flags;
    int32_t allocation_type;
    int32_t location_type;
    int32_t location_id;
    int32_t device;
    uint32_t num_devices;
    uint8_t binding_kind;
    uint8_t api_version;                     /* 1, or 2 for the device-explicit _v2 binds */
    uint16_t reserved0;
    uint32_t handle_count;                   /* live application handles */
    uint32_t pid;                            /* FETCH only: the fetching process */
    struct cuip_access access[CUIP_ACCESS_MAX];
};

/* HOST_COPY's fields: the host memory the kept copies hold (pinned) and
 * how many there are, the host memory of their hash tables; in an op's
 * reply, the bytes it copied and those it left because they were unchanged,
 * and the hash state (enum cuip_hash). */
static inline uint64_t cuip_host_copy_bytes(const struct cuip_record *r) { return r->size; }
static inline uint64_t cuip_host_copy_count(const struct cuip_record *r) { return r->address; }
static inline uint64_t cuip_host_copy_overhead(const struct cuip_record *r)
{
    return r->member_offset;
}
static inline uint64_t cuip_host_copy_copied(const struct cuip_record *r) { return r->offset; }
static inline uint64_t cuip_host_copy_unchanged(const struct cuip_record *r)
{
    return r->object_flags;
}
static inline uint64_t cuip_host_copy_hash(const struct cuip_record *r) { return r->op_flags; }
static inline void cuip_set_host_copy(struct cuip_record *r, uint64_t bytes, uint64_t count,
                                      uint64_t overhead, uint64_t copied, uint64_t unchanged,
                                      uint64_t hash)
{
    r->kind = CUIP_RECORD_HOST_COPY;
    r->size = bytes;
    r->address = count;
    r->member_offset = overhead;
    r->offset = copied;
    r->object_flags = unchanged;
    r->op_flags = hash;
}

/* Capability: what the application holds instead of a raw CUDA FD. A sealed
 * memfd carries exactly these 128 bytes; it never crosses to the coordinator. */
#define CUIP_CAP_MAGIC 0x43495543u       /* bytes "CUIC" */
#define CUIP_CAP_VERSION 1u
#define CUIP_CAP_ENDPOINT_LEN 40

struct cuip_capability {
    uint32_t magic;
    uint16_t version;
    uint16_t resource_kind;                  /* enum cuip_resource_kind */
    char creator[CUIP_PARTICIPANT_LEN];
    uint8_t resource_id[CUIP_ID_LEN];
    uint8_t authorization[CUIP_AUTH_LEN];
    /* The creator's socket name within the control dir (not a full path, so a
     * capability stays valid when the control dir is mounted elsewhere). */
    char endpoint[CUIP_CAP_ENDPOINT_LEN];
    uint64_t size;
    uint32_t handle_types;
    uint16_t flags;
    uint16_t num_devices;
};

/* What cuIpcGetMemHandle hands out for memory the shim owns (cuMemAlloc):
 * it fits CUipcMemHandle's 64 bytes and names the creator's allocation, so
 * cuIpcOpenMemHandle in another shim fetches it from the creator's endpoint
 * (`cuinterpose-<creator_pid>.sock`) exactly as a capability import does.
 * The authorization is the allocation's, whose last 4 bytes are zero for
 * owned memory (96 random bits). The range is the one cuMemAlloc returned,
 * within the allocation (a small one shares an allocation with others). */
#define CUIP_IPC_MAGIC 0x48495543u       /* bytes "CUIH" */
#define CUIP_IPC_AUTH_LEN 12
#define CUIP_PARTICIPANT_BYTES 16         /* a participant id's 32 hex digits as bytes */

struct cuip_ipc_handle {
    uint32_t magic;
    uint32_t creator_pid;
    uint8_t creator[CUIP_PARTICIPANT_BYTES];
    uint8_t resource_id[CUIP_ID_LEN];
    uint8_t authorization[CUIP_IPC_AUTH_LEN];
    uint32_t offset;
    uint64_t size;
};

/* The stored files (STORE_STAGED writes them, FETCH_STAGED reads them):
 * each process's staged bytes in `parts` files, so that as many threads write
 * as many files at once (buffered writes to one file serialize on its inode;
 * specs/protocol.md). Every part starts with this header, naming its own
 * index, the part count and the dump's identity (STORE's request carries it
 * in resource_id, FETCH's the one it expects); part 0 alone follows it with
 * the `count` entries; then every part holds its stripes' sums. The data is
 * one stream: the first allocation at 0, each next one at the previous one's
 * end rounded up to CUIP_STORED_ALIGN, in the order of the shim's allocation
 * table; an entry's offset is its place in the stream. The stream is cut into
 * CUIP_STORED_STRIPE-byte stripes, stripe s in part s mod parts at that
 * part's data_offset + (s / parts) * CUIP_STORED_STRIPE; part k's
 * `stripes` sums (uint64 each, its stripes in order) follow its header (part
 * 0: its table), and data_offset is their end rounded up to
 * CUIP_STORED_ALIGN. A stripe's sum is XXH64 of its bytes as the file holds
 * them (alignment gaps read as zeros; the stream's last stripe ends at the
 * stream's end) with the seed cuip_stored_seed(identity, s): a stripe moved,
 * or one of another dump, does not match. A part holding no stripe ends at
 * its header (part 0: its table); any other ends at its last stripe's last
 * byte. Everything follows from the sizes and the part count: FETCH refuses
 * any other file (each is hostile input until every field is checked).
 * Little-endian, as on the wire. A request hands 1 to CUIP_STORED_MAX_PARTS
 * descriptors, part k the k-th. Version 2 (no identity, no sums) is refused
 * by name. */
#define CUIP_STORED_MAGIC 0x47545343u     /* bytes "CSTG" */
#define CUIP_STORED_VERSION 3u
#define CUIP_STORED_ALIGN 4096u
#define CUIP_STORED_STRIPE (8u << 20)     /* a multiple of CUIP_STORED_ALIGN */
#define CUIP_STORED_MAX_PARTS 64u         /* the shim's most copy threads */

struct cuip_stored_header {
    uint32_t magic;
    uint32_t version;
    uint32_t count;                            /* entries, in part 0 */
    uint16_t part;                             /* this file's index */
    uint16_t parts;                            /* the files of the process */
    uint64_t bytes;                            /* the sum of the entries' sizes */
    uint64_t data_offset;                      /* this part's first stripe */
    char participant[CUIP_PARTICIPANT_LEN];    /* the writer's id: only it reads it back */
    uint8_t identity[CUIP_ID_LEN];             /* the dump's (the images' seal) */
    uint64_t stripes;                          /* this part's stripes: its sums */
};

struct cuip_stored_entry {
    uint8_t id[CUIP_ID_LEN];                   /* the allocation's resource id */
    uint64_t size;
    uint64_t offset;                           /* in the stream */
};

/* Stripe s's XXH64 seed: the identity's first 8 bytes (little-endian) plus s. */
static inline uint64_t cuip_stored_seed(const uint8_t identity[CUIP_ID_LEN], uint64_t s)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | identity[i];
    return v + s;
}

_Static_assert(sizeof(struct cuip_stored_header) == 88, "stored header is 88 bytes");
_Static_assert(sizeof(struct cuip_stored_entry) == 32, "stored entry is 32 bytes");
_Static_assert(sizeof(struct cuip_ipc_handle) == 64, "IPC handle is 64 bytes");
_Static_assert(sizeof(struct cuip_header) == 128, "header is 128 bytes");
_Static_assert(sizeof(struct cuip_access) == 16, "access is 16 bytes");
_Static_assert(sizeof(struct cuip_record) == 288, "record is 288 bytes");
_Static_assert(sizeof(struct cuip_capability) == 128, "capability is 128 bytes");

#endif
