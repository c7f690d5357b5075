// flash_bwd_ext.cuh — the extensions of docs/extensions.md in the backward's tensor-core kernels.
//
// The forward's pieces are reused as they are: ExtArgs (the FLASH_EXT_PARAMS argument tail),
// Mask<Is_causal, kExt, float> (lengths, window, block mask, softcap, ALiBi: score(), is_visible(),
// the tile ranges) and DropoutRng. What is backward-only lives here:
//   ext_p_ds        one element's P and dS with the score transform, the softcap's 1 − tanh² and
//                   the dropout factor Z = keep / (1 − p); ext_ds_factor: the dQ kernel's P ∘ (1 − tanh²);
//   BwdDropout      the entry's generator (an empty struct without kExtDropout);
//   dropout_bits_t  the keep bits of a 16-key x kW-query strip of the dK/dV kernel (S^T layout:
//                   rows are keys, so the forward's dropout_mma, whose rows are queries, does not
//                   apply): one Philox call per lane per pair of n8 tiles, like the forward;
//   dropout_bits_mma  the same for the dQ kernel's strip (the forward's layout), bits instead of
//                   dropout_mma's float per element;
//   QueryTileWalk   the query tiles the dK/dV kernel visits for one key tile (the key tile is the
//                   outer loop there): window / causal band, seqlens, block-mask skips.
// With kExt = 0 none of it is instantiated: the dense kernels keep their code.
#pragma once
#include "fa_port.cuh"
#include "flash_bwd_common.cuh"
#include "flash_ext.cuh"
#include "flash_fwd_tiles.cuh"  // dropout_mma (the dQ kernel's layout is the forward's), KeyTileWalk
#include "flash_mask.cuh"
#include "flash_softmax.cuh"

