// fa_emu_runtime.cpp — the flasharray CUDA emulator runtime (built once into libfa_emu_rt.so).
//
// Execution model
//   * A launch runs its blocks on `num_workers` OS threads; each worker runs one block at a
//     time, so the block's dynamic shared memory, fibers and barrier state are per worker.
//   * Every CUDA thread of a block is a fiber with its own stack (guard page below it). A
//     fiber runs until it reaches a rendezvous (__syncthreads, a warp collective) or exits, and
//     then switches back to the worker's scheduler with a hand-written context switch
//     (x86-64: callee-saved registers + MXCSR/x87 control word, ~10 instructions).
//   * The scheduler always resumes the runnable fiber chosen by the schedule: the lowest
//     thread id (forward), the highest (reverse) or a seeded random one (random). Forward
//     therefore runs warp 0 as far as it can go (to the next __syncthreads) before warp 1
//     starts; a missing barrier shows up as stale data or as a checked error.
//   * A warp collective is evaluated once, eagerly, when the last lane of its mask arrives,
//     with the formulas of /work/shared/ptx_semantics.md; fp32-accumulating mma (f16, bf16,
//     tf32) sums exact products in float64 and rounds once to fp32; f64 mma chains fp64 FMAs.
//   * cp.async copies are queued per thread and performed by the cp.async.wait_group that
//     covers them; ldmatrix refuses to read bytes that are the destination of a pending copy.
//   * Faults inside a fiber (raw out-of-bounds shared access into the guard pages, stack
//     overflow, integer division by zero) abort the block with an error instead of killing
//     the process: the signal handler redirects the faulting fiber to a rescue stack.
//   * mbarriers (sm_90) live beside shared memory, keyed by their shared offset, with the PTX state
//     (expected and pending arrivals, tx-count, phase); a wait for an incomplete phase suspends the
//     fiber until the phase completes. Bulk copies (cp.async.bulk global -> shared) are queued per
//     block and land, performing complete_tx on their mbarrier, when the schedule chooses: forward
//     as late as possible (when no fiber can run), reverse at once, random at random switches.
//     A block where every live fiber waits and no copy is in flight is a reported deadlock.
//     TMA loads (cp.async.bulk.tensor) are bulk copies gathered element by element through the
//     emulator's tensor map; TMA stores write global memory at the wait_group.read covering them,
//     their source checked against an image of shared memory as of the last fence.proxy.async.
//   * Named barriers (bar.sync/bar.arrive id, count) count whole warps; setmaxnreg is checked per
//     warpgroup; stmatrix and elect.sync are warp collectives like ldmatrix.
//   * Inter-block semaphores (fa::sem_wait / fa::sem_post): an unsatisfied wait blocks the
//     worker's OS thread inside the runtime call, the whole block suspended with its fibers;
//     while blocks remain to be dispatched, another worker thread is started so that `target`
//     workers keep running. When every live worker waits and no block is left, the launch
//     fails with a deadlock error; any failure wakes the waiters, which abandon their blocks.
#include "fa_emu_api.h"
#include "fa_emu_memstats.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cxxabi.h>
#include <dlfcn.h>
#include <exception>
#include <memory>
#include <mutex>
#include <signal.h>
#include <string>
#include <sys/mman.h>
#include <system_error>
#include <thread>
#include <unistd.h>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace {

// =========================================================================================
// Context switch
// =========================================================================================
#if defined(__x86_64__)
extern "C" void fa_emu_ctx_switch(void** save_sp, void* new_sp);
extern "C" void fa_emu_ctx_start();
// fa_emu_ctx_switch(save_sp, new_sp): push the callee-saved registers and the SSE/x87 control
// words on the current stack, store the stack pointer in *save_sp, load new_sp and pop the
// same frame from it. A new fiber's stack is prepared so that the first switch "returns"
// into fa_emu_ctx_start with r12 = argument and r13 = function.
asm(R"(
    .text
    .p2align 4
    .globl fa_emu_ctx_switch
    .hidden fa_emu_ctx_switch
    .type fa_emu_ctx_switch, @function
fa_emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fa_emu_ctx_switch, .-fa_emu_ctx_switch

    .p2align 4
    .globl fa_emu_ctx_start
    .hidden fa_emu_ctx_start
    .type fa_emu_ctx_start, @function
fa_emu_ctx_start:
    movq %r12, %rdi
    andq $-16, %rsp
    callq *%r13
    ud2
    .size fa_emu_ctx_start, .-fa_emu_ctx_start
)");

struct Context {
    void* sp = nullptr;
};

// Prepares `ctx` so that switching to it calls fn(arg) on the stack [lo, lo + size).
void ctx_make(Context* ctx, char* lo, size_t size, void (*fn)(void*), void* arg) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    uint32_t csr[2];
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
    *--sp = 0;                                                   // alignment pad
    *--sp = reinterpret_cast<uint64_t>(&fa_emu_ctx_start);      // `ret` target
    *--sp = 0;                                                   // rbp
    *--sp = 0;                                                   // rbx
    *--sp = reinterpret_cast<uint64_t>(arg);                     // r12
    *--sp = reinterpret_cast<uint64_t>(fn);                      // r13
    *--sp = 0;                                                   // r14
    *--sp = 0;                                                   // r15
    uint64_t packed;
    std::memcpy(&packed, csr, 8);
    *--sp = packed;                                              // mxcsr | x87 cw
    ctx->sp = sp;
}
inline void ctx_switch(Context* from, Context* to) { fa_emu_ctx_switch(&from->sp, to->sp); }
#else
// Portable fallback (slower): ucontext for every switch.
struct Context {
    ucontext_t uc;
};
void ctx_make(Context* ctx, char* lo, size_t size, void (*fn)(void*), void* arg) {
    getcontext(&ctx->uc);
    ctx->uc.uc_stack.ss_sp = lo;
    ctx->uc.uc_stack.ss_size = size;
    ctx->uc.uc_link = nullptr;
    makecontext(&ctx->uc, reinterpret_cast<void (*)()>(fn), 1, arg);
}
inline void ctx_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
#endif

// =========================================================================================
// Data structures
// =========================================================================================
enum State { RUNNABLE, RUNNING, WAIT_WARP, WAIT_BAR, WAIT_MBAR, WAIT_WG, WAIT_NBAR, WAIT_SEM, EXITED };
enum Op { OP_NONE, OP_SHFL, OP_SYNCWARP, OP_MMA, OP_LDMATRIX, OP_VOTE, OP_STMATRIX, OP_ELECT };

const char* op_name(int op, int kind) {
    switch (op) {
        case OP_SHFL:
            switch (kind) {
                case FA_EMU_SHFL_IDX: return "__shfl_sync";
                case FA_EMU_SHFL_XOR: return "__shfl_xor_sync";
                case FA_EMU_SHFL_DOWN: return "__shfl_down_sync";
                default: return "__shfl_up_sync";
            }
        case OP_SYNCWARP: return "__syncwarp";
        case OP_VOTE:
            return kind == FA_EMU_VOTE_BALLOT ? "__ballot_sync" : kind == FA_EMU_VOTE_ANY ? "__any_sync" : "__all_sync";
        case OP_MMA:
            return kind == FA_EMU_TF32      ? "fa::mma_m16n8k8_tf32"
                   : kind == FA_EMU_F64     ? "fa::mma_m8n8k4_f64"
                   : kind == FA_EMU_F64_K16 ? "fa::mma_m16n8k16_f64"
                                            : "fa::mma_m16n8k16";
        case OP_LDMATRIX: return "fa::ldmatrix";
        case OP_STMATRIX: return "fa::stmatrix";
        case OP_ELECT: return "fa::elect_one";
        default: return "?";
    }
}

struct Copy {
    unsigned char* dst;
    const unsigned char* src;
    int size, src_bytes;
    int64_t group;  // -1: not yet committed
};

// A wgmma.mma_async issued by a warpgroup (sm_90a): its results, computed at the issue from the operands
// read then, wait in `D` until each thread's covering wgmma.wait_group writes its share.
struct WgOp {
    int n = 0, wg = 0;
    std::vector<float> D;             // [64][n]
    std::vector<uint32_t> chunks;     // shared offsets of the 16-byte chunks the operands were read from
    std::vector<unsigned char> bytes; // their contents at the issue (each thread's completion compares)
};
// One thread's share of an in-flight wgmma: its accumulator registers and (rs) A-fragment registers.
struct WgPart {
    std::shared_ptr<WgOp> op;
    float* d;
    const uint32_t* a;     // nullptr: A from shared memory
    uint32_t a_snap[4];
    int64_t group;         // -1: not yet committed
};
// A register array a thread's wgmmas used (accumulator or A fragment), with its contents when last
// written by a wgmma or fenced by wgmma.fence: a difference at the next issue is an unfenced write.
struct WgTrack {
    const void* p;
    std::vector<uint32_t> snap;
};

// One element of a TMA box: its (swizzled) shared offset and its global address, null when out of bounds.
struct TmaElem {
    uint32_t smem;
    const unsigned char* g;
};

// A cp.async.bulk global -> shared in flight: performs complete_tx(bytes) on `bar` when delivered. A
// tensor copy (fa::tma_load_*) gathers its box element by element (`elems`, each `esize` bytes).
struct Bulk {
    unsigned char* dst;
    const unsigned char* src;
    int bytes, tid;
    uint32_t bar;  // shared offset of the mbarrier
    std::shared_ptr<std::vector<TmaElem>> elems;
    int esize = 0;
};

// A TMA store (fa::tma_store_*) in flight: its box elements, the source bytes as they were at the issue.
struct TmaStore {
    std::vector<TmaElem> elems;
    int esize;
    uint32_t src, bytes;  // shared offset and size of the source box
    std::vector<unsigned char> snap;
    int64_t group;  // -1: not yet committed
    int kind = 0;       // 0: TMA store (writes at the .read wait); 1: bulk reduce-add f32 (adds at completion)
    bool read = false;  // a covering wait_group(.read) has read the source (snap is what the op applies)
};

// A named barrier (bar.sync / bar.arrive id, count): the count (set by the first arrival while it is idle),
// the threads of whole warps arrived in this phase, and per warp the lanes that have executed the
// instruction while the warp's arrival is incomplete (and whether they sync, 1, or arrive, 0).
struct NamedBar {
    int expected = 0, arrived = 0, first_tid = 0;
    // threads of this phase at a group semaphore (fa::sem_wait_group / sem_post_group: `sem_what`) on this
    // barrier, and how many of them are the group's leader (checked when the phase completes)
    int sem_members = 0, sem_leaders = 0;
    const char* sem_what = nullptr;
    std::vector<uint32_t> lanes;
    std::vector<int> warp_kind;
};

// setmaxnreg of one warpgroup: the instruction its threads are executing (inc 1 / dec 0, the count), which
// threads have executed it, and the per-thread register count the last completed one set (0: the launch's).
struct MaxNReg {
    int inc = -1, n = 0, executed = 0, first_tid = 0, current = 0;
    uint64_t done[2] = {0, 0};
};

struct Fiber {
    fa_emu_thread_view view;  // first member: fa_emu_self() returns its address
    Context ctx;
    int state = RUNNABLE;
    int tid = 0, warp = 0, lane = 0;
    // the warp collective this fiber waits at
    int op = OP_NONE, kind = 0, arg = 0, width = 32, n = 0, trans = 0, dtype = 0;
    unsigned mask = 0;
    uint64_t value = 0, result = 0;
    const void* addr = nullptr;
    uint32_t* regs = nullptr;
    float* d = nullptr;
    const uint32_t* a = nullptr;
    const uint32_t* b = nullptr;
    const float* c = nullptr;
    void* bar_site = nullptr;
    int nbar_id = 0;            // the named barrier this fiber waits at (state WAIT_NBAR)
    bool nbar_counted = false;  // its warp's arrival there is counted
    // the mbarrier this fiber waits at (state WAIT_MBAR): its shared offset, the parity awaited
    uint32_t mbar_off = 0;
    int mbar_parity = 0;
    // per mbarrier (shared offset) the phases this fiber has seen complete through a try_wait: a bulk copy that
    // completed on phase p of it is ordered before this fiber's accesses once p < seen
    std::vector<std::pair<uint32_t, uint32_t>> mbar_seen;
    // the counter a group semaphore's leader waits for (state WAIT_SEM: fa::sem_wait_group) and the turn
    const int* sem = nullptr;
    int sem_expected = 0;
    // wgmma (state WAIT_WG): the instruction's operands; in-flight shares, commit groups, fence tracking
    uint64_t desc_a = 0, desc_b = 0;
    int scale_d = 0, trans_a = 0, trans_b = 0;
    std::vector<WgPart> wg_parts;
    int64_t wg_groups = 0;
    std::vector<WgTrack> wg_tracked;
    bool wg_fenced = false;                // executed a wgmma_fence
    std::vector<unsigned char> wg_stack;   // its stack [wg_stack_lo, top) at its last wgmma_fence
    uintptr_t wg_stack_lo = 0;
    // cp.async queue, in issue order
    std::vector<Copy> copies;
    size_t copies_head = 0;
    int64_t groups_committed = 0;
    // TMA stores (bulk async-groups), in issue order
    std::vector<TmaStore> tma_stores;
    int64_t bulk_groups = 0;
    // memory statistics: how often this thread reached each (call site, kind) since the last barrier
    std::unordered_map<uint64_t, uint32_t> site_count;
    char* stack_lo = nullptr;
};

// An mbarrier object (PTX ISA, "Contents of the mbarrier object"), kept beside shared memory and
// keyed by its shared offset: the 8 bytes themselves are opaque to the kernel.
struct MBar {
    uint32_t expected = 0, pending = 0;  // arrivals per phase; arrivals still missing in this phase
    int32_t tx = 0;                      // tx-count: bytes expected minus bytes completed
    uint32_t phase = 0;                  // phases completed since init; parity = phase & 1
    int init_tid = -1;                   // the thread that initialized it
    bool fenced = false;                 // that thread executed a fence.mbarrier_init / proxy.async since
};


struct Worker;

struct Launch {
    const fa_emu_launch_params* p;
    unsigned nblocks;
    std::vector<unsigned> order;
    std::atomic<unsigned> next{0};
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string error;
    // Worker threads and semaphores, guarded by sem_mu: `live` workers run or look for blocks,
    // `blocked` of them wait in fa_emu_sem_wait. While blocks remain to be dispatched, workers
    // are added so that live - blocked stays at `target` (the launch's worker count); a surplus
    // one (its waiter woke up) retires before taking another block.
    std::mutex sem_mu;
    std::condition_variable sem_cv;  // a post, a failure, a worker's exit
    std::vector<std::unique_ptr<Worker>> workers;
    std::vector<std::thread> threads;
    int target = 1, live = 0, blocked = 0;
};

constexpr size_t kPage = 4096;
constexpr size_t kGuard = 16 * kPage;       // below each fiber stack; around shared memory
constexpr size_t kAltStack = 64 * 1024;     // signal handler stack
constexpr size_t kRescueStack = 256 * 1024; // where a faulting fiber reports its error
constexpr int kGranule = 4;                 // pending-cp.async shadow granularity (bytes)

struct Worker {
    Launch* L = nullptr;
    const fa_emu_launch_params* p = nullptr;
    // fibers
    std::vector<Fiber> fibers;
    char* stacks = nullptr;
    size_t stacks_len = 0, stack_stride = 0, stack_size = 0;
    Context sched;
    Fiber* cur = nullptr;
    // shared memory: [smem, smem + smem_size) with guard pages on both sides
    char* smem_region = nullptr;
    size_t smem_region_len = 0;
    unsigned char* smem = nullptr;
    size_t smem_size = 0;
    std::vector<uint16_t> pending;  // per granule: cp.async and bulk copies not yet performed
    // per granule: the last bulk copy that landed there, as (its mbarrier's shared offset + 1, the phase it
    // completed on); 0: none since the block began
    std::vector<uint32_t> landed_bar, landed_phase;
    std::unordered_map<uint32_t, MBar> mbars;  // live mbarriers by shared offset
    std::vector<Bulk> bulks;        // bulk copies in flight, in issue order
    int mbar_waiting = 0;           // fibers in WAIT_MBAR
    std::vector<unsigned char> async_img;  // shared memory as of the block's last fence.proxy.async
    std::vector<int> wg_arrived;    // per warpgroup: threads waiting at its wgmma rendezvous
    std::vector<NamedBar> nbars;    // the 16 named barriers
    std::vector<MaxNReg> maxnreg;   // per warpgroup: its setmaxnreg in progress and register count
    // block state
    unsigned bidx[3] = {0, 0, 0};
    unsigned linear = 0;
    bool retired = false;
    // the fa::sem_wait this worker is blocked in (sem == nullptr: none); guarded by L->sem_mu. sem_group:
    // blocked because every fiber waits and sem_fibers of them are group leaders in WAIT_SEM (the one
    // named here, sem_tid, has the lowest thread id; any of them becoming ready wakes the block)
    const int* sem = nullptr;
    int sem_expected = 0, sem_buf = -1, sem_tid = 0;
    bool sem_group = false;
    int sem_fibers = 0;  // fibers in WAIT_SEM (block state)
    int nthreads = 0, nwarps = 0;
    std::vector<uint32_t> warp_waiting, warp_exited, warp_exists;
    std::vector<uint64_t> runnable;
    int nrunnable = 0;
    int bar_arrived = 0, exited = 0;
    void* bar_site = nullptr;
    int bar_first_tid = -1;
    int bar_kind = 0, bar_acc = 0, bar_result = 0;
    bool aborting = false;
    uint64_t rng = 0;
    // buffers lookup
    int last_buf = -1;
    // counters
    fa_emu_counters cnt{};
    std::vector<uint64_t> buf_read, buf_write;
    std::vector<uint64_t> buf_sectors;      // per buffer: read sectors, ideal, write sectors, ideal
    fa_emu_stats::Recorder stats;           // this block's accesses since its last barrier
    // fault handling
    char* altstack = nullptr;
    char* rescue = nullptr;
    char fault_msg[512];
};

thread_local Worker* tls_worker = nullptr;

// =========================================================================================
// Helpers
// =========================================================================================
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

std::string lanes_str(uint32_t m) {
    std::string s;
    int i = 0;
    while (i < 32) {
        if (!((m >> i) & 1u)) { ++i; continue; }
        int j = i;
        while (j + 1 < 32 && ((m >> (j + 1)) & 1u)) ++j;
        if (!s.empty()) s += ",";
        s += j == i ? strf("%d", i) : strf("%d-%d", i, j);
        i = j + 1;
    }
    return s.empty() ? "none" : s;
}

std::string site_str(void* site) {
    Dl_info info;
    if (site && dladdr(site, &info) && info.dli_sname) {
        int status = 0;
        char* dem = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
        std::string s = strf("%s+0x%lx", status == 0 && dem ? dem : info.dli_sname,
                             static_cast<unsigned long>(static_cast<char*>(site) - static_cast<char*>(info.dli_saddr)));
        free(dem);
        return s;
    }
    return strf("%p", site);
}

uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

inline Worker* W() { return tls_worker; }

void set_runnable(Worker* w, int tid) {
    uint64_t& word = w->runnable[tid >> 6];
    const uint64_t bit = uint64_t(1) << (tid & 63);
    if (!(word & bit)) { word |= bit; ++w->nrunnable; }
    w->fibers[tid].state = RUNNABLE;
}

std::string where(Worker* w, const Fiber* f) {
    const char* name = w->p->kernel_name ? w->p->kernel_name : "?";
    std::string s = strf("kernel '%s' block (%u,%u,%u)", name, w->bidx[0], w->bidx[1], w->bidx[2]);
    if (f) {
        s += strf(" thread (%u,%u,%u) [warp %d lane %d]", f->view.thread_idx[0], f->view.thread_idx[1],
                  f->view.thread_idx[2], f->warp, f->lane);
    }
    return s;
}

// The first error of a launch wins; every later one is dropped.
void set_error(Launch* L, const std::string& msg) {
    std::lock_guard<std::mutex> lock(L->mu);
    if (L->error.empty()) L->error = msg;
    L->failed.store(true);
}

