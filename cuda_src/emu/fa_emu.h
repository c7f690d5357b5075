// fa_emu.h — host branch of fa_port.cuh: CUDA builtins and fa:: wrappers on the emulator.
//
// Each CUDA thread is a fiber (cuda_src/emu/fa_emu_runtime.cpp). Everything here is either
// plain per-thread C++ (conversions, math) or a call into the runtime, which
//   * bounds-checks and counts global accesses (fa::gload / fa::gstore / fa::atomic_add),
//   * turns warp collectives (shuffles, __syncwarp, ldmatrix, mma) into warp rendezvous that
//     are evaluated once, with the PTX semantics, when every lane of the mask has arrived,
//   * turns __syncthreads() into a block rendezvous,
//   * queues cp.async copies and performs them at the cp.async.wait_group that covers them,
//   * keeps mbarrier state and queues bulk copies and TMA loads that land when the schedule chooses
//     (sm_90); TMA stores, named barriers, stmatrix, elect.sync and setmaxnreg go to the runtime too,
//   * suspends a block whose fa::sem_wait is not yet satisfied (another OS thread runs the rest).
#pragma once

// Every standard header the emulator needs comes first, before any macro below exists.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <string>
#include <type_traits>
#include <utility>

#include "fa_emu_api.h"

#define FA_EMULATOR 1

// ---- CUDA keywords -----------------------------------------------------------------------
// Only names no C or C++ standard library uses: a header included after this one (by a kernel,
// or by a header the kernel includes) must see its own spelling unchanged. CUDA's __noinline__
// is deliberately absent: libstdc++ (GCC >= 12) and libc++ write __attribute__((__noinline__)),
// which a macro `__noinline__ -> __attribute__((noinline))` turns into a syntax error. Kernels
// write FA_NOINLINE instead (below; __noinline__ on the GPU). tests/test_host_compiler.py checks
// these names against the installed standard library headers.
#define __global__
#define __device__
#define __host__
// __forceinline__ inlines at every optimization level, as nvcc does: the runtime identifies barriers and groups a warp's
// memory accesses by call site (the return address into the module), so a helper left out of line would give all its
// callers one identity (at -Og, the modules' level, GCC inlines no more than it must).
#define __forceinline__ inline __attribute__((always_inline))
#define FA_NOINLINE __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Static __shared__ variables become per-OS-thread storage: one block runs at a time on each
// emulator worker, so all fibers of a block see the same variable. flasharray kernels use
// dynamic shared memory only (FA_DYNAMIC_SMEM); the fa:: wrappers check against that region.
#define __shared__ thread_local
#define __constant__ const
// A kernel parameter the GPU keeps in its parameter space and lets the kernel take the address of (the
// tensor maps of TMA); on the emulator parameters are ordinary by-value copies, which have addresses too.
#define __grid_constant__

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct uint2 { unsigned int x, y; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };

static constexpr int warpSize = 32;

// The fiber view: laid out identically to fa_emu_thread_view in fa_emu_api.h.
#define threadIdx (*reinterpret_cast<const uint3*>(fa_emu_self()->thread_idx))
#define blockIdx (*reinterpret_cast<const uint3*>(fa_emu_self()->block_idx))
#define blockDim (*reinterpret_cast<const dim3*>(fa_emu_self()->block_dim))
#define gridDim (*reinterpret_cast<const dim3*>(fa_emu_self()->grid_dim))

#define __syncthreads() fa_emu_syncthreads()
inline void __syncwarp(unsigned mask = 0xffffffffu) { fa_emu_syncwarp(mask); }
#define __syncthreads_count(pred) fa_emu_syncthreads_reduce(FA_EMU_BAR_COUNT, (pred) ? 1 : 0)
#define __syncthreads_and(pred) fa_emu_syncthreads_reduce(FA_EMU_BAR_AND, (pred) ? 1 : 0)
#define __syncthreads_or(pred) fa_emu_syncthreads_reduce(FA_EMU_BAR_OR, (pred) ? 1 : 0)
inline unsigned __ballot_sync(unsigned mask, int pred) { return fa_emu_vote(FA_EMU_VOTE_BALLOT, mask, pred); }
inline int __any_sync(unsigned mask, int pred) { return static_cast<int>(fa_emu_vote(FA_EMU_VOTE_ANY, mask, pred)); }
inline int __all_sync(unsigned mask, int pred) { return static_cast<int>(fa_emu_vote(FA_EMU_VOTE_ALL, mask, pred)); }
inline void __trap() { fa_emu_trap("__trap() called"); }

