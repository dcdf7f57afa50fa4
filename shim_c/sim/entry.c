/* Loading and resolution: cuInit, version, error strings, and the
 * cuGetProcAddress resolver that cuda.bindings 13.x goes through for every
 * function (records/cuda-bindings-13.5-resolver-requests.txt). */
#include "sim.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The version-less resolver of CUDA 11.3..11.8, still exported by the real
 * driver under its plain name; cuda.h renames cuGetProcAddress to _v2. */
#undef cuGetProcAddress
SIM_EXPORT CUresult CUDAAPI sim_get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion,
                                                    cuuint64_t flags) __asm__("cuGetProcAddress");

int cuinterposeSimIsSimulated(void)
{
    return 1;
}

static void init_once_fn(void)
{
    sim.ndev = (int)sim_env_long("CUINTERPOSE_SIM_DEVICES", SIM_DEFAULT_DEVICES, 0, SIM_MAX_DEVICES);
    sim.mem_total = (uint64_t)sim_env_long("CUINTERPOSE_SIM_MEM_MIB", (long)SIM_DEFAULT_MEM_MIB, 64,
                                           1L << 30) << 20;
    sim.node = sim_env_node();
    sim_env_chip(sim.chip, sizeof sim.chip);
    for (int i = 0; i < SIM_MAX_DEVICES; i++)
        sim.gpu[i] = (uint8_t)i;
    sim.work_us = sim_env_long("CUINTERPOSE_SIM_WORK_US", 0, 0, 10L * 1000 * 1000);
    sim.next_handle = 0x5100000000ULL; /* recognisable, never a small integer */
    sim.next_ctx_id = 1;
    if (sim.ndev == 0) {
        sim.init_result = CUDA_ERROR_NO_DEVICE;
        return;
    }
    sim_acct_init();
    if (sim_service_start() != 0) {
        sim.init_result = CUDA_ERROR_OPERATING_SYSTEM;
        return;
    }
    sim.initialized = 1;
    sim.init_result = CUDA_SUCCESS;
}

CUresult CUDAAPI cuInit(unsigned int Flags)
{
    if (Flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&sim.init_once, init_once_fn);
    return sim.init_result;
}

