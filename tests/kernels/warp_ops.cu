// warp_ops.cu — one warp-level operation per kernel, data in and results out through global
// memory, so tests can compare every lane against a NumPy model of ptx_semantics.md.
#include "fa_port.cuh"

// kKind: 0 __shfl_sync, 1 __shfl_xor_sync, 2 __shfl_down_sync, 3 __shfl_up_sync.
// Each thread passes its own argument (source lane / xor mask / delta) from `args`.
template <int kKind, class T>
__global__ void shfl_test(T* out, const T* vals, const int* args, int width) {
    const int tid = threadIdx.x;
    const T v = fa::gload(vals + tid);
    const int a = fa::gload(args + tid);
    T r;
    if constexpr (kKind == 0) r = __shfl_sync(0xffffffffu, v, a, width);
    else if constexpr (kKind == 1) r = __shfl_xor_sync(0xffffffffu, v, a, width);
    else if constexpr (kKind == 2) r = __shfl_down_sync(0xffffffffu, v, static_cast<unsigned>(a), width);
    else r = __shfl_up_sync(0xffffffffu, v, static_cast<unsigned>(a), width);
    fa::gstore(out + tid, r);
}

// Shared memory holds `nrows` 16-byte rows copied from `data`; lane l passes the address of row
// row_of_lane[tid] (only lanes 0..8N-1 matter). Out: N registers per thread.
template <int N, bool Trans>
__global__ void ldmatrix_test(uint32_t* out, const uint16_t* data, const int* row_of_lane, int nrows) {
    FA_DYNAMIC_SMEM(smem);
    uint16_t* rows = reinterpret_cast<uint16_t*>(smem);   // [nrows][8]
    for (int i = threadIdx.x; i < nrows * 8; i += blockDim.x) rows[i] = fa::gload(data + i);
    __syncthreads();   // the rows are written by all threads, read by every lane's ldmatrix
    uint32_t r[N];
    fa::ldmatrix<N, Trans>(r, rows + 8 * fa::gload(row_of_lane + threadIdx.x));
    for (int j = 0; j < N; ++j) fa::gstore(out + threadIdx.x * N + j, r[j]);
}

// Per thread: A regs a[4], B regs b[2], C c[4] in; D d[4] out.
template <class T>
__global__ void mma_test(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    const int t = threadIdx.x;
    uint32_t ra[4], rb[2];
    float rc[4], rd[4];
    for (int i = 0; i < 4; ++i) ra[i] = fa::gload(a + 4 * t + i);
    for (int i = 0; i < 2; ++i) rb[i] = fa::gload(b + 2 * t + i);
    for (int i = 0; i < 4; ++i) rc[i] = fa::gload(c + 4 * t + i);
    fa::mma_m16n8k16<T>(rd, ra, rb, rc);
    for (int i = 0; i < 4; ++i) fa::gstore(d + 4 * t + i, rd[i]);
}

// Thread t copies Bytes from src + t*Bytes into shared slot t with src_bytes[t] valid bytes; then
// every thread reads back a slot written by another thread (after the wait and a barrier).
template <int Bytes>
__global__ void cp_async_test(unsigned char* out, const unsigned char* src, const int* src_bytes) {
    FA_DYNAMIC_SMEM(smem);
    const int t = threadIdx.x, n = blockDim.x;
    for (int i = 0; i < Bytes; ++i) smem[t * Bytes + i] = 0xAB;   // a pattern the copy must replace
    fa::cp_async<Bytes>(smem + t * Bytes, src + t * Bytes, fa::gload(src_bytes + t));
    fa::cp_async_commit();
    fa::cp_async_wait<0>();
    __syncthreads();   // every slot has landed before threads read each other's slots
    const int from = (t + 7) % n;
    for (int i = 0; i < Bytes; ++i) fa::gstore(out + from * Bytes + i, smem[from * Bytes + i]);
}