// ---- 16-bit float types (storage + round-to-nearest-even conversions) --------------------
namespace fa_emu {
inline uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u)  // inf or nan (nan keeps a quiet payload)
        return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u | ((absx >> 13) & 0x3ffu) : 0u));
    if (absx >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536: inf
    if (absx < 0x38800000u) {  // below 2^-14: half subnormal (unit 2^-24) or zero
        float a;
        std::memcpy(&a, &absx, 4);
        const float scaled = a * 16777216.0f;  // exact: power-of-two scaling
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
    }
    const uint32_t mant = absx & 0x7fffffu;
    const uint32_t exp = (absx >> 23) - 127 + 15;
    uint32_t h = (exp << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // ties to even; carry may give inf
    return static_cast<uint16_t>(sign | h);
}
inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    uint32_t x;
    if (exp == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        float v = std::ldexp(static_cast<float>(mant), -24);
        return sign ? -v : v;
    } else {
        x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline uint16_t f32_to_bf16_bits(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
}
inline float bf16_bits_to_f32(uint16_t h) {
    const uint32_t x = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
}  // namespace fa_emu

// Constructors and the conversion to float mirror cuda_fp16.h / cuda_bf16.h (without
// __CUDA_NO_HALF_CONVERSIONS__); every conversion rounds to nearest even.
#define FA_EMU_16BIT_CTORS(T, TO_BITS)                                                   \
    T() = default;                                                                      \
    T(float f) : x(TO_BITS(f)) {}                                                       \
    T(double f) : x(TO_BITS(static_cast<float>(f))) {}                                  \
    T(short v) : x(TO_BITS(static_cast<float>(v))) {}                                   \
    T(unsigned short v) : x(TO_BITS(static_cast<float>(v))) {}                          \
    T(int v) : x(TO_BITS(static_cast<float>(v))) {}                                     \
    T(unsigned int v) : x(TO_BITS(static_cast<float>(v))) {}                            \
    T(long long v) : x(TO_BITS(static_cast<float>(v))) {}                               \
    T(unsigned long long v) : x(TO_BITS(static_cast<float>(v))) {}
struct __half {
    uint16_t x;
    FA_EMU_16BIT_CTORS(__half, fa_emu::f32_to_f16_bits)
    operator float() const { return fa_emu::f16_bits_to_f32(x); }
};
struct __nv_bfloat16 {
    uint16_t x;
    FA_EMU_16BIT_CTORS(__nv_bfloat16, fa_emu::f32_to_bf16_bits)
    operator float() const { return fa_emu::bf16_bits_to_f32(x); }
};
#undef FA_EMU_16BIT_CTORS
typedef __half fa_half;
typedef __nv_bfloat16 fa_bf16;

inline float __half2float(__half h) { return fa_emu::f16_bits_to_f32(h.x); }
inline __half __float2half_rn(float f) { __half h; h.x = fa_emu::f32_to_f16_bits(f); return h; }
inline float __bfloat162float(__nv_bfloat16 h) { return fa_emu::bf16_bits_to_f32(h.x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { __nv_bfloat16 h; h.x = fa_emu::f32_to_bf16_bits(f); return h; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }

// ---- math builtins not in the C library ---------------------------------------------------
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// CUDA's device-side min/max overloads (same-type forms).
#define FA_EMU_MINMAX(T)                                  \
    inline T min(T a, T b) { return b < a ? b : a; }      \
    inline T max(T a, T b) { return a < b ? b : a; }
FA_EMU_MINMAX(int)
FA_EMU_MINMAX(unsigned int)
FA_EMU_MINMAX(long)
FA_EMU_MINMAX(unsigned long)
FA_EMU_MINMAX(long long)
FA_EMU_MINMAX(unsigned long long)
#undef FA_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- warp shuffles: 4- and 8-byte values ----------------------------------------------------
namespace fa_emu {
template <class T>
inline T shfl(int kind, unsigned mask, T var, int arg, int width) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "shuffles take 4- or 8-byte values");
    uint64_t bits = 0;
    std::memcpy(&bits, &var, sizeof(T));
    const uint64_t out = fa_emu_shfl(kind, mask, bits, arg, width);
    T r;
    std::memcpy(&r, &out, sizeof(T));
    return r;
}
}  // namespace fa_emu
template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    return fa_emu::shfl(FA_EMU_SHFL_IDX, mask, var, src_lane, width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    return fa_emu::shfl(FA_EMU_SHFL_XOR, mask, var, lane_mask, width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    return fa_emu::shfl(FA_EMU_SHFL_DOWN, mask, var, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    return fa_emu::shfl(FA_EMU_SHFL_UP, mask, var, static_cast<int>(delta), width);
}

// Declares `unsigned char* ptr` pointing at the block's dynamic shared memory.
#define FA_DYNAMIC_SMEM(ptr) unsigned char* ptr = fa_emu_dynamic_smem()

// The TMA tensor map: 128 bytes, 64-byte aligned, as cuda.h declares it. On the emulator its bytes are the
// emulator's own encoding (flasharray.emulator.encode_tensor_map; docs/emulator.md, "Hopper: TMA").
typedef struct CUtensorMap_st {
    alignas(64) unsigned long long opaque[16];
} CUtensorMap;

namespace fa {

template <class T> struct dependent_false { static constexpr bool value = false; };

inline uint32_t umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32); }

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(fa_half x) { return fa_emu::f16_bits_to_f32(x.x); }
inline float to_float(fa_bf16 x) { return fa_emu::bf16_bits_to_f32(x.x); }

template <class T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline double from_float<double>(float x) { return x; }
template <> inline fa_half from_float<fa_half>(float x) { return __float2half_rn(x); }
template <> inline fa_bf16 from_float<fa_bf16>(float x) { return __float2bfloat16_rn(x); }

template <class T> inline uint32_t pack2(float lo, float hi);
template <> inline uint32_t pack2<fa_half>(float lo, float hi) {
    return static_cast<uint32_t>(fa_emu::f32_to_f16_bits(lo)) |
           (static_cast<uint32_t>(fa_emu::f32_to_f16_bits(hi)) << 16);
}
template <> inline uint32_t pack2<fa_bf16>(float lo, float hi) {
    return static_cast<uint32_t>(fa_emu::f32_to_bf16_bits(lo)) |
           (static_cast<uint32_t>(fa_emu::f32_to_bf16_bits(hi)) << 16);
}
template <class T> inline float2 unpack2(uint32_t w);
template <> inline float2 unpack2<fa_half>(uint32_t w) {
    return {fa_emu::f16_bits_to_f32(static_cast<uint16_t>(w & 0xffffu)),
            fa_emu::f16_bits_to_f32(static_cast<uint16_t>(w >> 16))};
}
template <> inline float2 unpack2<fa_bf16>(uint32_t w) {
    return {fa_emu::bf16_bits_to_f32(static_cast<uint16_t>(w & 0xffffu)),
            fa_emu::bf16_bits_to_f32(static_cast<uint16_t>(w >> 16))};
}

template <class T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    static_assert(dependent_false<T>::value, "fa::mma_m16n8k16: T must be fa_half or fa_bf16");
}
template <>
inline void mma_m16n8k16<fa_half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    fa_emu_mma(FA_EMU_F16, d, a, b, c);
}
template <>
inline void mma_m16n8k16<fa_bf16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    fa_emu_mma(FA_EMU_BF16, d, a, b, c);
}