CUresult CUDAAPI cuDriverGetVersion(int *driverVersion)
{
    if (!driverVersion)
        return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = SIM_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* ---- error strings ---------------------------------------------------- */

struct err_name {
    CUresult code;
    const char *name;
};

#define E(x) {x, #x}
static const struct err_name err_names[] = {
    E(CUDA_SUCCESS),
    E(CUDA_ERROR_INVALID_VALUE),
    E(CUDA_ERROR_OUT_OF_MEMORY),
    E(CUDA_ERROR_NOT_INITIALIZED),
    E(CUDA_ERROR_DEINITIALIZED),
    E(CUDA_ERROR_PROFILER_DISABLED),
    E(CUDA_ERROR_PROFILER_NOT_INITIALIZED),
    E(CUDA_ERROR_PROFILER_ALREADY_STARTED),
    E(CUDA_ERROR_PROFILER_ALREADY_STOPPED),
    E(CUDA_ERROR_STUB_LIBRARY),
    E(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER),
    E(CUDA_ERROR_DEVICE_UNAVAILABLE),
    {SIM_ERROR_MULTICAST_RESOURCE_FULL, "CUDA_ERROR_MULTICAST_RESOURCE_FULL"},
    E(CUDA_ERROR_NO_DEVICE),
    E(CUDA_ERROR_INVALID_DEVICE),
    E(CUDA_ERROR_DEVICE_NOT_LICENSED),
    E(CUDA_ERROR_INVALID_IMAGE),
    E(CUDA_ERROR_INVALID_CONTEXT),
    E(CUDA_ERROR_CONTEXT_ALREADY_CURRENT),
    E(CUDA_ERROR_MAP_FAILED),
    E(CUDA_ERROR_UNMAP_FAILED),
    E(CUDA_ERROR_ARRAY_IS_MAPPED),
    E(CUDA_ERROR_ALREADY_MAPPED),
    E(CUDA_ERROR_NO_BINARY_FOR_GPU),
    E(CUDA_ERROR_ALREADY_ACQUIRED),
    E(CUDA_ERROR_NOT_MAPPED),
    E(CUDA_ERROR_NOT_MAPPED_AS_ARRAY),
    E(CUDA_ERROR_NOT_MAPPED_AS_POINTER),
    E(CUDA_ERROR_ECC_UNCORRECTABLE),
    E(CUDA_ERROR_UNSUPPORTED_LIMIT),
    E(CUDA_ERROR_CONTEXT_ALREADY_IN_USE),
    E(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED),
    E(CUDA_ERROR_INVALID_PTX),
    E(CUDA_ERROR_INVALID_GRAPHICS_CONTEXT),
    E(CUDA_ERROR_NVLINK_UNCORRECTABLE),
    E(CUDA_ERROR_JIT_COMPILER_NOT_FOUND),
    E(CUDA_ERROR_UNSUPPORTED_PTX_VERSION),
    E(CUDA_ERROR_JIT_COMPILATION_DISABLED),
    E(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY),
    E(CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC),
    E(CUDA_ERROR_CONTAINED),
    {SIM_ERROR_INSUFFICIENT_LOADER_VERSION, "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION"},
    E(CUDA_ERROR_INVALID_SOURCE),
    E(CUDA_ERROR_FILE_NOT_FOUND),
    E(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND),
    E(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED),
    E(CUDA_ERROR_OPERATING_SYSTEM),
    E(CUDA_ERROR_INVALID_HANDLE),
    E(CUDA_ERROR_ILLEGAL_STATE),
    E(CUDA_ERROR_LOSSY_QUERY),
    E(CUDA_ERROR_NOT_FOUND),
    E(CUDA_ERROR_NOT_READY),
    E(CUDA_ERROR_ILLEGAL_ADDRESS),
    E(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES),
    E(CUDA_ERROR_LAUNCH_TIMEOUT),
    E(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING),
    E(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED),
    E(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED),
    E(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE),
    E(CUDA_ERROR_CONTEXT_IS_DESTROYED),
    E(CUDA_ERROR_ASSERT),
    E(CUDA_ERROR_TOO_MANY_PEERS),
    E(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED),
    E(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
    E(CUDA_ERROR_HARDWARE_STACK_ERROR),
    E(CUDA_ERROR_ILLEGAL_INSTRUCTION),
    E(CUDA_ERROR_MISALIGNED_ADDRESS),
    E(CUDA_ERROR_INVALID_ADDRESS_SPACE),
    E(CUDA_ERROR_INVALID_PC),
    E(CUDA_ERROR_LAUNCH_FAILED),
    E(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE),
    E(CUDA_ERROR_TENSOR_MEMORY_LEAK),
    E(CUDA_ERROR_NOT_PERMITTED),
    E(CUDA_ERROR_NOT_SUPPORTED),
    E(CUDA_ERROR_SYSTEM_NOT_READY),
    E(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH),
    E(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE),
    E(CUDA_ERROR_MPS_CONNECTION_FAILED),
    E(CUDA_ERROR_MPS_RPC_FAILURE),
    E(CUDA_ERROR_MPS_SERVER_NOT_READY),
    E(CUDA_ERROR_MPS_MAX_CLIENTS_REACHED),
    E(CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED),
    E(CUDA_ERROR_MPS_CLIENT_TERMINATED),
    E(CUDA_ERROR_CDP_NOT_SUPPORTED),
    E(CUDA_ERROR_CDP_VERSION_MISMATCH),
    E(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED),
    E(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
    E(CUDA_ERROR_STREAM_CAPTURE_MERGE),
    E(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED),
    E(CUDA_ERROR_STREAM_CAPTURE_UNJOINED),
    E(CUDA_ERROR_STREAM_CAPTURE_ISOLATION),
    E(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
    E(CUDA_ERROR_CAPTURED_EVENT),
    E(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD),
    E(CUDA_ERROR_TIMEOUT),
    E(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE),
    E(CUDA_ERROR_EXTERNAL_DEVICE),
    E(CUDA_ERROR_INVALID_CLUSTER_SIZE),
    E(CUDA_ERROR_FUNCTION_NOT_LOADED),
    E(CUDA_ERROR_INVALID_RESOURCE_TYPE),
    E(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION),
    E(CUDA_ERROR_KEY_ROTATION),
    {SIM_ERROR_STREAM_DETACHED, "CUDA_ERROR_STREAM_DETACHED"},
    {SIM_ERROR_GRAPH_RECAPTURE_FAILURE, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE"},
    {SIM_ERROR_FABRIC_NOT_READY, "CUDA_ERROR_FABRIC_NOT_READY"},
    E(CUDA_ERROR_UNKNOWN),
};
#undef E

static const struct err_name err_strings[] = {
    {CUDA_SUCCESS, "no error"},
    {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_PERMITTED, "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "operation not supported"},
    {CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"},
    {CUDA_ERROR_TIMEOUT, "wait operation timed out"},
    {CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_UNKNOWN, "unknown error"},
};

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(err_names) / sizeof(err_names[0]); i++) {
        if (err_names[i].code == error) {
            *pStr = err_names[i].name;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(err_strings) / sizeof(err_strings[0]); i++) {
        if (err_strings[i].code == error) {
            *pStr = err_strings[i].name;
            return CUDA_SUCCESS;
        }
    }
    /* Codes without a sentence of their own read as their name. */
    return cuGetErrorName(error, pStr);
}

/* ---- resolver --------------------------------------------------------- */

struct proc {
    const char *name;
    int version; /* first CUDA version whose ABI this entry implements */
    void *fn;
};

/* For a (name, version) request the entry with the highest version not
 * above the requested one wins, as in the real driver: cuMemcpyDtoH at 3020
 * is the _v2 ABI, cuMulticastBindMem at 13010 the device-explicit one. */
/* Deprecated entry points are still the driver's to hand out. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#define P(name, ver, fn) {name, ver, (void *)(fn)}
static const struct proc procs[] = {
    P("cuInit", 2000, cuInit),
    P("cuDriverGetVersion", 2020, cuDriverGetVersion),
    P("cuGetProcAddress", 11030, sim_get_proc_address_v1),
    P("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    P("cuGetErrorName", 6000, cuGetErrorName),
    P("cuGetErrorString", 6000, cuGetErrorString),
    /* devices */
    P("cuDeviceGet", 2000, cuDeviceGet),
    P("cuDeviceGetCount", 2000, cuDeviceGetCount),
    P("cuDeviceGetName", 2000, cuDeviceGetName),
    P("cuDeviceGetUuid", 9020, cuDeviceGetUuid_v2),
    P("cuDeviceGetUuid", 11040, cuDeviceGetUuid_v2),
    P("cuDeviceGetAttribute", 2000, cuDeviceGetAttribute),
    P("cuDeviceTotalMem", 3020, cuDeviceTotalMem_v2),
    P("cuDeviceComputeCapability", 2000, cuDeviceComputeCapability),
    P("cuDeviceGetPCIBusId", 4010, cuDeviceGetPCIBusId),
    P("cuDeviceCanAccessPeer", 4000, cuDeviceCanAccessPeer),
    P("cuDevicePrimaryCtxRetain", 7000, cuDevicePrimaryCtxRetain),
    /* The 7.0 primary-context calls share the 11.0 ABI. */
    P("cuDevicePrimaryCtxRelease", 7000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxRelease", 11000, cuDevicePrimaryCtxRelease_v2),
    P("cuDevicePrimaryCtxGetState", 7000, cuDevicePrimaryCtxGetState),
    P("cuDevicePrimaryCtxSetFlags", 7000, cuDevicePrimaryCtxSetFlags_v2),
    P("cuDevicePrimaryCtxSetFlags", 11000, cuDevicePrimaryCtxSetFlags_v2),
    P("cuDevicePrimaryCtxReset", 7000, cuDevicePrimaryCtxReset_v2),
    P("cuDevicePrimaryCtxReset", 11000, cuDevicePrimaryCtxReset_v2),
    /* contexts */
    P("cuCtxCreate", 3020, cuCtxCreate_v2),
    P("cuCtxCreate", 12050, cuCtxCreate_v4),
    P("cuCtxDestroy", 4000, cuCtxDestroy_v2),
    P("cuCtxSetCurrent", 4000, cuCtxSetCurrent),
    P("cuCtxGetCurrent", 4000, cuCtxGetCurrent),
    P("cuCtxPushCurrent", 4000, cuCtxPushCurrent_v2),
    P("cuCtxPopCurrent", 4000, cuCtxPopCurrent_v2),
    P("cuCtxGetDevice", 2000, cuCtxGetDevice),
    P("cuCtxGetDevice", 13000, cuCtxGetDevice_v2),
    P("cuCtxSynchronize", 2000, cuCtxSynchronize),
    P("cuCtxSynchronize", 13000, cuCtxSynchronize_v2),
    P("cuCtxGetApiVersion", 3020, cuCtxGetApiVersion),
    P("cuCtxGetFlags", 7000, cuCtxGetFlags),
    P("cuCtxGetId", 12000, cuCtxGetId),
    /* streams and events */
    P("cuStreamCreate", 2000, cuStreamCreate),
    P("cuStreamCreateWithPriority", 5050, cuStreamCreateWithPriority),
    P("cuStreamDestroy", 4000, cuStreamDestroy_v2),
    P("cuStreamSynchronize", 2000, cuStreamSynchronize),
    P("cuStreamQuery", 2000, cuStreamQuery),
    P("cuStreamGetCtx", 9020, cuStreamGetCtx),
    P("cuStreamGetFlags", 5050, cuStreamGetFlags),
    P("cuStreamGetPriority", 5050, cuStreamGetPriority),
    P("cuStreamWaitEvent", 3020, cuStreamWaitEvent),
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc),
    P("cuModuleLoadData", 2000, cuModuleLoadData),
    P("cuModuleUnload", 2000, cuModuleUnload),
    P("cuModuleGetFunction", 2000, cuModuleGetFunction),
    P("cuLaunchKernel", 4000, cuLaunchKernel),
    P("cuStreamAddCallback", 5000, cuStreamAddCallback),
    P("cuEventCreate", 2000, cuEventCreate),
    P("cuEventDestroy", 4000, cuEventDestroy_v2),
    P("cuEventRecord", 2000, cuEventRecord),
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags),
    P("cuEventQuery", 2000, cuEventQuery),
    P("cuEventSynchronize", 2000, cuEventSynchronize),
    P("cuEventElapsedTime", 12080, cuEventElapsedTime_v2),
    /* memory */
    P("cuMemGetInfo", 3020, cuMemGetInfo_v2),
    P("cuMemAlloc", 3020, cuMemAlloc_v2),
    P("cuMemAllocPitch", 3020, cuMemAllocPitch_v2),
    P("cuMemFree", 3020, cuMemFree_v2),
    P("cuMemGetAddressRange", 3020, cuMemGetAddressRange_v2),
    P("cuMemGetAllocationGranularity", 10020, cuMemGetAllocationGranularity),
    P("cuMemAddressReserve", 10020, cuMemAddressReserve),
    P("cuMemAddressFree", 10020, cuMemAddressFree),
    P("cuMemCreate", 10020, cuMemCreate),
    P("cuMemRelease", 10020, cuMemRelease),
    P("cuMemMap", 10020, cuMemMap),
    P("cuMemUnmap", 10020, cuMemUnmap),
    P("cuMemSetAccess", 10020, cuMemSetAccess),
    P("cuMemGetAccess", 10020, cuMemGetAccess),
    P("cuMemExportToShareableHandle", 10020, cuMemExportToShareableHandle),
    P("cuMemImportFromShareableHandle", 10020, cuMemImportFromShareableHandle),
    P("cuMemGetAllocationPropertiesFromHandle", 10020, cuMemGetAllocationPropertiesFromHandle),
    P("cuMemRetainAllocationHandle", 11000, cuMemRetainAllocationHandle),
    P("cuPointerGetAttribute", 4000, cuPointerGetAttribute),
    P("cuPointerGetAttributes", 7000, cuPointerGetAttributes),
    /* legacy IPC and peer access */
    P("cuIpcGetMemHandle", 4010, cuIpcGetMemHandle),
    P("cuIpcOpenMemHandle", 4010, sim_ipc_open_mem_v1),
    P("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2),
    P("cuIpcCloseMemHandle", 4010, cuIpcCloseMemHandle),
    P("cuIpcGetEventHandle", 4010, cuIpcGetEventHandle),
    P("cuIpcOpenEventHandle", 4010, cuIpcOpenEventHandle),
    P("cuCtxEnablePeerAccess", 4000, cuCtxEnablePeerAccess),
    P("cuCtxDisablePeerAccess", 4000, cuCtxDisablePeerAccess),
    /* copies and host memory */
    P("cuMemcpy", 4000, cuMemcpy),
    P("cuMemcpyAsync", 4000, cuMemcpyAsync),
    P("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2),
    P("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2),
    P("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2),
    P("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2),
    P("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2),
    P("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2),
    P("cuMemcpyPeer", 4000, cuMemcpyPeer),
    P("cuMemcpyPeerAsync", 4000, cuMemcpyPeerAsync),
    P("cuArrayCreate", 3020, cuArrayCreate_v2),
    P("cuArrayDestroy", 2000, cuArrayDestroy),
    P("cuMemcpyAtoH", 3020, cuMemcpyAtoH_v2),
    P("cuMemcpyHtoA", 3020, cuMemcpyHtoA_v2),
    P("cuMemcpyAtoD", 3020, cuMemcpyAtoD_v2),
    P("cuMemcpyDtoA", 3020, cuMemcpyDtoA_v2),
    P("cuMemcpyAtoA", 3020, cuMemcpyAtoA_v2),
    P("cuMemcpyAtoHAsync", 3020, cuMemcpyAtoHAsync_v2),
    P("cuMemcpyHtoAAsync", 3020, cuMemcpyHtoAAsync_v2),
    P("cuMemcpy2D", 3020, cuMemcpy2D_v2),
    P("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2),
    P("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2),
    P("cuMemcpy3D", 3020, cuMemcpy3D_v2),
    P("cuMemcpy3DAsync", 3020, cuMemcpy3DAsync_v2),
    P("cuMemcpy3DPeer", 4000, cuMemcpy3DPeer),
    P("cuMemcpy3DPeerAsync", 4000, cuMemcpy3DPeerAsync),
    P("cuMemcpyBatchAsync", 12080, sim_memcpy_batch_v1),
    P("cuMemcpyBatchAsync", 13000, cuMemcpyBatchAsync_v2),
    P("cuMemcpy3DBatchAsync", 12080, sim_memcpy_3d_batch_v1),
    P("cuMemcpy3DBatchAsync", 13000, cuMemcpy3DBatchAsync_v2),
    P("cuMemsetD8", 3020, cuMemsetD8_v2),
    P("cuMemsetD16", 3020, cuMemsetD16_v2),
    P("cuMemsetD32", 3020, cuMemsetD32_v2),
    P("cuMemsetD8Async", 3020, cuMemsetD8Async),
    P("cuMemsetD16Async", 3020, cuMemsetD16Async),
    P("cuMemsetD32Async", 3020, cuMemsetD32Async),
    P("cuMemsetD2D8", 3020, cuMemsetD2D8_v2),
    P("cuMemsetD2D16", 3020, cuMemsetD2D16_v2),
    P("cuMemsetD2D32", 3020, cuMemsetD2D32_v2),
    P("cuMemsetD2D8Async", 3020, cuMemsetD2D8Async),
    P("cuMemsetD2D16Async", 3020, cuMemsetD2D16Async),
    P("cuMemsetD2D32Async", 3020, cuMemsetD2D32Async),
    /* stream-ordered work */
    P("cuStreamWaitValue32", 8000, sim_wait_value32_v1),
    P("cuStreamWaitValue32", 11070, cuStreamWaitValue32_v2),
    P("cuStreamWaitValue64", 9000, sim_wait_value64_v1),
    P("cuStreamWaitValue64", 11070, cuStreamWaitValue64_v2),
    P("cuStreamWriteValue32", 8000, sim_write_value32_v1),
    P("cuStreamWriteValue32", 11070, cuStreamWriteValue32_v2),
    P("cuStreamWriteValue64", 9000, sim_write_value64_v1),
    P("cuStreamWriteValue64", 11070, cuStreamWriteValue64_v2),
    P("cuStreamBatchMemOp", 8000, sim_batch_mem_op_v1),
    P("cuStreamBatchMemOp", 11070, cuStreamBatchMemOp_v2),
    P("cuDeviceGetDefaultMemPool", 11020, cuDeviceGetDefaultMemPool),
    P("cuMemAllocAsync", 11020, cuMemAllocAsync),
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync),
    P("cuMemFreeAsync", 11020, cuMemFreeAsync),
    P("cuMemPoolCreate", 11020, cuMemPoolCreate),
    P("cuMemPoolDestroy", 11020, cuMemPoolDestroy),
    P("cuMemPoolExportToShareableHandle", 11020, cuMemPoolExportToShareableHandle),
    P("cuMemPoolImportFromShareableHandle", 11020, cuMemPoolImportFromShareableHandle),
    P("cuMemPoolExportPointer", 11020, cuMemPoolExportPointer),
    P("cuMemPoolImportPointer", 11020, cuMemPoolImportPointer),
    P("cuMemHostAlloc", 2020, cuMemHostAlloc),
    P("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    P("cuMemFreeHost", 2000, cuMemFreeHost),
    P("cuMemHostRegister", 6050, cuMemHostRegister_v2),
    P("cuMemHostUnregister", 4000, cuMemHostUnregister),
    P("cuMemHostGetDevicePointer", 3020, cuMemHostGetDevicePointer_v2),
    P("cuMemHostGetFlags", 2030, cuMemHostGetFlags),
    /* multicast */
    P("cuMulticastGetGranularity", 12010, cuMulticastGetGranularity),
    P("cuMulticastCreate", 12010, cuMulticastCreate),
    P("cuMulticastAddDevice", 12010, cuMulticastAddDevice),
    P("cuMulticastBindMem", 12010, cuMulticastBindMem),
    P("cuMulticastBindMem", 13010, cuMulticastBindMem_v2),
    P("cuMulticastBindAddr", 12010, cuMulticastBindAddr),
    P("cuMulticastBindAddr", 13010, cuMulticastBindAddr_v2),
    P("cuMulticastUnbind", 12010, cuMulticastUnbind),
    /* checkpoint */
    P("cuCheckpointProcessLock", 12080, cuCheckpointProcessLock),
    P("cuCheckpointProcessCheckpoint", 12080, cuCheckpointProcessCheckpoint),
    P("cuCheckpointProcessRestore", 12080, cuCheckpointProcessRestore),
    P("cuCheckpointProcessUnlock", 12080, cuCheckpointProcessUnlock),
    P("cuCheckpointProcessGetState", 12080, cuCheckpointProcessGetState),
    P("cuCheckpointProcessGetRestoreThreadId", 12080, cuCheckpointProcessGetRestoreThreadId),
};

/* What a request with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM gets
 * instead, from the version its per-thread variant appeared in. */
static const struct proc procs_per_thread[] = {
    P("cuMemcpy", 7000, cuMemcpy_ptds),
    P("cuMemcpyAsync", 7000, cuMemcpyAsync_ptsz),
    P("cuMemcpyHtoD", 7000, cuMemcpyHtoD_v2_ptds),
    P("cuMemcpyDtoH", 7000, cuMemcpyDtoH_v2_ptds),
    P("cuMemcpyDtoD", 7000, cuMemcpyDtoD_v2_ptds),
    P("cuMemcpyHtoDAsync", 7000, cuMemcpyHtoDAsync_v2_ptsz),
    P("cuMemcpyDtoHAsync", 7000, cuMemcpyDtoHAsync_v2_ptsz),
    P("cuMemcpyDtoDAsync", 7000, cuMemcpyDtoDAsync_v2_ptsz),
    P("cuMemcpyPeer", 7000, cuMemcpyPeer_ptds),
    P("cuMemcpyPeerAsync", 7000, cuMemcpyPeerAsync_ptsz),
    P("cuMemcpyAtoH", 7000, cuMemcpyAtoH_v2_ptds),
    P("cuMemcpyHtoA", 7000, cuMemcpyHtoA_v2_ptds),
    P("cuMemcpyAtoD", 7000, cuMemcpyAtoD_v2_ptds),
    P("cuMemcpyDtoA", 7000, cuMemcpyDtoA_v2_ptds),
    P("cuMemcpyAtoA", 7000, cuMemcpyAtoA_v2_ptds),
    P("cuMemcpyAtoHAsync", 7000, cuMemcpyAtoHAsync_v2_ptsz),
    P("cuMemcpyHtoAAsync", 7000, cuMemcpyHtoAAsync_v2_ptsz),
    P("cuMemcpy2D", 7000, cuMemcpy2D_v2_ptds),
    P("cuMemcpy2DUnaligned", 7000, cuMemcpy2DUnaligned_v2_ptds),
    P("cuMemcpy2DAsync", 7000, cuMemcpy2DAsync_v2_ptsz),
    P("cuMemcpy3D", 7000, cuMemcpy3D_v2_ptds),
    P("cuMemcpy3DAsync", 7000, cuMemcpy3DAsync_v2_ptsz),
    P("cuMemcpy3DPeer", 7000, cuMemcpy3DPeer_ptds),
    P("cuMemcpy3DPeerAsync", 7000, cuMemcpy3DPeerAsync_ptsz),
    P("cuMemcpyBatchAsync", 12080, cuMemcpyBatchAsync_ptsz),
    P("cuMemcpyBatchAsync", 13000, cuMemcpyBatchAsync_v2_ptsz),
    P("cuMemcpy3DBatchAsync", 12080, cuMemcpy3DBatchAsync_ptsz),
    P("cuMemcpy3DBatchAsync", 13000, cuMemcpy3DBatchAsync_v2_ptsz),
    P("cuMemsetD8", 7000, cuMemsetD8_v2_ptds),
    P("cuMemsetD16", 7000, cuMemsetD16_v2_ptds),
    P("cuMemsetD32", 7000, cuMemsetD32_v2_ptds),
    P("cuMemsetD8Async", 7000, cuMemsetD8Async_ptsz),
    P("cuMemsetD16Async", 7000, cuMemsetD16Async_ptsz),
    P("cuMemsetD32Async", 7000, cuMemsetD32Async_ptsz),
    P("cuStreamSynchronize", 7000, cuStreamSynchronize_ptsz),
    P("cuStreamWaitEvent", 7000, cuStreamWaitEvent_ptsz),
    P("cuEventRecord", 7000, cuEventRecord_ptsz),
    P("cuEventRecordWithFlags", 11010, cuEventRecordWithFlags_ptsz),
    P("cuStreamAddCallback", 7000, cuStreamAddCallback_ptsz),
    P("cuMemsetD2D8", 7000, cuMemsetD2D8_v2_ptds),
    P("cuMemsetD2D16", 7000, cuMemsetD2D16_v2_ptds),
    P("cuMemsetD2D32", 7000, cuMemsetD2D32_v2_ptds),
    P("cuMemsetD2D8Async", 7000, cuMemsetD2D8Async_ptsz),
    P("cuMemsetD2D16Async", 7000, cuMemsetD2D16Async_ptsz),
    P("cuMemsetD2D32Async", 7000, cuMemsetD2D32Async_ptsz),
    P("cuLaunchHostFunc", 10000, cuLaunchHostFunc_ptsz),
    P("cuLaunchKernel", 7000, cuLaunchKernel_ptsz),
    P("cuStreamWaitValue32", 8000, sim_wait_value32_v1_ptsz),
    P("cuStreamWaitValue32", 11070, cuStreamWaitValue32_v2_ptsz),
    P("cuStreamWaitValue64", 9000, sim_wait_value64_v1_ptsz),
    P("cuStreamWaitValue64", 11070, cuStreamWaitValue64_v2_ptsz),
    P("cuStreamWriteValue32", 8000, sim_write_value32_v1_ptsz),
    P("cuStreamWriteValue32", 11070, cuStreamWriteValue32_v2_ptsz),
    P("cuStreamWriteValue64", 9000, sim_write_value64_v1_ptsz),
    P("cuStreamWriteValue64", 11070, cuStreamWriteValue64_v2_ptsz),
    P("cuStreamBatchMemOp", 8000, sim_batch_mem_op_v1_ptsz),
    P("cuStreamBatchMemOp", 11070, cuStreamBatchMemOp_v2_ptsz),
    P("cuMemAllocAsync", 11020, cuMemAllocAsync_ptsz),
    P("cuMemAllocFromPoolAsync", 11020, cuMemAllocFromPoolAsync_ptsz),
    P("cuMemFreeAsync", 11020, cuMemFreeAsync_ptsz),
};
#undef P
#pragma GCC diagnostic pop

/* The entry of `table` for `symbol` with the highest version not above
 * `version`; `*seen`: the name is in the table at all. */
static const struct proc *best_of(const struct proc *table, size_t n, const char *symbol,
                                  int version, int *seen)
{
    const struct proc *best = NULL;

    for (size_t i = 0; i < n; i++) {
        if (strcmp(table[i].name, symbol) != 0)
            continue;
        *seen = 1;
        if (table[i].version <= version && (!best || table[i].version > best->version))
            best = &table[i];
    }
    return best;
}

static CUresult resolve(const char *symbol, void **pfn, int version, cuuint64_t flags,
                        CUdriverProcAddressQueryResult *status)
{
    const struct proc *best = NULL;
    int seen = 0;

    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    /* A version from the future is an invalid argument on the real driver
     * (99999 in specs/records). The cut-off is the newest version the
     * simulator's table knows, not the header it was built with: a build
     * against CUDA 13.0's header must still answer cuda.bindings 13.5. */
    if (version <= 0 || version > SIM_NEWEST_API_VERSION)
        return CUDA_ERROR_INVALID_VALUE;
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    /* Per-thread default stream requests get the _ptsz/_ptds variant where
     * there is one, as from the driver; the rest is the same function. */
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
        best = best_of(procs_per_thread, sizeof procs_per_thread / sizeof procs_per_thread[0],
                       symbol, version, &seen);
    if (!best)
        best = best_of(procs, sizeof procs / sizeof procs[0], symbol, version, &seen);
    /* Measured on the real driver (specs/records): an unknown symbol is
     * CUDA_SUCCESS with a NULL pointer and the status saying why. */
    if (!best) {
        /* Debug aid: which functions a program wanted that we lack. */
        if (getenv("CUINTERPOSE_SIM_TRACE"))
            fprintf(stderr, "cuinterpose-sim: no %s at %d\n", symbol, version);
        if (status)
            *status = seen ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                           : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_SUCCESS;
    }
    *pfn = best->fn;
    if (status)
        *status = CU_GET_PROC_ADDRESS_SUCCESS;
    return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    return resolve(symbol, pfn, cudaVersion, flags, symbolStatus);
}

CUresult CUDAAPI sim_get_proc_address_v1(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags)
{
    return resolve(symbol, pfn, cudaVersion, flags, NULL);
}