namespace fa_bwd {

using flash::ExtArgs;  // FLASH_EXT_ARGS names it unqualified

// The kExt of a Mask type.
template <class M> struct MaskExt;
template <bool C, int E, typename A> struct MaskExt<flash::Mask<C, E, A>> { static constexpr int value = E; };
template <class M> struct MaskExt<const M> : MaskExt<M> {};

// One element (query row, key col) of the backward with extensions: s is the unscaled score q·k and
// dp = dO_i · v_j on entry; on return s = P·Z (the factor of dV_j += (P∘Z)^T dO_i) and dp = dS =
// P ∘ (dP ∘ Z − D_i) ∘ (1 − tanh²). P = exp(score − L_i) with the forward's score (softcap, then
// ALiBi): lse2 = L_i·log2 e (tensor cores: +inf for rows that see no key or lie past Lq_b, so P = 0;
// SIMT: −inf there, tested). z = Z (1 without dropout: folded away).
// The softcap's tanh is Mask::cap's, the forward's (every kernel takes the same precise one), so P
// is recomputed from the very same score on a GPU. in_block: the block mask's entry where the caller looked it up
// once per fragment (mask then its geometry: geometry_of).
template <class M, typename AccT>
__device__ __forceinline__ void ext_p_ds(AccT& s, AccT& dp, AccT lse2, AccT delta, AccT z, AccT scale_log2,
                                         const M& mask, int row, int col, bool in_block = true) {
    const bool on = in_block && mask.is_visible(row, col) && lse2 != flash::neg_inf<AccT>();
    const AccT p = on ? flash::exp2_acc(mask.score(s, row, col) * scale_log2 - lse2) : AccT(0);
    AccT ds = p * (dp * z - delta);
    if constexpr (M::kSoftcap) {
        // d(softcap·tanh(s / softcap)) / ds = 1 − tanh², tanh recomputed from the raw score.
        const AccT th = mask.cap(s) * mask.inv_softcap;
        ds *= AccT(1) - th * th;
    }
    dp = ds;
    s = p * z;
}

// The dQ kernel's factor of dS that depends on the score only, f = P ∘ (1 − tanh²) (P is no operand
// of dQ_i += dS K_j; dS = f ∘ (dP ∘ Z − D_i)): same inputs and P as ext_p_ds, so the dQ kernel can
// finish the score's transform before dP exists. The product is associated differently from
// ext_p_ds's (float rounding only).
// P (returned) and, in s, the factor of dS that depends on the score, f = P ∘ (1 − tanh²) (f = P without
// softcap): the grid-layout dK/dV kernel stores P^T for dV_j and keeps f for dS (no dropout there).
template <class M, typename AccT>
__device__ __forceinline__ AccT ext_p_factor(AccT& s, AccT lse2, AccT scale_log2, const M& mask, int row, int col) {
    const bool on = mask.is_visible(row, col) && lse2 != flash::neg_inf<AccT>();
    const AccT p = on ? flash::exp2_acc(mask.score(s, row, col) * scale_log2 - lse2) : AccT(0);
    AccT f = p;
    if constexpr (M::kSoftcap) {
        const AccT th = mask.cap(s) * mask.inv_softcap;
        f *= AccT(1) - th * th;
    }
    s = f;
    return p;
}

template <class M, typename AccT>
__device__ __forceinline__ AccT ext_ds_factor(AccT s, AccT lse2, AccT scale_log2, const M& mask, int row, int col) {
    AccT f = s;
    (void)ext_p_factor(f, lse2, scale_log2, mask, row, col);
    return f;
}

// The mask without its block mask (the per-element one of kernels that look the block mask up once per fragment:
// ext_pt_dst_sm90, grid_scores): the same members but bm .. div_k.
template <bool C, int E>
__device__ __forceinline__ flash::Mask<C, E & ~flash::kExtBlockMask, float> geometry(const flash::Mask<C, E, float>& m) {
    flash::Mask<C, E & ~flash::kExtBlockMask, float> out(m.Lq, m.Lk);
    out.window_left = m.window_left, out.window_right = m.window_right;
    out.softcap = m.softcap, out.inv_softcap = m.inv_softcap, out.slope = m.slope;
    return out;
}

// The mask less its block mask (geometry), or the mask itself without one (the same code as before it existed).
// (decltype(auto): without one a reference, so `const auto& geo = geometry_of(mask)` leaves the code unchanged.)
template <class M>
__device__ __forceinline__ decltype(auto) geometry_of(const M& mask) {
    if constexpr (M::kBlockMask)
        return geometry(mask);
    else
        return (mask);
}
// x inside the block mask's True blocks, else 0 (a select: a score the row's lse never saw may overflow exp2).
__device__ __forceinline__ float sel_block(bool in_block, float x) { return in_block ? x : 0.0f; }

// Dropout's state of one block: nothing without kExtDropout.
template <bool kOn, typename AccT = float>
struct BwdDropout {
    __device__ __forceinline__ static BwdDropout make(const flash::ExtArgs<AccT>& a, const BatchIndex& b) {
        (void)a; (void)b;
        return {};
    }
};
template <typename AccT>
struct BwdDropout<true, AccT> {
    flash::DropoutRng rng;
    AccT scale;  // 1 / (1 − p)
    __device__ __forceinline__ static BwdDropout make(const flash::ExtArgs<AccT>& a, const BatchIndex& b) {
        return {a.dropout(b), a.dropout_scale};
    }
    // Z of one element (one Philox call: the SIMT kernels).
    __device__ __forceinline__ AccT z(int row, int col) const {
        return flash::dropout_keep(rng, row, col) ? scale : AccT(0);
    }
};

// Keep bits of the dK/dV kernel's strip: keys k_first .. + 15 (rows of S^T, k_first a multiple of
// 16) by queries q_first .. + kW − 1 (columns). keep[nt] bit e: element e of n8 tile nt in the C
// layout (key k_first + g + 8 (e / 2), query q_first + 8 nt + 2t + e % 2). One Philox call covers
// one query and 8 keys; per pair of n8 tiles (16 queries x 2 key octets = 32 calls) lane L makes
// the call of query 16 np + L / 2 and octet L % 2, the even lanes gather both octets' bytes (one
// shuffle), and each lane fetches the four words of its two queries x two tiles (four shuffles).
template <int kW>
__device__ __forceinline__ void dropout_bits_t(uint32_t (&keep)[kW / 8], const flash::DropoutRng& rng, int q_first,
                                               int k_first, int lane) {
    static_assert(kW % 16 == 0, "dropout_bits_t pairs the n8 tiles of the strip");
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int np = 0; np < kW / 16; ++np) {
        const flash::Philox4 r = rng.row8(q_first + 16 * np + (lane >> 1), (k_first >> 3) + (lane & 1));
        uint32_t byte = 0;
#pragma unroll
        for (int c = 0; c < 8; ++c) byte |= static_cast<uint32_t>(rng.keep(r, c)) << c;
        // Even lanes: keys 0-7 of the strip in bits 0-7, keys 8-15 in bits 8-15.
        const uint32_t both = byte | (__shfl_xor_sync(0xffffffffu, byte, 1) << 8);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            uint32_t k = 0;
#pragma unroll
            for (int a = 0; a < 2; ++a) {  // query 2t + a of tile 2 np + s: lane 16 s + 2 (2t + a)
                const uint32_t w = __shfl_sync(0xffffffffu, both, 16 * s + 4 * t + 2 * a);
                k |= ((w >> g) & 1u) << a | ((w >> (g + 8)) & 1u) << (2 + a);
            }
            keep[2 * np + s] = k;
        }
    }
}

