/*
 * A stand-in libcuda.so.1 whose handles fall in the shim's tag range
 * (0xC1F0 << 48): the shim must refuse them cleanly (release the driver's
 * handle, answer CUDA_ERROR_NOT_SUPPORTED) instead of handing out a value it
 * could not tell apart from its own. Just enough driver for the shim to load.
 */
#define __CUDA_API_PUSH_VISIBILITY_DEFAULT 1
#include <cuda.h>

#include <string.h>

static int releases;
static int creates;

__attribute__((visibility("default"))) int collide_releases(void)
{
    return releases;
}

CUresult CUDAAPI cuInit(unsigned int flags)
{
    (void)flags;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult r, const char **s)
{
    *s = r == CUDA_SUCCESS ? "CUDA_SUCCESS" : r == CUDA_ERROR_NOT_SUPPORTED
                                                  ? "CUDA_ERROR_NOT_SUPPORTED"
                                                  : "CUDA_ERROR_OTHER";
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetCurrent(CUcontext *c)
{
    *c = NULL;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *h, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags)
{
    (void)size, (void)prop, (void)flags;
    *h = (CUmemGenericAllocationHandle)(0xC1F0ull << 48 | (unsigned)++creates);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle h)
{
    (void)h;
    releases++;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemMap(CUdeviceptr p, size_t s, size_t o, CUmemGenericAllocationHandle h,
                          unsigned long long f)
{
    (void)p, (void)s, (void)o, (void)h, (void)f;
    return CUDA_ERROR_NOT_SUPPORTED;
}

#undef cuGetProcAddress
CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *st)
{
    (void)version, (void)flags;
    *pfn = NULL;
    if (!strcmp(symbol, "cuMemCreate"))
        *pfn = (void *)cuMemCreate;
    else if (!strcmp(symbol, "cuMemRelease"))
        *pfn = (void *)cuMemRelease;
    if (st)
        *st = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_SUCCESS;
}
