// fa_port.cuh — the portability layer between flasharray's CUDA kernels and the hardware.
//
// Kernels include this header and use only what it provides beyond plain C++:
//   element types      fa_half (= __half), fa_bf16 (= __nv_bfloat16)
//   conversions        fa::to_float(x), fa::from_float<T>(f) (round to nearest even),
//                      fa::pack2<T>(lo, hi) -> uint32_t (lo in bits 0-15)
//   tensor cores       fa::mma_m16n8k16<T>(d, a, b, c), T in {fa_half, fa_bf16}
//                      fa::mma_m16n8k8_tf32(d, a, b, c) (fp32 bit patterns, low 13 bits ignored),
//                      fa::mma_m8n8k4_f64(d, a, b, c) (DMMA); both sm_80+
//   tf32               fa::cvt_tf32(x) (cvt.rna: ties away from zero), fa::split_tf32(x, hi, lo)
//                      (x ~ hi + lo, both tf32: the 3xTF32 operands); sm_80+
//   shared -> regs     fa::ldmatrix<N, Trans>(r, smem_row_addr), N in {1, 2, 4}
//   global -> shared   fa::cp_async<Bytes>(smem_dst, gmem_src, src_bytes), Bytes in {4, 8, 16},
//                      fa::cp_async_commit(), fa::cp_async_wait<N>()
//   global memory      fa::gload(p), fa::gstore(p, v), fa::atomic_add(p, v)
//   inter-block order  fa::sem_wait(sem, expected), fa::sem_post(sem): block-wide (every thread
//                      calls them); a block waits until an int counter in global memory equals
//                      `expected`, another adds 1 after its writes (sm_70+; usage rule below)
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

// CUDA's __noinline__, spelled so that the emulator's host compilers accept it too.
#define FA_NOINLINE __noinline__

// Declares `unsigned char* ptr` pointing at the block's dynamic shared memory.
#define FA_DYNAMIC_SMEM(ptr)                                                  \
    extern __shared__ __align__(16) unsigned char fa_dynamic_smem_[];        \
    unsigned char* ptr = fa_dynamic_smem_

namespace fa {

template <class T> struct dependent_false { static constexpr bool value = false; };

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
    // sm_75 has no cp.async: a plain synchronous copy with the same zero-fill contract.
    unsigned char* d = static_cast<unsigned char*>(smem_dst);
    const unsigned char* s = static_cast<const unsigned char*>(gmem_src);
    if (src_bytes >= Bytes) {
        if constexpr (Bytes == 16) {
            *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s);
        } else if constexpr (Bytes == 8) {
            *reinterpret_cast<uint2*>(d) = *reinterpret_cast<const uint2*>(s);
        } else {
            *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(s);
        }
    } else {
        for (int i = 0; i < Bytes; ++i) d[i] = i < src_bytes ? s[i] : static_cast<unsigned char>(0);
    }
#endif
}

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

__device__ __forceinline__ void sem_wait(const int* sem, int expected) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        while (ld_acquire_gpu(sem) != expected) {
        }
    }
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
__device__ __forceinline__ void sem_post(int* sem) {
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
        asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(sem), "r"(1) : "memory");
    }
}

}  // namespace fa

#else
// =====================================================================================
// Host branch: the flasharray CUDA emulator
// =====================================================================================
#include "emu/fa_emu.h"
#endif