// Keep bits of the dQ kernel's strip: queries row0 .. + 15 (rows, the forward's layout) by keys
// n0 .. n0 + 8 kNTiles − 1, as flash::dropout_mma draws them (one Philox call per lane per pair of
// n8 tiles, the quad's bytes gathered by two shuffles) but kept as bits, not as a float Z per
// element: keep[np] bit 8c + h is element 2 (c & 1) + h of n8 tile 2 np + (c >> 1) (keep_bit).
// kNTiles / 2 words instead of 4 kNTiles floats live across the strip's products.
template <int kNTiles>
__device__ __forceinline__ void dropout_bits_mma(uint32_t (&keep)[kNTiles / 2], const flash::DropoutRng& rng,
                                                 int row0, int n0, int lane) {
    static_assert(kNTiles % 2 == 0, "dropout_bits_mma pairs the n8 tiles of the strip");
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int np = 0; np < kNTiles / 2; ++np) {
        const flash::Philox4 r = rng.row8(row0 + g + 8 * (t & 1), (n0 >> 3) + 2 * np + (t >> 1));
        uint32_t byte = 0;
#pragma unroll
        for (int c = 0; c < 8; ++c) byte |= static_cast<uint32_t>(rng.keep(r, c)) << c;
        uint32_t bits = byte << (8 * t);  // byte c of the quad's word: the call of lane c
        bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
        bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
        keep[np] = bits >> (2 * t);  // bit 8c + h: column 2t + h of lane c's call
    }
}
// Whether element e of n8 tile nt (C layout) is kept, from dropout_bits_mma's words.
template <int kWords>
__device__ __forceinline__ bool keep_bit(const uint32_t (&keep)[kWords], int nt, int e) {
    return (keep[nt / 2] >> (8 * (2 * (nt & 1) + e / 2) + e % 2)) & 1u;
}

// The query tiles (height Br) the dK/dV kernel visits for the key tile [n0, n0 + Bc): from the first
// whose rows reach the tile (causal / window right edge) to one past the last (window left edge,
// the entry's Lq), none when the tile starts at or past the entry's Lk; next() skips tiles whose
// block-mask blocks are all False (never loaded).
template <class M>
struct QueryTileWalk {
    const M& mask;
    int n0, Br, Bc;

    __device__ __forceinline__ int end() const {
        if (n0 >= mask.Lk) return 0;
        return mask.m_block_max(flash::imin(n0 + Bc, mask.Lk), Br);
    }
    __device__ __forceinline__ int next(int i, int hi) const {
        ++i;
        if constexpr (M::kBlockMask)
            while (i < hi && !mask.block_any(i * Br, n0, Br, Bc)) ++i;
        return i;
    }
    // Tiles next() visits in [lo, hi) (lo itself visited).
    __device__ __forceinline__ int count(int lo, int hi) const {
        if constexpr (M::kBlockMask) {
            int n = 0;
            for (int i = lo; i < hi; i = next(i, hi)) ++n;
            return n;
        }
        return hi > lo ? hi - lo : 0;
    }
};

// The ordered dQ mode's turn at query tile i (kOrderedDQ): wait until the counter equals `expected`, then
// post `add` (fa::sem_post(counter, add)). Without a block mask: DQOrder::turn with the mask and posts of 1
// (the counter counts the visitors before this one). With one (kExtBlockMask) the visitors of i are the run of
// key blocks reaching it (DQOrder's comment: one contiguous run holding this block, the DQOrder::turn(i) blocks
// of ranks x − turn .. x − 1 before this one, x = DQOrder::rank: the grid's x) less the tiles whose blocks are all
// False, which visit nothing and post nothing; the counter then holds 1 + the rank of the last visitor that
// posted, 0 before the first. The block walks back in rank from its own to its previous visitor prev — past the
// tiles the mask skips, stopping at the run's start —, waits for rank(prev) + 1 (0: none) and posts
// rank(n) − rank(prev), leaving rank(n) + 1. Without holes the walk is one step; no block waits on a tile it
// skips (a counted turn would read the whole run's tiles).
struct DQTurn {
    int expected, add;
};
template <bool kDescending, class M>
__device__ __forceinline__ DQTurn dq_turn(const DQOrder<kDescending>& order, int i, const QueryTileWalk<M>& walk) {
    const int before = order.turn(i, walk.Br, walk.Bc, walk.mask);
    if constexpr (!M::kBlockMask) {
        return DQTurn{before, 1};
    } else {
        const int x = order.rank(order.n);
        int prev = -1;
        for (int y = x - 1; y >= x - before; --y)
            if (walk.mask.block_any(i * walk.Br, order.rank(y) * walk.Bc, walk.Br, walk.Bc)) {
                prev = y;
                break;
            }
        return DQTurn{prev + 1, x - prev};
    }
}

}  // namespace fa_bwd