// ---- tf32 and fp64 tensor cores (sm_80+ on the GPU) --------------------------------------
// cvt.rna.tf32.f32 exactly as ptxas lowers it for sm_80, sm_86 and sm_90 (no tf32 convert
// instruction exists; tests/test_static_tf32_f64.py pins the sequence):
//     FSETP.GEU P0, |x|, +INF;  @!P0 x += 0x1000;  x &= 0xffffe000
// i.e. finite values round the magnitude to 10 mantissa bits, ties away from zero, the carry
// possibly entering the exponent (max finite -> inf; subnormals alike); inf and NaN are only
// masked, so a NaN whose payload lies only in the low 13 bits becomes an infinity.
inline uint32_t tf32_round_bits(uint32_t x) {
    if ((x & 0x7fffffffu) < 0x7f800000u) x += 0x1000u;
    return x & 0xffffe000u;
}
inline float cvt_tf32(float x) { return __uint_as_float(tf32_round_bits(__float_as_uint(x))); }
inline void split_tf32(float x, float& hi, float& lo) {
    hi = cvt_tf32(x);
    lo = cvt_tf32(x - hi);
}
inline void mma_m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    fa_emu_mma(FA_EMU_TF32, d, a, b, c);
}
inline void mma_m8n8k4_f64(double (&d)[2], const double (&a)[1], const double (&b)[1], const double (&c)[2]) {
    fa_emu_mma(FA_EMU_F64, reinterpret_cast<float*>(d), reinterpret_cast<const uint32_t*>(a),
               reinterpret_cast<const uint32_t*>(b), reinterpret_cast<const float*>(c));
}

