/*
 * Interception: every way a program reaches the driver ends in the shim.
 *
 *  - direct symbols: the shim is preloaded, so its cuMemCreate & co. win;
 *  - dlsym (RTLD_DEFAULT/RTLD_NEXT or an explicit dlopen handle of libcuda or
 *    libcudart): the shim defines dlsym and substitutes its own wrapper for
 *    a tracked name, but only after the real dlsym found the symbol;
 *  - cuGetProcAddress / _v2 / _v2_ptsz and cudaGetDriverEntryPoint /
 *    ByVersion / _ptsz: the real resolver runs first; its answer is replaced
 *    only when it succeeded with a non-null pointer, by the wrapper of the
 *    same ABI. The ABI is taken from the pointer the driver returned when it
 *    is one of the driver's exports (exact), else from the requested version.
 *
 * The real driver is never linked: driver.c opens it by soname at first use.
 */
#include "shim.h"

#include <dlfcn.h>
#include <string.h>

SHIM_NO_SAN static bool same(const char *a, const char *b)
{
    while (*a && *a == *b) {
        a++;
        b++;
    }
    return *a == *b;
}

/* ------------------------------------------------------------ wrappers */
/* Defined in this file, unicast.c, multicast.c and capability.c. cuda.h maps some
 * names to _v2 with macros; the old ABIs are declared here by hand. */
#undef cuGetProcAddress
SHIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags);
SHIM_EXPORT CUresult cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int cudaVersion,
                                              cuuint64_t flags,
                                              CUdriverProcAddressQueryResult *status);

/* The runtime's entry points; ints stand for cudaError_t and the query enum
 * so that no runtime header is needed. */
