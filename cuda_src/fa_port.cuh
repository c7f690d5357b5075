// fa_port.cuh — the portability layer between flasharray's CUDA kernels and the hardware.
//
// Kernels include this header and use only what it provides beyond plain C++:
//   element types      fa_half (= __half), fa_bf16 (= __nv_bfloat16)
//   integers           fa::umulhi(a, b): the high 32 bits of a 32 x 32-bit unsigned product
//   conversions        fa::to_float(x), fa::from_float<T>(f) (round to nearest even),
//                      fa::pack2<T>(lo, hi) -> uint32_t (lo in bits 0-15), fa::unpack2<T>(w) -> float2
//   tensor cores       fa::mma_m16n8k16<T>(d, a, b, c), T in {fa_half, fa_bf16}
//                      fa::mma_m16n8k8_tf32(d, a, b, c) (fp32 bit patterns, low 13 bits ignored),
//                      fa::mma_m8n8k4_f64(d, a, b, c) (DMMA); both sm_80+
//                      fa::mma_m16n8k16_f64(d, a, b, c) (DMMA.16x8x16: eight m8n8k4's work); sm_90+
//   tf32               fa::cvt_tf32(x) (cvt.rna: ties away from zero), fa::split_tf32(x, hi, lo)
//                      (x ~ hi + lo, both tf32: the 3xTF32 operands); sm_80+
//   shared -> regs     fa::ldmatrix<N, Trans>(r, smem_row_addr), N in {1, 2, 4}
//   global -> shared   fa::cp_async<Bytes>(smem_dst, gmem_src, src_bytes), Bytes in {4, 8, 16},
//                      fa::cp_async_commit(), fa::cp_async_wait<N>(); fa::kSyncCopy: true where
//                      cp_async is a plain load and store (sm_75; below); fa::ChunkStage<N>: whole
//                      chunks staged now, landed later (cp.async on sm_80+, registers on sm_75);
//                      fa::ChunkPrefetch<N>: chunks fetched early, put when the destination is free
//                      (registers on sm_75; sm_80+: the cp.async at put)
//   global memory      fa::gload(p), fa::gstore(p, v), fa::atomic_add(p, v), fa::atomic_add_if(pred, p, v)
//   inter-block order  fa::sem_wait(sem, expected), fa::sem_post(sem): block-wide (every thread
//                      calls them); a block waits until an int counter in global memory equals
//                      `expected`, another adds 1 (or `add`: fa::sem_post(sem, add)) after its writes
//                      (sm_70+; usage rule below);
//                      fa::sem_acquire(sem, expected), fa::sem_release(sem): their halves by one thread,
//                      paired with the caller's own __syncthreads() (work in between)
//                      fa::sem_wait_group(sem, expected, id, nthreads), fa::sem_post_group(sem, id, nthreads[, add]):
//                      the same for the nthreads consecutive threads of named barrier `id` only
//                      (warp-specialized kernels: the consumers order themselves, the producer never joins)
//   named barriers     fa::named_barrier_sync(id, nthreads), fa::named_barrier_arrive(id, nthreads)
//                      (bar.sync / bar.arrive; id 0..15, nthreads a multiple of 32)
//   Hopper (sm_90)     mbarriers (a uint64_t in dynamic shared memory, 8-byte aligned):
//                      fa::mbarrier_init(bar, count), fa::mbarrier_inval(bar),
//                      fa::mbarrier_arrive(bar) -> state, fa::mbarrier_arrive_expect_tx(bar, tx_bytes),
//                      fa::mbarrier_expect_tx(bar, tx_bytes), fa::mbarrier_try_wait_parity(bar, parity)
//                      -> bool, fa::mbarrier_wait_parity(bar, parity); fa::fence_mbarrier_init(),
//                      fa::fence_proxy_async(); bulk copy global -> shared completing on an mbarrier:
//                      fa::cp_async_bulk_g2s(smem_dst, gmem_src, bytes, bar) (16-byte aligned, bytes
//                      a multiple of 16); TMA with a `const __grid_constant__ CUtensorMap` parameter
//                      (encoded on the host): fa::tma_load_{1..5}d(smem_dst, &tmap, c0, .., bar),
//                      fa::tma_store_{1..5}d(&tmap, c0, .., smem_src), fa::tma_store_commit(),
//                      fa::tma_store_wait<N>(), fa::tma_prefetch(&tmap).
//                      fa::stmatrix<N, Trans>(smem_row_addr, r) (ldmatrix's inverse), fa::elect_one(mask).
//                      Using one below sm_90 is a compile error at the use.
//   Hopper (sm_90a)    wgmma (warpgroup-wide, asynchronous): fa::wgmma_desc(smem, lbo, sbo, swizzle),
//                      fa::wgmma_m64nNk16_f32_{f16,bf16}_ss<N, TransA, TransB>(d, desc_a, desc_b,
//                      scale_d), fa::wgmma_m64nNk16_f32_{f16,bf16}_rs<N, TransB>(d, a, desc_b, scale_d),
//                      fa::wgmma_m64nNk8_f32_tf32_{ss,rs}<N>(...) (tf32: K-major operands only),
//                      fa::wgmma_fence(), fa::wgmma_commit_group(), fa::wgmma_wait_group<N>(),
//                      fa::wgmma_fence_operand(d); fa::setmaxnreg_inc<N>(), fa::setmaxnreg_dec<N>().
//                      Needs the arch-specific target sm_90a.
//   shared memory      FA_DYNAMIC_SMEM(ptr) declares `unsigned char* ptr` (16-byte aligned)
//   CUDA builtins      threadIdx/blockIdx/blockDim/gridDim, __syncthreads, __syncwarp,
//                      __shfl_sync/__shfl_xor_sync/__shfl_down_sync/__shfl_up_sync, exp2f, expf,
//                      logf, log2f, fmaxf, fminf, INFINITY, __global__ __device__ __forceinline__
//                      __launch_bounds__ __restrict__, FA_NOINLINE (CUDA's __noinline__, which the
//                      emulator cannot define: it collides with the C++ standard library's spelling)
//
// Two implementations of one interface:
//   * GPU (nvcc / NVRTC): the wrappers are inline PTX. This is the ONLY place in the project
//     where inline PTX is written; register layouts are those of /work/shared/ptx_semantics.md.
//   * Host (g++): the wrappers call the flasharray emulator runtime (cuda_src/emu/), which runs
//     every CUDA thread as a fiber and evaluates each warp collective once, with the PTX ISA
//     semantics, when all lanes of its mask have arrived. Global accesses are bounds-checked
//     against the launch's buffers and counted.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// =====================================================================================
// GPU branch
// =====================================================================================
#if defined(__CUDACC_RTC__)
// NVRTC has no C library headers; these are the types <cstdint> gives on LP64 Linux.
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef int int32_t;
typedef long int64_t;
#else
#include <cstdint>
#endif
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef __half fa_half;
typedef __nv_bfloat16 fa_bf16;

