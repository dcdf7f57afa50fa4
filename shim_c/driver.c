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

static void resolve_once(void)
{
    void *lib;

    /* Every entry point comes here first: the settings (the log level among
     * them) are read before anything is logged. */
    shim_settings();
    lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib)
        lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!lib) {
        shim_log(LOG_ERROR, "cannot open libcuda.so.1: %s", dlerror());
        return;
    }
    driver_lib = lib;
    remember_path(lib);
#define R(field, name, base, ver) field = (__typeof__(field))sym(lib, name, base, ver)
    R(real.cuGetProcAddress_v2, "cuGetProcAddress_v2", NULL, 0);
    R(real.gpa_v1, "cuGetProcAddress", NULL, 0);
    R(real.cuInit, "cuInit", "cuInit", 2000);
    R(real.cuGetErrorName, "cuGetErrorName", "cuGetErrorName", 6000);
    R(real.cuMemCreate, "cuMemCreate", "cuMemCreate", 10020);
    R(real.cuMemRelease, "cuMemRelease", "cuMemRelease", 10020);
    R(real.cuMemMap, "cuMemMap", "cuMemMap", 10020);
    R(real.cuMemUnmap, "cuMemUnmap", "cuMemUnmap", 10020);
    R(real.cuMemSetAccess, "cuMemSetAccess", "cuMemSetAccess", 10020);
    R(real.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle",
      "cuMemRetainAllocationHandle", 11000);
    R(real.cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle",
      "cuMemGetAllocationPropertiesFromHandle", 10020);
    R(real.cuMemExportToShareableHandle, "cuMemExportToShareableHandle",
      "cuMemExportToShareableHandle", 10020);
    R(real.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle",
      "cuMemImportFromShareableHandle", 10020);
    R(real.cuMemAddressReserve, "cuMemAddressReserve", "cuMemAddressReserve", 10020);
    R(real.cuMemAddressFree, "cuMemAddressFree", "cuMemAddressFree", 10020);
    R(real.cuMemHostAlloc, "cuMemHostAlloc", "cuMemHostAlloc", 2020);
    R(real.cuMemFreeHost, "cuMemFreeHost", "cuMemFreeHost", 2000);
    R(real.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync", 3020);
    R(real.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync", 3020);
    R(real.cuStreamCreate, "cuStreamCreate", "cuStreamCreate", 2000);
    R(real.cuStreamSynchronize, "cuStreamSynchronize", "cuStreamSynchronize", 2000);
    R(real.cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy", 4000);
    R(real.cuEventCreate, "cuEventCreate", "cuEventCreate", 2000);
    R(real.cuEventRecord, "cuEventRecord", "cuEventRecord", 2000);
    R(real.cuEventSynchronize, "cuEventSynchronize", "cuEventSynchronize", 2000);
    R(real.cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy", 4000);
    R(real.cuCtxGetCurrent, "cuCtxGetCurrent", "cuCtxGetCurrent", 4000);
    R(real.cuCtxPushCurrent, "cuCtxPushCurrent_v2", "cuCtxPushCurrent", 4000);
    R(real.cuCtxPopCurrent, "cuCtxPopCurrent_v2", "cuCtxPopCurrent", 4000);
    R(real.cuCtxGetDevice, "cuCtxGetDevice", "cuCtxGetDevice", 2000);
    R(real.cuCtxSynchronize, "cuCtxSynchronize", "cuCtxSynchronize", 2000);
    R(real.cuDeviceGetCount, "cuDeviceGetCount", "cuDeviceGetCount", 2000);
    R(real.cuDeviceGetUuid, "cuDeviceGetUuid_v2", "cuDeviceGetUuid", 11040);
    R(real.cuDeviceGetName, "cuDeviceGetName", "cuDeviceGetName", 2000);
    R(real.cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState", "cuDevicePrimaryCtxGetState",
      7000);
    R(real.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", 7000);
    R(real.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2",
      "cuDevicePrimaryCtxRelease", 11000);
    R(real.cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc", 3020);
    R(real.cuMemAllocPitch, "cuMemAllocPitch_v2", "cuMemAllocPitch", 3020);
    R(real.cuMemFree, "cuMemFree_v2", "cuMemFree", 3020);
    R(real.cuMemGetAddressRange, "cuMemGetAddressRange_v2", "cuMemGetAddressRange", 3020);
    R(real.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity",
      "cuMemGetAllocationGranularity", 10020);
    R(real.cuPointerGetAttribute, "cuPointerGetAttribute", "cuPointerGetAttribute", 4000);
    R(real.cuPointerGetAttributes, "cuPointerGetAttributes", "cuPointerGetAttributes", 7000);
    R(real.cuCtxDestroy, "cuCtxDestroy_v2", "cuCtxDestroy", 4000);
    R(real.cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset",
      11000);
    R(real.cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", 4000);
    R(real.cuCtxDisablePeerAccess, "cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", 4000);
    R(real.cuIpcGetMemHandle, "cuIpcGetMemHandle", "cuIpcGetMemHandle", 4010);
    R(real.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle", 11000);
    R(real.cuIpcOpenMemHandle_v1, "cuIpcOpenMemHandle", NULL, 0);
    R(real.cuIpcCloseMemHandle, "cuIpcCloseMemHandle", "cuIpcCloseMemHandle", 4010);
    R(real.cuMemPoolExportToShareableHandle, "cuMemPoolExportToShareableHandle",
      "cuMemPoolExportToShareableHandle", 11020);
    R(real.cuMemPoolImportFromShareableHandle, "cuMemPoolImportFromShareableHandle",
      "cuMemPoolImportFromShareableHandle", 11020);
    R(real.cuMemPoolExportPointer, "cuMemPoolExportPointer", "cuMemPoolExportPointer", 11020);
    R(real.cuMemPoolImportPointer, "cuMemPoolImportPointer", "cuMemPoolImportPointer", 11020);
    R(real.cuMemPoolDestroy, "cuMemPoolDestroy", "cuMemPoolDestroy", 11020);
    R(real.cuMulticastCreate, "cuMulticastCreate", "cuMulticastCreate", 12010);
    R(real.cuMulticastAddDevice, "cuMulticastAddDevice", "cuMulticastAddDevice", 12010);
    R(real.cuMulticastBindMem, "cuMulticastBindMem", "cuMulticastBindMem", 12010);
    R(real.cuMulticastBindAddr, "cuMulticastBindAddr", "cuMulticastBindAddr", 12010);
    R(real.cuMulticastUnbind, "cuMulticastUnbind", "cuMulticastUnbind", 12010);
    /* The device-explicit binds only by name: asking the resolver at 13010
     * could hand back the old ABI on a 13.0 driver. */
    R(real.cuMulticastBindMem_v2, "cuMulticastBindMem_v2", NULL, 0);
    R(real.cuMulticastBindAddr_v2, "cuMulticastBindAddr_v2", NULL, 0);
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