// Records the error and wakes the blocks waiting in fa_emu_sem_wait so that they abandon their
// work. A waiter tests `failed` under sem_mu, so taking it once here means none misses the wake-up.
// Never called with sem_mu held.
void record_error(Worker* w, const std::string& msg) {
    Launch* L = w->L;
    set_error(L, msg);
    { std::lock_guard<std::mutex> lock(L->sem_mu); }
    L->sem_cv.notify_all();
}

// Reports an error attributed to the running fiber and abandons the block. Never returns.
[[noreturn]] void fiber_fail(Worker* w, const std::string& what) {
    record_error(w, where(w, w->cur) + ": " + what);
    w->aborting = true;
    Fiber* f = w->cur;
    ctx_switch(&f->ctx, &w->sched);
    __builtin_unreachable();
}

void yield(Worker* w, Fiber* f) {
    ctx_switch(&f->ctx, &w->sched);
}

std::string smem_desc(Worker* w, const void* p) {
    const long off = static_cast<long>(static_cast<const unsigned char*>(p) - w->smem);
    return strf("shared offset %ld (dynamic shared memory is %zu bytes)", off, w->smem_size);
}

bool in_smem(Worker* w, const void* p, size_t n) {
    const unsigned char* q = static_cast<const unsigned char*>(p);
    return q >= w->smem && q + n <= w->smem + w->smem_size && q + n >= q;
}

// =========================================================================================
// Global memory checks
// =========================================================================================
int find_buffer(Worker* w, uint64_t a, size_t n) {
    const fa_emu_buffer* bufs = w->p->buffers;
    const int nb = w->p->num_buffers;
    int b = w->last_buf;
    if (b >= 0 && a >= bufs[b].lo && a + n <= bufs[b].hi) return b;
    for (int i = 0; i < nb; ++i) {
        if (a >= bufs[i].lo && a + n <= bufs[i].hi) {
            w->last_buf = i;
            return i;
        }
    }
    return -1;
}

std::string oob_desc(Worker* w, uint64_t a, size_t n) {
    const fa_emu_buffer* bufs = w->p->buffers;
    int best = -1;
    uint64_t best_dist = ~uint64_t(0);
    for (int i = 0; i < w->p->num_buffers; ++i) {
        uint64_t dist = a < bufs[i].lo ? bufs[i].lo - a : (a + n > bufs[i].hi ? a + n - bufs[i].hi : 0);
        if (dist < best_dist) { best_dist = dist; best = i; }
    }
    if (best < 0) return strf("address 0x%lx is outside every launch buffer (the launch has no array arguments)",
                              static_cast<unsigned long>(a));
    const fa_emu_buffer& B = bufs[best];
    return strf("address 0x%lx is outside every launch buffer; nearest is argument %d "
                "(%lu bytes): byte offset %ld",
                static_cast<unsigned long>(a), B.arg_index, static_cast<unsigned long>(B.hi - B.lo),
                static_cast<long>(static_cast<int64_t>(a - B.lo)));
}

void gcheck(Worker* w, const void* p, size_t n, int kind /*0 read,1 write,2 rmw*/, const char* what) {
    const uint64_t a = reinterpret_cast<uint64_t>(p);
    if (n && (n & (n - 1)) == 0 && (a & (std::min<size_t>(n, 16) - 1)) != 0)
        fiber_fail(w, strf("misaligned %s of %zu bytes at address 0x%lx (must be %zu-byte aligned)", what, n,
                           static_cast<unsigned long>(a), std::min<size_t>(n, 16)));
    const int b = find_buffer(w, a, n);
    if (b < 0) fiber_fail(w, strf("out-of-bounds %s of %zu bytes: %s", what, n, oob_desc(w, a, n).c_str()));
    if (kind != 0 && !w->p->buffers[b].writable)
        fiber_fail(w, strf("%s to argument %d, a read-only array (byte offset %lu)", what,
                           w->p->buffers[b].arg_index, static_cast<unsigned long>(a - w->p->buffers[b].lo)));
    if (kind != 1) { w->buf_read[b] += n; w->cnt.global_read_bytes += n; }
    if (kind != 0) { w->buf_write[b] += n; w->cnt.global_write_bytes += n; }
}

// One thread's access, filed under its warp instruction (see fa_emu_memstats.h).
void mem_record(Worker* w, void* site, fa_emu_stats::Kind kind, const void* p, size_t n, const void* src = nullptr) {
    Fiber* f = w->cur;
    const uint64_t s = reinterpret_cast<uint64_t>(site);
    const uint32_t k = f->site_count[s << 2 | kind]++;
    w->stats.record(s, k, f->warp, f->lane, kind, reinterpret_cast<uint64_t>(p), static_cast<uint32_t>(n),
                    reinterpret_cast<uint64_t>(src));
}

// Evaluates every warp instruction recorded since the last barrier (all lanes have issued theirs).
void mem_flush(Worker* w) {
    w->stats.flush([w](fa_emu_stats::Kind kind, uint64_t first, fa_emu_stats::Cost c) {
        if (kind == fa_emu_stats::kSharedWrite) {
            w->cnt.cp_async_smem_wavefronts += c.actual;
            w->cnt.cp_async_smem_wavefronts_ideal += c.ideal;
            return;
        }
        if (kind == fa_emu_stats::kCopy) {
            w->cnt.cp_async_lines += c.actual;
            w->cnt.cp_async_lines_ideal += c.ideal;
            w->cnt.cp_async_sectors += c.actual2;
            w->cnt.cp_async_sectors_ideal += c.ideal2;
            return;
        }
        const bool write = kind == fa_emu_stats::kGlobalWrite;
        (write ? w->cnt.gst_sectors : w->cnt.gld_sectors) += c.actual;
        (write ? w->cnt.gst_sectors_ideal : w->cnt.gld_sectors_ideal) += c.ideal;
        const int b = find_buffer(w, first, 1);
        if (b >= 0) {
            w->buf_sectors[4 * b + 2 * write] += c.actual;
            w->buf_sectors[4 * b + 2 * write + 1] += c.ideal;
        }
    });
    for (Fiber& f : w->fibers) f.site_count.clear();
}

// What makes the shared byte `byte` (its pending counter is nonzero) the destination of a copy in flight.
std::string pending_desc(Worker* w, const unsigned char* byte) {
    for (Fiber& o : w->fibers)
        for (size_t k = o.copies_head; k < o.copies.size(); ++k)
            if (byte >= o.copies[k].dst && byte < o.copies[k].dst + o.copies[k].size)
                return strf("%s, the destination of a cp.async issued by thread %d that no fa::cp_async_wait has "
                            "completed yet (missing cp_async_wait or __syncthreads?)", smem_desc(w, byte).c_str(), o.tid);
    for (const Bulk& b : w->bulks)
        if (byte >= b.dst && byte < b.dst + b.bytes)
            return strf("%s, the destination of a bulk copy (%s, %d bytes) issued by thread %d "
                        "that has not completed on its mbarrier at shared offset %u yet (missing "
                        "fa::mbarrier_wait_parity?)", smem_desc(w, byte).c_str(),
                        b.elems ? "fa::tma_load" : "fa::cp_async_bulk_g2s", b.bytes, b.tid, b.bar);
    return smem_desc(w, byte) + ", the destination of a copy in flight";
}

// =========================================================================================
// Warp collectives
// =========================================================================================
void eval_shfl(Worker* w, Fiber* lanes, unsigned mask) {
    for (int l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        Fiber& f = lanes[l];
        const int wd = f.width;
        if (wd < 1 || wd > 32 || (wd & (wd - 1)))
            { w->cur = &f; fiber_fail(w, strf("%s: width %d is not a power of two in [1, 32]", op_name(f.op, f.kind), wd)); }
        const int seg = l & ~(wd - 1);
        int src = l;
        switch (f.kind) {
            case FA_EMU_SHFL_IDX: src = seg + (f.arg & (wd - 1)); break;
            case FA_EMU_SHFL_XOR: { int j = l ^ f.arg; src = (j >= 0 && j <= seg + wd - 1) ? j : l; break; }
            // delta is unsigned: a huge delta leaves the segment (own value), it never wraps around
            case FA_EMU_SHFL_DOWN: { int64_t j = l + int64_t(uint32_t(f.arg)); src = (j <= seg + wd - 1) ? int(j) : l; break; }
            case FA_EMU_SHFL_UP: { int64_t j = l - int64_t(uint32_t(f.arg)); src = (j >= seg) ? int(j) : l; break; }
        }
        if (src < 0 || src > 31 || !((mask >> src) & 1u)) {
            w->cur = &f;
            fiber_fail(w, strf("%s (mask 0x%08x) reads lane %d, which is not in the mask "
                               "(its value is undefined on the GPU)", op_name(f.op, f.kind), mask, src));
        }
        f.result = lanes[src].value;
    }
    ++w->cnt.shuffles;
}

// Shared-memory wavefronts one 8x8 matrix of an ldmatrix needs: its 8 row addresses (16 bytes,
// i.e. 4 consecutive 4-byte banks, each) are served in one phase; the phase takes as many
// wavefronts as the most-used of the 32 banks has distinct words (the same word read twice is a
// broadcast). 1 when conflict-free; 8 when all rows start in the same bank (e.g. a 128-byte pitch).
int ldmatrix_wavefronts(uint16_t* const* rows) {
    uintptr_t words[32][8];
    int used[32] = {0};
    int worst = 1;
    for (int r = 0; r < 8; ++r) {
        for (int k = 0; k < 4; ++k) {
            const uintptr_t word = reinterpret_cast<uintptr_t>(rows[r]) / 4 + k;
            const int bank = static_cast<int>(word % 32);
            bool seen = false;
            for (int i = 0; i < used[bank]; ++i) seen |= words[bank][i] == word;
            if (!seen) words[bank][used[bank]++] = word;
            if (used[bank] > worst) worst = used[bank];
        }
    }
    return worst;
}

bool landed_seen(Worker* w, const Fiber& f, size_t g);
template <class In>
void merge_seen(Fiber* fibers, int n, In in);

// The row addresses of an ldmatrix / stmatrix (lanes 8j..8j+7: rows 0..7 of matrix j), checked: 16-byte
// aligned inside shared memory, not the destination of a copy in flight.
void matrix_rows(Worker* w, Fiber* lanes, const char* what, uint16_t* (&rows)[4][8]) {
    const int n = lanes[0].n;
    for (int j = 0; j < n; ++j) {
        for (int r = 0; r < 8; ++r) {
            Fiber& f = lanes[8 * j + r];
            const uintptr_t a = reinterpret_cast<uintptr_t>(f.addr);
            if (!in_smem(w, f.addr, 16)) {
                w->cur = &f;
                fiber_fail(w, strf("%s: row address %p (matrix %d row %d) is outside shared memory: %s", what,
                                   f.addr, j, r, smem_desc(w, f.addr).c_str()));
            }
            if (a & 15u) {
                w->cur = &f;
                fiber_fail(w, strf("%s: row address is not 16-byte aligned: %s", what, smem_desc(w, f.addr).c_str()));
            }
            const size_t g0 = (static_cast<const unsigned char*>(f.addr) - w->smem) / kGranule;
            for (size_t g = g0; g < g0 + 16 / kGranule; ++g) {
                if (w->pending[g]) {
                    w->cur = &f;
                    fiber_fail(w, std::string(what) + (f.op == OP_STMATRIX ? " writes " : " reads ") +
                                      pending_desc(w, w->smem + g * kGranule));
                }
                if (f.op == OP_STMATRIX && !landed_seen(w, f, g)) {
                    w->cur = &f;
                    fiber_fail(w, strf("%s writes shared offset %zu, where a bulk copy completing phase %u of the "
                                       "mbarrier at shared offset %u landed, unordered: this thread has not waited "
                                       "for that phase", what, g * kGranule, w->landed_phase[g],
                                       w->landed_bar[g] - 1));
                }
            }
            rows[j][r] = static_cast<uint16_t*>(const_cast<void*>(f.addr));
        }
    }
}

// The m8n8 b16 fragment of lane l in matrix j: elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1), the
// lower column in bits 0-15; transposed: (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
uint16_t* frag_elem(uint16_t* const* rows, int l, int half, int trans) {
    return trans ? &rows[2 * (l % 4) + half][l / 4] : &rows[l / 4][2 * (l % 4) + half];
}

void eval_ldmatrix(Worker* w, Fiber* lanes) {
    const int n = lanes[0].n;
    uint16_t* rows[4][8];
    matrix_rows(w, lanes, "fa::ldmatrix", rows);
    for (int j = 0; j < n; ++j) w->cnt.ldmatrix_wavefronts += ldmatrix_wavefronts(rows[j]);
    w->cnt.ldmatrix_wavefronts_ideal += n;
    for (int l = 0; l < 32; ++l)
        for (int j = 0; j < n; ++j)
            lanes[l].regs[j] = static_cast<uint32_t>(*frag_elem(rows[j], l, 0, lanes[0].trans)) |
                               (static_cast<uint32_t>(*frag_elem(rows[j], l, 1, lanes[0].trans)) << 16);
    ++w->cnt.ldmatrix;
}

// stmatrix: ldmatrix's inverse, each lane's fragment registers written to the rows (generic-proxy stores).
void eval_stmatrix(Worker* w, Fiber* lanes) {
    const int n = lanes[0].n;
    uint16_t* rows[4][8];
    matrix_rows(w, lanes, "fa::stmatrix", rows);
    for (int j = 0; j < n; ++j) w->cnt.stmatrix_wavefronts += ldmatrix_wavefronts(rows[j]);  // (the same phases)
    w->cnt.stmatrix_wavefronts_ideal += n;
    for (int l = 0; l < 32; ++l) {
        for (int j = 0; j < n; ++j) {
            const uint32_t v = lanes[l].regs[j];
            *frag_elem(rows[j], l, 0, lanes[0].trans) = static_cast<uint16_t>(v & 0xffffu);
            *frag_elem(rows[j], l, 1, lanes[0].trans) = static_cast<uint16_t>(v >> 16);
        }
    }
    ++w->cnt.stmatrix;
}

// Exact value of a 16-bit float (f16 or bf16) as float64 (bit manipulation, no libm).
double half_val(uint16_t x, int dtype) {
    uint32_t u;
    if (dtype == FA_EMU_BF16) {
        u = static_cast<uint32_t>(x) << 16;
    } else {
        const uint32_t sign = (static_cast<uint32_t>(x) & 0x8000u) << 16;
        const uint32_t e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
        if (e == 0x1f) {
            u = sign | 0x7f800000u | (m << 13);
        } else if (e == 0) {
            const double v = static_cast<double>(m) * 0x1p-24;   // subnormal: exact
            return sign ? -v : v;
        } else {
            u = sign | ((e + 112u) << 23) | (m << 13);           // rebias 15 -> 127
        }
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Exact value of a tf32 operand: the fp32 bit pattern with its low 13 mantissa bits ignored, i.e.
// truncated (ptx_semantics.md, tf32 notes); a NaN whose payload lies only there reads as an infinity.
double tf32_val(uint32_t x) {
    x &= 0xffffe000u;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

// m16n8k16 (f16, bf16): operands per the mma.m16n8k16 table; k runs over 0..15.
void gather_mma_16bit(const Fiber& f, int l, int dtype, double (&A)[16][16], double (&B)[16][8]) {
    const int g = l >> 2, t = l & 3;
    auto lo = [&](uint32_t r) { return half_val(static_cast<uint16_t>(r & 0xffffu), dtype); };
    auto hi = [&](uint32_t r) { return half_val(static_cast<uint16_t>(r >> 16), dtype); };
    A[g][2 * t] = lo(f.a[0]);         A[g][2 * t + 1] = hi(f.a[0]);
    A[g + 8][2 * t] = lo(f.a[1]);     A[g + 8][2 * t + 1] = hi(f.a[1]);
    A[g][2 * t + 8] = lo(f.a[2]);     A[g][2 * t + 9] = hi(f.a[2]);
    A[g + 8][2 * t + 8] = lo(f.a[3]); A[g + 8][2 * t + 9] = hi(f.a[3]);
    B[2 * t][g] = lo(f.b[0]);         B[2 * t + 1][g] = hi(f.b[0]);
    B[2 * t + 8][g] = lo(f.b[1]);     B[2 * t + 9][g] = hi(f.b[1]);
}

// m16n8k8 tf32: one element per register (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4],
// a3 = A[g+8][t+4]; b0 = B[t][g], b1 = B[t+4][g]); k runs over 0..7.
void gather_mma_tf32(const Fiber& f, int l, double (&A)[16][16], double (&B)[16][8]) {
    const int g = l >> 2, t = l & 3;
    A[g][t] = tf32_val(f.a[0]);
    A[g + 8][t] = tf32_val(f.a[1]);
    A[g][t + 4] = tf32_val(f.a[2]);
    A[g + 8][t + 4] = tf32_val(f.a[3]);
    B[t][g] = tf32_val(f.b[0]);
    B[t + 4][g] = tf32_val(f.b[1]);
}

// Whether eval_mma_f32 rounds its sums toward zero instead of to nearest: a model of the tensor
// cores' truncated sums (Fasi et al. 2021 for V100..A100; on an H200, 3xtf32's O, dK, dV errors grew
// with N as only truncation explains: docs/precision.md), for experiments:
// FLASHARRAY_EMULATOR_MMA_SUM=truncate. Read once per process; the default is round to nearest.
static bool mma_sum_truncates() {
    static const bool on = [] {
        const char* v = std::getenv("FLASHARRAY_EMULATOR_MMA_SUM");
        return v != nullptr && std::string(v) == "truncate";
    }();
    return on;
}

// s rounded to fp32: to nearest, or toward zero (mma_sum_truncates).
static float round_mma_sum(double s) {
    float f = static_cast<float>(s);
    if (mma_sum_truncates() && std::isfinite(f) && std::fabs(static_cast<double>(f)) > std::fabs(s))
        f = std::nextafter(f, 0.0f);
    return f;
}

// m16n8k16 (f16, bf16) and m16n8k8 (tf32), fp32 accumulators c0..c3 = C[g][2t], C[g][2t+1],
// C[g+8][2t], C[g+8][2t+1]. Products of f16/bf16/tf32 values (<= 11-bit significands) are exact in
// float64; they and c are summed in float64 in k order and rounded once to fp32 (round_mma_sum).
void eval_mma_f32(Fiber* lanes, int dtype) {
    double A[16][16], B[16][8], C[16][8];
    const int K = dtype == FA_EMU_TF32 ? 8 : 16;
    for (int l = 0; l < 32; ++l) {
        const Fiber& f = lanes[l];
        if (dtype == FA_EMU_TF32) gather_mma_tf32(f, l, A, B);
        else gather_mma_16bit(f, l, dtype, A, B);
        const int g = l >> 2, t = l & 3;
        C[g][2 * t] = f.c[0];             C[g][2 * t + 1] = f.c[1];
        C[g + 8][2 * t] = f.c[2];         C[g + 8][2 * t + 1] = f.c[3];
    }
    float D[16][8];
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 8; ++j) {
            double s = C[i][j];
            for (int k = 0; k < K; ++k) s += A[i][k] * B[k][j];  // products exact in float64
            D[i][j] = round_mma_sum(s);                         // one rounding to fp32
        }
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        float* d = lanes[l].d;
        d[0] = D[g][2 * t];
        d[1] = D[g][2 * t + 1];
        d[2] = D[g + 8][2 * t];
        d[3] = D[g + 8][2 * t + 1];
    }
}

// m8n8k4 f64 (DMMA): a0 = A[g][t], b0 = B[t][g], c0/c1 = C[g][2t], C[g][2t+1]; the pointers the
// lanes passed are double[1], double[1], double[2] (see fa_emu_api.h). Each D element is a chain
// of fp64 fused multiply-adds in k order, s = fma(A[i][k], B[k][j], s) from s = C[i][j].
void eval_mma_f64(Fiber* lanes) {
    double A[8][4], B[4][8], C[8][8];
    for (int l = 0; l < 32; ++l) {
        const Fiber& f = lanes[l];
        const int g = l >> 2, t = l & 3;
        const double* c = reinterpret_cast<const double*>(f.c);
        A[g][t] = *reinterpret_cast<const double*>(f.a);
        B[t][g] = *reinterpret_cast<const double*>(f.b);
        C[g][2 * t] = c[0];
        C[g][2 * t + 1] = c[1];
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        double* d = reinterpret_cast<double*>(lanes[l].d);
        for (int v = 0; v < 2; ++v) {
            double s = C[g][2 * t + v];
            for (int k = 0; k < 4; ++k) s = std::fma(A[g][k], B[k][2 * t + v], s);
            d[v] = s;
        }
    }
}

// m16n8k16 f64 (DMMA.16x8x16, sm_90): a[v0 + 2 v1] = A[g + 8 v0][t + 4 v1], b[v] = B[t + 4 v][g],
// c[v0 + 2 v1] = C[g + 8 v1][2t + v0] (double[8], double[4], double[4]). Each D element is m8n8k4's chain
// continued over the four k4 steps: s = fma(A[i][k], B[k][j], s) for k = 0..15 from s = C[i][j] — so one
// m16n8k16 gives the bits of the eight m8n8k4 it replaces (two m8 row tiles, k4 steps in k order).
void eval_mma_f64_k16(Fiber* lanes) {
    double A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const Fiber& f = lanes[l];
        const int g = l >> 2, t = l & 3;
        const double* a = reinterpret_cast<const double*>(f.a);
        const double* b = reinterpret_cast<const double*>(f.b);
        const double* c = reinterpret_cast<const double*>(f.c);
        for (int v = 0; v < 8; ++v) A[g + 8 * (v & 1)][t + 4 * (v >> 1)] = a[v];
        for (int v = 0; v < 4; ++v) B[t + 4 * v][g] = b[v];
        for (int v = 0; v < 4; ++v) C[g + 8 * (v >> 1)][2 * t + (v & 1)] = c[v];
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        double* d = reinterpret_cast<double*>(lanes[l].d);
        for (int v = 0; v < 4; ++v) {
            const int i = g + 8 * (v >> 1), j = 2 * t + (v & 1);
            double s = C[i][j];
            for (int k = 0; k < 16; ++k) s = std::fma(A[i][k], B[k][j], s);
            d[v] = s;
        }
    }
}