// The TMA tensor map (128 bytes, 64-byte aligned; encoded on the host by cuTensorMapEncodeTiled): cuda.h's
// declaration, which NVRTC does not ship.
#if defined(__CUDACC_RTC__)
typedef struct CUtensorMap_st {
    alignas(64) unsigned long long opaque[16];
} CUtensorMap;
#else
#include <cuda.h>
#endif

// CUDA's __noinline__, spelled so that the emulator's host compilers accept it too.
#define FA_NOINLINE __noinline__

// Declares `unsigned char* ptr` pointing at the block's dynamic shared memory.
#define FA_DYNAMIC_SMEM(ptr)                                                  \
    extern __shared__ __align__(16) unsigned char fa_dynamic_smem_[];        \
    unsigned char* ptr = fa_dynamic_smem_

namespace fa {

template <class T> struct dependent_false { static constexpr bool value = false; };

// ---- integers -----------------------------------------------------------------------
// The high 32 bits of a 32 x 32-bit unsigned product (__umulhi: one IMAD.HI; unlike a 64-bit product, the
// compiler does not split (x + c)·m into x·m + c·m with c·m held in registers across loops).
__device__ __forceinline__ uint32_t umulhi(uint32_t a, uint32_t b) { return __umulhi(a, b); }

// ---- conversions --------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(double x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(fa_half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(fa_bf16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_float<double>(float x) { return x; }
template <> __device__ __forceinline__ fa_half from_float<fa_half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ fa_bf16 from_float<fa_bf16>(float x) { return __float2bfloat16_rn(x); }

// Two 16-bit values in one register, `lo` in bits 0-15 (the lower-numbered element).
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<fa_half>(float lo, float hi) {
    return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
           (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}
template <> __device__ __forceinline__ uint32_t pack2<fa_bf16>(float lo, float hi) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}
// pack2's inverse: the two 16-bit values of a register as floats (exact), lo in .x.
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t w);
template <> __device__ __forceinline__ float2 unpack2<fa_half>(uint32_t w) {
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16))));
}
template <> __device__ __forceinline__ float2 unpack2<fa_bf16>(uint32_t w) {
    // bf16 is the upper half of a float: a shift and a mask, no conversion instruction.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// ---- tensor cores: D = A * B + C, m16n8k16, A row-major, B column-major, fp32 accumulate ----
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]) {
    static_assert(dependent_false<T>::value,
                  "fa::mma_m16n8k16: T must be fa_half (sm_75+) or fa_bf16 (sm_80+)");
}

template <>
__device__ __forceinline__ void mma_m16n8k16<fa_half>(float (&d)[4], const uint32_t (&a)[4],
                                                      const uint32_t (&b)[2], const float (&c)[4]) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    // sm_75 has m16n8k8 only: k = 0..7 uses (A0, A1; B0), k = 8..15 uses (A2, A3; B1).
    float t[4];
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
        : "=f"(t[0]), "=f"(t[1]), "=f"(t[2]), "=f"(t[3])
        : "r"(a[0]), "r"(a[1]), "r"(b[0]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[2]), "r"(a[3]), "r"(b[1]), "f"(t[0]), "f"(t[1]), "f"(t[2]), "f"(t[3]));
#endif
}

// No bf16 tensor-core instruction before sm_80: there the specialization does not exist, so a
// kernel instantiating mma_m16n8k16<fa_bf16> fails to compile (the primary template's message).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
template <>
__device__ __forceinline__ void mma_m16n8k16<fa_bf16>(float (&d)[4], const uint32_t (&a)[4],
                                                      const uint32_t (&b)[2], const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
#endif

// ---- tf32 and fp64 tensor cores (sm_80+) --------------------------------------------
// Templates only so that using one on sm_75 is a compile error at the use (the static_assert of
// an instantiated body) while merely including this header stays legal there (nvcc's host pass,
// without __CUDA_ARCH__, sees the sm_80 bodies, as for mma_m16n8k16<fa_bf16>).
template <class Sm80 = void>
__device__ __forceinline__ float cvt_tf32(float x) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return __uint_as_float(r);
#else
    static_assert(dependent_false<Sm80>::value, "fa::cvt_tf32 needs sm_80+");
    return x;
#endif
}

// x = hi + lo + O(2^-22 |x|), hi and lo tf32 (the operands of the 3xTF32 product).
template <class Sm80 = void>
__device__ __forceinline__ void split_tf32(float x, float& hi, float& lo) {
    hi = cvt_tf32<Sm80>(x);
    lo = cvt_tf32<Sm80>(x - hi);
}

// D = A * B + C, m16n8k8, A row-major, B column-major, fp32 accumulate; one tf32 per register.
template <class Sm80 = void>
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
          "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    static_assert(dependent_false<Sm80>::value, "fa::mma_m16n8k8_tf32 needs sm_80+");
#endif
}

// D = A * B + C, m8n8k4, fp64 throughout (DMMA).
template <class Sm80 = void>
__device__ __forceinline__ void mma_m8n8k4_f64(double (&d)[2], const double (&a)[1],
                                               const double (&b)[1], const double (&c)[2]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%4, %5};\n"
        : "=d"(d[0]), "=d"(d[1]) : "d"(a[0]), "d"(b[0]), "d"(c[0]), "d"(c[1]));
#else
    static_assert(dependent_false<Sm80>::value, "fa::mma_m8n8k4_f64 needs sm_80+");
#endif
}

// D = A * B + C, m16n8k16, fp64 throughout (SASS DMMA.16x8x16; sm_90 and newer). g = lane / 4, t = lane % 4:
// a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1], b[v] = B[t + 4 v][g], c[v0 + 2 v1] = C[g + 8 v1][2t + v0] (the
// m8n8k4 layouts of two m8 row tiles and four k4 steps: docs/emulator.md).
template <class Sm90 = void>
__device__ __forceinline__ void mma_m16n8k16_f64(double (&d)[4], const double (&a)[8], const double (&b)[4],
                                                 const double (&c)[4]) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7, %8, %9, %10, %11}, {%12, %13, %14, %15}, {%16, %17, %18, %19};\n"
        : "=d"(d[0]), "=d"(d[1]), "=d"(d[2]), "=d"(d[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
          "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]), "d"(c[0]), "d"(c[1]), "d"(c[2]), "d"(c[3]));
#else
    static_assert(dependent_false<Sm90>::value, "fa::mma_m16n8k16_f64 needs sm_90+");
#endif
}

// ---- ldmatrix: lanes 8j..8j+7 pass the addresses of rows 0..7 of matrix j -------------
template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* smem_row_addr) {
    static_assert(N == 1 || N == 2 || N == 4, "fa::ldmatrix: N must be 1, 2 or 4");
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row_addr));
    if constexpr (N == 1 && !Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
    } else if constexpr (N == 1 && Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
    } else if constexpr (N == 2 && !Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    } else if constexpr (N == 2 && Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    } else if constexpr (N == 4 && !Trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    }
}