template <class = void>
inline void mma_m16n8k16_f64(double (&d)[4], const double (&a)[8], const double (&b)[4], const double (&c)[4]) {
    fa_emu_mma(FA_EMU_F64_K16, reinterpret_cast<float*>(d), reinterpret_cast<const uint32_t*>(a),
               reinterpret_cast<const uint32_t*>(b), reinterpret_cast<const float*>(c));
}

template <int N, bool Trans>
inline void ldmatrix(uint32_t (&r)[N], const void* smem_row_addr) {
    static_assert(N == 1 || N == 2 || N == 4, "fa::ldmatrix: N must be 1, 2 or 4");
    fa_emu_ldmatrix(N, Trans ? 1 : 0, r, smem_row_addr);
}

// stmatrix (sm_90): ldmatrix's inverse; lanes 8j..8j+7 pass the addresses of rows 0..7 of matrix j.
template <int N, bool Trans>
inline void stmatrix(void* smem_row_addr, const uint32_t (&r)[N]) {
    static_assert(N == 1 || N == 2 || N == 4, "fa::stmatrix: N must be 1, 2 or 4");
    fa_emu_stmatrix(N, Trans ? 1 : 0, r, smem_row_addr);
}

// elect.sync (sm_90): true in exactly one lane of `mask` (the lowest), a warp collective over the mask.
inline bool elect_one(unsigned mask = 0xffffffffu) { return fa_emu_elect(mask) != 0; }

// fa_port.cuh's kSyncCopy: true here, so that the emulator runs the copy loops' sm_75 path (threads
// with whole chunks separate); the copies it issues are the same either way.
constexpr bool kSyncCopy = true;
template <int Bytes>
inline void cp_async(void* smem_dst, const void* gmem_src, int src_bytes) {
    static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "fa::cp_async: Bytes must be 4, 8 or 16");
    fa_emu_cp_async(smem_dst, gmem_src, Bytes, src_bytes);
}
// fa_port.cuh's ChunkStage: stage() issues the cp.async (as sm_80+ does: a read of the destination before
// the covering wait is an error) and land() checks what sm_75 needs: the chunk was staged at that
// destination, is landed once, and before the cp_async_wait that completes it; every staged chunk lands.
template <int N>
struct ChunkStage {
    void* dst[N] = {};
    void stage(int i, void* smem_dst, const void* gmem_src, int src_bytes) {
        if (i < 0 || i >= N) fa_emu_trap("fa::ChunkStage::stage: chunk index out of range");
        if (src_bytes != 0 && src_bytes != 16) fa_emu_trap("fa::ChunkStage::stage: src_bytes must be 16 or 0");
        if (dst[i]) fa_emu_trap("fa::ChunkStage::stage: chunk staged again before it landed");
        fa_emu_cp_async(smem_dst, gmem_src, 16, src_bytes);
        dst[i] = smem_dst;
    }
    void land(int i, void* smem_dst) {
        if (i < 0 || i >= N || dst[i] != smem_dst)
            fa_emu_trap("fa::ChunkStage::land: no chunk staged at this index and destination");
        if (!fa_emu_cp_async_pending(smem_dst))
            fa_emu_trap("fa::ChunkStage::land: after the cp_async_wait that completed the chunk (sm_75 writes "
                        "it at land)");
        dst[i] = nullptr;
    }
    ~ChunkStage() {
        for (int i = 0; i < N; ++i)
            if (dst[i]) fa_emu_trap("fa::ChunkStage: a staged chunk never landed (sm_75 would not write it)");
    }
};
// fa_port.cuh's ChunkPrefetch: fetch() records the source, put() issues the cp.async (as sm_80+ does) after
// checking what sm_75 needs: the chunk was fetched from that source with that count (16 or 0), is put once,
// and every fetched chunk is put.
template <int N>
struct ChunkPrefetch {
    const void* src[N] = {};
    int bytes[N] = {};
    bool fetched[N] = {};
    void fetch(int i, const void* gmem_src, int src_bytes) {
        if (i < 0 || i >= N) fa_emu_trap("fa::ChunkPrefetch::fetch: chunk index out of range");
        if (src_bytes != 0 && src_bytes != 16) fa_emu_trap("fa::ChunkPrefetch::fetch: src_bytes must be 16 or 0");
        if (fetched[i]) fa_emu_trap("fa::ChunkPrefetch::fetch: chunk fetched again before it was put");
        src[i] = gmem_src, bytes[i] = src_bytes, fetched[i] = true;
    }
    void put(int i, void* smem_dst, const void* gmem_src, int src_bytes) {
        if (i < 0 || i >= N || !fetched[i])
            fa_emu_trap("fa::ChunkPrefetch::put: chunk not fetched (sm_75 would store stale registers)");
        if (src[i] != gmem_src || bytes[i] != src_bytes)
            fa_emu_trap("fa::ChunkPrefetch::put: source or byte count differs from the fetch");
        fetched[i] = false;
        fa_emu_cp_async(smem_dst, gmem_src, 16, src_bytes);
    }
    ~ChunkPrefetch() {
        for (int i = 0; i < N; ++i)
            if (fetched[i]) fa_emu_trap("fa::ChunkPrefetch: a fetched chunk was never put");
    }
};
inline void cp_async_commit() { fa_emu_cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
    static_assert(N >= 0 && N <= 7, "fa::cp_async_wait: N must be in [0, 7]");
    fa_emu_cp_async_wait(N);
}