// fa::ChunkStage: each thread stages 4 chunks of 16 bytes (chunk i of thread t at 16 (4t + i) in shared
// memory, from src chunk (4t + i) + shift; thread t's chunk 2 is absent when t is odd: src_bytes 0, zeros),
// does work in between (a slot of another thread it writes to out[0]), lands them, waits, and every thread
// reads back another thread's chunks.
__global__ void chunk_stage_test(unsigned char* out, const unsigned char* src, int shift) {
    FA_DYNAMIC_SMEM(smem);
    const int t = threadIdx.x, n = blockDim.x;
    for (int i = 0; i < 64; ++i) smem[t * 64 + i] = 0xAB;   // a pattern the copies must replace
    __syncthreads();
    fa::ChunkStage<4> st;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const bool absent = i == 2 && t % 2 == 1;
        st.stage(i, smem + (4 * t + i) * 16, src + (4 * t + i + shift) * 16, absent ? 0 : 16);
    }
    fa::cp_async_commit();
#pragma unroll
    for (int i = 0; i < 4; ++i) st.land(i, smem + (4 * t + i) * 16);
    fa::cp_async_wait<0>();
    __syncthreads();
    const int from = (t + 5) % n;
    for (int i = 0; i < 64; ++i) fa::gstore(out + from * 64 + i, smem[from * 64 + i]);
}

// Three commit groups of one 4-byte copy each into s[3t + g]; records what the thread sees in
// its own three slots before any wait and after wait<2>, wait<1>, wait<0>.
__global__ void wait_group_test(float* out, const float* src) {
    FA_DYNAMIC_SMEM(smem);
    float* s = reinterpret_cast<float*>(smem);
    const int t = threadIdx.x;
    for (int g = 0; g < 3; ++g) s[3 * t + g] = -1.0f;
    for (int g = 0; g < 3; ++g) {
        fa::cp_async<4>(s + 3 * t + g, src + 3 * t + g, 4);
        fa::cp_async_commit();
    }
    float* o = out + 12 * t;
    for (int g = 0; g < 3; ++g) fa::gstore(o + g, s[3 * t + g]);
    fa::cp_async_wait<2>();
    for (int g = 0; g < 3; ++g) fa::gstore(o + 3 + g, s[3 * t + g]);
    fa::cp_async_wait<1>();
    for (int g = 0; g < 3; ++g) fa::gstore(o + 6 + g, s[3 * t + g]);
    fa::cp_async_wait<0>();
    for (int g = 0; g < 3; ++g) fa::gstore(o + 9 + g, s[3 * t + g]);
}

// Votes over each thread's predicate pred[tid] with mask masks[warp]; lanes outside the mask skip.
// out[4 tid .. 4 tid + 3] = ballot, any, all, __syncthreads_count/and/or packed (count | and<<16 | or<<17).
__global__ void vote_test(unsigned* out, const int* pred, const unsigned* masks) {
    const int tid = threadIdx.x, lane = tid % 32;
    const int p = fa::gload(pred + tid);
    const unsigned mask = fa::gload(masks + tid / 32);
    unsigned ballot = 0, any = 0, all = 0;
    if ((mask >> lane) & 1u) {
        ballot = __ballot_sync(mask, p);
        any = static_cast<unsigned>(__any_sync(mask, p));
        all = static_cast<unsigned>(__all_sync(mask, p));
    }
    const int count = __syncthreads_count(p);
    const int all_block = __syncthreads_and(p);
    const int any_block = __syncthreads_or(p);
    fa::gstore(out + 4 * tid, ballot);
    fa::gstore(out + 4 * tid + 1, any);
    fa::gstore(out + 4 * tid + 2, all);
    fa::gstore(out + 4 * tid + 3, static_cast<unsigned>(count) | (static_cast<unsigned>(all_block) << 16) |
                                      (static_cast<unsigned>(any_block) << 17));
}