void eval_mma(Worker* w, Fiber* lanes) {
    const int dtype = lanes[0].dtype;
    for (int l = 0; l < 32; ++l) {
        if (lanes[l].dtype != dtype) {
            w->cur = &lanes[l];
            fiber_fail(w, "fa::mma: lanes of one warp use different element types or shapes");
        }
    }
    if (dtype == FA_EMU_F64) eval_mma_f64(lanes);
    else if (dtype == FA_EMU_F64_K16) eval_mma_f64_k16(lanes);
    else eval_mma_f32(lanes, dtype);
    ++w->cnt.mma;
}

// The calling fiber has filled its op fields; wait until the collective is evaluated.
void warp_arrive(Worker* w, Fiber* f) {
    const unsigned mask = f->mask;
    const int warp = f->warp;
    const char* name = op_name(f->op, f->kind);
    if (!((mask >> f->lane) & 1u))
        fiber_fail(w, strf("%s: the calling lane %d is not in the mask 0x%08x", name, f->lane, mask));
    if (mask & ~w->warp_exists[warp])
        fiber_fail(w, strf("%s: mask 0x%08x names lanes %s, which do not exist (blockDim has %d threads)", name, mask,
                           lanes_str(mask & ~w->warp_exists[warp]).c_str(), w->nthreads));
    if (mask & w->warp_exited[warp])
        fiber_fail(w, strf("%s (mask 0x%08x): lanes %s have exited and can never arrive (incomplete warp "
                           "collective)", name, mask, lanes_str(mask & w->warp_exited[warp]).c_str()));
    w->warp_waiting[warp] |= 1u << f->lane;
    f->state = WAIT_WARP;
    if ((w->warp_waiting[warp] & mask) == mask) {
        Fiber* lanes = &w->fibers[warp * 32];
        for (int l = 0; l < 32; ++l) {
            if (!((mask >> l) & 1u)) continue;
            const Fiber& g = lanes[l];
            if (g.op != f->op || g.mask != mask || ((f->op == OP_SHFL || f->op == OP_VOTE) && g.kind != f->kind) ||
                ((f->op == OP_LDMATRIX || f->op == OP_STMATRIX) && (g.n != f->n || g.trans != f->trans))) {
                fiber_fail(w, strf("%s (mask 0x%08x) met lane %d waiting at a different warp collective "
                                   "(%s, mask 0x%08x): divergent warp collectives",
                                   name, mask, l, op_name(g.op, g.kind), g.mask));
            }
        }
        switch (f->op) {
            case OP_SHFL: eval_shfl(w, lanes, mask); break;
            case OP_SYNCWARP:
                ++w->cnt.syncwarps;
                merge_seen(lanes, 32, [&](const Fiber& g) { return ((mask >> g.lane) & 1u) != 0; });
                break;
            case OP_VOTE: {
                uint32_t ballot = 0;
                for (int l = 0; l < 32; ++l)
                    if (((mask >> l) & 1u) && lanes[l].value) ballot |= 1u << l;
                const uint64_t r = f->kind == FA_EMU_VOTE_BALLOT ? ballot
                                   : f->kind == FA_EMU_VOTE_ANY  ? (ballot != 0)
                                                                 : (ballot == mask);
                for (int l = 0; l < 32; ++l)
                    if ((mask >> l) & 1u) lanes[l].result = r;
                ++w->cnt.votes;
                break;
            }
            case OP_MMA: eval_mma(w, lanes); break;
            case OP_LDMATRIX: eval_ldmatrix(w, lanes); break;
            case OP_STMATRIX: eval_stmatrix(w, lanes); break;
            case OP_ELECT:   // the lowest lane of the mask is the leader (deterministic per mask)
                for (int l = 0; l < 32; ++l)
                    if ((mask >> l) & 1u) lanes[l].result = l == __builtin_ctz(mask);
                ++w->cnt.elects;
                break;
        }
        w->warp_waiting[warp] &= ~mask;
        for (int l = 0; l < 32; ++l)
            if ((mask >> l) & 1u) set_runnable(w, warp * 32 + l);
        w->cur = f;
    }
    yield(w, f);
}

// =========================================================================================
// mbarriers and bulk copies (sm_90; docs/emulator.md, "Hopper: mbarrier and bulk copies")
// =========================================================================================
constexpr int64_t kCountMax = (1 << 20) - 1;  // arrival counts and |tx-count| are 20-bit quantities

std::string mbar_state(uint32_t off, const MBar& b) {
    return strf("mbarrier at shared offset %u (phase %u, parity %u; %u of %u arrivals pending; tx-count %d bytes)",
                off, b.phase, b.phase & 1u, b.pending, b.expected, b.tx);
}

// The shared offset of an mbarrier address, checked: 8-byte aligned, inside dynamic shared memory.
uint32_t mbar_offset(Worker* w, const void* bar, const char* what) {
    if (!in_smem(w, bar, 8))
        fiber_fail(w, strf("%s: mbarrier address %p is outside dynamic shared memory: %s", what, bar,
                           smem_desc(w, bar).c_str()));
    if (reinterpret_cast<uintptr_t>(bar) & 7u)
        fiber_fail(w, strf("%s: mbarrier address is not 8-byte aligned: %s", what, smem_desc(w, bar).c_str()));
    return static_cast<uint32_t>(static_cast<const unsigned char*>(bar) - w->smem);
}

MBar& mbar_live(Worker* w, const void* bar, const char* what, uint32_t* off) {
    *off = mbar_offset(w, bar, what);
    auto it = w->mbars.find(*off);
    if (it == w->mbars.end())
        fiber_fail(w, strf("%s: no mbarrier is initialized at shared offset %u (used before fa::mbarrier_init, or "
                           "after fa::mbarrier_inval)", what, *off));
    return it->second;
}

// A phase completes when its arrivals and its transactions are all in: the phase advances (the
// parity flips), the pending count reloads, and the fibers waiting for the completed parity run.
void mbar_maybe_complete(Worker* w, uint32_t off, MBar& b) {
    if (b.pending != 0 || b.tx != 0) return;
    ++b.phase;
    b.pending = b.expected;
    for (int t = 0; w->mbar_waiting > 0 && t < w->nthreads; ++t) {
        Fiber& f = w->fibers[t];
        if (f.state != WAIT_MBAR || f.mbar_off != off || (b.phase & 1u) == static_cast<uint32_t>(f.mbar_parity))
            continue;
        --w->mbar_waiting;
        set_runnable(w, t);
    }
}

// tx-count += delta (expect-tx: delta > 0, complete-tx: delta < 0); "" or what is wrong. The tx-count
// may be negative while arrivals are pending (a copy may land before the arrive.expect_tx that
// accounts for it); once all arrivals of the phase are in, it may not.
std::string mbar_tx(uint32_t off, MBar& b, int64_t delta, const char* op) {
    const int64_t tx = int64_t(b.tx) + delta;
    if (tx > kCountMax)
        return strf("%s of %lld bytes overflows the tx-count of the %s (at most 2^20-1 bytes)", op,
                    static_cast<long long>(std::abs(delta)), mbar_state(off, b).c_str());
    if (tx < -kCountMax || (tx < 0 && b.pending == 0))
        return strf("%s of %lld bytes underflows the tx-count of the %s to %lld: more bytes completed than "
                    "expected (arrive_expect_tx declared fewer)", op, static_cast<long long>(std::abs(delta)),
                    mbar_state(off, b).c_str(), static_cast<long long>(tx));
    b.tx = static_cast<int32_t>(tx);
    return "";
}

void mbar_check_tx_arg(Worker* w, const char* what, int tx_bytes) {
    if (tx_bytes < 0 || tx_bytes > kCountMax)
        fiber_fail(w, strf("%s: tx byte count %d is outside [0, 2^20-1]", what, tx_bytes));
}

void mbar_init(Worker* w, const void* bar, int count) {
    const char* what = "fa::mbarrier_init";
    const uint32_t off = mbar_offset(w, bar, what);
    if (count < 1 || count > kCountMax)
        fiber_fail(w, strf("%s: arrival count %d is outside [1, 2^20-1]", what, count));
    auto it = w->mbars.find(off);
    if (it != w->mbars.end())
        fiber_fail(w, strf("%s: shared offset %u holds a live mbarrier (initialized by thread %d): "
                           "fa::mbarrier_inval it first", what, off, it->second.init_tid));
    for (uint32_t g = off / kGranule; g < (off + 8) / kGranule; ++g)
        if (w->pending[g]) fiber_fail(w, strf("%s: the mbarrier's bytes are ", what) + pending_desc(w, w->smem + g * kGranule));
    MBar b;
    b.expected = b.pending = static_cast<uint32_t>(count);
    b.init_tid = w->cur->tid;
    w->mbars[off] = b;
}

void mbar_inval(Worker* w, const void* bar) {
    const char* what = "fa::mbarrier_inval";
    uint32_t off;
    const MBar& b = mbar_live(w, bar, what, &off);
    for (const Fiber& f : w->fibers)
        if (f.state == WAIT_MBAR && f.mbar_off == off)
            fiber_fail(w, strf("%s: thread %d waits on the %s", what, f.tid, mbar_state(off, b).c_str()));
    for (const Bulk& c : w->bulks)
        if (c.bar == off)
            fiber_fail(w, strf("%s: a bulk copy issued by thread %d is in flight and completes on the %s", what, c.tid,
                               mbar_state(off, b).c_str()));
    w->mbars.erase(off);
}

uint64_t mbar_arrive(Worker* w, const void* bar, int tx_bytes, bool expect_tx) {
    const char* what = expect_tx ? "fa::mbarrier_arrive_expect_tx" : "fa::mbarrier_arrive";
    uint32_t off;
    MBar& b = mbar_live(w, bar, what, &off);
    if (expect_tx) {
        mbar_check_tx_arg(w, what, tx_bytes);
        const std::string err = mbar_tx(off, b, tx_bytes, "expect-tx");
        if (!err.empty()) fiber_fail(w, std::string(what) + ": " + err);
    }
    if (b.pending == 0)
        fiber_fail(w, strf("%s: arrival beyond the expected count: the %s has all its arrivals and waits for its "
                           "tx bytes", what, mbar_state(off, b).c_str()));
    const uint64_t token = b.phase;
    if (--b.pending == 0 && b.tx < 0)
        fiber_fail(w, strf("%s: the last arrival finds more bytes completed than expected: %s", what,
                           mbar_state(off, b).c_str()));
    mbar_maybe_complete(w, off, b);
    return token;
}

void mbar_expect_tx(Worker* w, const void* bar, int tx_bytes) {
    const char* what = "fa::mbarrier_expect_tx";
    uint32_t off;
    MBar& b = mbar_live(w, bar, what, &off);
    mbar_check_tx_arg(w, what, tx_bytes);
    const std::string err = mbar_tx(off, b, tx_bytes, "expect-tx");
    if (!err.empty()) fiber_fail(w, std::string(what) + ": " + err);
}

// The fiber has seen `phase` phases of the mbarrier at `off` complete (a try_wait returned).
void mbar_seen(Fiber* f, uint32_t off, uint32_t phase) {
    for (auto& s : f->mbar_seen)
        if (s.first == off) {
            s.second = std::max(s.second, phase);
            return;
        }
    f->mbar_seen.emplace_back(off, phase);
}

// A barrier completed among `fibers` (those `in` selects): each has now seen what any of them had seen complete
// (the barrier orders their accesses after every participant's earlier waits).
template <class In>
void merge_seen(Fiber* fibers, int n, In in) {
    std::vector<std::pair<uint32_t, uint32_t>> all;
    for (int t = 0; t < n; ++t) {
        if (!in(fibers[t])) continue;
        for (const auto& s : fibers[t].mbar_seen) {
            auto it = std::find_if(all.begin(), all.end(), [&](const auto& a) { return a.first == s.first; });
            if (it == all.end()) all.push_back(s);
            else it->second = std::max(it->second, s.second);
        }
    }
    if (all.empty()) return;
    for (int t = 0; t < n; ++t)
        if (in(fibers[t])) fibers[t].mbar_seen = all;
}

// Whether the fiber's writes to granule g are ordered after the last bulk copy that landed there: none did, or
// the fiber has seen the phase that copy completed on complete (a try_wait on its mbarrier returned since).
bool landed_seen(Worker* w, const Fiber& f, size_t g) {
    if (w->landed_bar[g] == 0) return true;
    for (const auto& s : f.mbar_seen)
        if (s.first + 1 == w->landed_bar[g]) return s.second > w->landed_phase[g];
    return false;
}

// try_wait.parity: true once the phase of parity `parity` has completed, i.e. while the current
// phase has the other parity. Otherwise the fiber suspends until the phase completes (PTX lets
// try_wait suspend until then; the emulator never times out, so it always returns true).
int mbar_try_wait(Worker* w, const void* bar, int parity) {
    const char* what = "fa::mbarrier_try_wait_parity";
    uint32_t off;
    const MBar& b = mbar_live(w, bar, what, &off);
    if (parity != 0 && parity != 1) fiber_fail(w, strf("%s: phase parity %d is not 0 or 1", what, parity));
    ++w->cnt.mbar_waits;
    Fiber* f = w->cur;
    if ((b.phase & 1u) == static_cast<uint32_t>(parity)) {
        ++w->cnt.mbar_blocked;
        f->state = WAIT_MBAR;
        f->mbar_off = off;
        f->mbar_parity = parity;
        ++w->mbar_waiting;
        yield(w, f);
    }
    mbar_seen(f, off, mbar_live(w, bar, what, &off).phase);
    return 1;
}

// fence.mbarrier_init / fence.proxy.async: the calling thread's initialized mbarriers become
// visible to the async proxy (bulk copies may complete on them).
void mbar_fence(Worker* w) {
    for (auto& kv : w->mbars)
        if (kv.second.init_tid == w->cur->tid) kv.second.fenced = true;
}

// The 32-byte global sectors a bulk copy's source touches (one contiguous range), against the ideal.
void bulk_sectors(Worker* w, const void* src, int bytes) {
    const uint64_t a = reinterpret_cast<uint64_t>(src);
    const uint64_t actual = (a + bytes + 31) / 32 - a / 32, ideal = (static_cast<uint64_t>(bytes) + 31) / 32;
    w->cnt.gld_sectors += actual;
    w->cnt.gld_sectors_ideal += ideal;
    const int b = find_buffer(w, a, 1);
    if (b >= 0) {
        w->buf_sectors[4 * b] += actual;
        w->buf_sectors[4 * b + 1] += ideal;
    }
}

void bulk_check_dst(Worker* w, const unsigned char* dst, int bytes, const char* what) {
    if (bytes <= 0 || bytes % 16)
        fiber_fail(w, strf("%s: size %d bytes is not a positive multiple of 16", what, bytes));
    if (!in_smem(w, dst, bytes))
        fiber_fail(w, strf("%s: destination %p (%d bytes) is outside dynamic shared memory: %s", what,
                           static_cast<const void*>(dst), bytes, smem_desc(w, dst).c_str()));
    if (reinterpret_cast<uintptr_t>(dst) & 15u)
        fiber_fail(w, strf("%s: destination is not 16-byte aligned: %s", what, smem_desc(w, dst).c_str()));
    const size_t g0 = (dst - w->smem) / kGranule;
    for (size_t g = g0; g < g0 + bytes / kGranule; ++g)
        if (w->pending[g])
            fiber_fail(w, strf("%s: destination overlaps ", what) + pending_desc(w, w->smem + g * kGranule) +
                              " (two copies in flight write the same bytes)");
    for (const auto& kv : w->mbars)
        if (w->smem + kv.first + 8 > dst && w->smem + kv.first < dst + bytes)
            fiber_fail(w, strf("%s: destination %s (%d bytes) overwrites the live %s", what, smem_desc(w, dst).c_str(),
                               bytes, mbar_state(kv.first, kv.second).c_str()));
}

// The shared offset of the live mbarrier a bulk copy completes on, checked: its initialization is visible
// to the async proxy.
uint32_t bulk_barrier(Worker* w, const void* bar, const char* what) {
    uint32_t off;
    const MBar& b = mbar_live(w, bar, what, &off);
    if (!b.fenced)
        fiber_fail(w, strf("%s completes on the %s, which its initializing thread %d has not made visible to the "
                           "async proxy: fa::fence_mbarrier_init() after fa::mbarrier_init (then __syncthreads())",
                           what, mbar_state(off, b).c_str(), b.init_tid));
    return off;
}

void bulk_g2s(Worker* w, void* smem_dst, const void* gmem_src, int bytes, const void* bar) {
    const char* what = "fa::cp_async_bulk_g2s";
    unsigned char* dst = static_cast<unsigned char*>(smem_dst);
    bulk_check_dst(w, dst, bytes, what);
    if (reinterpret_cast<uintptr_t>(gmem_src) & 15u)
        fiber_fail(w, strf("%s: global source %p is not 16-byte aligned", what, gmem_src));
    gcheck(w, gmem_src, static_cast<size_t>(bytes), 0, "fa::cp_async_bulk_g2s global read");
    const uint32_t off = bulk_barrier(w, bar, what);
    bulk_sectors(w, gmem_src, bytes);
    const size_t g0 = (dst - w->smem) / kGranule;
    for (size_t g = g0; g < g0 + bytes / kGranule; ++g) ++w->pending[g];
    w->bulks.push_back(Bulk{dst, static_cast<const unsigned char*>(gmem_src), bytes, w->cur->tid, off, nullptr, 0});
    ++w->cnt.bulk_copies;
    w->cnt.bulk_copy_bytes += static_cast<uint64_t>(bytes);
}

