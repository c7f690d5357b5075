// fa_emu_memstats.h — memory efficiency of warp-wide accesses on the emulator.
//
// The hardware serves a warp's memory instruction as a whole: a global access costs one
// transaction per 32-byte sector any lane touches, a shared-memory access one wavefront per
// conflict-free pass over the 32 four-byte banks. The emulator's fa:: wrappers are per-thread
// calls, so the runtime first regroups them into warp instructions: the k-th call a thread makes
// from one call site (since the block's last barrier) belongs to the warp's k-th execution of that
// instruction. Groups are evaluated at every __syncthreads() and at the end of the block, when every
// lane has issued its share. (Divergent lanes that execute a site a different number of times are
// regrouped by occurrence; a model, exact for the convergent loops the kernels use.)
//
//   global sectors      distinct 32-byte sectors touched by the group; ideal: ceil(unique bytes / 32)
//   shared wavefronts   per phase (32 lanes for ≤ 4-byte accesses, 16 for 8-byte, 8 for 16-byte),
//                       the largest number of distinct words any bank holds; ideal:
//                       ceil(unique bytes / 128), i.e. one wavefront per 128 bytes
//
// cp.async copies (kind kCopy: each lane's shared destination with its global source) have two more
// costs, a model of what Nsight Compute measured on an H100 (docs/gpu_h200.md, "Fourth GPU session";
// LDGSTS, 16-byte chunks, two 256-byte rows per warp instruction). Rows padded to 272 bytes took
// 24 global sectors and ~8.5 shared wavefronts per instruction. Unpadded 256-byte rows took 16 and 3.8.
// FlashAttention-2's XOR-swizzled rows took 16 and 4.0. The model gives 24 / 7.5, 16 / 4 and 16 / 4:
//   copy lines          per phase, the distinct 128-byte shared-memory lines the destinations touch;
//                       ideal: ceil(unique destination bytes / 128)
//   copy sectors        the distinct pairs (32-byte global sector, 32-byte shared-memory slot) the copied
//                       bytes form: a sector whose bytes land in two slots is requested twice; ideal:
//                       ceil(unique source bytes / 32)
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace fa_emu_stats {

enum Kind : uint32_t { kGlobalRead = 0, kGlobalWrite = 1, kSharedWrite = 2, kCopy = 3 };

struct Access {
    uint64_t addr;
    uint32_t size;
    uint32_t lane;
    uint64_t src = 0;  // kCopy: the global source of the size bytes at addr (shared)
};

struct Key {
    uint64_t site;
    uint32_t occurrence;
    uint32_t warp_kind;  // warp << 2 | kind
    bool operator==(const Key& o) const {
        return site == o.site && occurrence == o.occurrence && warp_kind == o.warp_kind;
    }
};

struct KeyHash {
    size_t operator()(const Key& k) const {
        uint64_t h = k.site * 0x9e3779b97f4a7c15ull ^ (uint64_t(k.occurrence) << 20) ^ k.warp_kind;
        h ^= h >> 29;
        return static_cast<size_t>(h * 0xbf58476d1ce4e5b9ull);
    }
};

struct Cost {
    uint64_t actual = 0, ideal = 0;
    uint64_t actual2 = 0, ideal2 = 0;  // kCopy: copy sectors (actual, ideal: copy lines)
};

// Byte ranges of the group merged: the bytes actually requested (a repeated address is a broadcast).
inline std::vector<std::pair<uint64_t, uint64_t>> merged_ranges(std::vector<Access>& acc) {
    std::sort(acc.begin(), acc.end(), [](const Access& a, const Access& b) { return a.addr < b.addr; });
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const Access& a : acc) {
        const uint64_t lo = a.addr, hi = a.addr + a.size;
        if (!out.empty() && lo <= out.back().second) out.back().second = std::max(out.back().second, hi);
        else out.emplace_back(lo, hi);
    }
    return out;
}

inline Cost global_sectors(std::vector<Access>& acc) {
    Cost c;
    uint64_t unique = 0, last = ~uint64_t(0);
    for (const auto& r : merged_ranges(acc)) {
        unique += r.second - r.first;
        for (uint64_t s = r.first >> 5; s <= (r.second - 1) >> 5; ++s) {
            if (s != last) ++c.actual;
            last = s;
        }
    }
    c.ideal = (unique + 31) / 32;
    return c;
}