typedef int (*rt_entry_fn)(const char *, void **, unsigned long long, int *);
typedef int (*rt_entry_ver_fn)(const char *, void **, unsigned int, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPoint(const char *, void **, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPoint_ptsz(const char *, void **, unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPointByVersion(const char *, void **, unsigned int,
                                                 unsigned long long, int *);
SHIM_EXPORT int cudaGetDriverEntryPointByVersion_ptsz(const char *, void **, unsigned int,
                                                      unsigned long long, int *);
SHIM_EXPORT void *dlsym(void *handle, const char *name);

/* One tracked driver function. `v2` is the newer ABI (NULL when it has
 * one), used from `split` on; real_v1/real_v2 point into `real`. */
struct tracked {
    const char *base;
    void *v1;
    void *v2;
    int split;
    void **real_v1;
    void **real_v2;
};

#define T1(name) {#name, (void *)name, NULL, 0, (void **)&real.name, NULL}
static const struct tracked tracked[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress, (void *)cuGetProcAddress_v2, 12000,
     (void **)&real.gpa_v1, (void **)&real.cuGetProcAddress_v2},
    T1(cuInit),
    T1(cuMemCreate),
    T1(cuMemRelease),
    T1(cuMemMap),
    T1(cuMemUnmap),
    T1(cuMemAddressFree),
    T1(cuMemSetAccess),
    T1(cuMemRetainAllocationHandle),
    T1(cuMemGetAllocationPropertiesFromHandle),
    T1(cuMemExportToShareableHandle),
    T1(cuMemImportFromShareableHandle),
    T1(cuMulticastCreate),
    T1(cuMulticastAddDevice),
    {"cuMulticastBindMem", (void *)cuMulticastBindMem, (void *)cuMulticastBindMem_v2, 13010,
     (void **)&real.cuMulticastBindMem, (void **)&real.cuMulticastBindMem_v2},
    {"cuMulticastBindAddr", (void *)cuMulticastBindAddr, (void *)cuMulticastBindAddr_v2, 13010,
     (void **)&real.cuMulticastBindAddr, (void **)&real.cuMulticastBindAddr_v2},
    T1(cuMulticastUnbind),
};
#define NTRACKED (sizeof tracked / sizeof tracked[0])

/* Exported names that dlsym substitutes (exact symbol names). */
struct named {
    const char *name;
    void *fn;
};
static const struct named named[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress},
    {"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2},
    {"cuGetProcAddress_v2_ptsz", (void *)cuGetProcAddress_v2_ptsz},
    {"cuInit", (void *)cuInit},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle},
    {"cuMemGetAllocationPropertiesFromHandle", (void *)cuMemGetAllocationPropertiesFromHandle},
    {"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle},
    {"cuMulticastCreate", (void *)cuMulticastCreate},
    {"cuMulticastAddDevice", (void *)cuMulticastAddDevice},
    {"cuMulticastBindMem", (void *)cuMulticastBindMem},
    {"cuMulticastBindMem_v2", (void *)cuMulticastBindMem_v2},
    {"cuMulticastBindAddr", (void *)cuMulticastBindAddr},
    {"cuMulticastBindAddr_v2", (void *)cuMulticastBindAddr_v2},
    {"cuMulticastUnbind", (void *)cuMulticastUnbind},
    {"cudaGetDriverEntryPoint", (void *)cudaGetDriverEntryPoint},
    {"cudaGetDriverEntryPoint_ptsz", (void *)cudaGetDriverEntryPoint_ptsz},
    {"cudaGetDriverEntryPointByVersion", (void *)cudaGetDriverEntryPointByVersion},
    {"cudaGetDriverEntryPointByVersion_ptsz", (void *)cudaGetDriverEntryPointByVersion_ptsz},
};
#define NNAMED (sizeof named / sizeof named[0])

/* The runtime's real entry points, learnt from dlsym or RTLD_NEXT. */
enum { RT_EP, RT_EP_PTSZ, RT_EPV, RT_EPV_PTSZ, RT_N };
static void *rt_real[RT_N];
static const char *const rt_names[RT_N] = {
    "cudaGetDriverEntryPoint", "cudaGetDriverEntryPoint_ptsz", "cudaGetDriverEntryPointByVersion",
    "cudaGetDriverEntryPointByVersion_ptsz"};

/* ------------------------------------------------------------ substitution */
/* Which wrapper stands for `p`, the driver's answer for `name` at `version`;
 * NULL when the name is not tracked or the ABI is unknown. */
static void *wrapper_for(const char *name, void *p, int version)
{
    for (size_t i = 0; i < NTRACKED; i++) {
        const struct tracked *t = &tracked[i];
        void *r1, *r2;
        if (!same(t->base, name))
            continue;
        if (!t->v2)
            return t->v1;
        r1 = *t->real_v1;
        r2 = *t->real_v2;
        if (p == r2 && r2)
            return t->v2;
        if (p == r1 && r1)
            return t->v1;
        /* An internal pointer: trust the version, if that ABI exists. */
        if (version >= t->split && r2)
            return t->v2;
        if (version < t->split && r1)
            return t->v1;
        shim_log(LOG_WARN, "cannot tell the ABI of %s at version %d; not intercepted", name,
                 version);
        return NULL;
    }
    return NULL;
}

static void substitute(const char *name, void **pfn, int version)
{
    void *w;
    if (!name || !pfn || !*pfn)
        return;
    w = wrapper_for(name, *pfn, version);
    if (w) {
        shim_log(LOG_DEBUG, "resolver: %s@%d -> shim", name, version);
        *pfn = w;
    }
}

/* ------------------------------------------------------------ dlsym */
SHIM_NO_SAN void *dlsym(void *handle, const char *name)
{
    shim_dlsym_fn rd = shim_real_dlsym();
    void *p;

    if (!rd)
        return NULL;
    /* RTLD_NEXT is relative to the caller; from here it means "after the
     * shim", which is what a caller loaded after the shim wants. */
    p = rd(handle, name);
    if (!p)
        return p;
    if (name[0] != 'c' || name[1] != 'u')
        return p;
    for (size_t i = 0; i < NNAMED; i++) {
        if (!same(named[i].name, name))
            continue;
        if (named[i].fn == p)
            return p;
        /* The runtime's real entry points are remembered for our wrappers. */
        for (int k = 0; k < RT_N; k++)
            if (same(rt_names[k], name) && !__atomic_load_n(&rt_real[k], __ATOMIC_ACQUIRE))
                __atomic_store_n(&rt_real[k], p, __ATOMIC_RELEASE);
        return named[i].fn;
    }
    return p;
}

/* ------------------------------------------------------------ cuInit */
CUresult CUDAAPI cuInit(unsigned int flags)
{
    CUresult r;
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    r = real.cuInit(flags);
    if (r == CUDA_SUCCESS)
        shim_ensure_started();
    return r;
}

/* ------------------------------------------------------------ cuGetProcAddress */
CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r;

    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    r = real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, &st);
    if (status)
        *status = st;
    if (r == CUDA_SUCCESS && st == CU_GET_PROC_ADDRESS_SUCCESS && pfn)
        substitute(symbol, pfn, cudaVersion);
    return r;
}

CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                  cuuint64_t flags)
{
    CUresult r;
    if (!shim_resolve_real())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!real.gpa_v1) {
        /* Only the _v2 ABI exists: answer the old call through it. */
        CUdriverProcAddressQueryResult st;
        r = real.cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, &st);
        if (r == CUDA_SUCCESS && st != CU_GET_PROC_ADDRESS_SUCCESS)
            r = CUDA_ERROR_NOT_FOUND;
    } else {
        r = real.gpa_v1(symbol, pfn, cudaVersion, flags);
    }
    if (r == CUDA_SUCCESS && pfn)
        substitute(symbol, pfn, cudaVersion);
    return r;
}

/* In cuda.h this is an inline around cuGetProcAddress_v2 that asks for the
 * per-thread default stream; defined here for programs that look it up. */
CUresult CUDAAPI cuGetProcAddress_v2_ptsz(const char *symbol, void **pfn, int cudaVersion,
                                          cuuint64_t flags,
                                          CUdriverProcAddressQueryResult *status)
{
    const cuuint64_t mask =
        CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if ((flags & mask) == 0)
        flags |= CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, status);
}

/* ------------------------------------------------------------ runtime entry points */
static void *rt_get(int k)
{
    void *p = __atomic_load_n(&rt_real[k], __ATOMIC_ACQUIRE);
    shim_dlsym_fn rd;
    if (p)
        return p;
    rd = shim_real_dlsym();
    p = rd ? rd(RTLD_NEXT, rt_names[k]) : NULL;
    if (p)
        __atomic_store_n(&rt_real[k], p, __ATOMIC_RELEASE);
    return p;
}

/* The version-less resolvers answer for the runtime's own version: ask the
 * runtime that owns `entry` (not the shim's headers). 0 when unknown. */
static int rt_version(void *entry)
{
    Dl_info info;
    void *lib;
    int (*get)(int *);
    int v = 0;
    shim_dlsym_fn rd = shim_real_dlsym();

    if (!rd || !dladdr(entry, &info) || !info.dli_fname)
        return 0;
    lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!lib)
        return 0;
    get = (int (*)(int *))rd(lib, "cudaRuntimeGetVersion");
    if (!get || get(&v) != 0)
        v = 0;
    dlclose(lib);
    return v;
}

#define CUDA_ERROR_SYMBOL_NOT_FOUND_RT 500 /* cudaErrorSymbolNotFound */

static int rt_entry(int k, const char *symbol, void **fp, unsigned long long flags, int *st)
{
    rt_entry_fn f = (rt_entry_fn)rt_get(k);
    int local = -1, r;
    if (!f)
        return CUDA_ERROR_SYMBOL_NOT_FOUND_RT;
    shim_resolve_real();
    r = f(symbol, fp, flags, &local);
    if (st)
        *st = local;
    if (r == 0 && local == 0 && fp && *fp)
        substitute(symbol, fp, rt_version((void *)f));
    return r;
}

static int rt_entry_ver(int k, const char *symbol, void **fp, unsigned int version,
                        unsigned long long flags, int *st)
{
    rt_entry_ver_fn f = (rt_entry_ver_fn)rt_get(k);
    int local = -1, r;
    if (!f)
        return CUDA_ERROR_SYMBOL_NOT_FOUND_RT;
    shim_resolve_real();
    r = f(symbol, fp, version, flags, &local);
    if (st)
        *st = local;
    if (r == 0 && local == 0 && fp && *fp)
        substitute(symbol, fp, (int)version);
    return r;
}

int cudaGetDriverEntryPoint(const char *s, void **fp, unsigned long long flags, int *st)
{
    return rt_entry(RT_EP, s, fp, flags, st);
}

int cudaGetDriverEntryPoint_ptsz(const char *s, void **fp, unsigned long long flags, int *st)
{
    return rt_entry(RT_EP_PTSZ, s, fp, flags, st);
}

int cudaGetDriverEntryPointByVersion(const char *s, void **fp, unsigned int v,
                                     unsigned long long flags, int *st)
{
    return rt_entry_ver(RT_EPV, s, fp, v, flags, st);
}

int cudaGetDriverEntryPointByVersion_ptsz(const char *s, void **fp, unsigned int v,
                                          unsigned long long flags, int *st)
{
    return rt_entry_ver(RT_EPV_PTSZ, s, fp, v, flags, st);
}