// ---- cp.async: Bytes copied global -> shared, bytes past src_bytes zero-filled --------
// kSyncCopy: sm_75 has no cp.async, and fa::cp_async there is a load and a store. A store waits for
// its load, so a copy loop whose chunks each branch on a run-time src_bytes (whole, partial, none)
// pays one global round trip per chunk. Copy loops therefore give threads whose chunks are whole a
// separate path where src_bytes is 16 or 0 at compile time: the partial-chunk branch folds away and
// the compiler issues every chunk's load before the first store. The emulator takes that path too
// (fa_emu.h), so the code sm_75 runs is code the emulator checks.
#if __CUDA_ARCH__ >= 800
constexpr bool kSyncCopy = false;
#else
constexpr bool kSyncCopy = true;
#endif

// The word a Bytes-byte chunk is copied as (sm_75's fallback).
template <int Bytes> struct ChunkWord { using type = uint4; };
template <> struct ChunkWord<8> { using type = uint2; };
template <> struct ChunkWord<4> { using type = uint32_t; };

template <int Bytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src, int src_bytes) {
    static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "fa::cp_async: Bytes must be 4, 8 or 16");
#if __CUDA_ARCH__ >= 800
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    if constexpr (Bytes == 16) {
        // .cg: cache at L2 only; streamed tiles are not reused through L1.
        asm volatile("cp.async.cg.shared.global [%0], [%1], %2, %3;\n"
                     :: "r"(dst), "l"(gmem_src), "n"(Bytes), "r"(src_bytes) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                     :: "r"(dst), "l"(gmem_src), "n"(Bytes), "r"(src_bytes) : "memory");
    }
#else
    // sm_75 has no cp.async: a plain synchronous copy with the same zero-fill contract (a whole
    // chunk and a missing one are one vector load / store; a partial one, rare, a rolled byte loop).
    using V = typename ChunkWord<Bytes>::type;
    if (src_bytes >= Bytes) {
        *reinterpret_cast<V*>(smem_dst) = *reinterpret_cast<const V*>(gmem_src);
    } else if (src_bytes <= 0) {
        *reinterpret_cast<V*>(smem_dst) = V{};
    } else {
        unsigned char* d = static_cast<unsigned char*>(smem_dst);
        const unsigned char* s = static_cast<const unsigned char*>(gmem_src);
#pragma unroll 1
        for (int i = 0; i < Bytes; ++i) d[i] = i < src_bytes ? s[i] : static_cast<unsigned char>(0);
    }
#endif
}

// ---- staged chunk copies: read now, written to shared memory later (sm_75's pipelining) ----------
// fa::ChunkStage<N> st; st.stage(i, smem_dst, gmem_src, src_bytes) for chunks i < N (a compile-time
// index after unrolling; whole 16-byte chunks only: src_bytes 16 or 0), work, then st.land(i, smem_dst)
// for each staged chunk before the cp_async_wait that the chunks' readers wait on (cp_async_commit after
// the stages, as for cp_async). The destination must be free from stage() on. sm_80+: stage() is fa::cp_async<16> (the copy is
// asynchronous already) and land() nothing. sm_75: stage() loads the chunk into registers and land()
// stores it, so the loads' latency hides behind the work in between (N · 4 registers held through it).
template <int N>
struct ChunkStage {
#if __CUDA_ARCH__ >= 800
    __device__ __forceinline__ void stage(int, void* smem_dst, const void* gmem_src, int src_bytes) {
        cp_async<16>(smem_dst, gmem_src, src_bytes);
    }
    __device__ __forceinline__ void land(int, void*) const {}
#else
    uint4 v[N];
    __device__ __forceinline__ void stage(int i, void*, const void* gmem_src, int src_bytes) {
        v[i] = src_bytes >= 16 ? *reinterpret_cast<const uint4*>(gmem_src) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ void land(int i, void* smem_dst) const { *reinterpret_cast<uint4*>(smem_dst) = v[i]; }
#endif
};

// ---- prefetched chunk copies: read early, copied when the destination is free (sm_75) -------------
// fa::ChunkPrefetch<N> pf; pf.fetch(i, gmem_src, src_bytes) for chunks i < N (compile-time index, whole
// chunks: src_bytes 16 or 0) while the destination is still in use, then, once it is free,
// pf.put(i, smem_dst, gmem_src, src_bytes) with the same source and count, and cp_async_commit /
// cp_async_wait as for cp_async. sm_80+: fetch() nothing, put() fa::cp_async<16> (the copy a kernel
// would issue there anyway). sm_75: fetch() loads into registers, put() stores them, so the loads'
// latency hides behind the work between the two.
template <int N>
struct ChunkPrefetch {
#if __CUDA_ARCH__ >= 800
    __device__ __forceinline__ void fetch(int, const void*, int) {}
    __device__ __forceinline__ void put(int, void* smem_dst, const void* gmem_src, int src_bytes) const {
        cp_async<16>(smem_dst, gmem_src, src_bytes);
    }
#else
    uint4 v[N];
    __device__ __forceinline__ void fetch(int i, const void* gmem_src, int src_bytes) {
        v[i] = src_bytes >= 16 ? *reinterpret_cast<const uint4*>(gmem_src) : make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ void put(int i, void* smem_dst, const void*, int) const {
        *reinterpret_cast<uint4*>(smem_dst) = v[i];
    }
#endif
};

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(N >= 0 && N <= 7, "fa::cp_async_wait: N must be in [0, 7]");
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}

// ---- global memory ------------------------------------------------------------------
template <class T> __device__ __forceinline__ T gload(const T* p) { return *p; }
template <class T> __device__ __forceinline__ void gstore(T* p, T v) { *p = v; }
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
// The add only where pred holds, by one predicated red (no branch around it: ptxas otherwise may put the
// address arithmetic inside a branch per atomic); p need not be valid where pred is false.
__device__ __forceinline__ void atomic_add_if(bool pred, float* p, float v) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q red.global.add.f32 [%0], %1;\n}\n"
                 :: "l"(p), "f"(v), "r"(static_cast<int>(pred)) : "memory");
}
__device__ __forceinline__ void atomic_add_if(bool pred, double* p, double v) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q red.global.add.f64 [%0], %1;\n}\n"
                 :: "l"(p), "d"(v), "r"(static_cast<int>(pred)) : "memory");
}