// Bulk copy k lands: its bytes are written, then complete_tx(bytes) on its mbarrier. Called by the
// scheduler (no fiber runs); false, the launch failed, on an error.
bool bulk_deliver(Worker* w, size_t k) {
    const Bulk c = w->bulks[k];
    w->bulks.erase(w->bulks.begin() + static_cast<long>(k));
    if (c.elems) {
        for (const TmaElem& e : *c.elems) {   // out-of-bounds elements are filled with zeros
            if (e.g) std::memcpy(w->smem + e.smem, e.g, static_cast<size_t>(c.esize));
            else std::memset(w->smem + e.smem, 0, static_cast<size_t>(c.esize));
        }
    } else {
        std::memcpy(c.dst, c.src, static_cast<size_t>(c.bytes));
    }
    // written by the async proxy: a TMA store may read these bytes without a fence
    std::memcpy(w->async_img.data() + (c.dst - w->smem), c.dst, static_cast<size_t>(c.bytes));
    const size_t g0 = (c.dst - w->smem) / kGranule;
    auto it = w->mbars.find(c.bar);
    for (size_t g = g0; g < g0 + c.bytes / kGranule; ++g) {
        --w->pending[g];
        w->landed_bar[g] = it == w->mbars.end() ? 0 : c.bar + 1;
        w->landed_phase[g] = it == w->mbars.end() ? 0 : it->second.phase;
    }
    const std::string err = it == w->mbars.end() ? strf("its mbarrier at shared offset %u is gone", c.bar)
                                                 : mbar_tx(c.bar, it->second, -int64_t(c.bytes), "complete-tx");
    if (!err.empty()) {
        record_error(w, where(w, &w->fibers[c.tid]) + strf(": %s (%d bytes to %s) lands: ",
                                                             c.elems ? "fa::tma_load" : "fa::cp_async_bulk_g2s",
                                                             c.bytes, smem_desc(w, c.dst).c_str()) + err);
        return false;
    }
    mbar_maybe_complete(w, c.bar, it->second);
    return true;
}

// When copies in flight land is the schedule's choice: forward as late as possible (one at a time,
// oldest first, only when no fiber can run), reverse at the first switch after their issue, random
// each with probability 1/4 at every switch (and a random one when no fiber can run).
bool bulk_schedule(Worker* w) {
    const int sched = w->p->schedule;
    if (w->nrunnable == 0) return bulk_deliver(w, sched == FA_EMU_SCHED_RANDOM ? splitmix(w->rng) % w->bulks.size() : 0);
    if (sched == FA_EMU_SCHED_FORWARD) return true;
    for (size_t k = 0; k < w->bulks.size();) {
        if (sched == FA_EMU_SCHED_REVERSE || splitmix(w->rng) % 4 == 0) {
            if (!bulk_deliver(w, k)) return false;
        } else {
            ++k;
        }
    }
    return true;
}

std::string mbar_deadlock_desc(Worker* w) {
    const Fiber* first = nullptr;
    int at_mbar = 0, at_bar = 0, at_warp = 0;
    for (const Fiber& f : w->fibers) {
        if (f.state == WAIT_MBAR && !first) first = &f;
        at_mbar += f.state == WAIT_MBAR;
        at_bar += f.state == WAIT_BAR;
        at_warp += f.state == WAIT_WARP;
    }
    if (!first) return "";
    const MBar& b = w->mbars.at(first->mbar_off);
    return strf("deadlock: thread (%u,%u,%u) [warp %d lane %d] waits for the phase of parity %d of the %s to "
                "complete, and no bulk copy in flight can complete it (%d thread(s) wait at mbarriers, %d at "
                "__syncthreads(), %d at warp collectives, %d exited)",
                first->view.thread_idx[0], first->view.thread_idx[1], first->view.thread_idx[2], first->warp,
                first->lane, first->mbar_parity, mbar_state(first->mbar_off, b).c_str(), at_mbar, at_bar, at_warp,
                w->exited);
}

// =========================================================================================
// wgmma (sm_90a; docs/emulator.md, "Hopper: wgmma")
// =========================================================================================
constexpr uint32_t kWgPoison = 0x7fa5a5a5u;  // a signaling NaN: in-flight accumulator registers hold it

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): addresses and offsets in
// units of 16 bytes (bits 0-13 start, 16-29 leading-dimension byte offset, 32-45 stride-dimension
// byte offset), base offset bits 49-51, swizzle mode bits 62-63 (0 none, 1 128B, 2 64B, 3 32B).
struct WgDesc {
    uint32_t start, lbo, sbo, base, swizzle;
};

WgDesc wg_decode(uint64_t d) {
    return WgDesc{static_cast<uint32_t>(d & 0x3fff) << 4, static_cast<uint32_t>((d >> 16) & 0x3fff) << 4,
                  static_cast<uint32_t>((d >> 32) & 0x3fff) << 4, static_cast<uint32_t>((d >> 49) & 7),
                  static_cast<uint32_t>(d >> 62)};
}

uint32_t wg_swizzle_bytes(uint32_t mode) { return mode == 1 ? 128 : mode == 2 ? 64 : mode == 3 ? 32 : 0; }

// The swizzle of a shared address: 16-byte chunk bits [4, 4+b) ^= row bits [7, 7+b), b = 3, 2, 1 for
// 128B, 64B, 32B (CuTe's Swizzle<b,4,3>), i.e. the pattern repeats every 1024, 512, 256 bytes.
uint32_t wg_swizzle(uint32_t addr, uint32_t mode) {
    const uint32_t mask = mode == 1 ? 0x70u : mode == 2 ? 0x30u : mode == 3 ? 0x10u : 0u;
    return addr ^ ((addr >> 3) & mask);
}

// Byte address of element (i, k) of an operand of `es`-byte elements (2: f16/bf16, k 0..15; 4: tf32, k
// 0..7) in the canonical layouts: i indexes M (A) or N (B), k indexes K. K-major: core matrices of 8 rows
// (i) x 16 bytes (16/es k's); MN-major (16-bit only): 8 rows (k) x 16 bytes (8 i). With swizzle width Wb
// the row pitch is Wb (a row of an atom holds Wb bytes).
uint32_t wg_addr(const WgDesc& d, bool mn_major, int i, int k, int es) {
    const uint32_t wb = wg_swizzle_bytes(d.swizzle);
    const int kc = 16 / es;  // k's per 16-byte core-matrix row
    uint32_t off;
    if (!mn_major && wb == 0) off = (i % 8) * 16 + (i / 8) * d.sbo + (k / kc) * d.lbo + (k % kc) * es;
    else if (!mn_major) off = (i % 8) * wb + (i / 8) * d.sbo + k * es;
    else if (wb == 0) off = (i % 8) * 2 + (i / 8) * d.sbo + (k % 8) * 16 + (k / 8) * d.lbo;
    else off = (i % (wb / 2)) * 2 + (i / (wb / 2)) * d.lbo + (k % 8) * wb + (k / 8) * d.sbo;
    return wg_swizzle(d.start + off, d.swizzle);
}

// The K of one wgmma and its element size per type: k16 of 16-bit elements, k8 of tf32 (32 bytes of a
// K-major row either way).
int wg_k(int dtype) { return dtype == FA_EMU_TF32 ? 8 : 16; }
int wg_elem_bytes(int dtype) { return dtype == FA_EMU_TF32 ? 4 : 2; }

const char* wg_name(const Fiber* f) { return f->a ? "fa::wgmma (rs)" : "fa::wgmma (ss)"; }

// Reads a rows x K operand (element (i, k) -> out[i * 16 + k]; K = wg_k(dtype)) from shared memory through
// its descriptor, checking the bytes and recording the 16-byte chunks read.
void wg_read_operand(Worker* w, WgOp& op, uint64_t desc, bool mn_major, int rows, int dtype, const char* which,
                     std::vector<double>& out) {
    const WgDesc d = wg_decode(desc);
    if (d.base != 0)
        fiber_fail(w, strf("fa::wgmma: the %s descriptor has matrix base offset %u; only 0 is emulated (align the "
                           "swizzle pattern)", which, d.base));
    const int K = wg_k(dtype), es = wg_elem_bytes(dtype);
    out.assign(static_cast<size_t>(rows) * 16, 0.0);
    for (int i = 0; i < rows; ++i) {
        for (int k = 0; k < K; ++k) {
            const uint32_t a = wg_addr(d, mn_major, i, k, es);
            if (a + es > w->smem_size)
                fiber_fail(w, strf("fa::wgmma: %s element (%d, %d) at shared offset %u is outside dynamic shared "
                                   "memory (%zu bytes); descriptor start %u, LBO %u, SBO %u, swizzle mode %u", which, i,
                                   k, a, w->smem_size, d.start, d.lbo, d.sbo, d.swizzle));
            if (w->pending[a / kGranule])
                fiber_fail(w, strf("fa::wgmma reads its %s operand at ", which) + pending_desc(w, w->smem + a));
            if (es == 4) {
                uint32_t x;
                std::memcpy(&x, w->smem + a, 4);
                out[static_cast<size_t>(i) * 16 + k] = tf32_val(x);
            } else {
                uint16_t x;
                std::memcpy(&x, w->smem + a, 2);
                out[static_cast<size_t>(i) * 16 + k] = half_val(x, dtype);
            }
            op.chunks.push_back(a & ~15u);
        }
    }
}

void wg_snapshot_chunks(Worker* w, WgOp& op) {
    std::sort(op.chunks.begin(), op.chunks.end());
    op.chunks.erase(std::unique(op.chunks.begin(), op.chunks.end()), op.chunks.end());
    op.bytes.resize(op.chunks.size() * 16);
    for (size_t c = 0; c < op.chunks.size(); ++c) std::memcpy(&op.bytes[16 * c], w->smem + op.chunks[c], 16);
}

// The rs variant's A: per warp q of the warpgroup the mma.sync A fragment of rows 16q..16q+15: m16n8k16
// (16-bit pairs) or, tf32, m16n8k8 (a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]).
void wg_read_a_regs(Fiber* wgf, int dtype, std::vector<double>& A) {
    A.assign(64 * 16, 0.0);
    for (int th = 0; th < 128; ++th) {
        const Fiber& f = wgf[th];
        const int r = 16 * (th / 32) + ((th % 32) >> 2), t = th & 3;
        if (dtype == FA_EMU_TF32) {
            const int rows[4] = {r, r + 8, r, r + 8}, cols[4] = {t, t, t + 4, t + 4};
            for (int v = 0; v < 4; ++v) A[rows[v] * 16 + cols[v]] = tf32_val(f.a[v]);
            continue;
        }
        const int c = 2 * t;
        const int rows[4] = {r, r + 8, r, r + 8}, cols[4] = {c, c, c + 8, c + 8};
        for (int v = 0; v < 4; ++v) {
            A[rows[v] * 16 + cols[v]] = half_val(static_cast<uint16_t>(f.a[v] & 0xffffu), dtype);
            A[rows[v] * 16 + cols[v] + 1] = half_val(static_cast<uint16_t>(f.a[v] >> 16), dtype);
        }
    }
}

// Accumulator element v (0 .. n/2-1) of thread th: warp q = th / 32 owns rows 16q..16q+15, and within
// the warp the mma C fragment repeats over the n/8 column blocks: v = 4j + {0,1,2,3} ->
// (g, 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t), (g+8, 8j+2t+1), g = lane >> 2, t = lane & 3.
size_t wg_acc_index(int th, int v, int n) {
    const int lane = th % 32, j = v / 4, e = v % 4;
    const int row = 16 * (th / 32) + (lane >> 2) + 8 * (e >> 1), col = 8 * j + 2 * (lane & 3) + (e & 1);
    return static_cast<size_t>(row) * n + col;
}

// The thread's latest in-flight share whose accumulator is `d` (chained wgmmas of one shape), or null.
WgPart* wg_inflight_acc(Fiber& f, const float* d) {
    for (size_t k = f.wg_parts.size(); k-- > 0;)
        if (f.wg_parts[k].d == d) return &f.wg_parts[k];
    return nullptr;
}

WgTrack* wg_track_find(Fiber& f, const void* p) {
    for (WgTrack& t : f.wg_tracked)
        if (t.p == p) return &t;
    return nullptr;
}

void wg_track_set(Fiber& f, const void* p, const uint32_t* words, int count) {
    WgTrack* t = wg_track_find(f, p);
    if (!t) {
        f.wg_tracked.push_back(WgTrack{p, {}});
        t = &f.wg_tracked.back();
    }
    t->snap.assign(words, words + count);
}

[[noreturn]] void wg_unfenced(Worker* w, Fiber& f, const char* what, int v) {
    w->cur = &f;
    fiber_fail(w, strf("%s: %s register %d was written by ordinary code since the thread's last fa::wgmma_fence() "
                       "(missing wgmma_fence between the write and the wgmma)", wg_name(&f), what, v));
}

// The fence rule for a register array the wgmma reads (accumulator or A fragment): its contents equal
// those of the thread's last wgmma_fence (the stack image taken then), or, for an accumulator a wgmma
// wrote since, those it wrote. An array of a stack frame newer than the fence was written after it.
void wg_check_fenced(Worker* w, Fiber& f, const void* p, int count, const char* what) {
    const uint32_t* cur = static_cast<const uint32_t*>(p);
    if (const WgTrack* t = wg_track_find(f, p)) {
        for (int v = 0; v < count && v < static_cast<int>(t->snap.size()); ++v)
            if (cur[v] != t->snap[v]) wg_unfenced(w, f, what, v);
        return;
    }
    if (!f.wg_fenced) {
        w->cur = &f;
        fiber_fail(w, strf("%s: no fa::wgmma_fence() before this thread's first wgmma on these %s registers",
                           wg_name(&f), what));
    }
    const uintptr_t p0 = reinterpret_cast<uintptr_t>(p), lo = f.wg_stack_lo, hi = lo + f.wg_stack.size();
    const uintptr_t stack_lo = reinterpret_cast<uintptr_t>(f.stack_lo);
    if (p0 >= lo && p0 + 4 * count <= hi) {
        for (int v = 0; v < count; ++v)
            if (std::memcmp(cur + v, &f.wg_stack[p0 + 4 * v - lo], 4) != 0) wg_unfenced(w, f, what, v);
    } else if (p0 >= stack_lo && p0 < lo) {
        wg_unfenced(w, f, what, 0);  // in a frame the fence did not see
    }
}

// The input accumulator of thread th (scale_d: its registers, or the chained in-flight result); checks
// the fence rule and poisons the registers, which now belong to the wgmma.
void wg_take_acc(Worker* w, Fiber& f, int th, int n, std::vector<double>& C) {
    const int cnt = n / 2;
    WgPart* prev = wg_inflight_acc(f, f.d);
    if (prev && prev->op->n != n) {
        w->cur = &f;
        fiber_fail(w, strf("%s: the accumulator is in flight in a wgmma of another shape (n%d, now n%d)", wg_name(&f),
                           prev->op->n, n));
    }
    for (const WgPart& p : f.wg_parts)
        if (p.d != f.d && p.d < f.d + cnt && f.d < p.d + p.op->n / 2) {
            w->cur = &f;
            fiber_fail(w, strf("%s: the accumulator overlaps the registers of another in-flight wgmma", wg_name(&f)));
        }
    if (!prev) wg_check_fenced(w, f, f.d, cnt, "accumulator");
    for (int v = 0; v < cnt; ++v) {
        float c;
        std::memcpy(&c, f.d + v, 4);
        C[wg_acc_index(th, v, n)] = prev ? prev->op->D[wg_acc_index(th, v, n)] : c;
    }
    if (!prev)
        for (int v = 0; v < cnt; ++v) std::memcpy(f.d + v, &kWgPoison, 4);
}

// D = A B (+ C when scale_d): exact products summed in float64 in k order after C, one rounding to fp32
// per element (as the fp32-accumulating mma.sync: round_mma_sum, to nearest unless the truncated-sum model
// is on). K: 16 (f16 / bf16) or 8 (tf32).
void wg_compute(WgOp& op, const std::vector<double>& A, const std::vector<double>& B, const std::vector<double>& C,
                bool scale_d, int K) {
    const int n = op.n;
    op.D.resize(static_cast<size_t>(64) * n);
    for (int i = 0; i < 64; ++i)
        for (int j = 0; j < n; ++j) {
            double s = scale_d ? C[static_cast<size_t>(i) * n + j] : 0.0;
            for (int k = 0; k < K; ++k) s += A[i * 16 + k] * B[static_cast<size_t>(j) * 16 + k];
            op.D[static_cast<size_t>(i) * n + j] = round_mma_sum(s);
        }
}

// Every thread of the warpgroup issued the same instruction (shape, types, descriptors, scale, transposes).
void wg_check_uniform(Worker* w, Fiber* wgf) {
    const Fiber& f0 = wgf[0];
    for (int th = 1; th < 128; ++th) {
        const Fiber& f = wgf[th];
        if (f.dtype != f0.dtype || f.n != f0.n || (f.a == nullptr) != (f0.a == nullptr) || f.desc_a != f0.desc_a ||
            f.desc_b != f0.desc_b || f.scale_d != f0.scale_d || f.trans_a != f0.trans_a || f.trans_b != f0.trans_b) {
            w->cur = &wgf[th];
            fiber_fail(w, strf("%s: warpgroup %d: thread %d issued a different wgmma than thread %d (shape, type, "
                               "descriptors, scale_d and transposes must be warpgroup-uniform)", wg_name(&f),
                               f.warp / 4, f.tid, f0.tid));
        }
    }
}

// The 128th thread of warpgroup wg arrived: read the operands, compute D, hand each thread its share.
void wg_issue(Worker* w, int wg) {
    Fiber* wgf = &w->fibers[128 * wg];
    wg_check_uniform(w, wgf);
    const Fiber& f0 = wgf[0];
    auto op = std::make_shared<WgOp>();
    op->n = f0.n;
    op->wg = wg;
    std::vector<double> A, B, C(static_cast<size_t>(64) * f0.n, 0.0);
    if (f0.a) wg_read_a_regs(wgf, f0.dtype, A);
    else wg_read_operand(w, *op, f0.desc_a, f0.trans_a != 0, 64, f0.dtype, "A", A);
    wg_read_operand(w, *op, f0.desc_b, f0.trans_b != 0, f0.n, f0.dtype, "B", B);
    wg_snapshot_chunks(w, *op);
    for (int th = 0; th < 128; ++th) {
        if (wgf[th].a) {
            w->cur = &wgf[th];  // a fence error names the thread
            wg_check_fenced(w, wgf[th], wgf[th].a, 4, "A-fragment");
        }
        wg_take_acc(w, wgf[th], th, f0.n, C);
    }
    wg_compute(*op, A, B, C, f0.scale_d != 0, wg_k(f0.dtype));
    for (int th = 0; th < 128; ++th) {
        Fiber& f = wgf[th];
        WgPart part{op, f.d, f.a, {0, 0, 0, 0}, -1};
        if (f.a) std::memcpy(part.a_snap, f.a, 16);
        f.wg_parts.push_back(part);
    }
    ++w->cnt.wgmma;
}

void wg_check_participants(Worker* w, Fiber* f) {
    const int wg = f->warp / 4;
    if (128 * (wg + 1) > w->nthreads)
        fiber_fail(w, strf("%s: warpgroup %d (warps %d-%d) is incomplete: the block has %d threads, a wgmma needs all "
                           "128 threads of its warpgroup", wg_name(f), wg, 4 * wg, 4 * wg + 3, w->nthreads));
    for (int q = 4 * wg; q < 4 * wg + 4; ++q)
        if (w->warp_exited[q])
            fiber_fail(w, strf("%s: warpgroup %d (warps %d-%d): lanes %s of warp %d have exited and can never issue "
                               "it (a wgmma is a warpgroup collective)", wg_name(f), wg, 4 * wg, 4 * wg + 3,
                               lanes_str(w->warp_exited[q]).c_str(), q));
}

void wg_arrive(Worker* w, Fiber* f) {
    wg_check_participants(w, f);
    const int wg = f->warp / 4;
    f->state = WAIT_WG;
    if (++w->wg_arrived[wg] == 128) {
        wg_issue(w, wg);
        w->wg_arrived[wg] = 0;
        for (int th = 128 * wg; th < 128 * wg + 128; ++th) set_runnable(w, th);
        w->cur = f;
    }
    yield(w, f);
}

