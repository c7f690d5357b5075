// fa_emu_api.h — the C ABI of the emulator runtime (libfa_emu_rt), used by kernel modules
// (through fa_emu.h) and by the Python driver (flasharray/emulator.py, through ctypes).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// What a fiber knows about itself. threadIdx etc. read these fields.
typedef struct fa_emu_thread_view {
    unsigned thread_idx[3];
    unsigned block_idx[3];
    unsigned block_dim[3];
    unsigned grid_dim[3];
} fa_emu_thread_view;

enum { FA_EMU_SHFL_IDX = 0, FA_EMU_SHFL_XOR = 1, FA_EMU_SHFL_DOWN = 2, FA_EMU_SHFL_UP = 3 };
// fa_emu_mma's `dtype`. F16, BF16: m16n8k16, a[4]/b[2] hold packed 16-bit pairs, c/d float[4].
// TF32: m16n8k8, a[4]/b[2] hold fp32 bit patterns (low 13 mantissa bits ignored), c/d float[4].
// F64: m8n8k4; d, a, b, c point at double[2], double[1], double[1], double[2] (cast to the
// parameter types; the runtime casts them back). F64_K16: m16n8k16 (sm_90); double[4], [8], [4], [4].
enum { FA_EMU_F16 = 0, FA_EMU_BF16 = 1, FA_EMU_TF32 = 2, FA_EMU_F64 = 3, FA_EMU_F64_K16 = 4 };
enum { FA_EMU_VOTE_BALLOT = 0, FA_EMU_VOTE_ANY = 1, FA_EMU_VOTE_ALL = 2 };
enum { FA_EMU_BAR_PLAIN = 0, FA_EMU_BAR_COUNT = 1, FA_EMU_BAR_AND = 2, FA_EMU_BAR_OR = 3 };

// Barriers are identified by their call site (a divergent __syncthreads() is an error), so the
// compiler must not duplicate a call into branches: Clang's `convergent` forbids exactly that (GCC
// has no such attribute; the driver passes it -fno-thread-jumps instead).
#if defined(__clang__)
#define FA_EMU_CONVERGENT __attribute__((convergent))
#else
#define FA_EMU_CONVERGENT
#endif

// The view of the calling fiber. Constant for the lifetime of a kernel invocation (a fiber
// never changes identity), hence `const`: the compiler may reuse the result.
const fa_emu_thread_view* fa_emu_self(void) __attribute__((const));

