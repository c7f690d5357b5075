// flash_kv_append.cu — flash_attention_with_kvcache's append, one launch for every entry (kvcache.py).
//
// Block (t, h, e) copies the new keys' row t of head h of entry e, k_new[e, h, t, :D] and
// v_new[e, h, t, :Dv], into the cache at the entry's logical row r = seqlens[e] + t: contiguous, cache
// entry e, row r; paged (block_table != nullptr), page block_table[e, r / page_size], row
// r % page_size. Block (0, 0, e) also writes lengths[e] = seqlens[e] + L_new, the key count the
// forward reads (so the host never reads seqlens back). Element strides for every dim (the head dim's
// is 1: the caller's arrays have contiguous rows, as the forward needs). The values are not checked
// here: the host checks them first unless the caller opted out (kvcache.py, check_values).
#include "fa_port.cuh"

template <typename T>
__global__ void flash_kv_append_kernel(T* __restrict__ k_cache, long long kc_entry, long long kc_head, long long kc_row,
                                       T* __restrict__ v_cache, long long vc_entry, long long vc_head, long long vc_row,
                                       const T* __restrict__ k_new, long long kn_entry, long long kn_head,
                                       long long kn_row,
                                       const T* __restrict__ v_new, long long vn_entry, long long vn_head,
                                       long long vn_row,
                                       const int* __restrict__ seqlens, int* __restrict__ lengths,
                                       const int* __restrict__ block_table, long long table_row, int page_size,
                                       int L_new, int D, int Dv, int paged) {
    const int t = static_cast<int>(blockIdx.x), h = static_cast<int>(blockIdx.y), e = static_cast<int>(blockIdx.z);
    const int s = fa::gload(seqlens + e);
    if (t == 0 && h == 0 && threadIdx.x == 0) fa::gstore(lengths + e, s + L_new);
    const int r = s + t;  // the entry's logical row
    long long slot = e, row = r;
    if (paged) {
        slot = fa::gload(block_table + (long long)e * table_row + r / page_size);
        row = r % page_size;
    }
    T* kd = k_cache + slot * kc_entry + (long long)h * kc_head + row * kc_row;
    T* vd = v_cache + slot * vc_entry + (long long)h * vc_head + row * vc_row;
    const T* ks = k_new + (long long)e * kn_entry + (long long)h * kn_head + (long long)t * kn_row;
    const T* vs = v_new + (long long)e * vn_entry + (long long)h * vn_head + (long long)t * vn_row;
    for (int i = static_cast<int>(threadIdx.x); i < D; i += static_cast<int>(blockDim.x)) fa::gstore(kd + i, fa::gload(ks + i));
    for (int i = static_cast<int>(threadIdx.x); i < Dv; i += static_cast<int>(blockDim.x)) fa::gstore(vd + i, fa::gload(vs + i));
}