// ---- inter-block ordering: semaphores in global memory (sm_70+) ------------------------
// Usage rule: a block may only wait for blocks with a SMALLER linear block index (blockIdx.x
// fastest, then .y, .z). The GPU dispatches blocks in linear order, so the blocks a waiter
// depends on are already resident or finished; waiting for a later block can deadlock when the
// grid does not fit on the GPU at once (nothing preempts the spinning waiter). The counter starts
// at 0 (cudaMemset) and only grows: a block waits for `expected`, does its work, posts.
//
// Both are block-wide and convergent: every thread of the block calls them.
// sem_wait: thread 0 spins on an acquire load at GPU scope, then the barrier extends what it
// acquired to the whole block (bar.sync orders CTA-scope; causality order is transitive).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// sem_acquire / sem_release: the calling thread's halves of sem_wait / sem_post, for kernels that put work
// between a poll and the barrier that extends it (or between a barrier and the post): sem_wait is thread 0's
// sem_acquire then __syncthreads(); sem_post is __syncthreads() then thread 0's sem_release. The caller keeps
// the same pairing: a __syncthreads() after sem_acquire before any other thread relies on the turn, and one
// between the block's writes and sem_release.
__device__ __forceinline__ void sem_acquire(const int* sem, int expected) {
    while (ld_acquire_gpu(sem) != expected) {
    }
}

__device__ __forceinline__ void sem_wait(const int* sem, int expected) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) sem_acquire(sem, expected);
    __syncthreads();
}

// sem_post: the barrier makes every thread's earlier writes happen-before thread 0's release
// reduction, and a release operation is cumulative in the PTX memory model: it publishes what its
// thread has observed (here: the whole block's writes through bar.sync), so a reader that
// acquires the new count sees them. FA3 (through CUTLASS's arrive_inc) does the same:
// __syncthreads(), then one release add by thread 0. red.release.gpu rather than
// __threadfence() + atomicAdd: __threadfence() is fence.sc.gpu, a sequentially consistent fence
// the pattern does not need, while a release add orders exactly the earlier writes; `red` (no
// return value) also lets the waiter's spin be the only round trip.
// `add`: the count posted (1; the ordered dQ mode with a block mask posts the distance between two visitors'
// ranks, flash_bwd_ext.cuh's dq_turn).
__device__ __forceinline__ void sem_release(int* sem, int add = 1) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(sem), "r"(add) : "memory");
}

__device__ __forceinline__ void sem_post(int* sem, int add = 1) {
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) sem_release(sem, add);
}

// Group-wide variants: the same wait and post for a group of `nthreads` consecutive threads (linear thread
// index; a multiple of 32, the same in every participant), which all call them; `id` (1..15) is a named
// barrier the group may also use elsewhere, as long as only the group's threads ever arrive at it. The
// leader is the group's one thread whose linear index is a multiple of nthreads. Wait: the leader spins on
// the acquire load, then bar.sync id, nthreads extends what it acquired to the group (bar.sync orders at CTA
// scope among its participants; causality order is transitive). Post: bar.sync id, nthreads makes the
// group's earlier writes happen-before the leader's release reduction, which is cumulative (sem_post's
// argument over the group instead of the block). Threads outside the group are not involved: a
// warp-specialized kernel's producer keeps loading while its consumers wait for their turn.
__device__ __forceinline__ bool sem_group_leader(int nthreads) {
    const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    return linear % static_cast<unsigned>(nthreads) == 0;
}

__device__ __forceinline__ void sem_wait_group(const int* sem, int expected, int id, int nthreads) {
    if (sem_group_leader(nthreads)) {
        while (ld_acquire_gpu(sem) != expected) {
        }
    }
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ void sem_post_group(int* sem, int id, int nthreads, int add = 1) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
    if (sem_group_leader(nthreads)) {
        asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(sem), "r"(add) : "memory");
    }
}

// ---- named barriers: bar.sync / bar.arrive id, nthreads ----------------------------------------
// Barrier `id` (0..15; 0 is __syncthreads()'s) completes when `nthreads` threads (a multiple of 32, the same
// in every participant) have arrived, whole warps at a time; sync waits for the completion, arrive does not
// (the producer/consumer and ping-pong handshakes of warp-specialized kernels). All architectures.
__device__ __forceinline__ void named_barrier_sync(int id, int nthreads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int nthreads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
}

// ---- Hopper (sm_90): mbarriers and bulk asynchronous copies ---------------------------------
// An mbarrier (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier") is
// an opaque 64-bit object in shared memory: the expected arrival count, the arrivals pending in the
// current phase, a transaction count (tx-count, bytes) and the current phase. A phase completes
// when its pending arrivals and its tx-count are both zero; the phase then advances (its parity
// flips) and the pending count reloads. try_wait.parity(p) is true once the phase of parity p has
// completed, i.e. while the current phase's parity is not p. The emulator implements the same
// rules with checked errors (docs/emulator.md, "Hopper: mbarrier and bulk copies").
//
// Each is a template with a defaulted parameter (as cvt_tf32): using one in a kernel compiled
// for an architecture below sm_90 is a compile error at the use; including the header is not.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define FA_SM90_ASM(...) asm volatile(__VA_ARGS__)
#define FA_SM90_OK true
#else
#define FA_SM90_ASM(...) static_assert(dependent_false<Sm90>::value, "fa:: mbarrier and bulk copies need sm_90+")
#define FA_SM90_OK false
#endif
template <int N> struct sm90_ok { enum { value = FA_SM90_OK }; };
#undef FA_SM90_OK

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// mbarrier.init: phase 0, `count` arrivals expected per phase (1 .. 2^20-1), tx-count 0.
template <class Sm90 = void>
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
    FA_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_u32(bar)), "r"(count) : "memory");
}

// mbarrier.inval: before the 8 bytes are reused for anything else (or initialized again).
template <class Sm90 = void>
__device__ __forceinline__ void mbarrier_inval(uint64_t* bar) {
    FA_SM90_ASM("mbarrier.inval.shared::cta.b64 [%0];\n" :: "r"(smem_u32(bar)) : "memory");
}

// One arrival (release at CTA scope); returns the opaque state of the phase arrived on.
template <class Sm90 = void>
__device__ __forceinline__ uint64_t mbarrier_arrive(uint64_t* bar) {
    uint64_t state = 0;
    FA_SM90_ASM("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(smem_u32(bar)) : "memory");
    return state;
}

// expect-tx(tx_bytes) then one arrival: the phase also waits for tx_bytes of completed transactions.
template <class Sm90 = void>
__device__ __forceinline__ uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, int tx_bytes) {
    uint64_t state = 0;
    FA_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;\n"
                : "=l"(state) : "r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
    return state;
}