FA_EMU_CONVERGENT void fa_emu_syncthreads(void);
FA_EMU_CONVERGENT int fa_emu_syncthreads_reduce(int kind, int predicate);
unsigned fa_emu_vote(int kind, unsigned mask, int predicate);
void fa_emu_syncwarp(unsigned mask);
uint64_t fa_emu_shfl(int kind, unsigned mask, uint64_t value, int arg, int width);
void fa_emu_mma(int dtype, float* d, const uint32_t* a, const uint32_t* b, const float* c);
void fa_emu_ldmatrix(int n, int trans, uint32_t* r, const void* smem_row_addr);
void fa_emu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, int src_bytes);
void fa_emu_cp_async_commit(void);
void fa_emu_cp_async_wait(int n);
// Whether the calling thread has a cp.async to smem_dst issued and not yet completed by a wait
// (fa::ChunkStage's check that a staged chunk lands before the wait covering it).
int fa_emu_cp_async_pending(const void* smem_dst);
void fa_emu_gcheck(const void* p, size_t size, int is_write);
void fa_emu_atomic_add_f32(float* p, float v);
void fa_emu_atomic_add_f64(double* p, double v);
// Inter-block semaphores, block-wide (fa::sem_wait / fa::sem_post; every thread of the block
// calls them, at one call site: it is the barrier's identity). sem_wait: thread 0 waits until
// *sem == expected (acquire), then the block's barrier; if the counter is short, the worker's OS
// thread blocks with the whole block suspended and another worker starts the blocks not yet
// dispatched. sem_post: the block's barrier, then thread 0 adds `add` (> 0; release) and wakes waiters.
FA_EMU_CONVERGENT void fa_emu_sem_wait(const int* sem, int expected);
FA_EMU_CONVERGENT void fa_emu_sem_post(int* sem, int add);
// Their halves by the calling thread (fa::sem_acquire / fa::sem_release; the kernel puts its own barriers
// around them): the wait suspends the block as sem_wait's does; the post adds `add` (release) and wakes waiters.
void fa_emu_sem_acquire(const int* sem, int expected);
void fa_emu_sem_release(int* sem, int add);
// Group semaphores (fa::sem_wait_group / fa::sem_post_group): the same over the nthreads threads of named
// barrier `id` (bar.sync id, nthreads) instead of the block; the leader is the participant whose linear
// thread index is a multiple of nthreads. A short wait suspends only the leader's fiber (the group waits at
// the barrier, other threads run on); the block blocks its worker only when nothing else in it can run.
// Each phase is checked: every participant at the same operation, exactly one leader.
void fa_emu_sem_wait_group(const int* sem, int expected, int id, int nthreads);
void fa_emu_sem_post_group(int* sem, int id, int nthreads, int add);
// mbarriers in dynamic shared memory and bulk copies completing on them (sm_90; fa_port.cuh's
// "Hopper" section, docs/emulator.md). arrive: tx_bytes is expected first when expect_tx != 0;
// returns the phase arrived on. try_wait_parity suspends the fiber until the phase of that parity
// has completed (it returns 1). fence_async: fence.mbarrier_init (kind 0) / fence.proxy.async (1).
void fa_emu_mbarrier_init(uint64_t* bar, int count);
void fa_emu_mbarrier_inval(uint64_t* bar);
uint64_t fa_emu_mbarrier_arrive(uint64_t* bar, int tx_bytes, int expect_tx);
void fa_emu_mbarrier_expect_tx(uint64_t* bar, int tx_bytes);
int fa_emu_mbarrier_try_wait_parity(uint64_t* bar, int parity);
void fa_emu_fence_async(int kind);
void fa_emu_cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar);
// TMA (sm_90; docs/emulator.md, "Hopper: TMA"): tmap points at the 128-byte CUtensorMap the emulator's
// encoder wrote; coords[dims], innermost first. tma_load lands like a bulk copy (complete_tx of the box
// bytes on bar); tma_store reads its source at the covering fa_emu_bulk_wait_read (cp.async.bulk.
// wait_group.read n) of the groups fa_emu_bulk_commit closes. tma_prefetch only checks the map.
void fa_emu_tma_load(void* smem_dst, const void* tmap, int dims, const int* coords, uint64_t* bar);
void fa_emu_tma_store(const void* tmap, int dims, const int* coords, const void* smem_src);
void fa_emu_tma_prefetch(const void* tmap);
void fa_emu_bulk_commit(void);
void fa_emu_bulk_wait_read(int n);
// cp.async.bulk.wait_group n (completion, without .read) and the 1-D bulk reduce-add
// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 (its adds applied at the covering wait).
void fa_emu_bulk_wait(int n);
void fa_emu_bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, int bytes);
// Named barriers (bar.sync / bar.arrive id, nthreads; docs/emulator.md): sync != 0 waits for the barrier.
void fa_emu_named_barrier(int id, int nthreads, int sync);
// stmatrix.sync.aligned.m8n8.x{n}{.trans}.shared.b16 (sm_90): ldmatrix's inverse, a warp collective.
void fa_emu_stmatrix(int n, int trans, const uint32_t* r, void* smem_row_addr);
// elect.sync (sm_90): a warp collective over mask; returns 1 in the leader (the lowest lane of mask), else 0.
unsigned fa_emu_elect(unsigned mask);
// setmaxnreg.{inc,dec}.sync.aligned.u32 n (sm_90a): checked per warpgroup (docs/emulator.md).
void fa_emu_setmaxnreg(int inc, int n);
// wgmma (sm_90a; docs/emulator.md, "Hopper: wgmma"): m64nNk16, f16/bf16 -> f32. A warpgroup collective
// (the 128 threads of warps 4k..4k+3), evaluated when the last one arrives. a: the rs variant's A fragment
// (uint32_t[4]), nullptr for A from shared memory (desc_a); d: float[n/2], written at the covering
// fa_emu_wgmma_wait. fa_emu_smem_addr: the shared address of p (its offset in dynamic shared memory).
void fa_emu_wgmma(int dtype, int n, float* d, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, int scale_d,
                  int trans_a, int trans_b);