template <class T>
inline T gload(const T* p) {
    fa_emu_gcheck(p, sizeof(T), 0);
    T v;
    std::memcpy(static_cast<void*>(&v), static_cast<const void*>(p), sizeof(T));
    return v;
}
template <class T>
inline void gstore(T* p, T v) {
    fa_emu_gcheck(p, sizeof(T), 1);
    std::memcpy(static_cast<void*>(p), static_cast<const void*>(&v), sizeof(T));
}
inline void atomic_add(float* p, float v) { fa_emu_atomic_add_f32(p, v); }
inline void atomic_add(double* p, double v) { fa_emu_atomic_add_f64(p, v); }
// fa_port.cuh's predicated red: nothing (no access, no check of p) where pred is false.
inline void atomic_add_if(bool pred, float* p, float v) { if (pred) fa_emu_atomic_add_f32(p, v); }
inline void atomic_add_if(bool pred, double* p, double v) { if (pred) fa_emu_atomic_add_f64(p, v); }

// Block-wide (every thread calls them): the runtime lets thread 0 wait or post and puts the
// block's barrier around it, as the GPU branch does.
inline void sem_wait(const int* sem, int expected) { fa_emu_sem_wait(sem, expected); }
inline void sem_post(int* sem, int add = 1) { fa_emu_sem_post(sem, add); }
// The calling thread's halves (the kernel's own barriers around them, as on the GPU).
inline void sem_acquire(const int* sem, int expected) { fa_emu_sem_acquire(sem, expected); }
inline void sem_release(int* sem, int add = 1) { fa_emu_sem_release(sem, add); }
// Group-wide (the nthreads threads of named barrier id): the runtime picks the leader as the GPU branch does.
inline void sem_wait_group(const int* sem, int expected, int id, int nthreads) {
    fa_emu_sem_wait_group(sem, expected, id, nthreads);
}
inline void sem_post_group(int* sem, int id, int nthreads, int add = 1) {
    fa_emu_sem_post_group(sem, id, nthreads, add);
}