inline Cost shared_wavefronts(std::vector<Access>& acc) {
    Cost c;
    uint32_t size = 0;
    for (const Access& a : acc) size = std::max(size, a.size);
    const uint32_t lanes_per_phase = size >= 16 ? 8 : size == 8 ? 16 : 32;
    for (uint32_t phase = 0; phase < 32 / lanes_per_phase; ++phase) {
        std::vector<uint64_t> words;
        for (const Access& a : acc)
            if (a.lane / lanes_per_phase == phase)
                for (uint64_t w = a.addr / 4; w <= (a.addr + a.size - 1) / 4; ++w) words.push_back(w);
        if (words.empty()) continue;
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        uint32_t per_bank[32] = {0};
        uint32_t worst = 0;
        for (uint64_t w : words) worst = std::max(worst, ++per_bank[w % 32]);
        c.actual += worst;
    }
    uint64_t unique = 0;
    for (const auto& r : merged_ranges(acc)) unique += r.second - r.first;
    c.ideal = (unique + 127) / 128;
    return c;
}

// kCopy: copy lines (actual, ideal) and copy sectors (actual2, ideal2), the header's model.
inline Cost copy_costs(std::vector<Access>& acc) {
    Cost c;
    uint32_t size = 0;
    for (const Access& a : acc) size = std::max(size, a.size);
    const uint32_t lanes_per_phase = size > 8 ? 8 : size > 4 ? 16 : 32;
    for (uint32_t phase = 0; phase < 32 / lanes_per_phase; ++phase) {
        std::vector<uint64_t> lines;
        for (const Access& a : acc)
            if (a.lane / lanes_per_phase == phase)
                for (uint64_t l = a.addr / 128; l <= (a.addr + a.size - 1) / 128; ++l) lines.push_back(l);
        std::sort(lines.begin(), lines.end());
        c.actual += std::unique(lines.begin(), lines.end()) - lines.begin();
    }
    std::vector<std::pair<uint64_t, uint64_t>> pairs;  // (global sector, shared slot) of every copied byte run
    for (const Access& a : acc)
        for (uint32_t b = 0; b < a.size;) {
            const uint64_t g = a.src + b, d = a.addr + b;
            const uint32_t run = static_cast<uint32_t>(std::min<uint64_t>({32 - g % 32, 32 - d % 32, a.size - b}));
            pairs.emplace_back(g / 32, d / 32);
            b += run;
        }
    std::sort(pairs.begin(), pairs.end());
    c.actual2 = std::unique(pairs.begin(), pairs.end()) - pairs.begin();
    std::vector<Access> dst(acc), src(acc);
    for (Access& a : src) a.addr = a.src;
    uint64_t unique_dst = 0, unique_src = 0;
    for (const auto& r : merged_ranges(dst)) unique_dst += r.second - r.first;
    for (const auto& r : merged_ranges(src)) unique_src += r.second - r.first;
    c.ideal = (unique_dst + 127) / 128;
    c.ideal2 = (unique_src + 31) / 32;
    return c;
}

// The accesses of one block since its last barrier, grouped into warp instructions.
class Recorder {
  public:
    void record(uint64_t site, uint32_t occurrence, int warp, int lane, Kind kind, uint64_t addr, uint32_t size,
                uint64_t src = 0) {
        Key key{site, occurrence, static_cast<uint32_t>(warp) << 2 | kind};
        groups_[key].push_back(Access{addr, size, static_cast<uint32_t>(lane), src});
    }

    // Evaluates and clears every group; visit(kind, first address, cost) receives each one.
    template <class Visit>
    void flush(Visit&& visit) {
        for (auto& kv : groups_) {
            const Kind kind = static_cast<Kind>(kv.first.warp_kind & 3u);
            const uint64_t first = kv.second.front().addr;
            const Cost cost = kind == kCopy          ? copy_costs(kv.second)
                              : kind == kSharedWrite ? shared_wavefronts(kv.second)
                                                     : global_sectors(kv.second);
            visit(kind, first, cost);
        }
        groups_.clear();
    }

  private:
    std::unordered_map<Key, std::vector<Access>, KeyHash> groups_;
};

}  // namespace fa_emu_stats