void fa_emu_wgmma_fence(void);
void fa_emu_wgmma_commit(void);
void fa_emu_wgmma_wait(int n);
uint32_t fa_emu_smem_addr(const void* p);
unsigned char* fa_emu_dynamic_smem(void);
void fa_emu_trap(const char* what) __attribute__((noreturn));

// ---- launch interface (Python driver) -----------------------------------------------------
typedef void (*fa_emu_entry_fn)(void** args);

typedef struct fa_emu_buffer {
    uint64_t lo, hi;     // byte range [lo, hi) of the array's memory
    int32_t arg_index;   // kernel argument it was passed as
    int32_t writable;    // 0: read-only array, stores are errors
} fa_emu_buffer;

typedef struct fa_emu_counters {
    uint64_t global_read_bytes, global_write_bytes;
    uint64_t mma, ldmatrix, cp_async, cp_async_bytes, barriers, shuffles, syncwarps, atomics;
    uint64_t blocks, fiber_switches, votes;
    uint64_t ldmatrix_wavefronts, ldmatrix_wavefronts_ideal;  // shared-memory bank conflicts
    // warp-instruction memory efficiency (fa_emu_memstats.h): global 32-byte sectors touched by
    // loads (incl. cp.async sources) and stores (incl. atomics), shared wavefronts of cp.async
    // destinations; each with the ideal count
    uint64_t gld_sectors, gld_sectors_ideal, gst_sectors, gst_sectors_ideal;
    uint64_t cp_async_smem_wavefronts, cp_async_smem_wavefronts_ideal;
    uint64_t sem_waits, sem_blocked;  // fa::sem_wait calls; those that had to block
    uint64_t bulk_copies, bulk_copy_bytes;  // fa::cp_async_bulk_g2s calls and their bytes
    uint64_t mbar_waits, mbar_blocked;      // mbarrier parity waits; those that found the phase incomplete
    uint64_t wgmma;                         // wgmma.mma_async instructions (one per warpgroup issue)
    uint64_t tma_loads, tma_load_bytes;     // fa::tma_load_* calls and their box bytes (OOB fill included)
    uint64_t tma_stores, tma_store_bytes;   // fa::tma_store_* calls and their box bytes
    uint64_t named_barriers;                // completed named barriers (bar.sync/bar.arrive id, count)
    uint64_t stmatrix, elects, setmaxnreg;  // warp stmatrix / elect.sync; warpgroup setmaxnreg completions
    // cp.async copies (fa_emu_memstats.h's model of an H100's LDGSTS): 128-byte shared lines per phase and
    // (global sector, 32-byte shared slot) pairs, each with the ideal count
    uint64_t cp_async_lines, cp_async_lines_ideal, cp_async_sectors, cp_async_sectors_ideal;
    uint64_t stmatrix_wavefronts, stmatrix_wavefronts_ideal;  // stmatrix bank conflicts (ldmatrix's rule)
} fa_emu_counters;

enum { FA_EMU_SCHED_FORWARD = 0, FA_EMU_SCHED_REVERSE = 1, FA_EMU_SCHED_RANDOM = 2 };

typedef struct fa_emu_launch_params {
    const char* kernel_name;
    fa_emu_entry_fn entry;
    void** args;
    unsigned grid[3], block[3];
    uint64_t shared_mem;
    int schedule;
    uint64_t seed;
    int num_workers;             // OS threads running blocks in parallel (>= 1)
    uint64_t stack_bytes;        // per fiber
    const fa_emu_buffer* buffers;
    int num_buffers;
    uint64_t* buffer_read_bytes;   // [num_buffers], filled
    uint64_t* buffer_write_bytes;  // [num_buffers], filled
    fa_emu_counters* counters;     // filled
    char* error;                   // filled with a message on failure
    size_t error_size;
    uint64_t* buffer_sectors;      // [4 * num_buffers], filled: read sectors, ideal, write sectors, ideal
} fa_emu_launch_params;

// Returns 0 on success, nonzero with params->error set otherwise.
int fa_emu_launch(fa_emu_launch_params* params);
// ns per fiber switch measured with `iterations` ping-pong switches between two fibers.
double fa_emu_measure_switch_ns(int iterations);
int fa_emu_abi_version(void);

#ifdef __cplusplus
}
#endif