// expect-tx without an arrival.
template <class Sm90 = void>
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, int tx_bytes) {
    FA_SM90_ASM("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n"
                :: "r"(smem_u32(bar)), "r"(tx_bytes) : "memory");
}

// True once the phase of parity `parity` (0 or 1) has completed (acquire at CTA scope); may suspend
// the thread for a system-dependent time limit first, and return false when it expires.
template <class Sm90 = void>
__device__ __forceinline__ bool mbarrier_try_wait_parity(uint64_t* bar, int parity) {
    uint32_t done = 0;
    FA_SM90_ASM("{\n\t.reg .pred p;\n\t"
                "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                "selp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}

template <class Sm90 = void>
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, int parity) {
    while (!mbarrier_try_wait_parity<Sm90>(bar, parity)) {
    }
}

// Makes this thread's earlier mbarrier.init visible to the async proxy (the bulk copies completing
// on it) and to the cluster: after the inits, before the __syncthreads() that publishes them.
template <class Sm90 = void>
__device__ __forceinline__ void fence_mbarrier_init() {
    FA_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Orders this thread's generic-proxy shared-memory accesses with later async-proxy ones.
template <class Sm90 = void>
__device__ __forceinline__ void fence_proxy_async() {
    FA_SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// cp.async.bulk global -> shared (16-byte aligned, bytes a positive multiple of 16); its completion
// performs complete_tx(bytes) on `bar` (counted by an earlier or later expect-tx of the phase).
template <class Sm90 = void>
__device__ __forceinline__ void cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                :: "r"(smem_u32(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// ---- TMA: cp.async.bulk.tensor (tensor maps encoded on the host; docs/emulator.md, "Hopper: TMA") ----
// tmap: the address of a `const __grid_constant__ CUtensorMap` kernel parameter; coordinates innermost
// first, in elements, any int (out-of-bounds elements load as zeros and are not stored). The shared box is
// 128-byte aligned. A load completes on `bar` with complete_tx(box bytes), as cp_async_bulk_g2s.
template <class Sm90 = void>
__device__ __forceinline__ void tma_load_1d(void* smem_dst, const CUtensorMap* tmap, int c0, uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.tensor.1d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2}], "
                "[%3];\n" :: "r"(smem_u32(smem_dst)), "l"(tmap), "r"(c0), "r"(smem_u32(bar)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
                "[%4];\n" :: "r"(smem_u32(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2,
                                            uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
                "[%1, {%2, %3, %4}], [%5];\n"
                :: "r"(smem_u32(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_load_4d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
                "[%1, {%2, %3, %4, %5}], [%6];\n"
                :: "r"(smem_u32(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
                : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_load_5d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2, int c3,
                                            int c4, uint64_t* bar) {
    FA_SM90_ASM("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
                "[%1, {%2, %3, %4, %5, %6}], [%7];\n"
                :: "r"(smem_u32(smem_dst)), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
                   "r"(smem_u32(bar)) : "memory");
}
// Stores shared -> global in a bulk async-group: the source must hold what the generic proxy wrote before a
// fence_proxy_async() and stay unchanged until tma_store_wait<N>() covers the store's group.
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_1d(const CUtensorMap* tmap, int c0, const void* smem_src) {
    FA_SM90_ASM("cp.async.bulk.tensor.1d.global.shared::cta.tile.bulk_group [%0, {%1}], [%2];\n"
                :: "l"(tmap), "r"(c0), "r"(smem_u32(smem_src)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* tmap, int c0, int c1, const void* smem_src) {
    FA_SM90_ASM("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n"
                :: "l"(tmap), "r"(c0), "r"(c1), "r"(smem_u32(smem_src)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* tmap, int c0, int c1, int c2, const void* smem_src) {
    FA_SM90_ASM("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(smem_src)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* tmap, int c0, int c1, int c2, int c3,
                                             const void* smem_src) {
    FA_SM90_ASM("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(smem_src)) : "memory");
}
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* tmap, int c0, int c1, int c2, int c3, int c4,
                                             const void* smem_src) {
    FA_SM90_ASM("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n"
                :: "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_u32(smem_src)) : "memory");
}
// Closes the thread's bulk async-group (its TMA stores since the last commit).
template <class Sm90 = void>
__device__ __forceinline__ void tma_store_commit() {
    FA_SM90_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until every committed bulk group but the newest N has read its shared source.
template <int N>
__device__ __forceinline__ void tma_store_wait() {
    static_assert(N >= 0 && N <= 7, "fa::tma_store_wait: N must be in [0, 7]");
    static_assert(sm90_ok<N>::value, "fa:: mbarrier and bulk copies need sm_90+");
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// 1-D bulk reduce-add shared -> global, fp32 (FlashAttention-3's dQ accumulation): gmem_dst and smem_src 16-byte
// aligned, bytes a positive multiple of 16; the source as for tma_store (fence_proxy_async before the issue,
// unchanged until bulk_wait_read<N>() covers its group); the adds land at completion: bulk_wait<N>().
template <class Sm90 = void>
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, int bytes) {
    FA_SM90_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                :: "l"(gmem_dst), "r"(smem_u32(smem_src)), "r"(bytes) : "memory");
}
// The bulk async-group's commit (= tma_store_commit) and waits: .read (source read) and completion.
template <class Sm90 = void>
__device__ __forceinline__ void bulk_commit() {
    FA_SM90_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    static_assert(N >= 0 && N <= 7, "fa::bulk_wait_read: N must be in [0, 7]");
    static_assert(sm90_ok<N>::value, "fa:: mbarrier and bulk copies need sm_90+");
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
    static_assert(N >= 0 && N <= 7, "fa::bulk_wait: N must be in [0, 7]");
    static_assert(sm90_ok<N>::value, "fa:: mbarrier and bulk copies need sm_90+");
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}
// Brings the tensor map into the cache ahead of its first use (a hint).
template <class Sm90 = void>
__device__ __forceinline__ void tma_prefetch(const CUtensorMap* tmap) {
    FA_SM90_ASM("prefetch.tensormap [%0];\n" :: "l"(tmap) : "memory");
}

// ---- stmatrix (ldmatrix's inverse) and elect.sync ------------------------------------------------
// stmatrix: lanes 8j..8j+7 pass the addresses of rows 0..7 of matrix j (16-byte aligned); lane l's r[j] holds
// matrix j's elements (l / 4, 2 (l % 4) .. +1), transposed (2 (l % 4) .. +1, l / 4), the lower in bits 0-15.
template <int N, bool Trans>
__device__ __forceinline__ void stmatrix(void* smem_row_addr, const uint32_t (&r)[N]) {
    static_assert(N == 1 || N == 2 || N == 4, "fa::stmatrix: N must be 1, 2 or 4");
    static_assert(sm90_ok<N>::value, "fa::stmatrix needs sm_90+");
    const uint32_t addr = smem_u32(smem_row_addr);
    if constexpr (N == 1 && !Trans) {
        asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" :: "r"(addr), "r"(r[0]) : "memory");
    } else if constexpr (N == 1 && Trans) {
        asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};\n" :: "r"(addr), "r"(r[0]) : "memory");
    } else if constexpr (N == 2 && !Trans) {
        asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n"
                     :: "r"(addr), "r"(r[0]), "r"(r[1]) : "memory");
    } else if constexpr (N == 2 && Trans) {
        asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n"
                     :: "r"(addr), "r"(r[0]), "r"(r[1]) : "memory");
    } else if constexpr (N == 4 && !Trans) {
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    } else {
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
    }
}

// elect.sync: true in exactly one lane of `mask` (every lane of the mask executes it together).
template <class Sm90 = void>
__device__ __forceinline__ bool elect_one(unsigned mask = 0xffffffffu) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
    uint32_t elected = 0;
    asm volatile("{\n\t.reg .pred p;\n\telect.sync _|p, %1;\n\tselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(elected) : "r"(mask));
    return elected != 0;
#else
    static_assert(dependent_false<Sm90>::value, "fa::elect_one needs sm_90+");
    return false;
#endif
}
#undef FA_SM90_ASM

// ---- Hopper (sm_90a): wgmma, warpgroup matrix multiply-accumulate ---------------------------
// wgmma.mma_async m64nNk16, f16/bf16 inputs, f32 accumulators, issued by the 128 threads of a warpgroup
// (warps 4k..4k+3) together. B (and in the _ss forms A) come from shared memory through 64-bit matrix
// descriptors; the _rs forms take A from registers (the mma.m16n8k16 A fragment of rows 16w..16w+15
// in warp w of the warpgroup). The accumulator d[N/2] of thread (warp w, lane l), g = l >> 2,
// t = l & 3: d[4j + e] = D[16w + g + 8(e >> 1)][8j + 2t + (e & 1)], j = 0 .. N/8 - 1.
// The instruction is asynchronous: wgmma_fence() before it (and after any write of its accumulator or A
// registers), wgmma_commit_group() to close a group, wgmma_wait_group<N>() until at most N groups are
// in flight; the registers must not be touched between the issue and the covering wait (then
// wgmma_fence_operand(d) keeps the compiler from moving accesses across the wait). Needs the
// arch-specific target sm_90a (__CUDA_ARCH_FEAT_SM90_ALL): elsewhere a use is a compile error.
// Rules and layouts: docs/emulator.md, "Hopper: wgmma".
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA_WGMMA_ARCH_OK true
#define FA_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FA_WGMMA_ARCH_OK false
#define FA_SM90A_ASM(...) static_assert(dependent_false<Sm90a>::value, "fa::wgmma needs sm_90a (arch sm_90a)")
#endif
template <int N> struct wgmma_arch_ok { enum { value = FA_WGMMA_ARCH_OK }; };

// setmaxnreg: every warp of the warpgroup executes the same one; .inc raises the per-thread register maximum to
// N (blocking until the CTA's pool has the registers), .dec releases down to N; N a multiple of 8 in [24, 256].
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "fa::setmaxnreg: N must be a multiple of 8 in [24, 256]");
    static_assert(wgmma_arch_ok<N>::value, "fa::setmaxnreg needs sm_90a (arch sm_90a)");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "fa::setmaxnreg: N must be a multiple of 8 in [24, 256]");
    static_assert(wgmma_arch_ok<N>::value, "fa::setmaxnreg needs sm_90a (arch sm_90a)");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}

// Swizzle modes as the descriptor's bits 62-63 encode them.
enum WgmmaSwizzle { kWgmmaSwizzleNone = 0, kWgmmaSwizzle128B = 1, kWgmmaSwizzle64B = 2, kWgmmaSwizzle32B = 3 };

// The matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4, 16-29
// leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 base offset (0),
// 62-63 swizzle mode. Addresses and offsets must be multiples of 16 bytes.
__device__ __forceinline__ uint64_t wgmma_desc_encode(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes,
                                                      int swizzle) {
    return (static_cast<uint64_t>((smem_addr >> 4) & 0x3fffu)) |
           (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fffu) << 16) |
           (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fffu) << 32) | (static_cast<uint64_t>(swizzle & 3) << 62);
}
__device__ __forceinline__ uint64_t wgmma_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes, int swizzle) {
    return wgmma_desc_encode(smem_u32(smem), lbo_bytes, sbo_bytes, swizzle);
}
// The descriptor of the operand `bytes` (a multiple of 16) further in shared memory: only the start-address field
// moves. It holds a shared-window address >> 4 in 14 bits (< 256 KB), so inside the block's shared memory the add
// never carries out of it (the emulator checks both conditions), where wgmma_desc shifts, masks and merges every
// field again. A plain 64-bit add: ptxas folds it into the uniform datapath's UIADD3 pairs; splitting the words
// for a 32-bit add (the first version) cost a UMOV per HGMMA to re-pair them (ws backward loops 6-13 % longer).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    return desc + static_cast<uint64_t>(bytes >> 4);
}

template <class Sm90a = void>
__device__ __forceinline__ void wgmma_fence() {
    FA_SM90A_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
template <class Sm90a = void>
__device__ __forceinline__ void wgmma_commit_group() {
    FA_SM90A_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "fa::wgmma_wait_group: N must be in [0, 7]");
    static_assert(wgmma_arch_ok<N>::value, "fa::wgmma needs sm_90a (arch sm_90a)");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Pins the accumulator registers: no access to them moves across this point (after a wait, before a fence).
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define FA_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
    "+f"(d[i + 6]), "+f"(d[i + 7])
#define FA_WG_D32(i) FA_WG_D8(i), FA_WG_D8(i + 8), FA_WG_D8(i + 16), FA_WG_D8(i + 24)
#define FA_WG_D_32 FA_WG_D8(0), FA_WG_D8(8)
#define FA_WG_D_64 FA_WG_D32(0)
#define FA_WG_D_80 FA_WG_D32(0), FA_WG_D8(32)
#define FA_WG_D_128 FA_WG_D32(0), FA_WG_D32(32)
#define FA_WG_D_176 FA_WG_D32(0), FA_WG_D32(32), FA_WG_D8(64), FA_WG_D8(72), FA_WG_D8(80)
#define FA_WG_D_192 FA_WG_D32(0), FA_WG_D32(32), FA_WG_D32(64)
#define FA_WG_D_256 FA_WG_D32(0), FA_WG_D32(32), FA_WG_D32(64), FA_WG_D32(96)
// The register list {%0, ..., %(N/2-1)} and the operand numbers after it, per N (the N of the S wgmma: Bc;
// of the O wgmma: dv).
#define FA_WG_ACC_32 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
#define FA_WG_SS_32 "%16, %17, p, 1, 1, %19, %20;\n"  // desc-a, desc-b, scale-d (p = %18 != 0), trans-a, trans-b
#define FA_WG_SS_P_32 "setp.ne.b32 p, %18, 0;\n\t"
#define FA_WG_RS_32 "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n"  // a0-a3, desc-b, scale-d (p = %21 != 0), trans-b
#define FA_WG_RS_P_32 "setp.ne.b32 p, %21, 0;\n\t"
#define FA_WG_ACC_64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define FA_WG_SS_64 "%32, %33, p, 1, 1, %35, %36;\n"  // desc-a, desc-b, scale-d (p = %34 != 0), trans-a, trans-b
#define FA_WG_SS_P_64 "setp.ne.b32 p, %34, 0;\n\t"
#define FA_WG_RS_64 "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n"  // a0-a3, desc-b, scale-d (p = %37 != 0), trans-b
#define FA_WG_RS_P_64 "setp.ne.b32 p, %37, 0;\n\t"
#define FA_WG_ACC_80 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39}, "
#define FA_WG_SS_80 "%40, %41, p, 1, 1, %43, %44;\n"  // desc-a, desc-b, scale-d (p = %42 != 0), trans-a, trans-b
#define FA_WG_SS_P_80 "setp.ne.b32 p, %42, 0;\n\t"
#define FA_WG_RS_80 "{%40, %41, %42, %43}, %44, p, 1, 1, %46;\n"  // a0-a3, desc-b, scale-d (p = %45 != 0), trans-b
#define FA_WG_RS_P_80 "setp.ne.b32 p, %45, 0;\n\t"
#define FA_WG_ACC_128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
#define FA_WG_SS_128 "%64, %65, p, 1, 1, %67, %68;\n"  // desc-a, desc-b, scale-d (p = %66 != 0), trans-a, trans-b
#define FA_WG_SS_P_128 "setp.ne.b32 p, %66, 0;\n\t"
#define FA_WG_RS_128 "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n"  // a0-a3, desc-b, scale-d (p = %69 != 0), trans-b
#define FA_WG_RS_P_128 "setp.ne.b32 p, %69, 0;\n\t"
#define FA_WG_ACC_176 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87}, "
#define FA_WG_SS_176 "%88, %89, p, 1, 1, %91, %92;\n"  // desc-a, desc-b, scale-d (p = %90 != 0), trans-a, trans-b
#define FA_WG_SS_P_176 "setp.ne.b32 p, %90, 0;\n\t"
#define FA_WG_RS_176 "{%88, %89, %90, %91}, %92, p, 1, 1, %94;\n"  // a0-a3, desc-b, scale-d (p = %93 != 0), trans-b
#define FA_WG_RS_P_176 "setp.ne.b32 p, %93, 0;\n\t"
#define FA_WG_ACC_192 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, "
#define FA_WG_SS_192 "%96, %97, p, 1, 1, %99, %100;\n"  // desc-a, desc-b, scale-d (p = %98 != 0), trans-a, trans-b
#define FA_WG_SS_P_192 "setp.ne.b32 p, %98, 0;\n\t"
#define FA_WG_RS_192 "{%96, %97, %98, %99}, %100, p, 1, 1, %102;\n"  // a0-a3, desc-b, scale-d (p = %101 != 0), trans-b
#define FA_WG_RS_P_192 "setp.ne.b32 p, %101, 0;\n\t"
#define FA_WG_ACC_256 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
#define FA_WG_SS_256 "%128, %129, p, 1, 1, %131, %132;\n"  // desc-a, desc-b, scale-d (p = %130 != 0), trans-a, trans-b
#define FA_WG_SS_P_256 "setp.ne.b32 p, %130, 0;\n\t"
#define FA_WG_RS_256 "{%128, %129, %130, %131}, %132, p, 1, 1, %134;\n"  // a0-a3, desc-b, scale-d (p = %133 != 0), trans-b
#define FA_WG_RS_P_256 "setp.ne.b32 p, %133, 0;\n\t"

// The instructions per shape and type: ss (A, B from shared memory) and rs (A from registers).
template <int N, class T> struct Wgmma;
#define FA_WGMMA_DEFINE(N, T, TY)                                                                               \
    template <> struct Wgmma<N, T> {                                                                            \
        template <int TA, int TB>                                                                               \
        static __device__ __forceinline__ void ss(float* d, uint64_t da, uint64_t db, int sd) {                 \
            asm volatile("{\n\t.reg .pred p;\n\t" FA_WG_SS_P_##N "wgmma.mma_async.sync.aligned.m64n" #N            \
                         "k16.f32" TY " " FA_WG_ACC_##N FA_WG_SS_##N "}\n"                                       \
                         : FA_WG_D_##N : "l"(da), "l"(db), "r"(sd), "n"(TA), "n"(TB));                         \
        }                                                                                                       \
        template <int TB>                                                                                       \
        static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t db, int sd) {           \
            asm volatile("{\n\t.reg .pred p;\n\t" FA_WG_RS_P_##N "wgmma.mma_async.sync.aligned.m64n" #N            \
                         "k16.f32" TY " " FA_WG_ACC_##N FA_WG_RS_##N "}\n"                                       \
                         : FA_WG_D_##N : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(sd), "n"(TB)); \
        }                                                                                                       \
    };
FA_WGMMA_DEFINE(32, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(64, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(80, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(128, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(176, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(192, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(256, fa_half, ".f16.f16")
FA_WGMMA_DEFINE(32, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(64, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(80, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(128, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(176, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(192, fa_bf16, ".bf16.bf16")
FA_WGMMA_DEFINE(256, fa_bf16, ".bf16.bf16")

// tf32 (m64nNk8, K-major operands only: the instruction takes no transpose immediates for .tf32). The same
// operand numbering as the 16-bit forms without the trans immediates.
#define FA_WG_SS_TF32(A, B, SD) "%" #A ", %" #B ", p, 1, 1;\n"
#define FA_WG_RS_TF32(A0, A1, A2, A3, B, SD) "{%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1;\n"
template <int N> struct WgmmaTf32;
#define FA_WGMMA_TF32_DEFINE(N, SS, RS)                                                                         \
    template <> struct WgmmaTf32<N> {                                                                           \
        static __device__ __forceinline__ void ss(float* d, uint64_t da, uint64_t db, int sd) {                 \
            asm volatile("{\n\t.reg .pred p;\n\t" FA_WG_SS_P_##N "wgmma.mma_async.sync.aligned.m64n" #N            \
                         "k8.f32.tf32.tf32 " FA_WG_ACC_##N SS "}\n"                                              \
                         : FA_WG_D_##N : "l"(da), "l"(db), "r"(sd));                                             \
        }                                                                                                       \
        static __device__ __forceinline__ void rs(float* d, const uint32_t* a, uint64_t db, int sd) {           \
            asm volatile("{\n\t.reg .pred p;\n\t" FA_WG_RS_P_##N "wgmma.mma_async.sync.aligned.m64n" #N            \
                         "k8.f32.tf32.tf32 " FA_WG_ACC_##N RS "}\n"                                              \
                         : FA_WG_D_##N : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(sd));         \
        }                                                                                                       \
    };
FA_WGMMA_TF32_DEFINE(32, FA_WG_SS_TF32(16, 17, 18), FA_WG_RS_TF32(16, 17, 18, 19, 20, 21))
FA_WGMMA_TF32_DEFINE(64, FA_WG_SS_TF32(32, 33, 34), FA_WG_RS_TF32(32, 33, 34, 35, 36, 37))
FA_WGMMA_TF32_DEFINE(128, FA_WG_SS_TF32(64, 65, 66), FA_WG_RS_TF32(64, 65, 66, 67, 68, 69))

#define FA_WGMMA_CHECK(N)                                                                                     \
    static_assert(N == 32 || N == 64 || N == 80 || N == 128 || N == 176 || N == 192 || N == 256,               \
                  "fa::wgmma on the GPU: N must be 32, 64, 80, 128, 176, 192 or 256");                        \
    static_assert(wgmma_arch_ok<N>::value, "fa::wgmma needs sm_90a (arch sm_90a)")

// D (+)= A B, m64nNk16: scale_d 0 ignores the accumulator's input (D = A B), 1 accumulates. TransA /
// TransB (imm-trans-a/b): A M-major / B N-major in shared memory instead of K-major.
template <int N, bool TransA = false, bool TransB = false>
__device__ __forceinline__ void wgmma_m64nNk16_f32_f16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                          int scale_d) {
    FA_WGMMA_CHECK(N);
    Wgmma<N, fa_half>::template ss<TransA, TransB>(d, desc_a, desc_b, scale_d);
}
template <int N, bool TransA = false, bool TransB = false>
__device__ __forceinline__ void wgmma_m64nNk16_f32_bf16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                           int scale_d) {
    FA_WGMMA_CHECK(N);
    Wgmma<N, fa_bf16>::template ss<TransA, TransB>(d, desc_a, desc_b, scale_d);
}
template <int N, bool TransB = false>
__device__ __forceinline__ void wgmma_m64nNk16_f32_f16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                                          int scale_d) {
    FA_WGMMA_CHECK(N);
    Wgmma<N, fa_half>::template rs<TransB>(d, a, desc_b, scale_d);
}
template <int N, bool TransB = false>
__device__ __forceinline__ void wgmma_m64nNk16_f32_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                                           uint64_t desc_b, int scale_d) {
    FA_WGMMA_CHECK(N);
    Wgmma<N, fa_bf16>::template rs<TransB>(d, a, desc_b, scale_d);
}
#undef FA_WGMMA_CHECK
// D (+)= A B, m64nNk8 tf32 (N 32, 64 or 128 on the GPU): both operands K-major; rs: A the m16n8k8 tf32 fragment
// per warp (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]).
template <int N>
__device__ __forceinline__ void wgmma_m64nNk8_f32_tf32_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                          int scale_d) {
    static_assert(N == 32 || N == 64 || N == 128, "fa::wgmma tf32 on the GPU: N must be 32, 64 or 128");
    static_assert(wgmma_arch_ok<N>::value, "fa::wgmma needs sm_90a (arch sm_90a)");
    WgmmaTf32<N>::ss(d, desc_a, desc_b, scale_d);
}
template <int N>
__device__ __forceinline__ void wgmma_m64nNk8_f32_tf32_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                                          int scale_d) {
    static_assert(N == 32 || N == 64 || N == 128, "fa::wgmma tf32 on the GPU: N must be 32, 64 or 128");
    static_assert(wgmma_arch_ok<N>::value, "fa::wgmma needs sm_90a (arch sm_90a)");
    WgmmaTf32<N>::rs(d, a, desc_b, scale_d);
}
#undef FA_WGMMA_TF32_DEFINE
#undef FA_WG_SS_TF32
#undef FA_WG_RS_TF32
#undef FA_WGMMA_DEFINE
#undef FA_WG_D8
#undef FA_WG_D32
#undef FA_WG_D_32
#undef FA_WG_D_64
#undef FA_WG_D_80
#undef FA_WG_D_128
#undef FA_WG_D_176
#undef FA_WG_D_192
#undef FA_WG_D_256
#undef FA_WG_ACC_32
#undef FA_WG_ACC_64
#undef FA_WG_ACC_80
#undef FA_WG_ACC_128
#undef FA_WG_ACC_176
#undef FA_WG_ACC_192
#undef FA_WG_ACC_256
#undef FA_WG_SS_32
#undef FA_WG_SS_64
#undef FA_WG_SS_80
#undef FA_WG_SS_128
#undef FA_WG_SS_176
#undef FA_WG_SS_192
#undef FA_WG_SS_256
#undef FA_WG_SS_P_32
#undef FA_WG_SS_P_64
#undef FA_WG_SS_P_80
#undef FA_WG_SS_P_128
#undef FA_WG_SS_P_176
#undef FA_WG_SS_P_192
#undef FA_WG_SS_P_256
#undef FA_WG_RS_32
#undef FA_WG_RS_64
#undef FA_WG_RS_80
#undef FA_WG_RS_128
#undef FA_WG_RS_176
#undef FA_WG_RS_192
#undef FA_WG_RS_256
#undef FA_WG_RS_P_32
#undef FA_WG_RS_P_64
#undef FA_WG_RS_P_80
#undef FA_WG_RS_P_128
#undef FA_WG_RS_P_176
#undef FA_WG_RS_P_192
#undef FA_WG_RS_P_256
#undef FA_SM90A_ASM
#undef FA_WGMMA_ARCH_OK

}  // namespace fa

#else
// =====================================================================================
// Host branch: the flasharray CUDA emulator
// =====================================================================================
#include "emu/fa_emu.h"
#endif