// ---- Hopper (sm_90): mbarriers and bulk copies (the runtime keeps the mbarrier state) -------
inline void mbarrier_init(uint64_t* bar, int count) { fa_emu_mbarrier_init(bar, count); }
inline void mbarrier_inval(uint64_t* bar) { fa_emu_mbarrier_inval(bar); }
inline uint64_t mbarrier_arrive(uint64_t* bar) { return fa_emu_mbarrier_arrive(bar, 0, 0); }
inline uint64_t mbarrier_arrive_expect_tx(uint64_t* bar, int tx_bytes) {
    return fa_emu_mbarrier_arrive(bar, tx_bytes, 1);
}
inline void mbarrier_expect_tx(uint64_t* bar, int tx_bytes) { fa_emu_mbarrier_expect_tx(bar, tx_bytes); }
inline bool mbarrier_try_wait_parity(uint64_t* bar, int parity) {
    return fa_emu_mbarrier_try_wait_parity(bar, parity) != 0;
}
inline void mbarrier_wait_parity(uint64_t* bar, int parity) { fa_emu_mbarrier_try_wait_parity(bar, parity); }
inline void fence_mbarrier_init() { fa_emu_fence_async(0); }
inline void fence_proxy_async() { fa_emu_fence_async(1); }
inline void cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar) {
    fa_emu_cp_async_bulk_g2s(smem_dst, gmem_src, bytes, bar);
}

// ---- named barriers: bar.sync / bar.arrive id, nthreads (the runtime counts arrivals per barrier) ----
inline void named_barrier_sync(int id, int nthreads) { fa_emu_named_barrier(id, nthreads, 1); }
inline void named_barrier_arrive(int id, int nthreads) { fa_emu_named_barrier(id, nthreads, 0); }

// ---- Hopper (sm_90): TMA (the runtime decodes the emulator's tensor map, queues loads like bulk copies) ---
inline void tma_load_1d(void* smem_dst, const CUtensorMap* tmap, int c0, uint64_t* bar) {
    const int c[1] = {c0};
    fa_emu_tma_load(smem_dst, tmap, 1, c, bar);
}
inline void tma_load_2d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, uint64_t* bar) {
    const int c[2] = {c0, c1};
    fa_emu_tma_load(smem_dst, tmap, 2, c, bar);
}
inline void tma_load_3d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2, uint64_t* bar) {
    const int c[3] = {c0, c1, c2};
    fa_emu_tma_load(smem_dst, tmap, 3, c, bar);
}
inline void tma_load_4d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2, int c3, uint64_t* bar) {
    const int c[4] = {c0, c1, c2, c3};
    fa_emu_tma_load(smem_dst, tmap, 4, c, bar);
}
inline void tma_load_5d(void* smem_dst, const CUtensorMap* tmap, int c0, int c1, int c2, int c3, int c4,
                        uint64_t* bar) {
    const int c[5] = {c0, c1, c2, c3, c4};
    fa_emu_tma_load(smem_dst, tmap, 5, c, bar);
}
inline void tma_store_1d(const CUtensorMap* tmap, int c0, const void* smem_src) {
    const int c[1] = {c0};
    fa_emu_tma_store(tmap, 1, c, smem_src);
}
inline void tma_store_2d(const CUtensorMap* tmap, int c0, int c1, const void* smem_src) {
    const int c[2] = {c0, c1};
    fa_emu_tma_store(tmap, 2, c, smem_src);
}
inline void tma_store_3d(const CUtensorMap* tmap, int c0, int c1, int c2, const void* smem_src) {
    const int c[3] = {c0, c1, c2};
    fa_emu_tma_store(tmap, 3, c, smem_src);
}
inline void tma_store_4d(const CUtensorMap* tmap, int c0, int c1, int c2, int c3, const void* smem_src) {
    const int c[4] = {c0, c1, c2, c3};
    fa_emu_tma_store(tmap, 4, c, smem_src);
}
inline void tma_store_5d(const CUtensorMap* tmap, int c0, int c1, int c2, int c3, int c4, const void* smem_src) {
    const int c[5] = {c0, c1, c2, c3, c4};
    fa_emu_tma_store(tmap, 5, c, smem_src);
}
inline void tma_store_commit() { fa_emu_bulk_commit(); }
template <int N>
inline void tma_store_wait() {
    static_assert(N >= 0 && N <= 7, "fa::tma_store_wait: N must be in [0, 7]");
    fa_emu_bulk_wait_read(N);
}
inline void tma_prefetch(const CUtensorMap* tmap) { fa_emu_tma_prefetch(tmap); }
// 1-D bulk reduce-add shared -> global (fp32), in the thread's bulk async-group; bulk_wait<N> is
// cp.async.bulk.wait_group N (completion: the adds land), bulk_wait_read<N> the .read form.
inline void bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, int bytes) {
    fa_emu_bulk_reduce_add_f32(gmem_dst, smem_src, bytes);
}
inline void bulk_commit() { fa_emu_bulk_commit(); }
template <int N>
inline void bulk_wait_read() {
    static_assert(N >= 0 && N <= 7, "fa::bulk_wait_read: N must be in [0, 7]");
    fa_emu_bulk_wait_read(N);
}
template <int N>
inline void bulk_wait() {
    static_assert(N >= 0 && N <= 7, "fa::bulk_wait: N must be in [0, 7]");
    fa_emu_bulk_wait(N);
}

