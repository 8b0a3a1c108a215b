"""How fast host memory gets page-locked: PyTorch's pinned allocation under an allocator setting.

    python benchmarks/pin_probe.py GIB                 # cudaHostAlloc, PyTorch's default
    PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:16 \\
        python benchmarks/pin_probe.py GIB             # malloc, pages touched by 16 threads, cudaHostRegister

Prints one JSON line: the setting, the seconds to allocate GIB GiB pinned, and a device-to-host copy's GB/s into
it (the memory is as fast either way). twinflow's offload buffer is made the second way
(twinflow.optim.offload_states.host_buffer): results/pin_probe_h100.txt.
"""

import json
import os
import sys
import time

import torch

n = int(float(sys.argv[1]) * 2**30)
torch.cuda.init()
t = time.perf_counter()
b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
t1 = time.perf_counter() - t
g = torch.empty(n, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
b.copy_(g, non_blocking=True)
torch.cuda.synchronize()
c = time.perf_counter() - t
print(json.dumps({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "gib": n / 2**30, "alloc_s": t1,
                  "copy_GBps": n / c / 1e9, "pinned": b.is_pinned()}))  # fmt: skip
