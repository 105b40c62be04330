#!/usr/bin/env python3
"""The operations transformers' PagedAttentionCache.update performs for a full-attention layer
(generation/continuous_batching/cache.py at a597f974), timed on the workloads of kvc_bench_paged's
update benchmarks: a decode batch of 32 requests with 512 cached tokens each (block sizes 16, 64,
256) and a small one of 4 requests with 128 tokens (block size 16); 8 KV heads x head_dim 128,
float32, on the CPU. Per step: the new K and V rows scattered into the pool with index_copy_, then
every read row gathered with index_select (K and V), on pools laid out as transformers lays them
out ([(num_blocks + 2) * block_size, heads, head_dim]).

    /usr/bin/python3 benchmarks/paged_torch_baseline.py [block_size ...]   (Debian: apt install python3-torch)

Prints the median step time (ms) per block size, and kvc's figure to compare with comes from
`build/benchmarks/kvc_bench_paged --benchmark_filter=update` run right after (docs/paged.md).
"""
import statistics
import sys
import time

import torch


def step_times(block_size, requests=32, past=512, heads=8, dim=128, steps=40):
    torch.set_num_threads(1)  # the same single thread kvc's update runs on
    blocks_per_request = (past + 1 + block_size - 1) // block_size
    num_blocks = requests * (blocks_per_request + 1)
    rows = (num_blocks + 2) * block_size
    key_cache = torch.zeros(rows, heads, dim)
    value_cache = torch.zeros(rows, heads, dim)
    # Requests' blocks one after the other, as a fresh BlockManager hands them out.
    read, write = [], []
    for r in range(requests):
        first = r * blocks_per_request
        table = list(range(first, first + blocks_per_request))
        read += [table[p // block_size] * block_size + p % block_size for p in range(past + 1)]
        write.append(table[past // block_size] * block_size + past % block_size)
    read_index = torch.tensor(read, dtype=torch.int64)
    write_index = torch.tensor(write, dtype=torch.int64)
    k = torch.ones(requests, heads, dim)
    v = torch.full((requests, heads, dim), 2.0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        key_cache.index_copy_(0, write_index, k)
        value_cache.index_copy_(0, write_index, v)
        k_out = key_cache.index_select(0, read_index)
        v_out = value_cache.index_select(0, read_index)
        times.append(time.perf_counter() - start)
        del k_out, v_out
    return statistics.median(times)


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [16, 64, 256]
    print(f"torch {torch.__version__}, 1 thread")
    for bs in sizes:
        print(f"transformers' update, 32 requests x 512 tokens, block size {bs}: "
              f"{step_times(bs) * 1e3:.3f} ms per step (median)")
    small = step_times(16, requests=4, past=128, steps=400)
    print(f"transformers' update, 4 requests x 128 tokens, block size 16: {small * 1e3:.3f} ms per step (median)")


if __name__ == "__main__":
    main()