// ---- Hopper (sm_90a): wgmma (the runtime rendezvouses the warpgroup, checks the asynchrony rules) ---
// The emulator's shared address is the offset in dynamic shared memory (1024-byte aligned at 0).
enum WgmmaSwizzle { kWgmmaSwizzleNone = 0, kWgmmaSwizzle128B = 1, kWgmmaSwizzle64B = 2, kWgmmaSwizzle32B = 3 };
inline uint64_t wgmma_desc_encode(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes, int swizzle) {
    return (static_cast<uint64_t>((smem_addr >> 4) & 0x3fffu)) |
           (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3fffu) << 16) |
           (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3fffu) << 32) | (static_cast<uint64_t>(swizzle & 3) << 62);
}
inline uint64_t wgmma_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes, int swizzle) {
    return wgmma_desc_encode(fa_emu_smem_addr(smem), lbo_bytes, sbo_bytes, swizzle);
}
// fa_port.cuh's: the start-address field advanced by bytes / 16, which must not carry out of its 14 bits.
inline uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    if (bytes % 16 != 0) fa_emu_trap("fa::wgmma_desc_advance: the advance is not a multiple of 16 bytes");
    if ((desc & 0x3fffu) + (bytes >> 4) > 0x3fffu)
        fa_emu_trap("fa::wgmma_desc_advance: the start address leaves its 14-bit field (past 256 KB)");
    return desc + (bytes >> 4);
}
// setmaxnreg (sm_90a): the warpgroup's per-thread register maximum, checked by the runtime.
template <int N>
inline void setmaxnreg_inc() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "fa::setmaxnreg: N must be a multiple of 8 in [24, 256]");
    fa_emu_setmaxnreg(1, N);
}
template <int N>
inline void setmaxnreg_dec() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "fa::setmaxnreg: N must be a multiple of 8 in [24, 256]");
    fa_emu_setmaxnreg(0, N);
}
inline void wgmma_fence() { fa_emu_wgmma_fence(); }
inline void wgmma_commit_group() { fa_emu_wgmma_commit(); }
template <int N>
inline void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "fa::wgmma_wait_group: N must be in [0, 7]");
    fa_emu_wgmma_wait(N);
}
template <int R>
inline void wgmma_fence_operand(float (&)[R]) {}

#define FA_EMU_WGMMA_N(N) static_assert((N) >= 8 && (N) <= 256 && (N) % 8 == 0, "fa::wgmma: N must be 8..256, a multiple of 8")
template <int N, bool TransA = false, bool TransB = false>
inline void wgmma_m64nNk16_f32_f16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_F16, N, d, nullptr, desc_a, desc_b, scale_d, TransA, TransB);
}
template <int N, bool TransA = false, bool TransB = false>
inline void wgmma_m64nNk16_f32_bf16_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_BF16, N, d, nullptr, desc_a, desc_b, scale_d, TransA, TransB);
}
template <int N, bool TransB = false>
inline void wgmma_m64nNk16_f32_f16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_F16, N, d, a, 0, desc_b, scale_d, 0, TransB);
}
template <int N, bool TransB = false>
inline void wgmma_m64nNk16_f32_bf16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_BF16, N, d, a, 0, desc_b, scale_d, 0, TransB);
}
// m64nNk8 tf32 (fp32 bit patterns, the low 13 mantissa bits ignored), both operands K-major.
template <int N>
inline void wgmma_m64nNk8_f32_tf32_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_TF32, N, d, nullptr, desc_a, desc_b, scale_d, 0, 0);
}
template <int N>
inline void wgmma_m64nNk8_f32_tf32_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
    FA_EMU_WGMMA_N(N);
    fa_emu_wgmma(FA_EMU_TF32, N, d, a, 0, desc_b, scale_d, 0, 0);
}
#undef FA_EMU_WGMMA_N

}  // namespace fa
