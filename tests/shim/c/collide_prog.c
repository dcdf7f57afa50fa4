/* Against collide_driver: cuMemCreate through the shim must fail with
 * CUDA_ERROR_NOT_SUPPORTED and the driver's handle must have been released. */
#include <cuda.h>

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*init)(unsigned);
    int (*releases)(void);
    CUmemGenericAllocationHandle h = 0;
    CUmemAllocationProp p;
    CUresult r;

    if (!lib)
        return 2;
    init = (CUresult(*)(unsigned))dlsym(lib, "cuInit");
    create = (__typeof__(create))dlsym(lib, "cuMemCreate");
    releases = (int (*)(void))dlsym(lib, "collide_releases");
    if (!init || !create || !releases)
        return 2;
    memset(&p, 0, sizeof p);
    init(0);
    r = create(&h, 1 << 21, &p, 0);
    printf("create=%d handle=%#llx releases=%d\n", (int)r, (unsigned long long)h, releases());
    return r == CUDA_ERROR_NOT_SUPPORTED && h == 0 && releases() == 1 ? 0 : 1;
}