// A covered share completes: its operands (until every thread of the warpgroup has waited for the wgmma)
// and the thread's registers must be as the issue left them; the results
// land unless a later in-flight wgmma of this thread accumulates into the same registers.
void wg_complete(Worker* w, Fiber* f, const WgPart& p, bool last_for_acc) {
    WgOp& op = *p.op;
    for (size_t c = 0; c < op.chunks.size(); ++c)
        if (std::memcmp(&op.bytes[16 * c], w->smem + op.chunks[c], 16) != 0)
            fiber_fail(w, strf("fa::wgmma_wait_group: shared memory the wgmma of warpgroup %d reads (%s) was "
                               "written between its issue and its completion", op.wg,
                               smem_desc(w, w->smem + op.chunks[c]).c_str()));
    if (p.a && std::memcmp(p.a_snap, p.a, 16) != 0)
        fiber_fail(w, "fa::wgmma_wait_group: the A-fragment registers of an in-flight wgmma (rs) were written "
                      "between its issue and its covering wgmma_wait_group (or the array holding them ended before "
                      "that wait: its storage may then hold a later variable; declare it where it lives until the wait)");
    for (int v = 0; v < op.n / 2; ++v) {
        uint32_t x;
        std::memcpy(&x, p.d + v, 4);
        if (x != kWgPoison)
            fiber_fail(w, strf("fa::wgmma_wait_group: accumulator register %d of an in-flight wgmma (warpgroup %d) was "
                               "accessed (written: 0x%08x) between its issue and its covering wgmma_wait_group",
                               v, op.wg, x));
    }
    if (!last_for_acc) return;
    const int th = f->tid - 128 * op.wg;
    for (int v = 0; v < op.n / 2; ++v) p.d[v] = op.D[wg_acc_index(th, v, op.n)];
    wg_track_set(*f, p.d, reinterpret_cast<const uint32_t*>(p.d), op.n / 2);
}

void wg_wait(Worker* w, Fiber* f, int n) {
    const int64_t limit = f->wg_groups - n;
    std::vector<WgPart> keep;
    for (size_t k = 0; k < f->wg_parts.size(); ++k) {
        const WgPart& p = f->wg_parts[k];
        if (p.group < 0 || p.group >= limit) {
            keep.push_back(p);
            continue;
        }
        bool later = false;
        for (size_t m = k + 1; m < f->wg_parts.size(); ++m) later |= f->wg_parts[m].d == p.d;
        wg_complete(w, f, p, !later);
    }
    f->wg_parts.swap(keep);
}

// wgmma.fence: the thread's register arrays as they are now may feed its next wgmmas. The image of its
// stack (every frame of the kernel, the registers' home on the emulator) is what the issue compares.
void wg_fence(Worker* w, Fiber* f) {
    for (WgTrack& t : f->wg_tracked) {
        const uint32_t* cur = static_cast<const uint32_t*>(t.p);
        if (!wg_inflight_acc(*f, static_cast<const float*>(t.p))) t.snap.assign(cur, cur + t.snap.size());
    }
    const uintptr_t lo = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
    const uintptr_t hi = reinterpret_cast<uintptr_t>(f->stack_lo) + w->stack_size;
    f->wg_stack_lo = lo;
    f->wg_stack.assign(reinterpret_cast<const unsigned char*>(lo), reinterpret_cast<const unsigned char*>(hi));
    f->wg_fenced = true;
}

std::string wg_deadlock_desc(Worker* w) {
    for (size_t wg = 0; wg < w->wg_arrived.size(); ++wg) {
        if (!w->wg_arrived[wg]) continue;
        int at_bar = 0, exited = 0;
        for (int th = 128 * static_cast<int>(wg); th < 128 * static_cast<int>(wg) + 128 && th < w->nthreads; ++th) {
            at_bar += w->fibers[th].state == WAIT_BAR;
            exited += w->fibers[th].state == EXITED;
        }
        return strf("warpgroup %zu (warps %zu-%zu): the wgmma never completes: %d of its 128 threads wait at it, the "
                    "others never arrive (%d wait at __syncthreads(), %d exited): a wgmma is a warpgroup collective",
                    wg, 4 * wg, 4 * wg + 3, w->wg_arrived[wg], at_bar, exited);
    }
    return "";
}

// =========================================================================================
// TMA: cp.async.bulk.tensor (sm_90; docs/emulator.md, "Hopper: TMA")
// =========================================================================================
// The emulator's tensor map: the 128 bytes of a CUtensorMap as flasharray's encoder
// (flasharray/_private/tensor_map.py) writes them for the emulator. Words: [0] kTmaMagic, [1] the global
// address, [2..6] the dimensions (innermost first), [7..10] the byte strides of dimensions 1..4, [11] box
// dimensions 0..3 (16 bits each), [12] box dimension 4 | element strides << 16 (4 bits each), [13] rank |
// element size << 8 | swizzle bytes << 16 | data type << 32 | interleave << 40 | L2 promotion << 48 |
// OOB fill << 56.
constexpr uint64_t kTmaMagic = 0x50414d54554d4546ull;  // "FEMUTMAP"

struct TmaMap {
    int rank = 0, esize = 0, swizzle = 0;  // swizzle: 0, 32, 64 or 128 bytes
    uint64_t addr = 0, dim[5] = {0}, stride[5] = {0};  // stride[0] = esize
    uint32_t box[5] = {0};
    uint64_t box_bytes() const {
        uint64_t n = static_cast<uint64_t>(esize);
        for (int d = 0; d < rank; ++d) n *= box[d];
        return n;
    }
};

// Decodes and checks a tensor map; dims: the number of coordinates the call passes (0: not checked).
TmaMap tma_decode(Worker* w, const void* tmap, int dims, const char* what) {
    uint64_t q[16];
    std::memcpy(q, tmap, sizeof q);
    if (q[0] != kTmaMagic)
        fiber_fail(w, strf("%s: the tensor map at %p is not one flasharray's encoder made for the emulator "
                           "(flasharray.emulator.encode_tensor_map)", what, tmap));
    TmaMap m;
    m.rank = static_cast<int>(q[13] & 0xff);
    m.esize = static_cast<int>((q[13] >> 8) & 0xff);
    m.swizzle = static_cast<int>((q[13] >> 16) & 0xffff);
    m.addr = q[1];
    for (int d = 0; d < 5; ++d) {
        m.dim[d] = q[2 + d];
        m.box[d] = static_cast<uint32_t>(d < 4 ? (q[11] >> (16 * d)) & 0xffff : q[12] & 0xffff);
    }
    m.stride[0] = static_cast<uint64_t>(m.esize);
    for (int d = 1; d < 5; ++d) m.stride[d] = q[6 + d];
    if (m.rank < 1 || m.rank > 5) fiber_fail(w, strf("%s: tensor map of rank %d (1..5)", what, m.rank));
    if (dims && dims != m.rank)
        fiber_fail(w, strf("%s: %d coordinates for a tensor map of rank %d (use fa::tma_load_%dd / tma_store_%dd)",
                           what, dims, m.rank, m.rank, m.rank));
    return m;
}

uint32_t tma_swizzle_mode(int bytes) { return bytes == 128 ? 1 : bytes == 64 ? 2 : bytes == 32 ? 3 : 0; }

// The box at coordinates c (innermost first), element by element in the dense shared-memory order (the
// innermost dimension fastest): its shared offset from `smem_off`, swizzled as wgmma's descriptors read it
// (the same address bits), and its global address; out-of-bounds coordinates (negative, or >= the
// dimension) give a null address.
std::vector<TmaElem> tma_box(const TmaMap& m, const int* c, uint32_t smem_off) {
    const uint64_t n = m.box_bytes() / static_cast<uint64_t>(m.esize);
    const uint32_t mode = tma_swizzle_mode(m.swizzle);
    std::vector<TmaElem> out(n);
    for (uint64_t e = 0; e < n; ++e) {
        uint64_t rest = e, addr = m.addr;
        bool inside = true;
        for (int d = 0; d < m.rank; ++d) {
            const int64_t x = int64_t(c[d]) + int64_t(rest % m.box[d]);
            rest /= m.box[d];
            inside = inside && x >= 0 && static_cast<uint64_t>(x) < m.dim[d];
            addr += static_cast<uint64_t>(x) * m.stride[d];
        }
        const uint32_t off = smem_off + static_cast<uint32_t>(e) * static_cast<uint32_t>(m.esize);
        out[e] = TmaElem{wg_swizzle(off, mode), inside ? reinterpret_cast<const unsigned char*>(addr) : nullptr};
    }
    return out;
}

// Bounds-checks and counts the in-bounds global elements (kind 0 read, 1 write), and their 32-byte sectors
// against the ideal.
void tma_global(Worker* w, const std::vector<TmaElem>& elems, int esize, int kind, const char* what) {
    std::vector<uint64_t> sectors;
    uint64_t bytes = 0, first = 0;
    for (const TmaElem& e : elems) {
        if (!e.g) continue;
        gcheck(w, e.g, static_cast<size_t>(esize), kind, what);
        if (sectors.empty()) first = reinterpret_cast<uint64_t>(e.g);
        sectors.push_back(reinterpret_cast<uint64_t>(e.g) / 32);
        bytes += static_cast<uint64_t>(esize);
    }
    if (sectors.empty()) return;
    const int b = find_buffer(w, first, 1);   // the map's array (one buffer holds the tensor)
    std::sort(sectors.begin(), sectors.end());
    const uint64_t actual = static_cast<uint64_t>(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
    const uint64_t ideal = (bytes + 31) / 32;
    (kind ? w->cnt.gst_sectors : w->cnt.gld_sectors) += actual;
    (kind ? w->cnt.gst_sectors_ideal : w->cnt.gld_sectors_ideal) += ideal;
    if (b >= 0) {
        w->buf_sectors[4 * b + 2 * kind] += actual;
        w->buf_sectors[4 * b + 2 * kind + 1] += ideal;
    }
}

// A TMA box in shared memory: inside dynamic shared memory and 128-byte aligned (PTX ISA, cp.async.bulk.tensor).
uint32_t tma_smem(Worker* w, const void* p, uint64_t bytes, const char* what) {
    if (!in_smem(w, p, bytes))
        fiber_fail(w, strf("%s: the box (%lu bytes) at %p is outside dynamic shared memory: %s", what,
                           static_cast<unsigned long>(bytes), p, smem_desc(w, p).c_str()));
    // the shared address is the offset in dynamic shared memory (as for wgmma's descriptors)
    const uint32_t off = static_cast<uint32_t>(static_cast<const unsigned char*>(p) - w->smem);
    if (off & 127u)
        fiber_fail(w, strf("%s: the shared-memory box is not 128-byte aligned: %s", what, smem_desc(w, p).c_str()));
    return off;
}

// The box's first inner element: its byte offset c0 * element size a multiple of 16. Not in the PTX ISA's
// text, but the hardware's: on an H200 (2026-11-27) the loads at inner offsets of 360, -10 and 20 bytes raised
// cudaErrorIllegalInstruction, while the library's (inner coordinate 0) ran; Triton found the same
// (triton-lang/triton#7385: "the TMA read address after applying the coordinates has to be 16-byte aligned").
// Strides are multiples of 16 and the address 16-byte aligned, so only the inner coordinate can break it.
void tma_check_inner(Worker* w, const TmaMap& m, const int* c, const char* what) {
    const int64_t offset = static_cast<int64_t>(c[0]) * m.esize;
    if (offset % 16)
        fiber_fail(w, strf("%s: inner coordinate %d x %d-byte elements = %lld bytes, not a multiple of 16: the GPU "
                           "raises an illegal instruction (the box's first inner element must be 16-byte aligned)",
                           what, c[0], m.esize, static_cast<long long>(offset)));
}

void tma_load(Worker* w, void* smem_dst, const void* tmap, int dims, const int* c, const void* bar) {
    const char* what = "fa::tma_load";
    const TmaMap m = tma_decode(w, tmap, dims, what);
    tma_check_inner(w, m, c, what);
    const uint64_t bytes = m.box_bytes();
    const uint32_t off = tma_smem(w, smem_dst, bytes, what);
    bulk_check_dst(w, static_cast<unsigned char*>(smem_dst), static_cast<int>(bytes), what);
    auto elems = std::make_shared<std::vector<TmaElem>>(tma_box(m, c, off));
    tma_global(w, *elems, m.esize, 0, "fa::tma_load global read");
    const uint32_t bar_off = bulk_barrier(w, bar, what);
    const size_t g0 = off / kGranule;
    for (size_t g = g0; g < g0 + bytes / kGranule; ++g) ++w->pending[g];
    w->bulks.push_back(Bulk{w->smem + off, nullptr, static_cast<int>(bytes), w->cur->tid, bar_off, elems, m.esize});
    ++w->cnt.tma_loads;
    w->cnt.tma_load_bytes += bytes;
}

// The async-proxy rule: the source of a TMA store holds what the generic proxy wrote before the block's last
// fence.proxy.async (or what copies of the async proxy wrote), and no copy in flight writes it.
void tma_check_source(Worker* w, uint32_t off, uint64_t bytes, const char* what,
                      const char* op = "the TMA store") {
    for (uint64_t i = 0; i < bytes; ++i) {
        if (w->pending[(off + i) / kGranule])
            fiber_fail(w, std::string(what) + ": the source box holds " + pending_desc(w, w->smem + off + i));
        if (w->smem[off + i] != w->async_img[off + i])
            fiber_fail(w, strf("%s reads %s, written by ordinary (generic-proxy) stores since the block's last "
                               "fa::fence_proxy_async(): %s (async proxy) may not see them; "
                               "fence.proxy.async between the writes and the store (then __syncthreads())",
                               what, smem_desc(w, w->smem + off + i).c_str(), op));
    }
}

void tma_store(Worker* w, const void* tmap, int dims, const int* c, const void* smem_src) {
    const char* what = "fa::tma_store";
    const TmaMap m = tma_decode(w, tmap, dims, what);
    tma_check_inner(w, m, c, what);
    const uint64_t bytes = m.box_bytes();
    const uint32_t off = tma_smem(w, smem_src, bytes, what);
    tma_check_source(w, off, bytes, what);
    TmaStore st{tma_box(m, c, off), m.esize, off, static_cast<uint32_t>(bytes), {}, -1};
    tma_global(w, st.elems, m.esize, 1, "fa::tma_store global write");
    st.snap.assign(w->smem + off, w->smem + off + bytes);
    w->cur->tma_stores.push_back(std::move(st));
    ++w->cnt.tma_stores;
    w->cnt.tma_store_bytes += bytes;
}

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [gdst], [src], bytes (PTX ISA, cp.reduce.async.bulk):
// the 1-D bulk reduce-add. Both addresses 16-byte aligned, bytes a positive multiple of 16; the source is read
// through the async proxy (the TMA store's fence rule) and snapshotted at the issue; the adds are applied to
// global memory at completion (a covering cp.async.bulk.wait_group, or the thread's exit), fp32 element by
// element in address order, each a real atomic add (other blocks add concurrently).
void bulk_reduce_add_f32(Worker* w, float* gdst, const void* smem_src, int bytes) {
    const char* what = "fa::bulk_reduce_add_f32";
    if (bytes <= 0 || bytes % 16)
        fiber_fail(w, strf("%s: %d bytes: the size must be a positive multiple of 16", what, bytes));
    if (reinterpret_cast<uintptr_t>(gdst) & 15u)
        fiber_fail(w, strf("%s: the global address %p is not 16-byte aligned", what, static_cast<void*>(gdst)));
    if (!in_smem(w, smem_src, static_cast<uint64_t>(bytes)))
        fiber_fail(w, strf("%s: the source (%d bytes) at %p is outside dynamic shared memory: %s", what, bytes,
                           smem_src, smem_desc(w, smem_src).c_str()));
    const uint32_t off = static_cast<uint32_t>(static_cast<const unsigned char*>(smem_src) - w->smem);
    if (off & 15u)
        fiber_fail(w, strf("%s: the shared source is not 16-byte aligned: %s", what, smem_desc(w, smem_src).c_str()));
    tma_check_source(w, off, static_cast<uint64_t>(bytes), what, "the bulk reduce");
    TmaStore st{{}, 4, off, static_cast<uint32_t>(bytes), {}, -1, 1, false};
    st.elems.resize(static_cast<size_t>(bytes) / 4);
    for (size_t e = 0; e < st.elems.size(); ++e)
        st.elems[e] = TmaElem{off + 4 * static_cast<uint32_t>(e), reinterpret_cast<const unsigned char*>(gdst + e)};
    tma_global(w, st.elems, 4, 1, "fa::bulk_reduce_add_f32 global read-modify-write");
    st.snap.assign(w->smem + off, w->smem + off + bytes);
    w->cur->tma_stores.push_back(std::move(st));
}

// A bulk reduce's adds (completion): each element an atomic fp32 add, in address order.
void bulk_reduce_apply(const TmaStore& st) {
    for (const TmaElem& e : st.elems) {
        uint32_t* p = reinterpret_cast<uint32_t*>(const_cast<unsigned char*>(e.g));
        float v;
        std::memcpy(&v, st.snap.data() + (e.smem - st.src), 4);
        uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED), nw;
        do {
            float f;
            std::memcpy(&f, &old, 4);
            f += v;
            std::memcpy(&nw, &f, 4);
        } while (!__atomic_compare_exchange_n(p, &old, nw, true, __ATOMIC_RELEASE, __ATOMIC_RELAXED));
    }
}

// cp.async.bulk.wait_group[.read] n: every committed bulk group but the newest n has read its source, which
// must be unchanged since the issue; the emulator performs a TMA store's global writes at that read
// (out-of-bounds elements are not written). A bulk reduce's adds wait for completion (`complete`: the wait
// without .read), else the op stays in flight with its snapshot.
void tma_wait_read(Worker* w, Fiber* f, int n, bool complete = false) {
    const int64_t limit = f->bulk_groups - n;
    std::vector<TmaStore> keep;
    for (TmaStore& st : f->tma_stores) {
        if (st.group < 0 || st.group >= limit) {
            keep.push_back(std::move(st));
            continue;
        }
        if (!st.read) {
            for (uint32_t i = 0; i < st.bytes; ++i)
                if (w->smem[st.src + i] != st.snap[i])
                    fiber_fail(w, st.kind ? strf("fa::bulk_wait: the source of a bulk reduce-add "
                                                 "(fa::bulk_reduce_add_f32) (%s) was overwritten between its issue "
                                                 "and the cp.async.bulk.wait_group.read covering it",
                                                 smem_desc(w, w->smem + st.src + i).c_str())
                                          : strf("fa::tma_store_wait: the source of a TMA store (%s) was overwritten "
                                                 "between its issue and the fa::tma_store_wait<N>() "
                                                 "(cp.async.bulk.wait_group.read) covering it",
                                                 smem_desc(w, w->smem + st.src + i).c_str()));
            st.read = true;
            if (st.kind == 0)
                for (const TmaElem& e : st.elems)
                    if (e.g) std::memcpy(const_cast<unsigned char*>(e.g), st.snap.data() + (e.smem - st.src),
                                         static_cast<size_t>(st.esize));
        }
        if (st.kind == 1) {
            if (complete) bulk_reduce_apply(st);
            else keep.push_back(std::move(st));
        }
    }
    f->tma_stores = std::move(keep);
}

// A semaphore post (release) does not publish a bulk reduce still in flight: the async proxy's global
// writes are ordered before the post only by a cp.async.bulk.wait_group (without .read) covering them.
void bulk_check_published(Worker* w, const char* what) {
    for (const TmaStore& st : w->cur->tma_stores)
        if (st.kind == 1)
            fiber_fail(w, strf("%s: this thread has a bulk reduce-add (fa::bulk_reduce_add_f32) in flight, not "
                               "complete%s: the release does not publish its adds (a later turn could add first); "
                               "commit and fa::bulk_wait<0>() (cp.async.bulk.wait_group 0, not .read) before the "
                               "post", what, st.read ? " (its source was read: .read is not completion)" : ""));
}

