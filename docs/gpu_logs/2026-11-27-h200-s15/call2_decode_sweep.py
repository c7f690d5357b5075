"""Decode split-count sweep (fp16, D 128, Lq 1): ms per forward at each num_splits vs FlashAttention-2."""
import math, sys
sys.path.insert(0, "benchmarks")
import numpy as np
import cupy as cp
import gpu, gpu_timing
from flasharray._private import cuda_forward

props = cp.cuda.runtime.getDeviceProperties(0)
clock = gpu_timing.CudaClock()
for B, Hq, Hkv, Lk in ((1, 32, 32, 32768), (1, 32, 32, 8192), (1, 8, 8, 65536), (2, 32, 8, 32768)):
    tensors = gpu.decode_tensors(cp, B, Hq, Hkv, 1, Lk, 128, np.float16)
    copies = [tensors] + [gpu.decode_tensors(cp, B, Hq, Hkv, 1, Lk, 128, np.float16, copy=i)
                          for i in range(1, gpu_timing.copies_for_l2(sum(x.nbytes for x in tensors), props["l2CacheSize"]))]
    fa2 = gpu_timing.time_ms([gpu._make_torch_flash_decode(t, False, "cuda") for t in copies], clock).ms
    auto = gpu.decode_launch(tensors, False, "cuda")
    print("B %d Hq %d Hkv %d Lk %d: FA2 %.4f ms; auto: %s" % (B, Hq, Hkv, Lk, fa2, auto), flush=True)
    for s in (None, 1, 2, 4, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64):
        def make(t, s=s):
            q, k, v = gpu.gqa_views(*t)
            return lambda: cuda_forward.forward(q, k, v, causal=False, scale=1 / math.sqrt(128),
                                                batch_shape=q.shape[:-2], device="cuda", num_splits=s)
        try:
            fns = [make(t) for t in copies]
            rep = gpu.check_decode("flasharray", fns[0](), tensors, False, "cuda")
            ms = gpu_timing.time_ms(fns, clock).ms
            print("  splits %-4s %.4f ms  %.2fx FA2%s" % (s, ms, ms / fa2, "" if rep.passed else "  FAILED"), flush=True)
        except Exception as e:
            print("  splits %-4s %s: %s" % (s, type(e).__name__, str(e)[:100]), flush=True)
