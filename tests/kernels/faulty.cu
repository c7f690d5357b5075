// faulty.cu — kernels with one deliberate bug each; the emulator must report every one as an
// EmulatorError naming the kernel, block, thread and what went wrong (never crash the process).
#include "fa_port.cuh"

__global__ void global_read_oob(float* out, const float* in, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    fa::gstore(out + i, fa::gload(in + i + n));   // reads n elements past each thread's slot
}

__global__ void global_write_oob(float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    fa::gstore(out + i, 1.0f);                     // no `if (i < n)` guard
    (void)n;
}

__global__ void global_misaligned(float* out, const float* in) {
    const char* p = reinterpret_cast<const char*>(in) + 2;
    fa::gstore(out + threadIdx.x, fa::gload(reinterpret_cast<const float*>(p)));
}

__global__ void write_read_only(float* out) { fa::gstore(out + threadIdx.x, 0.0f); }

__global__ void cp_async_src_oob(float* out, const float* in, int n) {
    FA_DYNAMIC_SMEM(smem);
    fa::cp_async<16>(smem + 16 * threadIdx.x, in + 4 * threadIdx.x, 16);   // no zero-fill past n
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    (void)out; (void)n;
}

// fa::ChunkStage misuse: landed after the wait that completed it (sm_75 would store after the readers
// waited), a chunk never landed, a partial chunk staged.
__global__ void stage_land_after_wait(const float* in) {
    FA_DYNAMIC_SMEM(smem);
    fa::ChunkStage<1> st;
    st.stage(0, smem, in, 16);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    st.land(0, smem);
}

__global__ void stage_never_landed(const float* in) {
    FA_DYNAMIC_SMEM(smem);
    fa::ChunkStage<2> st;
    st.stage(0, smem, in, 16);
    st.stage(1, smem + 16, in, 16);
    fa::cp_async_commit();
    st.land(0, smem);
    fa::cp_async_wait<0>();
}

__global__ void stage_partial_chunk(const float* in) {
    FA_DYNAMIC_SMEM(smem);
    fa::ChunkStage<1> st;
    st.stage(0, smem, in, 8);
    fa::cp_async_commit();
    st.land(0, smem);
    fa::cp_async_wait<0>();
}

__global__ void cp_async_dst_oob(const float* in, int slot) {
    FA_DYNAMIC_SMEM(smem);
    fa::cp_async<16>(smem + 16 * slot, in, 16);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
}

__global__ void cp_async_misaligned(const float* in, int offset) {
    FA_DYNAMIC_SMEM(smem);
    fa::cp_async<16>(smem + offset, in, 16);
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
}

__global__ void ldmatrix_bad_row(uint32_t* out, int row_offset_bytes) {
    FA_DYNAMIC_SMEM(smem);
    for (int i = threadIdx.x; i < 512; i += blockDim.x) smem[i] = 0;
    __syncthreads();   // shared tile initialised before ldmatrix reads it
    uint32_t r[4];
    const int lane = threadIdx.x % 32;
    fa::ldmatrix<4, false>(r, smem + (lane == 13 ? row_offset_bytes : 16 * lane));
    fa::gstore(out + threadIdx.x, r[0]);
}

__global__ void raw_shared_oob(float* out, int index) {
    FA_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    s[threadIdx.x] = 1.0f;
    __syncthreads();   // the values are written before thread 0 reads them
    if (threadIdx.x == 0) fa::gstore(out, s[index]);
}

__global__ void early_exit_barrier(float* out) {
    if (threadIdx.x >= 40) return;                 // these threads never reach the barrier
    __syncthreads();
    fa::gstore(out + threadIdx.x, 1.0f);
}

__global__ void divergent_barrier(float* out) {
    if (threadIdx.x / 32 == 0) {
        __syncthreads();                           // warp 0 waits here ...
        fa::gstore(out + threadIdx.x, 1.0f);
    } else {
        fa::gstore(out + threadIdx.x, 2.0f);
        __syncthreads();                           // ... the other warps there
    }
}

__global__ void shuffle_missing_lanes(float* out) {
    float v = static_cast<float>(threadIdx.x);
    if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);   // lanes 16-31 skip it
    __syncthreads();
    fa::gstore(out + threadIdx.x, v);
}

__global__ void shuffle_exited_lanes(float* out) {
    if (threadIdx.x % 32 >= 24) return;
    const float v = __shfl_down_sync(0xffffffffu, static_cast<float>(threadIdx.x), 1);
    fa::gstore(out + threadIdx.x, v);
}

__global__ void shuffle_source_outside_mask(float* out) {
    const unsigned mask = 0x0000ffffu;
    float v = static_cast<float>(threadIdx.x);
    if (threadIdx.x < 16) v = __shfl_sync(mask, v, 20);                  // lane 20 is not in the mask
    fa::gstore(out + threadIdx.x, v);
}

__global__ void shuffle_half_masks(float* out) {
    // Two independent half-warp groups, each with its own mask: legal, must complete.
    const unsigned mask = threadIdx.x < 16 ? 0x0000ffffu : 0xffff0000u;
    const float v = __shfl_xor_sync(mask, static_cast<float>(threadIdx.x), 1);
    fa::gstore(out + threadIdx.x, v);
}

__global__ void mma_partial_warp(float* out) {
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0}, d[4];
    if (threadIdx.x % 32 != 7) fa::mma_m16n8k16<fa_half>(d, a, b, c);   // lane 7 skips it
    else d[0] = 0.0f;
    fa::gstore(out + threadIdx.x, d[0]);
}

// Each level's 8 KiB frame is visible to the level below (its address escapes into the call), so
// no compiler can turn the recursion into a loop (Clang does, for the plain accumulator form).
__device__ int deep(int n, volatile char* parent) {
    volatile char pad[8192];
    pad[0] = static_cast<char>(n);
    if (n == 0) return parent[0] & 0;
    return deep(n - 1, pad) + pad[0];
}
__global__ void stack_overflow(int* out, int depth) {
    volatile char root = 0;
    fa::gstore(out + threadIdx.x, deep(depth, &root));
}

__global__ void int_div_zero(int* out, int d) { fa::gstore(out + threadIdx.x, 100 / d); }

__global__ void trap_kernel(int* out) {
    if (threadIdx.x == 5) __trap();
    fa::gstore(out + threadIdx.x, 1);
}

__global__ void args_kernel(float* out, const fa_half* h, int i, long long j, float f, double d, unsigned u) {
    fa::gstore(out, fa::to_float(fa::gload(h)) + i + static_cast<float>(j) + f + static_cast<float>(d) + u);
}