// =========================================================================================
// setmaxnreg.inc/dec.sync.aligned.u32 N (sm_90a; docs/emulator.md, "setmaxnreg")
// =========================================================================================
const char* maxnreg_name(int inc) { return inc ? "fa::setmaxnreg_inc" : "fa::setmaxnreg_dec"; }

// Every thread of the warpgroup executes the same setmaxnreg (the count and the direction) before any of them
// executes another; .inc raises the per-thread maximum to N (N >= the current one), .dec lowers it.
void setmaxnreg(Worker* w, int inc, int n) {
    Fiber* f = w->cur;
    const char* what = maxnreg_name(inc);
    if (n < 24 || n > 256 || n % 8)
        fiber_fail(w, strf("%s<%d>: the register count must be a multiple of 8 in [24, 256]", what, n));
    const int wg = f->warp / 4;
    if (32 * (4 * wg + 4) > w->nthreads)
        fiber_fail(w, strf("%s<%d>: warpgroup %d (warps %d-%d) is incomplete: the block has %d threads, setmaxnreg "
                           "is executed by all warps of a warpgroup", what, n, wg, 4 * wg, 4 * wg + 3, w->nthreads));
    MaxNReg& m = w->maxnreg[wg];
    const int i = f->tid - 128 * wg;
    for (int k = 0; k < 128; ++k)   // a thread that exited without executing it never will
        if (w->fibers[128 * wg + k].state == EXITED && !(m.executed > 0 && ((m.done[k / 64] >> (k % 64)) & 1u)))
            fiber_fail(w, strf("%s<%d>: thread %d of warpgroup %d has exited without executing it: setmaxnreg is "
                               "warpgroup-uniform", what, n, 128 * wg + k, wg));
    if (m.executed > 0 && ((m.done[i / 64] >> (i % 64)) & 1u))
        fiber_fail(w, strf("%s<%d>: this thread executes a second setmaxnreg while %d of the 128 threads of warpgroup "
                           "%d have not executed the first: synchronize the warpgroup between two", what, n,
                           128 - m.executed, wg));
    if (m.executed > 0 && (m.inc != inc || m.n != n))
        fiber_fail(w, strf("%s<%d>: thread %d of warpgroup %d executed %s<%d>: the warps of a warpgroup execute the "
                           "same setmaxnreg", what, n, m.first_tid, wg, maxnreg_name(m.inc), m.n));
    if (m.executed == 0) {
        if (m.current && (inc ? n < m.current : n > m.current))
            fiber_fail(w, strf("%s<%d>: the warpgroup's register count is %d: .inc must not lower it, .dec must not "
                               "raise it", what, n, m.current));
        m.inc = inc;
        m.n = n;
        m.first_tid = f->tid;
    }
    m.done[i / 64] |= uint64_t(1) << (i % 64);
    if (++m.executed == 128) {
        m.current = n;
        m.executed = 0;
        m.done[0] = m.done[1] = 0;
        ++w->cnt.setmaxnreg;
    }
}

void maxnreg_thread_exits(Worker* w, const Fiber* f) {
    const int wg = f->warp / 4;
    if (wg >= static_cast<int>(w->maxnreg.size())) return;
    const MaxNReg& m = w->maxnreg[wg];
    const int i = f->tid - 128 * wg;
    if (m.executed > 0 && !((m.done[i / 64] >> (i % 64)) & 1u))
        fiber_fail(w, strf("thread exits without executing the %s<%d> that %d thread(s) of its warpgroup %d executed "
                           "(first: thread %d): setmaxnreg is warpgroup-uniform", maxnreg_name(m.inc), m.n, m.executed,
                           wg, m.first_tid));
}

// =========================================================================================
// Named barriers: bar.sync / bar.arrive id, nthreads (docs/emulator.md, "Named barriers")
// =========================================================================================
constexpr int kNamedBarriers = 16;

// bar.sync and bar.arrive are .aligned: a warp arrives as a unit, counting 32 threads, once every lane of it
// that has not exited has executed the instruction. Until then the lanes wait in `lanes` (sync lanes
// suspended, arrive lanes already running on).
std::string nbar_state(const Worker* w, int id) {
    const NamedBar& b = w->nbars[id];
    std::string pend;
    for (int wp = 0; wp < w->nwarps; ++wp)
        if (b.lanes[wp]) pend += strf("%swarp %d lanes %s", pend.empty() ? "" : ", ", wp, lanes_str(b.lanes[wp]).c_str());
    return strf("named barrier %d (%d of its %d threads arrived; lanes waiting for the rest of their warp: %s)", id,
                b.arrived, b.expected, pend.empty() ? "none" : pend.c_str());
}

// The barrier completes: the threads of the counted warps that sync run, the next phase starts empty.
void nbar_complete(Worker* w, int id) {
    NamedBar& b = w->nbars[id];
    if (b.sem_members > 0) {
        // A group semaphore's phase: every participant called it, and exactly one is its leader (the thread
        // that polls or posts): with none the group would pass unordered, with two a post would count twice.
        const int members = b.sem_members, leaders = b.sem_leaders;
        const char* what = b.sem_what;
        b.sem_members = b.sem_leaders = 0;
        b.sem_what = nullptr;
        if (members != b.expected)
            fiber_fail(w, strf("%s(id %d, %d threads): named barrier %d completed with %d thread(s) at %s and %d at "
                               "a plain fa::named_barrier_sync/arrive: every thread of the group calls %s",
                               what, id, b.expected, id, members, what, b.expected - members, what));
        if (leaders != 1)
            fiber_fail(w, strf("%s(id %d, %d threads): %d of the group's threads have a linear thread index that is "
                               "a multiple of %d (the leader, which %s): the group must be %d consecutive threads, "
                               "so that exactly one is", what, id, b.expected, leaders, b.expected,
                               std::strcmp(what, "fa::sem_post_group") ? "polls the counter" : "posts",
                               b.expected));
    }
    merge_seen(w->fibers.data(), w->nthreads,
               [&](const Fiber& f) { return f.state == WAIT_NBAR && f.nbar_id == id && f.nbar_counted; });
    for (int t = 0; t < w->nthreads; ++t) {
        Fiber& f = w->fibers[t];
        if (f.state == WAIT_NBAR && f.nbar_id == id && f.nbar_counted) set_runnable(w, t);
    }
    b.arrived = 0;
    ++w->cnt.named_barriers;
}

// Warp `wp` arrives at barrier `id` if every lane that has not exited is there.
void nbar_warp_arrives(Worker* w, int id, int wp) {
    NamedBar& b = w->nbars[id];
    const uint32_t live = w->warp_exists[wp] & ~w->warp_exited[wp];
    if (b.lanes[wp] == 0 || (b.lanes[wp] & live) != live) return;
    for (int l = 0; l < 32; ++l)
        if ((b.lanes[wp] >> l) & 1u) w->fibers[wp * 32 + l].nbar_counted = true;
    b.lanes[wp] = 0;
    b.warp_kind[wp] = -1;
    b.arrived += 32;
    if (b.arrived == b.expected) nbar_complete(w, id);
}

void nbar_check_args(Worker* w, const char* what, int id, int nthreads) {
    if (id < 0 || id >= kNamedBarriers) fiber_fail(w, strf("%s: barrier id %d is outside 0..15", what, id));
    if (nthreads <= 0 || nthreads % 32)
        fiber_fail(w, strf("%s(%d, %d): the thread count must be a positive multiple of 32 (the warp size)", what, id,
                           nthreads));
    if (nthreads > 32 * w->nwarps)
        fiber_fail(w, strf("%s(%d, %d): more threads than the block's %d warps have (%d): the barrier can never "
                           "complete", what, id, nthreads, w->nwarps, 32 * w->nwarps));
    if (id == 0 && w->bar_arrived > 0)
        fiber_fail(w, strf("%s(0, %d): %d thread(s) wait at __syncthreads(), which is barrier 0 too", what, nthreads,
                           w->bar_arrived));
}

void named_barrier(Worker* w, int id, int nthreads, bool sync) {
    Fiber* f = w->cur;
    const char* what = sync ? "fa::named_barrier_sync" : "fa::named_barrier_arrive";
    nbar_check_args(w, what, id, nthreads);
    NamedBar& b = w->nbars[id];
    bool busy = b.arrived > 0;
    for (uint32_t m : b.lanes) busy = busy || m != 0;
    if (!busy) {
        b.expected = nthreads;
        b.first_tid = f->tid;
    } else if (b.expected != nthreads) {
        fiber_fail(w, strf("%s(%d, %d): thread %d arrived at named barrier %d with a count of %d: every participant "
                           "must pass the same thread count", what, id, nthreads, b.first_tid, id, b.expected));
    }
    if (b.warp_kind[f->warp] >= 0 && b.warp_kind[f->warp] != static_cast<int>(sync))
        fiber_fail(w, strf("%s(%d, %d): lanes %s of warp %d are at %s of the same barrier: a warp executes one "
                           "barrier instruction together (divergent bar.sync / bar.arrive)", what, id, nthreads,
                           lanes_str(b.lanes[f->warp]).c_str(), f->warp,
                           sync ? "fa::named_barrier_arrive" : "fa::named_barrier_sync"));
    b.warp_kind[f->warp] = sync;
    b.lanes[f->warp] |= 1u << f->lane;
    f->nbar_counted = false;
    if (sync) {
        f->state = WAIT_NBAR;
        f->nbar_id = id;
    }
    nbar_warp_arrives(w, id, f->warp);
    if (sync) yield(w, f);
}

// A thread exits: lanes of its warp waiting for it at a named barrier may now form the warp's arrival.
void nbar_thread_exits(Worker* w, const Fiber* f) {
    for (int id = 0; id < kNamedBarriers; ++id) nbar_warp_arrives(w, id, f->warp);
}

std::string nbar_deadlock_desc(Worker* w) {
    for (int id = 0; id < kNamedBarriers; ++id) {
        int waiting = 0;
        for (const Fiber& f : w->fibers) waiting += f.state == WAIT_NBAR && f.nbar_id == id;
        if (waiting == 0) continue;
        return strf("deadlock: %s never completes: %d thread(s) wait at fa::named_barrier_sync, the others never "
                    "arrive (%d thread(s) wait at __syncthreads(), %d exited)", nbar_state(w, id).c_str(), waiting,
                    w->bar_arrived, w->exited);
    }
    return "";
}

// =========================================================================================
// Fiber lifecycle and the scheduler
// =========================================================================================
void thread_exit(Worker* w, Fiber* f) {
    // Pending cp.async copies of an exiting thread land in shared memory no one reads again.
    for (size_t k = f->copies_head; k < f->copies.size(); ++k) {
        const Copy& cp = f->copies[k];
        const size_t g0 = (cp.dst - w->smem) / kGranule;
        for (size_t g = g0; g < g0 + cp.size / kGranule; ++g) --w->pending[g];
    }
    f->copies.clear();
    f->copies_head = 0;
    size_t unread[2] = {0, 0};
    for (const TmaStore& st : f->tma_stores) unread[st.kind] += !st.read;
    if (unread[0])
        fiber_fail(w, strf("thread exits with %zu TMA store(s) whose source reads no fa::tma_store_wait<N>() has "
                           "covered (commit them and wait before exiting: the shared memory goes away)", unread[0]));
    if (unread[1])
        fiber_fail(w, strf("thread exits with %zu bulk reduce-add(s) (fa::bulk_reduce_add_f32) whose source reads no "
                           "fa::bulk_wait_read<N>() / fa::bulk_wait<N>() has covered (commit them and wait before "
                           "exiting: the shared memory goes away)", unread[1]));
    for (const TmaStore& st : f->tma_stores) bulk_reduce_apply(st);  // read reduces complete after the exit
    f->tma_stores.clear();
    if (!f->wg_parts.empty())
        fiber_fail(w, strf("thread exits with %zu wgmma(s) in flight (no covering fa::wgmma_wait_group): their "
                           "accumulator registers are never written", f->wg_parts.size()));
    if (f->warp / 4 < static_cast<int>(w->wg_arrived.size()) && w->wg_arrived[f->warp / 4] > 0)
        fiber_fail(w, strf("thread exits while %d thread(s) of warpgroup %d (warps %d-%d) wait for it at a wgmma: "
                           "a wgmma is a warpgroup collective (missing participant)", w->wg_arrived[f->warp / 4],
                           f->warp / 4, f->warp / 4 * 4, f->warp / 4 * 4 + 3));
    if (w->bar_arrived > 0)
        fiber_fail(w, strf("thread exits while %d thread(s) wait at __syncthreads() (%s): it never reaches "
                           "that barrier (divergent or early-exit barrier)",
                           w->bar_arrived, site_str(w->bar_site).c_str()));
    const uint32_t waiting = w->warp_waiting[f->warp];
    for (int l = 0; l < 32; ++l) {
        if (!((waiting >> l) & 1u)) continue;
        const Fiber& g = w->fibers[f->warp * 32 + l];
        if ((g.mask >> f->lane) & 1u)
            fiber_fail(w, strf("thread exits while lane %d waits for it at %s (mask 0x%08x): incomplete warp "
                               "collective", l, op_name(g.op, g.kind), g.mask));
    }
    f->state = EXITED;
    ++w->exited;
    w->warp_exited[f->warp] |= 1u << f->lane;
    nbar_thread_exits(w, f);
    maxnreg_thread_exits(w, f);
    ctx_switch(&f->ctx, &w->sched);
    __builtin_unreachable();
}

void fiber_main(void* arg) {
    Worker* w = static_cast<Worker*>(arg);
    Fiber* f = w->cur;
    try {
        w->p->entry(w->p->args);
    } catch (const std::exception& e) {
        fiber_fail(w, strf("C++ exception escaped the kernel: %s", e.what()));
    } catch (...) {
        fiber_fail(w, "C++ exception escaped the kernel");
    }
    thread_exit(w, f);
}

int pick(Worker* w) {
    const int nw = static_cast<int>(w->runnable.size());
    switch (w->p->schedule) {
        case FA_EMU_SCHED_REVERSE:
            for (int i = nw - 1; i >= 0; --i)
                if (w->runnable[i]) return i * 64 + 63 - __builtin_clzll(w->runnable[i]);
            break;
        case FA_EMU_SCHED_RANDOM: {
            int k = static_cast<int>(splitmix(w->rng) % static_cast<uint64_t>(w->nrunnable));
            for (int i = 0; i < nw; ++i) {
                uint64_t word = w->runnable[i];
                const int c = __builtin_popcountll(word);
                if (k >= c) { k -= c; continue; }
                for (; k > 0; --k) word &= word - 1;
                return i * 64 + __builtin_ctzll(word);
            }
            break;
        }
        default:
            for (int i = 0; i < nw; ++i)
                if (w->runnable[i]) return i * 64 + __builtin_ctzll(w->runnable[i]);
    }
    return -1;
}

std::string deadlock_desc(Worker* w) {
    const std::string mbar = mbar_deadlock_desc(w);
    if (!mbar.empty()) return mbar;
    const std::string wg = wg_deadlock_desc(w);
    if (!wg.empty()) return wg;
    const std::string nbar = nbar_deadlock_desc(w);
    if (!nbar.empty()) return nbar;
    for (int wp = 0; wp < w->nwarps; ++wp) {
        const uint32_t waiting = w->warp_waiting[wp];
        if (!waiting) continue;
        const int l = __builtin_ctz(waiting);
        const Fiber& f = w->fibers[wp * 32 + l];
        const uint32_t missing = f.mask & ~waiting;
        uint32_t at_bar = 0, at_other = 0;
        for (int m = 0; m < 32; ++m) {
            if (!((missing >> m) & 1u)) continue;
            const Fiber& g = w->fibers[wp * 32 + m];
            if (g.state == WAIT_BAR) at_bar |= 1u << m;
            else at_other |= 1u << m;
        }
        std::string s = strf("warp %d: %s (mask 0x%08x) never completes: lanes %s wait at it, lanes %s never arrive",
                             wp, op_name(f.op, f.kind), f.mask, lanes_str(waiting & f.mask).c_str(),
                             lanes_str(missing).c_str());
        if (at_bar) s += strf(" (lanes %s wait at __syncthreads())", lanes_str(at_bar).c_str());
        if (at_other) s += strf(" (lanes %s wait at another warp collective with a different mask)", lanes_str(at_other).c_str());
        return s + ": incomplete warp collective";
    }
    return strf("deadlock: %d thread(s) wait at __syncthreads(), %d exited", w->bar_arrived, w->exited);
}

