/* Modules and kernel launches, as far as the shim needs them: the simulated
 * GPU runs no code, so cuModuleLoadData accepts only the shim's own kernel
 * (the kept host copy's chunk hash, recognized by its entry point KH_ENTRY in
 * the PTX) and cuLaunchKernel runs its C twin (../keephash.h: the same
 * per-word steps and finalizers as the PTX) over the device memory, queued on
 * the stream like any work. Any other image is CUDA_ERROR_NOT_SUPPORTED:
 * the simulator cannot run it. cuinterposeSimFailLaunch injects one failed
 * launch (util.c's helper); cuinterposeSimFailModule fails every load after
 * `skip` until it is called again with CUDA_SUCCESS (the shim loads the
 * kernel ahead, on a thread of its own, and again at SAVE: one failure would
 * land on whichever came first). */
#include "sim.h"

#include <stdlib.h>
#include <string.h>

#include "../keephash.h"

#define MODULE_MAGIC 0x4d4f4453u /* "SDOM" */

struct sim_module {
    unsigned magic;
    struct sim_function {
        unsigned magic;
    } hash;
};

static int module_valid(const struct sim_module *m)
{
    return m && m->magic == MODULE_MAGIC;
}

/* The twin of kernels/keep_hash.cu for one chunk of `n` words: lane t folds
 * words t, t + KH_THREADS, ...; the lanes' finalized states XORed. */
static void twin_chunk(const unsigned long long *p, unsigned long long n,
                       unsigned long long out[2])
{
    out[0] = out[1] = 0;
    for (unsigned t = 0; t < KH_THREADS; t++) {
        unsigned long long a, b;
        kh_lane_init(t, &a, &b);
        for (unsigned long long i = t; i < n; i += KH_THREADS)
            kh_lane_step(&a, &b, p[i]);
        kh_lane_final(t, &a, &b);
        out[0] ^= a;
        out[1] ^= b;
    }
}

/* The queued launch: w->src the words (w->n of them), w->dst the output,
 * w->width the grid (one chunk per block). Memory unmapped since the launch
 * was checked fails the context, as any work does. */
static CUresult run_hash(struct sim_work *w)
{
    const unsigned long long *base = (const unsigned long long *)w->src;
    unsigned long long *out = (unsigned long long *)w->dst;
    CUresult r;

    sim_lock();
    r = sim_copy_range_check(w->src, w->n * 8, w->dev, 0);
    if (r == CUDA_SUCCESS)
        r = sim_copy_range_check(w->dst, w->width * 16, w->dev, 1);
    if (r == CUDA_SUCCESS)
        for (size_t c = 0; c < w->width; c++) {
            unsigned long long first = (unsigned long long)c * KH_WORDS;
            unsigned long long n = first >= w->n ? 0
                                   : w->n - first < KH_WORDS ? w->n - first : KH_WORDS;
            twin_chunk(base + first, n, out + 2 * c);
        }
    sim_unlock();
    return r == CUDA_SUCCESS ? r : CUDA_ERROR_ILLEGAL_ADDRESS;
}

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image)
{
    struct sim_module *m;
    CUresult r;

    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    r = sim.fail_module.result;
    if (r != CUDA_SUCCESS && sim.fail_module.skip > 0) {
        sim.fail_module.skip--;
        r = CUDA_SUCCESS;
    }
    sim_unlock();
    if (r != CUDA_SUCCESS)
        return r;
    if (!sim_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!strstr((const char *)image, ".entry " KH_ENTRY "("))
        return CUDA_ERROR_NOT_SUPPORTED;
    m = calloc(1, sizeof *m);
    if (!m)
        return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MODULE_MAGIC;
    m->hash.magic = MODULE_MAGIC;
    *module = (CUmodule)m;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleUnload(CUmodule module)
{
    struct sim_module *m = (struct sim_module *)module;

    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    m->magic = 0;
    m->hash.magic = 0;
    free(m);
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule module, const char *name)
{
    struct sim_module *m = (struct sim_module *)module;

    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!module_valid(m))
        return CUDA_ERROR_INVALID_HANDLE;
    if (strcmp(name, KH_ENTRY) != 0)
        return CUDA_ERROR_NOT_FOUND;
    *hfunc = (CUfunction)&m->hash;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
                       void **extra)
{
    const struct sim_function *fn = (const struct sim_function *)f;
    struct sim_work w;
    int dev;
    CUresult r;

    if (!fn || fn->magic != MODULE_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!params || extra || gx == 0 || gy != 1 || gz != 1 || bx != KH_THREADS || by != 1 ||
        bz != 1 || shared != 0)
        return CUDA_ERROR_INVALID_VALUE;
    r = sim_fault_due(&sim.fail_launch);
    if (r == CUDA_SUCCESS)
        r = sim_current_dev(&dev);
    if (r == CUDA_SUCCESS)
        r = sim_stream_check(s);
    if (r != CUDA_SUCCESS)
        return r;
    memset(&w, 0, sizeof w);
    w.run = run_hash;
    memcpy(&w.src, params[0], sizeof w.src);
    memcpy(&w.n, params[1], sizeof w.n);
    memcpy(&w.dst, params[2], sizeof w.dst);
    w.width = gx;
    if (w.n > SIZE_MAX / 8 || (unsigned long long)gx * KH_WORDS < w.n)
        return CUDA_ERROR_INVALID_VALUE;
    sim_lock();
    r = sim_copy_range_check(w.src, w.n * 8, dev, 0);
    if (r == CUDA_SUCCESS)
        r = sim_copy_range_check(w.dst, (size_t)gx * 16, dev, 1);
    sim_unlock();
    return r == CUDA_SUCCESS ? sim_enqueue(s, &w) : r;
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                unsigned by, unsigned bz, unsigned shared, CUstream s,
                                void **params, void **extra)
{
    SIM_API(launch(f, gx, gy, gz, bx, by, bz, shared, s, params, extra));
}

CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                     unsigned bx, unsigned by, unsigned bz, unsigned shared,
                                     CUstream s, void **params, void **extra)
{
    SIM_API(launch(f, gx, gy, gz, bx, by, bz, shared, sim_per_thread(s), params, extra));
}

int cuinterposeSimFailModule(unsigned skip, CUresult result)
{
    sim_fault_arm(&sim.fail_module, skip, result);
    return 0;
}

int cuinterposeSimFailLaunch(unsigned skip, CUresult result)
{
    sim_fault_arm(&sim.fail_launch, skip, result);
    return 0;
}
