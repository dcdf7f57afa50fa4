/*
 * The real driver: its entry points (`real`), resolved once from
 * libcuda.so.1, which the shim never links (it is opened by soname at first
 * use); the real dlsym; context push and pop for the control thread; the
 * names of CUresults.
 */
#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>

SHIM_HIDDEN struct shim_real real;

/* ------------------------------------------------------------ real dlsym */
static shim_dlsym_fn real_dlsym_ptr;

/* A dlsym interposer cannot ask dlsym for the real dlsym: find it with
 * dlvsym. The version differs by architecture and glibc release. Runs before
 * the sanitizer runtime is initialised (libasan calls dlsym while setting
 * up), hence no instrumentation on this path. */
SHIM_NO_SAN shim_dlsym_fn shim_real_dlsym(void)
{
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17",
                                           "GLIBC_2.0"};
    shim_dlsym_fn f = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_ACQUIRE);
    if (f)
        return f;
    for (unsigned i = 0; i < sizeof versions / sizeof versions[0] && !f; i++)
        f = (shim_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    __atomic_store_n(&real_dlsym_ptr, f, __ATOMIC_RELEASE);
    return f;
}

/* ------------------------------------------------------------ real driver */
static pthread_once_t resolve_once_ctl = PTHREAD_ONCE_INIT;
static bool resolve_ok;
static void *driver_lib; /* set once by resolve_once */
static char driver_path[512]; /* set once by resolve_once, before resolve_done */
static bool resolve_done;     /* atomic: resolve_once has finished */

static void *sym(void *lib, const char *name, const char *base, int version)
{
    shim_dlsym_fn rd = shim_real_dlsym();
    void *p = rd ? rd(lib, name) : NULL;
    CUdriverProcAddressQueryResult st;

    /* A driver that lacks the exported name still answers its resolver. */
    if (!p && base && real.cuGetProcAddress_v2 &&
        real.cuGetProcAddress_v2(base, &p, version, 0, &st) != CUDA_SUCCESS)
        p = NULL;
    return p;
}

/* What the loader calls the library (the path it found it at): what a
 * coordinator must dlopen to reach the same driver (protocol.h,
 * CUIP_ASK_DRIVER). */
static void remember_path(void *lib)
{
    struct link_map *map = NULL;

    if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name)
        snprintf(driver_path, sizeof driver_path, "%s", map->l_name);
}

/* The process's libcuda.so.1 (the one already loaded, else by soname). */
static void *open_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);

    if (!lib)
        lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!lib)
        shim_log(LOG_ERROR, "cannot open libcuda.so.1: %s", dlerror());
    return lib;
}

/* Every entry point of SHIM_REAL (shim.h), in its order. */
static void resolve_once(void)
{
    void *lib;

    /* Every entry point comes here first: the settings (the log level among
     * them) are read before anything is logged. */
    shim_settings();
    lib = open_driver();
    if (!lib)
        return;
    driver_lib = lib;
    remember_path(lib);
#define R(field, params, name, base, version)                                  \
    real.field = (__typeof__(real.field))sym(lib, name, base, version);
    SHIM_REAL(R)
#undef R
    if (!real.cuGetProcAddress_v2 || !real.cuMemCreate || !real.cuMemMap || !real.cuInit) {
        shim_log(LOG_ERROR, "libcuda.so.1 lacks the VMM entry points the shim needs");
        return;
    }
    resolve_ok = true;
}

static void resolve_and_mark(void)
{
    resolve_once();
    __atomic_store_n(&resolve_done, true, __ATOMIC_RELEASE);
}

bool shim_resolve_real(void)
{
    pthread_once(&resolve_once_ctl, resolve_and_mark);
    return resolve_ok;
}

const char *shim_driver_path(void)
{
    return __atomic_load_n(&resolve_done, __ATOMIC_ACQUIRE) ? driver_path : "";
}

void *shim_driver_symbol(const char *name)
{
    shim_dlsym_fn rd = shim_real_dlsym();

    if (!shim_resolve_real() || !rd)
        return NULL;
    return rd(driver_lib, name);
}

/* Not among the wrapped calls, and only SAVE/LOAD need them: asked for on
 * first use, from the driver's resolver, as an application would ask. */
static pthread_once_t host_register_once = PTHREAD_ONCE_INIT;

static void *proc(const char *name, int version)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;

    if (!real.cuGetProcAddress_v2 ||
        real.cuGetProcAddress_v2(name, &p, version, 0, &st) != CUDA_SUCCESS ||
        st != CU_GET_PROC_ADDRESS_SUCCESS)
        return NULL;
    return p;
}

static void resolve_host_register(void)
{
    real.cuMemHostRegister = (__typeof__(real.cuMemHostRegister))proc("cuMemHostRegister", 6050);
    real.cuMemHostUnregister = (__typeof__(real.cuMemHostUnregister))proc("cuMemHostUnregister",
                                                                          4000);
}

bool shim_resolve_host_register(void)
{
    pthread_once(&host_register_once, resolve_host_register);
    return real.cuMemHostRegister && real.cuMemHostUnregister;
}

/* ------------------------------------------------------------ contexts */
CUresult shim_ctx_enter(CUcontext ctx, bool *pushed)
{
    CUresult r;
    *pushed = false;
    if (!ctx)
        return CUDA_SUCCESS;
    r = real.cuCtxPushCurrent(ctx);
    if (r == CUDA_SUCCESS)
        *pushed = true;
    return r;
}

void shim_ctx_leave(bool pushed)
{
    CUcontext dummy;
    if (pushed)
        real.cuCtxPopCurrent(&dummy);
}

/* ------------------------------------------------------------ results */
const char *shim_cu_name(CUresult r)
{
    const char *s = NULL;
    if (real.cuGetErrorName && real.cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "CUDA_ERROR_(unnamed)";
}

void shim_fail(char *msg, size_t n, const char *call, CUresult r)
{
    snprintf(msg, n, "%s failed: %s (%d)", call, shim_cu_name(r), (int)r);
}