void alloc_block_resources(Worker* w) {
    const fa_emu_launch_params* p = w->p;
    const int nthreads = static_cast<int>(p->block[0] * p->block[1] * p->block[2]);
    w->nthreads = nthreads;
    w->nwarps = (nthreads + 31) / 32;
    w->stack_size = (p->stack_bytes + kPage - 1) & ~(kPage - 1);
    w->stack_stride = w->stack_size + kGuard;
    w->stacks_len = w->stack_stride * static_cast<size_t>(nthreads);
    w->stacks = static_cast<char*>(mmap(nullptr, w->stacks_len, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (w->stacks == MAP_FAILED) { w->stacks = nullptr; return; }
    w->fibers.assign(nthreads, Fiber());
    for (int t = 0; t < nthreads; ++t) {
        char* base = w->stacks + w->stack_stride * t;
        mprotect(base, kGuard, PROT_NONE);  // stack overflow faults here
        w->fibers[t].stack_lo = base + kGuard;
    }
    // Shared memory placed so that its end touches the upper guard region.
    w->smem_size = p->shared_mem;
    const size_t body = (w->smem_size + kPage - 1) & ~(kPage - 1);
    w->smem_region_len = kGuard + body + kGuard;
    w->smem_region = static_cast<char*>(mmap(nullptr, w->smem_region_len, PROT_NONE,
                                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (w->smem_region == MAP_FAILED) { w->smem_region = nullptr; return; }
    if (body) mprotect(w->smem_region + kGuard, body, PROT_READ | PROT_WRITE);
    uintptr_t base = reinterpret_cast<uintptr_t>(w->smem_region + kGuard + body - w->smem_size) & ~uintptr_t(15);
    w->smem = reinterpret_cast<unsigned char*>(base);
    w->pending.assign((w->smem_size + kGranule - 1) / kGranule + 1, 0);
    w->landed_bar.assign(w->pending.size(), 0);
    w->landed_phase.assign(w->pending.size(), 0);
    w->async_img.assign(w->smem_size, 0xff);
    w->warp_waiting.assign(w->nwarps, 0);
    w->warp_exited.assign(w->nwarps, 0);
    w->warp_exists.assign(w->nwarps, 0);
    w->wg_arrived.assign((w->nwarps + 3) / 4, 0);
    w->nbars.assign(16, NamedBar());
    w->maxnreg.assign((w->nwarps + 3) / 4, MaxNReg());
    for (int t = 0; t < nthreads; ++t) w->warp_exists[t / 32] |= 1u << (t % 32);
    w->runnable.assign((nthreads + 63) / 64, 0);
    w->buf_read.assign(p->num_buffers, 0);
    w->buf_write.assign(p->num_buffers, 0);
    w->buf_sectors.assign(4 * static_cast<size_t>(p->num_buffers), 0);
}

void free_block_resources(Worker* w) {
    if (w->stacks) munmap(w->stacks, w->stacks_len);
    if (w->smem_region) munmap(w->smem_region, w->smem_region_len);
    w->stacks = nullptr;
    w->smem_region = nullptr;
}

bool sem_poll(Worker* w);

bool run_block(Worker* w, unsigned linear) {
    const fa_emu_launch_params* p = w->p;
    w->bidx[0] = linear % p->grid[0];
    w->bidx[1] = (linear / p->grid[0]) % p->grid[1];
    w->bidx[2] = linear / (p->grid[0] * p->grid[1]);
    w->linear = linear;
    w->rng = p->seed * 0x9e3779b97f4a7c15ull + linear + 1;
    splitmix(w->rng);
    // Shared memory starts as NaN/-1 bytes each block: reading what nobody wrote shows.
    if (w->smem_size) std::memset(w->smem, 0xff, w->smem_size);
    std::fill(w->async_img.begin(), w->async_img.end(), static_cast<unsigned char>(0xff));
    std::fill(w->pending.begin(), w->pending.end(), 0);
    std::fill(w->landed_bar.begin(), w->landed_bar.end(), 0);
    std::fill(w->warp_waiting.begin(), w->warp_waiting.end(), 0);
    std::fill(w->warp_exited.begin(), w->warp_exited.end(), 0);
    std::fill(w->runnable.begin(), w->runnable.end(), 0);
    w->nrunnable = 0;
    w->bar_arrived = 0;
    w->exited = 0;
    w->bar_site = nullptr;
    w->aborting = false;
    w->mbars.clear();
    w->bulks.clear();
    w->mbar_waiting = 0;
    w->sem_fibers = 0;
    std::fill(w->wg_arrived.begin(), w->wg_arrived.end(), 0);
    std::fill(w->maxnreg.begin(), w->maxnreg.end(), MaxNReg());
    for (NamedBar& b : w->nbars) {
        b.expected = b.arrived = b.first_tid = 0;
        b.sem_members = b.sem_leaders = 0;
        b.sem_what = nullptr;
        b.lanes.assign(w->nwarps, 0);
        b.warp_kind.assign(w->nwarps, -1);
    }
    for (int t = 0; t < w->nthreads; ++t) {
        Fiber& f = w->fibers[t];
        f.tid = t;
        f.warp = t / 32;
        f.lane = t % 32;
        f.view.thread_idx[0] = t % p->block[0];
        f.view.thread_idx[1] = (t / p->block[0]) % p->block[1];
        f.view.thread_idx[2] = t / (p->block[0] * p->block[1]);
        for (int k = 0; k < 3; ++k) {
            f.view.block_idx[k] = w->bidx[k];
            f.view.block_dim[k] = p->block[k];
            f.view.grid_dim[k] = p->grid[k];
        }
        f.op = OP_NONE;
        f.site_count.clear();
        f.copies.clear();
        f.copies_head = 0;
        f.groups_committed = 0;
        f.tma_stores.clear();
        f.bulk_groups = 0;
        f.wg_parts.clear();
        f.wg_tracked.clear();
        f.wg_groups = 0;
        f.wg_fenced = false;
        f.mbar_seen.clear();
        ctx_make(&f.ctx, f.stack_lo, w->stack_size, &fiber_main, w);
        set_runnable(w, t);
    }
    for (;;) {
        if (!w->bulks.empty() && !bulk_schedule(w)) return false;
        if (w->sem_fibers > 0 && !sem_poll(w)) return false;
        if (w->nrunnable == 0) {
            if (w->bulks.empty()) break;
            continue;
        }
        const int t = pick(w);
        w->runnable[t >> 6] &= ~(uint64_t(1) << (t & 63));
        --w->nrunnable;
        Fiber* f = &w->fibers[t];
        f->state = RUNNING;
        w->cur = f;
        ctx_switch(&w->sched, &f->ctx);
        w->cur = nullptr;
        w->cnt.fiber_switches += 2;
        if (w->aborting) return false;
    }
    if (w->exited != w->nthreads) {
        record_error(w, where(w, nullptr) + ": " + deadlock_desc(w));
        return false;
    }
    mem_flush(w);
    ++w->cnt.blocks;
    return true;
}

// =========================================================================================
// Fault handling
// =========================================================================================
std::mutex g_sig_mu;
int g_sig_users = 0;
const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE};
struct sigaction g_old[3];

extern "C" void fa_emu_fault_trampoline(Worker* w) {
    fiber_fail(w, w->fault_msg);
}

void fault_handler(int sig, siginfo_t* si, void* ucv) {
    Worker* w = tls_worker;
    if (!w || !w->cur) {
        // Not ours: put the previous handler back and let the fault happen again under it.
        for (int i = 0; i < 3; ++i)
            if (kSignals[i] == sig) sigaction(sig, &g_old[i], nullptr);
        return;
    }
    char* a = static_cast<char*>(si->si_addr);
    Fiber* f = w->cur;
    if (sig == SIGFPE) {
        snprintf(w->fault_msg, sizeof w->fault_msg, "arithmetic fault (SIGFPE: integer division by zero or overflow)");
    } else if (w->smem_region && a >= w->smem_region && a < w->smem_region + w->smem_region_len) {
        snprintf(w->fault_msg, sizeof w->fault_msg,
                 "out-of-bounds shared memory access (raw pointer): shared offset %ld (dynamic shared memory is "
                 "%zu bytes)", static_cast<long>(reinterpret_cast<unsigned char*>(a) - w->smem), w->smem_size);
    } else if (a >= f->stack_lo - kGuard && a < f->stack_lo) {
        snprintf(w->fault_msg, sizeof w->fault_msg,
                 "fiber stack overflow (%zu KiB per thread; raise FLASHARRAY_EMULATOR_STACK_KB)",
                 w->stack_size / 1024);
    } else {
        snprintf(w->fault_msg, sizeof w->fault_msg,
                 "invalid memory access at address %p (raw pointer dereference; global memory must go through "
                 "fa::gload/fa::gstore/fa::cp_async, shared memory through FA_DYNAMIC_SMEM)", si->si_addr);
    }
#if defined(__x86_64__)
    ucontext_t* uc = static_cast<ucontext_t*>(ucv);
    uintptr_t top = (reinterpret_cast<uintptr_t>(w->rescue) + kRescueStack) & ~uintptr_t(15);
    uc->uc_mcontext.gregs[REG_RSP] = static_cast<greg_t>(top - 8);  // as if just called
    uc->uc_mcontext.gregs[REG_RIP] = reinterpret_cast<greg_t>(&fa_emu_fault_trampoline);
    uc->uc_mcontext.gregs[REG_RDI] = reinterpret_cast<greg_t>(w);
#else
    (void)ucv;
    for (int i = 0; i < 3; ++i)
        if (kSignals[i] == sig) sigaction(sig, &g_old[i], nullptr);
#endif
}

void install_handlers() {
    std::lock_guard<std::mutex> lock(g_sig_mu);
    if (g_sig_users++ > 0) return;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = &fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &sa, &g_old[i]);
}

void remove_handlers() {
    std::lock_guard<std::mutex> lock(g_sig_mu);
    if (--g_sig_users > 0) return;
    for (int i = 0; i < 3; ++i) sigaction(kSignals[i], &g_old[i], nullptr);
}

// =========================================================================================
// Worker threads and semaphores (state guarded by L->sem_mu; spawn_worker and check_deadlock
// are called with it held)
// =========================================================================================
void worker_main(Launch* L, Worker* w);

// Starts one more worker thread; false (and the launch failed) if the OS refuses.
bool spawn_worker(Launch* L) {
    L->workers.emplace_back(new Worker());
    Worker* w = L->workers.back().get();
    w->L = L;
    w->p = L->p;
    try {
        L->threads.emplace_back(worker_main, L, w);
    } catch (const std::system_error& e) {
        set_error(L, strf("emulator: cannot start a worker thread: %s", e.what()));
        L->sem_cv.notify_all();
        return false;
    }
    ++L->live;
    return true;
}

std::string sem_desc(const Launch* L, const int* sem, int buf) {
    const fa_emu_buffer& B = L->p->buffers[buf];
    const unsigned long off = static_cast<unsigned long>(reinterpret_cast<uint64_t>(sem) - B.lo);
    return strf("argument %d element %lu (byte offset %lu)", B.arg_index, off / sizeof(int), off);
}

// A blocked worker's wait is satisfied: its block-wide counter, or any of its WAIT_SEM leaders' counters.
bool sem_ready(Worker* w) {
    if (!w->sem_group) return __atomic_load_n(w->sem, __ATOMIC_ACQUIRE) >= w->sem_expected;
    for (const Fiber& f : w->fibers)
        if (f.state == WAIT_SEM && __atomic_load_n(f.sem, __ATOMIC_ACQUIRE) >= f.sem_expected) return true;
    return false;
}

// Every live worker waits in fa_emu_sem_wait for a count not reached yet (one that was posted may
// not have woken up yet: it still counts as blocked) and no block is left to start: nothing can
// post any more. Fails the launch naming the waiting block with the lowest linear index.
void check_deadlock(Launch* L) {
    if (L->live == 0 || L->blocked < L->live || L->next.load() < L->nblocks || L->failed.load()) return;
    Worker* first = nullptr;
    for (auto& w : L->workers) {
        if (!w->sem) continue;
        if (sem_ready(w.get())) return;  // about to wake up
        if (!first || w->linear < first->linear) first = w.get();
    }
    const int now = __atomic_load_n(first->sem, __ATOMIC_ACQUIRE);
    const char* what = first->sem_group ? "fa::sem_wait_group" : "fa::sem_wait";
    set_error(L, where(first, &first->fibers[first->sem_tid]) +
                     strf(": deadlock in %s: it waits for %s to equal %d, which is %d; all %d running "
                          "block(s) wait in fa::sem_wait or fa::sem_wait_group and no block is left to start, so no "
                          "post can come", what, sem_desc(L, first->sem, first->sem_buf).c_str(), first->sem_expected,
                          now, L->blocked));
    L->sem_cv.notify_all();
}

// A worker started while another was blocked retires once that one runs again.
bool retire_if_surplus(Launch* L, Worker* w) {
    std::lock_guard<std::mutex> lock(L->sem_mu);
    if (L->live - L->blocked <= L->target) return false;
    --L->live;
    w->retired = true;
    return true;
}

void worker_done(Launch* L, Worker* w) {
    std::lock_guard<std::mutex> lock(L->sem_mu);
    if (!w->retired) --L->live;
    check_deadlock(L);
    L->sem_cv.notify_all();  // fa_emu_launch waits for live == 0
}

// Blocks the calling worker's OS thread (its block stays suspended inside this call) until *sem
// reaches `expected` or the launch fails; returns the value then seen.
int sem_block(Worker* w, const int* sem, int expected) {
    Launch* L = w->L;
    ++w->cnt.sem_blocked;
    std::unique_lock<std::mutex> lock(L->sem_mu);
    w->sem = sem;
    w->sem_expected = expected;
    w->sem_buf = find_buffer(w, reinterpret_cast<uint64_t>(sem), sizeof(int));
    w->sem_tid = 0;
    w->sem_group = false;
    ++L->blocked;
    if (L->live - L->blocked < L->target && L->next.load() < L->nblocks) spawn_worker(L);
    check_deadlock(L);
    int v = 0;
    L->sem_cv.wait(lock, [&] {
        v = __atomic_load_n(sem, __ATOMIC_ACQUIRE);
        return v >= expected || L->failed.load();
    });
    --L->blocked;
    w->sem = nullptr;
    const bool failed = L->failed.load();
    lock.unlock();
    if (failed) fiber_fail(w, "fa::sem_wait abandoned: the launch failed");  // the first error is kept
    return v;
}

// The scheduler's turn for group semaphores (fa::sem_wait_group): leaders whose counter has reached their
// turn run again. When nothing else can run in the block (no runnable fiber, no copy in flight), the worker's
// OS thread blocks as in sem_block until one of them is ready; false if the launch failed meanwhile. So a
// leader's wait suspends only itself: the rest of its block (a producer warpgroup, another group that may
// post the counter) keeps running under the schedule.
bool sem_wake_ready(Worker* w) {
    bool woke = false;
    for (int t = 0; t < w->nthreads; ++t) {
        Fiber& f = w->fibers[t];
        if (f.state != WAIT_SEM || __atomic_load_n(f.sem, __ATOMIC_ACQUIRE) < f.sem_expected) continue;
        --w->sem_fibers;
        set_runnable(w, t);
        woke = true;
    }
    return woke;
}

bool sem_poll(Worker* w) {
    if (sem_wake_ready(w) || w->nrunnable > 0 || !w->bulks.empty()) return true;
    Launch* L = w->L;
    int first = 0;
    while (w->fibers[first].state != WAIT_SEM) ++first;
    std::unique_lock<std::mutex> lock(L->sem_mu);
    w->sem = w->fibers[first].sem;
    w->sem_expected = w->fibers[first].sem_expected;
    w->sem_buf = find_buffer(w, reinterpret_cast<uint64_t>(w->sem), sizeof(int));
    w->sem_tid = first;
    w->sem_group = true;
    ++L->blocked;
    if (L->live - L->blocked < L->target && L->next.load() < L->nblocks) spawn_worker(L);
    check_deadlock(L);
    L->sem_cv.wait(lock, [&] { return sem_ready(w) || L->failed.load(); });
    --L->blocked;
    w->sem = nullptr;
    w->sem_group = false;
    const bool failed = L->failed.load();
    lock.unlock();
    return !failed && sem_wake_ready(w);
}

void worker_main(Launch* L, Worker* w) {
    tls_worker = w;
    stack_t ss, old_ss;
    w->altstack = static_cast<char*>(malloc(kAltStack));
    w->rescue = static_cast<char*>(malloc(kRescueStack));
    ss.ss_sp = w->altstack;
    ss.ss_size = kAltStack;
    ss.ss_flags = 0;
    sigaltstack(&ss, &old_ss);
    alloc_block_resources(w);
    if (!w->stacks || !w->smem_region) {
        record_error(w, "emulator: cannot allocate fiber stacks or shared memory (mmap failed)");
    } else {
        while (!L->failed.load(std::memory_order_relaxed) && !retire_if_surplus(L, w)) {
            const unsigned i = L->next.fetch_add(1);
            if (i >= L->nblocks) break;
            if (!run_block(w, L->order[i])) break;
        }
    }
    free_block_resources(w);
    ss.ss_flags = SS_DISABLE;
    sigaltstack(&ss, nullptr);
    free(w->altstack);
    free(w->rescue);
    tls_worker = nullptr;
    worker_done(L, w);
}

}  // namespace

// =========================================================================================
// C ABI: called from kernels
// =========================================================================================
extern "C" {

const fa_emu_thread_view* fa_emu_self(void) { return &tls_worker->cur->view; }

unsigned char* fa_emu_dynamic_smem(void) { return tls_worker->smem; }

namespace {
// Block rendezvous at `site`; kind/predicate implement __syncthreads_count/_and/_or.
int barrier(void* site, int kind, int predicate) {
    Worker* w = W();
    Fiber* f = w->cur;
    if (w->exited > 0) {
        int t = 0;
        while (w->fibers[t].state != EXITED) ++t;
        fiber_fail(w, strf("__syncthreads() (%s) is reached after %d thread(s) exited (first: thread %d): they never "
                           "reach this barrier (divergent or early-exit barrier)",
                           site_str(site).c_str(), w->exited, t));
    }
    if (!w->nbars.empty() && w->nbars[0].arrived > 0)
        fiber_fail(w, strf("__syncthreads() (%s) while %d thread(s) have arrived at named barrier 0 (its count %d): "
                           "__syncthreads() is barrier 0 too", site_str(site).c_str(), w->nbars[0].arrived,
                           w->nbars[0].expected));
    if (w->bar_arrived == 0) {
        w->bar_site = site;
        w->bar_first_tid = f->tid;
        w->bar_kind = kind;
        w->bar_acc = 0;
    } else if (site != w->bar_site || kind != w->bar_kind) {
        fiber_fail(w, strf("divergent __syncthreads(): this thread waits at %s while thread %d waits at %s",
                           site_str(site).c_str(), w->bar_first_tid, site_str(w->bar_site).c_str()));
    }
    w->bar_acc += predicate ? 1 : 0;
    f->state = WAIT_BAR;
    f->bar_site = site;
    if (++w->bar_arrived == w->nthreads) {
        mem_flush(w);
        // Every thread reads the result before any thread can complete another barrier.
        w->bar_result = kind == FA_EMU_BAR_COUNT ? w->bar_acc
                        : kind == FA_EMU_BAR_AND ? (w->bar_acc == w->nthreads)
                                                 : (w->bar_acc > 0);
        w->bar_arrived = 0;
        ++w->cnt.barriers;
        merge_seen(w->fibers.data(), w->nthreads, [](const Fiber&) { return true; });
        for (int t = 0; t < w->nthreads; ++t) set_runnable(w, t);
    }
    yield(w, f);
    return w->bar_result;
}

void sem_wait_thread0(Worker* w, const int* sem, int expected) {
    gcheck(w, sem, sizeof(int), 0, "fa::sem_wait");
    ++w->cnt.sem_waits;
    int v = __atomic_load_n(sem, __ATOMIC_ACQUIRE);
    if (v < expected) v = sem_block(w, sem, expected);
    if (v > expected) {
        const int b = find_buffer(w, reinterpret_cast<uint64_t>(sem), sizeof(int));
        fiber_fail(w, strf("fa::sem_wait: %s is %d, past the expected %d: a counter only grows, so it can never "
                           "equal it (a block posted twice, or the counter did not start at 0?)",
                           sem_desc(w->L, sem, b).c_str(), v, expected));
    }
}

// add: the count posted; a post of less than 1 is a kernel's error (a counter that does not grow can strand
// its waiters; one that shrinks breaks the "past the expected" check).
void sem_post_add_check(Worker* w, const char* what, int add) {
    if (add < 1) fiber_fail(w, strf("%s: posts %d; a post adds at least 1", what, add));
}

void sem_post_thread0(Worker* w, int* sem, int add) {
    gcheck(w, sem, sizeof(int), 2, "fa::sem_post");
    sem_post_add_check(w, "fa::sem_post", add);
    Launch* L = w->L;
    bool waiters;
    {
        // Under sem_mu: a waiter between its test and its wait cannot miss this increment.
        std::lock_guard<std::mutex> lock(L->sem_mu);
        __atomic_fetch_add(sem, add, __ATOMIC_RELEASE);
        waiters = L->blocked > 0;
    }
    if (waiters) L->sem_cv.notify_all();
}
}  // namespace

__attribute__((noinline)) void fa_emu_syncthreads(void) { barrier(__builtin_return_address(0), FA_EMU_BAR_PLAIN, 0); }

__attribute__((noinline)) int fa_emu_syncthreads_reduce(int kind, int predicate) {
    return barrier(__builtin_return_address(0), kind, predicate);
}

unsigned fa_emu_vote(int kind, unsigned mask, int predicate) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_VOTE;
    f->kind = kind;
    f->mask = mask;
    f->value = predicate ? 1 : 0;
    warp_arrive(w, f);
    return static_cast<unsigned>(f->result);
}

void fa_emu_syncwarp(unsigned mask) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_SYNCWARP;
    f->mask = mask;
    warp_arrive(w, f);
}

uint64_t fa_emu_shfl(int kind, unsigned mask, uint64_t value, int arg, int width) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_SHFL;
    f->kind = kind;
    f->mask = mask;
    f->value = value;
    f->arg = arg;
    f->width = width;
    warp_arrive(w, f);
    return f->result;
}

void fa_emu_mma(int dtype, float* d, const uint32_t* a, const uint32_t* b, const float* c) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_MMA;
    f->kind = dtype;  // names the instruction in error messages
    f->mask = 0xffffffffu;
    f->dtype = dtype;
    f->d = d;
    f->a = a;
    f->b = b;
    f->c = c;
    warp_arrive(w, f);
}

void fa_emu_ldmatrix(int n, int trans, uint32_t* r, const void* smem_row_addr) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_LDMATRIX;
    f->mask = 0xffffffffu;
    f->n = n;
    f->trans = trans;
    f->regs = r;
    f->addr = smem_row_addr;
    warp_arrive(w, f);
}

void fa_emu_stmatrix(int n, int trans, const uint32_t* r, void* smem_row_addr) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_STMATRIX;
    f->mask = 0xffffffffu;
    f->n = n;
    f->trans = trans;
    f->regs = const_cast<uint32_t*>(r);
    f->addr = smem_row_addr;
    warp_arrive(w, f);
}

unsigned fa_emu_elect(unsigned mask) {
    Worker* w = W();
    Fiber* f = w->cur;
    f->op = OP_ELECT;
    f->mask = mask;
    warp_arrive(w, f);
    return static_cast<unsigned>(f->result);
}

