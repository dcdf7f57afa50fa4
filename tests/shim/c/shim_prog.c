/*
 * Resolution test program: reaches the driver either through direct symbols
 * (linked against libcuda.so.1) or, with VIA_DLSYM, through
 * dlopen("libcuda.so.1") + dlsym, and checks that the shim stands in the way.
 *
 *   export  create an exportable allocation, fill it, export it: the FD must
 *           be a cuinterpose capability (sealed memfd, magic "CUIC"); import
 *           it back (own capability), map it at a second VA, read the bytes.
 *   bogus   tagged values that are unknown or dead are rejected
 *           (CUDA_ERROR_INVALID_VALUE), never passed to the driver.
 *
 * Prints one line "key=value ..." and exits 0 when every check passed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* F_GET_SEALS */
#endif
#include <cuda.h>

#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct api {
    CUresult (*init)(unsigned);
    CUresult (*deviceGet)(CUdevice *, int);
    CUresult (*primaryRetain)(CUcontext *, CUdevice);
    CUresult (*ctxSetCurrent)(CUcontext);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *,
                            CUmemAllocationGranularity_flags);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*addrFree)(CUdeviceptr, size_t);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                    unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*setAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*exportH)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                        unsigned long long);
    CUresult (*importH)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*errName)(CUresult, const char **);
};

static struct api A;

#ifdef VIA_DLSYM
static void *must(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "dlsym %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        exit(2);
    }
#define L(f, n) A.f = (__typeof__(A.f))must(lib, n)
    L(init, "cuInit");
    L(deviceGet, "cuDeviceGet");
    L(primaryRetain, "cuDevicePrimaryCtxRetain");
    L(ctxSetCurrent, "cuCtxSetCurrent");
    L(granularity, "cuMemGetAllocationGranularity");
    L(create, "cuMemCreate");
    L(reserve, "cuMemAddressReserve");
    L(addrFree, "cuMemAddressFree");
    L(map, "cuMemMap");
    L(unmap, "cuMemUnmap");
    L(setAccess, "cuMemSetAccess");
    L(release, "cuMemRelease");
    L(htod, "cuMemcpyHtoD_v2");
    L(dtoh, "cuMemcpyDtoH_v2");
    L(exportH, "cuMemExportToShareableHandle");
    L(importH, "cuMemImportFromShareableHandle");
    L(errName, "cuGetErrorName");
#undef L
}
#else
static void load(void)
{
    A.init = cuInit;
    A.deviceGet = cuDeviceGet;
    A.primaryRetain = cuDevicePrimaryCtxRetain;
    A.ctxSetCurrent = cuCtxSetCurrent;
    A.granularity = cuMemGetAllocationGranularity;
    A.create = cuMemCreate;
    A.reserve = cuMemAddressReserve;
    A.addrFree = cuMemAddressFree;
    A.map = cuMemMap;
    A.unmap = cuMemUnmap;
    A.setAccess = cuMemSetAccess;
    A.release = cuMemRelease;
    A.htod = cuMemcpyHtoD;
    A.dtoh = cuMemcpyDtoH;
    A.exportH = cuMemExportToShareableHandle;
    A.importH = cuMemImportFromShareableHandle;
    A.errName = cuGetErrorName;
}
#endif

static const char *name(CUresult r)
{
    const char *s = "?";
    A.errName(r, &s);
    return s;
}

#define CK(call)                                                                         \
    do {                                                                                 \
        CUresult r_ = (call);                                                            \
        if (r_ != CUDA_SUCCESS) {                                                        \
            fprintf(stderr, "%s:%d %s -> %s\n", __FILE__, __LINE__, #call, name(r_));    \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

static CUmemAllocationProp prop(void)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
}

static size_t setup(void)
{
    CUdevice dev;
    CUcontext ctx;
    size_t gran = 0;
    CUmemAllocationProp p = prop();
    CK(A.init(0));
    CK(A.deviceGet(&dev, 0));
    CK(A.primaryRetain(&ctx, dev));
    CK(A.ctxSetCurrent(ctx));
    CK(A.granularity(&gran, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    return gran;
}

static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size)
{
    CUdeviceptr va;
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    d.location.id = 0;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(A.reserve(&va, size, 0, 0, 0));
    CK(A.map(va, size, 0, h, 0));
    CK(A.setAccess(va, size, &d, 1));
    return va;
}

static int is_capability(int fd)
{
    struct stat st;
    uint32_t magic = 0;
    int seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || seals < 0)
        return 0;
    if ((seals & (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) !=
        (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL))
        return 0;
    if (pread(fd, &magic, sizeof magic, 0) != (ssize_t)sizeof magic)
        return 0;
    return st.st_size == 128 && magic == 0x43495543u;
}

static int mode_export(void)
{
    size_t size = setup() * 2;
    CUmemAllocationProp p = prop();
    CUmemGenericAllocationHandle h, h2;
    CUdeviceptr va, va2;
    unsigned char *in = malloc(size), *out = malloc(size);
    int fd = -1, cap, tagged, same;

    for (size_t i = 0; i < size; i++)
        in[i] = (unsigned char)(i * 131 + 7);
    CK(A.create(&h, size, &p, 0));
    tagged = ((uint64_t)h >> 48) == 0xC1F0u;
    va = map_rw(h, size);
    CK(A.htod(va, in, size));
    CK(A.exportH(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    cap = is_capability(fd);
    CK(A.importH(&h2, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    va2 = map_rw(h2, size);
    CK(A.dtoh(out, va2, size));
    same = !memcmp(in, out, size);
    CK(A.unmap(va2, size));
    CK(A.unmap(va, size));
    CK(A.release(h2));
    CK(A.release(h));
    CK(A.addrFree(va2, size));
    CK(A.addrFree(va, size));
    printf("capability=%d tagged=%d own_import_same_bytes=%d\n", cap, tagged, same);
    free(in);
    free(out);
    return cap && tagged && same ? 0 : 1;
}

static int mode_bogus(void)
{
    size_t size = setup();
    CUmemAllocationProp p = prop();
    CUmemGenericAllocationHandle h, unknown = (CUmemGenericAllocationHandle)0xC1F0123400005678ull;
    CUdeviceptr va;
    CUresult r1, r2, r3, r4;

    r1 = A.release(unknown);
    CK(A.reserve(&va, size, 0, 0, 0));
    r2 = A.map(va, size, 0, unknown, 0);
    CK(A.create(&h, size, &p, 0));
    CK(A.release(h));
    r3 = A.release(h);           /* dead */
    r4 = A.map(va, size, 0, h, 0); /* dead */
    CK(A.addrFree(va, size));
    printf("unknown_release=%s unknown_map=%s dead_release=%s dead_map=%s\n", name(r1),
           name(r2), name(r3), name(r4));
    return r1 == CUDA_ERROR_INVALID_VALUE && r2 == CUDA_ERROR_INVALID_VALUE &&
                   r3 == CUDA_ERROR_INVALID_VALUE && r4 == CUDA_ERROR_INVALID_VALUE
               ? 0
               : 1;
}

int main(int argc, char **argv)
{
    load();
    if (argc > 1 && !strcmp(argv[1], "export"))
        return mode_export();
    if (argc > 1 && !strcmp(argv[1], "bogus"))
        return mode_bogus();
    fprintf(stderr, "usage: %s export|bogus\n", argv[0]);
    return 2;
}