void fa_emu_cp_async(void* smem_dst, const void* gmem_src, int cp_size, int src_bytes) {
    Worker* w = W();
    Fiber* f = w->cur;
    unsigned char* dst = static_cast<unsigned char*>(smem_dst);
    if (src_bytes < 0 || src_bytes > cp_size)
        fiber_fail(w, strf("fa::cp_async<%d>: src_bytes %d is outside [0, %d]", cp_size, src_bytes, cp_size));
    if (!in_smem(w, dst, cp_size))
        fiber_fail(w, strf("fa::cp_async<%d>: destination %p is outside shared memory: %s", cp_size, smem_dst,
                           smem_desc(w, dst).c_str()));
    if (reinterpret_cast<uintptr_t>(dst) % cp_size)
        fiber_fail(w, strf("fa::cp_async<%d>: destination is not %d-byte aligned: %s", cp_size, cp_size,
                           smem_desc(w, dst).c_str()));
    if (src_bytes > 0) {
        if (reinterpret_cast<uintptr_t>(gmem_src) % cp_size)
            fiber_fail(w, strf("fa::cp_async<%d>: global source %p is not %d-byte aligned", cp_size, gmem_src,
                               cp_size));
        gcheck(w, gmem_src, static_cast<size_t>(src_bytes), 0, "fa::cp_async global read");
        mem_record(w, __builtin_return_address(0), fa_emu_stats::kGlobalRead, gmem_src, src_bytes);
        // the destination as an offset into the block's dynamic shared memory (lines and slots counted from its base,
        // taken as 128-byte aligned; the Hopper kernels round it up to 1024 bytes themselves)
        mem_record(w, __builtin_return_address(0), fa_emu_stats::kCopy, reinterpret_cast<const void*>(dst - w->smem),
                   src_bytes, gmem_src);
    }
    mem_record(w, __builtin_return_address(0), fa_emu_stats::kSharedWrite, dst, cp_size);
    const size_t g0 = (dst - w->smem) / kGranule;
    for (size_t g = g0; g < g0 + cp_size / kGranule; ++g) ++w->pending[g];
    f->copies.push_back(Copy{dst, static_cast<const unsigned char*>(gmem_src), cp_size, src_bytes, -1});
    ++w->cnt.cp_async;
    w->cnt.cp_async_bytes += cp_size;
}

void fa_emu_cp_async_commit(void) {
    Fiber* f = W()->cur;
    for (size_t k = f->copies_head; k < f->copies.size(); ++k)
        if (f->copies[k].group < 0) f->copies[k].group = f->groups_committed;
    ++f->groups_committed;
}

void fa_emu_cp_async_wait(int n) {
    Worker* w = W();
    Fiber* f = w->cur;
    // Every committed group except the newest n completes now, in issue order.
    const int64_t limit = f->groups_committed - n;
    size_t k = f->copies_head;
    for (; k < f->copies.size(); ++k) {
        Copy& cp = f->copies[k];
        if (cp.group < 0 || cp.group >= limit) break;
        if (cp.src_bytes > 0) std::memcpy(cp.dst, cp.src, cp.src_bytes);
        if (cp.src_bytes < cp.size) std::memset(cp.dst + cp.src_bytes, 0, cp.size - cp.src_bytes);
        const size_t g0 = (cp.dst - w->smem) / kGranule;
        for (size_t g = g0; g < g0 + cp.size / kGranule; ++g) --w->pending[g];
    }
    f->copies_head = k;
    if (f->copies_head == f->copies.size()) {
        f->copies.clear();
        f->copies_head = 0;
    }
}

int fa_emu_cp_async_pending(const void* smem_dst) {
    const Fiber* f = W()->cur;
    for (size_t k = f->copies_head; k < f->copies.size(); ++k)
        if (f->copies[k].dst == smem_dst) return 1;
    return 0;
}

void fa_emu_gcheck(const void* p, size_t size, int is_write) {
    Worker* w = W();
    gcheck(w, p, size, is_write ? 1 : 0, is_write ? "fa::gstore" : "fa::gload");
    mem_record(w, __builtin_return_address(0), is_write ? fa_emu_stats::kGlobalWrite : fa_emu_stats::kGlobalRead,
               p, size);
}

void fa_emu_atomic_add_f32(float* p, float v) {
    Worker* w = W();
    gcheck(w, p, sizeof(float), 2, "fa::atomic_add");
    mem_record(w, __builtin_return_address(0), fa_emu_stats::kGlobalWrite, p, sizeof(float));
    ++w->cnt.atomics;
    uint32_t old = __atomic_load_n(reinterpret_cast<uint32_t*>(p), __ATOMIC_RELAXED), nw;
    do {
        float f;
        std::memcpy(&f, &old, 4);
        f += v;
        std::memcpy(&nw, &f, 4);
    } while (!__atomic_compare_exchange_n(reinterpret_cast<uint32_t*>(p), &old, nw, true, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
}

void fa_emu_atomic_add_f64(double* p, double v) {
    Worker* w = W();
    gcheck(w, p, sizeof(double), 2, "fa::atomic_add");
    mem_record(w, __builtin_return_address(0), fa_emu_stats::kGlobalWrite, p, sizeof(double));
    ++w->cnt.atomics;
    uint64_t old = __atomic_load_n(reinterpret_cast<uint64_t*>(p), __ATOMIC_RELAXED), nw;
    do {
        double f;
        std::memcpy(&f, &old, 8);
        f += v;
        std::memcpy(&nw, &f, 8);
    } while (!__atomic_compare_exchange_n(reinterpret_cast<uint64_t*>(p), &old, nw, true, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
}

__attribute__((noinline)) void fa_emu_sem_wait(const int* sem, int expected) {
    void* site = __builtin_return_address(0);
    Worker* w = W();
    if (w->cur->tid == 0) sem_wait_thread0(w, sem, expected);
    barrier(site, FA_EMU_BAR_PLAIN, 0);
}

__attribute__((noinline)) void fa_emu_sem_post(int* sem, int add) {
    bulk_check_published(W(), "fa::sem_post");
    barrier(__builtin_return_address(0), FA_EMU_BAR_PLAIN, 0);
    Worker* w = W();
    if (w->cur->tid == 0) sem_post_thread0(w, sem, add);
}

void fa_emu_sem_acquire(const int* sem, int expected) { sem_wait_thread0(W(), sem, expected); }

void fa_emu_sem_release(int* sem, int add) {
    bulk_check_published(W(), "fa::sem_release");
    sem_post_thread0(W(), sem, add);
}

// Group semaphores: the leader (the participant whose linear thread index is a multiple of nthreads) polls or
// posts; the named barrier `id` over the nthreads participants orders the rest. The leader's short wait is a
// fiber state (WAIT_SEM, resolved by sem_poll), not a blocked block: the threads outside the group run on.
namespace {
void sem_group_arrive(Worker* w, const char* what, int id, int nthreads, bool leader) {
    NamedBar& b = w->nbars[id];
    if (b.sem_members > 0 && b.sem_what != what)
        fiber_fail(w, strf("%s(id %d, %d threads): %d thread(s) of this barrier phase are at %s: a group passes one "
                           "semaphore operation together", what, id, nthreads, b.sem_members, b.sem_what));
    b.sem_what = what;
    ++b.sem_members;
    b.sem_leaders += leader;
}
}  // namespace

void fa_emu_sem_wait_group(const int* sem, int expected, int id, int nthreads) {
    static const char* const what = "fa::sem_wait_group";
    Worker* w = W();
    Fiber* f = w->cur;
    nbar_check_args(w, what, id, nthreads);
    const bool leader = f->tid % nthreads == 0;
    if (leader) {
        gcheck(w, sem, sizeof(int), 0, what);
        ++w->cnt.sem_waits;
        int v = __atomic_load_n(sem, __ATOMIC_ACQUIRE);
        if (v < expected) {
            ++w->cnt.sem_blocked;
            f->state = WAIT_SEM;
            f->sem = sem;
            f->sem_expected = expected;
            ++w->sem_fibers;
            yield(w, f);
            v = __atomic_load_n(sem, __ATOMIC_ACQUIRE);
        }
        if (v > expected) {
            const int b = find_buffer(w, reinterpret_cast<uint64_t>(sem), sizeof(int));
            fiber_fail(w, strf("%s: %s is %d, past the expected %d: a counter only grows, so it can never equal it "
                               "(a group posted twice, or the counter did not start at 0?)", what,
                               sem_desc(w->L, sem, b).c_str(), v, expected));
        }
    }
    sem_group_arrive(w, what, id, nthreads, leader);
    named_barrier(w, id, nthreads, true);
}

void fa_emu_sem_post_group(int* sem, int id, int nthreads, int add) {
    static const char* const what = "fa::sem_post_group";
    Worker* w = W();
    nbar_check_args(w, what, id, nthreads);
    bulk_check_published(w, what);
    const bool leader = w->cur->tid % nthreads == 0;
    sem_group_arrive(w, what, id, nthreads, leader);
    named_barrier(w, id, nthreads, true);
    if (leader) {
        gcheck(w, sem, sizeof(int), 2, what);
        sem_post_add_check(w, what, add);
        Launch* L = w->L;
        bool waiters;
        {
            std::lock_guard<std::mutex> lock(L->sem_mu);  // as sem_post_thread0: no waiter misses it
            __atomic_fetch_add(sem, add, __ATOMIC_RELEASE);
            waiters = L->blocked > 0;
        }
        if (waiters) L->sem_cv.notify_all();
    }
}

void fa_emu_trap(const char* what) { fiber_fail(W(), what); }

void fa_emu_mbarrier_init(uint64_t* bar, int count) { mbar_init(W(), bar, count); }
void fa_emu_mbarrier_inval(uint64_t* bar) { mbar_inval(W(), bar); }
uint64_t fa_emu_mbarrier_arrive(uint64_t* bar, int tx_bytes, int expect_tx) {
    return mbar_arrive(W(), bar, tx_bytes, expect_tx != 0);
}
void fa_emu_mbarrier_expect_tx(uint64_t* bar, int tx_bytes) { mbar_expect_tx(W(), bar, tx_bytes); }
int fa_emu_mbarrier_try_wait_parity(uint64_t* bar, int parity) { return mbar_try_wait(W(), bar, parity); }
void fa_emu_fence_async(int kind) {
    Worker* w = W();
    mbar_fence(w);
    // fence.proxy.async: what the generic proxy wrote to shared memory so far is visible to the async proxy
    if (kind == 1 && w->smem_size) std::memcpy(w->async_img.data(), w->smem, w->smem_size);
}
void fa_emu_cp_async_bulk_g2s(void* smem_dst, const void* gmem_src, int bytes, uint64_t* bar) {
    bulk_g2s(W(), smem_dst, gmem_src, bytes, bar);
}

void fa_emu_tma_load(void* smem_dst, const void* tmap, int dims, const int* coords, uint64_t* bar) {
    tma_load(W(), smem_dst, tmap, dims, coords, bar);
}
void fa_emu_tma_store(const void* tmap, int dims, const int* coords, const void* smem_src) {
    tma_store(W(), tmap, dims, coords, smem_src);
}
void fa_emu_tma_prefetch(const void* tmap) { tma_decode(W(), tmap, 0, "fa::tma_prefetch"); }
void fa_emu_bulk_commit(void) {
    Fiber* f = W()->cur;
    for (TmaStore& st : f->tma_stores)
        if (st.group < 0) st.group = f->bulk_groups;
    ++f->bulk_groups;
}
void fa_emu_bulk_wait_read(int n) { tma_wait_read(W(), W()->cur, n); }
void fa_emu_bulk_wait(int n) { tma_wait_read(W(), W()->cur, n, true); }
void fa_emu_bulk_reduce_add_f32(float* gmem_dst, const void* smem_src, int bytes) {
    bulk_reduce_add_f32(W(), gmem_dst, smem_src, bytes);
}
void fa_emu_named_barrier(int id, int nthreads, int sync) { named_barrier(W(), id, nthreads, sync != 0); }
void fa_emu_setmaxnreg(int inc, int n) { setmaxnreg(W(), inc != 0, n); }

void fa_emu_wgmma(int dtype, int n, float* d, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, int scale_d,
                  int trans_a, int trans_b) {
    Worker* w = W();
    Fiber* f = w->cur;
    if ((dtype != FA_EMU_F16 && dtype != FA_EMU_BF16 && dtype != FA_EMU_TF32) || n < 8 || n > 256 || n % 8)
        fiber_fail(w, strf("fa::wgmma: unsupported shape m64n%dk%d or element type %d (f16/bf16 k16, tf32 k8, n = "
                           "8..256 in steps of 8)", n, wg_k(dtype), dtype));
    if (a && trans_a) fiber_fail(w, "fa::wgmma (rs): A from registers has no transpose");
    if (dtype == FA_EMU_TF32 && (trans_a || trans_b))
        fiber_fail(w, "fa::wgmma: tf32 operands are K-major only (the instruction has no transpose for .tf32)");
    f->dtype = dtype;
    f->n = n;
    f->d = d;
    f->a = a;
    f->desc_a = desc_a;
    f->desc_b = desc_b;
    f->scale_d = scale_d != 0;
    f->trans_a = trans_a != 0;
    f->trans_b = trans_b != 0;
    wg_arrive(w, f);
}
void fa_emu_wgmma_fence(void) { wg_fence(W(), W()->cur); }
void fa_emu_wgmma_commit(void) {
    Fiber* f = W()->cur;
    for (WgPart& p : f->wg_parts)
        if (p.group < 0) p.group = f->wg_groups;
    ++f->wg_groups;
}
void fa_emu_wgmma_wait(int n) { wg_wait(W(), W()->cur, n); }
uint32_t fa_emu_smem_addr(const void* p) {
    Worker* w = W();
    if (!in_smem(w, p, 1)) fiber_fail(w, "fa::wgmma_desc: the address is outside dynamic shared memory: " + smem_desc(w, p));
    return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - w->smem);
}

// =========================================================================================
// C ABI: launch (Python driver)
// =========================================================================================
int fa_emu_abi_version(void) { return 8; }

int fa_emu_launch(fa_emu_launch_params* p) {
    auto fail = [&](const std::string& msg) {
        if (p->error && p->error_size) snprintf(p->error, p->error_size, "%s", msg.c_str());
        return 1;
    };
    const uint64_t nthreads = uint64_t(p->block[0]) * p->block[1] * p->block[2];
    const uint64_t nblocks = uint64_t(p->grid[0]) * p->grid[1] * p->grid[2];
    if (nthreads == 0 || nthreads > 1024) return fail(strf("block of %lu threads (must be 1..1024)", (unsigned long)nthreads));
    if (p->block[2] > 64) return fail("blockDim.z must be <= 64");
    if (nblocks == 0) return fail("empty grid");
    if (p->grid[1] > 65535 || p->grid[2] > 65535) return fail("gridDim.y and gridDim.z must be <= 65535");
    if (nblocks > 0xffffffffull) return fail("grid too large");
    Launch L;
    L.p = p;
    L.nblocks = static_cast<unsigned>(nblocks);
    L.order.resize(L.nblocks);
    for (unsigned i = 0; i < L.nblocks; ++i) L.order[i] = i;
    if (p->schedule == FA_EMU_SCHED_REVERSE) std::reverse(L.order.begin(), L.order.end());
    if (p->schedule == FA_EMU_SCHED_RANDOM) {
        uint64_t s = p->seed ^ 0x5851f42d4c957f2dull;
        for (unsigned i = L.nblocks; i > 1; --i) std::swap(L.order[i - 1], L.order[splitmix(s) % i]);
    }
    install_handlers();
    {
        std::unique_lock<std::mutex> lock(L.sem_mu);
        L.target = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(p->num_workers, nblocks)));
        for (int i = 0; i < L.target && spawn_worker(&L); ++i) {
        }
        L.sem_cv.wait(lock, [&] { return L.live == 0; });  // no worker is left to start another
    }
    for (auto& t : L.threads) t.join();
    remove_handlers();
    fa_emu_counters total{};
    for (int b = 0; b < p->num_buffers; ++b) p->buffer_read_bytes[b] = p->buffer_write_bytes[b] = 0;
    for (int b = 0; p->buffer_sectors && b < 4 * p->num_buffers; ++b) p->buffer_sectors[b] = 0;
    for (auto& wp : L.workers) {
        const Worker& w = *wp;
        total.global_read_bytes += w.cnt.global_read_bytes;
        total.global_write_bytes += w.cnt.global_write_bytes;
        total.mma += w.cnt.mma;
        total.ldmatrix += w.cnt.ldmatrix;
        total.ldmatrix_wavefronts += w.cnt.ldmatrix_wavefronts;
        total.ldmatrix_wavefronts_ideal += w.cnt.ldmatrix_wavefronts_ideal;
        total.cp_async += w.cnt.cp_async;
        total.cp_async_bytes += w.cnt.cp_async_bytes;
        total.barriers += w.cnt.barriers;
        total.shuffles += w.cnt.shuffles;
        total.syncwarps += w.cnt.syncwarps;
        total.atomics += w.cnt.atomics;
        total.votes += w.cnt.votes;
        total.blocks += w.cnt.blocks;
        total.fiber_switches += w.cnt.fiber_switches;
        total.gld_sectors += w.cnt.gld_sectors;
        total.gld_sectors_ideal += w.cnt.gld_sectors_ideal;
        total.gst_sectors += w.cnt.gst_sectors;
        total.gst_sectors_ideal += w.cnt.gst_sectors_ideal;
        total.cp_async_smem_wavefronts += w.cnt.cp_async_smem_wavefronts;
        total.cp_async_smem_wavefronts_ideal += w.cnt.cp_async_smem_wavefronts_ideal;
        total.sem_waits += w.cnt.sem_waits;
        total.sem_blocked += w.cnt.sem_blocked;
        total.bulk_copies += w.cnt.bulk_copies;
        total.bulk_copy_bytes += w.cnt.bulk_copy_bytes;
        total.mbar_waits += w.cnt.mbar_waits;
        total.mbar_blocked += w.cnt.mbar_blocked;
        total.wgmma += w.cnt.wgmma;
        total.tma_loads += w.cnt.tma_loads;
        total.tma_load_bytes += w.cnt.tma_load_bytes;
        total.tma_stores += w.cnt.tma_stores;
        total.tma_store_bytes += w.cnt.tma_store_bytes;
        total.named_barriers += w.cnt.named_barriers;
        total.stmatrix += w.cnt.stmatrix;
        total.elects += w.cnt.elects;
        total.setmaxnreg += w.cnt.setmaxnreg;
        total.cp_async_lines += w.cnt.cp_async_lines;
        total.cp_async_lines_ideal += w.cnt.cp_async_lines_ideal;
        total.cp_async_sectors += w.cnt.cp_async_sectors;
        total.cp_async_sectors_ideal += w.cnt.cp_async_sectors_ideal;
        total.stmatrix_wavefronts += w.cnt.stmatrix_wavefronts;
        total.stmatrix_wavefronts_ideal += w.cnt.stmatrix_wavefronts_ideal;
        for (int b = 0; b < p->num_buffers && b < static_cast<int>(w.buf_read.size()); ++b) {
            p->buffer_read_bytes[b] += w.buf_read[b];
            p->buffer_write_bytes[b] += w.buf_write[b];
            for (int k = 0; k < 4 && p->buffer_sectors; ++k) p->buffer_sectors[4 * b + k] += w.buf_sectors[4 * b + k];
        }
    }
    if (p->counters) *p->counters = total;
    if (L.failed.load()) return fail(L.error);
    return 0;
}

double fa_emu_measure_switch_ns(int iterations) {
    struct PingPong {
        Context main, fib;
        int left;
    };
    static thread_local PingPong* pp;
    PingPong st;
    st.left = iterations;
    pp = &st;
    const size_t size = 64 * 1024;
    char* stack = static_cast<char*>(malloc(size));
    ctx_make(&st.fib, stack, size, [](void*) {
        for (;;) ctx_switch(&pp->fib, &pp->main);
    }, nullptr);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iterations; ++i) ctx_switch(&st.main, &st.fib);
    const auto t1 = std::chrono::steady_clock::now();
    free(stack);
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / (2.0 * iterations);
}

}  // extern "C"
