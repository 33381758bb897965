"""Benchmark of CPU decode attention (issue 3): the Cython paged kernel against torch.

One run times, on the same shapes and interleaved repeat by repeat (the VM is noisy, so
baseline and candidate must share the same moments):
  kernel  moe_engine.model.paged_attention.paged_decode_attention on a paged cache with shuffled
          block tables, allocated as the engine's (host_alloc.huge_page_zeros: 2 MiB pages where
          the kernel offers them);
  4k      the same kernel on a copy of that cache in ordinary 4 KiB pages (torch's allocator);
  cached  the same kernel and work with every sequence on the first one's blocks, so its K/V
          come from cache: the kernel's compute rate, which caps its share of the read roof
          on this CPU (column c/read, RESULT compute_ceiling);
  sdpa    torch scaled_dot_product_attention(enable_gqa=True) on contiguous K/V;
  bmm     torch batched matmul with the GQA group folded into the query length, contiguous K/V;
  read    a STREAM-like read pass over a buffer larger than the last-level cache.
The torch versions get contiguous K/V, i.e. they skip the block gather a paged cache would
need: the comparison favours them. Each repeat uses another set of blocks (and of torch K/V
copies), so the data touched between two reads of the same byte exceeds the cache.

  .venv/bin/python bench/attention.py                      # full grid, ~3 minutes on 2 cores
  .venv/bin/python bench/attention.py --batch 64 --context 2048 --dtype bf16
  .venv/bin/python bench/attention.py --isa avx2           # force an ISA build (or MOE_BATCH_ISA)
  .venv/bin/python bench/attention.py --mla 512 --q-heads 128 --kv-heads 1 --head-dim 576
      # DeepSeek-V3's latent cache: one 576-dim entry per token (512 latent + 64 rope), whose
      # first 512 dims are the values; the kernel runs as the engine runs it (DecodeAttention)

The header names the CPU, its relevant flags and the ISA build of the kernel that ran; the read
roof is always measured with the widest vectors the CPU has.

The last line is machine-readable, for the target shape (batch 64 x context 2048, bf16):
  RESULT kernel_gbps=<x> read_gbps=<y> bw_fraction=<x/y> vs_sdpa=<kernel speed / sdpa speed>
         vs_4k_pages=<kernel speed / its speed on 4 KiB pages> cached_gbps=<z>
         compute_ceiling=<min(1, z/y): the bw_fraction the kernel's compute allows> isa=<build>
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# moe_engine.model.paged_attention and DecodeAttention, imported in main() once MOE_BATCH_ISA
# is set
kernels = None
DecodeAttention = None
huge_page_zeros = None


def read_gbps(buf: torch.Tensor, threads: int) -> float:
    """One timed read pass over buf (fp32) with the extension's vectorized sum."""
    t0 = time.perf_counter()
    kernels.read_sum(buf, threads)
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


class Case:
    """Inputs for one (dtype, batch, context) shape, with `rotate` disjoint copies of the KV."""

    def __init__(self, dtype, batch, context, n_q, n_kv, d, block_size, rotate, gen,
                 latent_rank=None):
        self.dtype, self.batch, self.context = dtype, batch, context
        self.n_q, self.n_kv, self.d, self.rotate = n_q, n_kv, d, rotate
        # MLA: the values are the first latent_rank dims of the keys, stored once
        self.dv = latent_rank or d
        self.scale = d ** -0.5
        blocks_per_seq = -(-context // block_size)
        used = batch * blocks_per_seq
        # one pool, shuffled, split into `rotate` disjoint sets of block tables
        self.key_cache_4k = torch.randn(rotate * used, n_kv, block_size, d, generator=gen).to(dtype)
        self.value_cache_4k = (self.key_cache_4k if latent_rank else torch.randn(
            rotate * used, n_kv, block_size, d, generator=gen).to(dtype))
        self.key_cache = huge_page_zeros(self.key_cache_4k.shape, dtype).copy_(self.key_cache_4k)
        self.value_cache = (self.key_cache if latent_rank else huge_page_zeros(
            self.value_cache_4k.shape, dtype).copy_(self.value_cache_4k))
        perm = torch.randperm(rotate * used, generator=gen).to(torch.int32)
        self.tables = [perm[r * used:(r + 1) * used].view(batch, blocks_per_seq).contiguous()
                       for r in range(rotate)]
        # every sequence on the first sequence's blocks: the same work, its data in cache after
        # the first sequence (blocks_per_seq x n_kv runs of K and V, 8 MiB at 2048 bf16 tokens
        # of 8 heads), so the kernel's rate there is its compute rate, its ceiling on this CPU
        self.hot_table = self.tables[0][:1].expand(batch, blocks_per_seq).contiguous()
        self.context_lens = torch.full((batch,), context, dtype=torch.int32)
        self.query = torch.randn(batch, n_q, d, generator=gen)
        self.query_t = self.query.to(dtype)
        self.out = torch.empty(batch, n_q, self.dv)
        # contiguous K/V for the torch baselines: [batch, n_kv, context, d]
        self.k_flat, self.v_flat = [], []
        for t in self.tables:
            self.k_flat.append(self._gather(self.key_cache, t))
            self.v_flat.append(self._gather(self.value_cache, t)[..., :self.dv])
        copies = 1 if latent_rank else 2
        self.kv_bytes = copies * batch * n_kv * context * d * self.key_cache.element_size()
        self.latent = (DecodeAttention("cython", head_dim=d, latent_value_dim=latent_rank)
                       if latent_rank else None)

    def _gather(self, cache, table):
        g = cache[table.long()].permute(0, 2, 1, 3, 4).reshape(self.batch, self.n_kv, -1, self.d)
        return g[:, :, :self.context].contiguous()

    def kernel(self, r, threads, small_pages=False):
        key, value = ((self.key_cache_4k, self.value_cache_4k) if small_pages else
                      (self.key_cache, self.value_cache))
        if self.latent is not None:
            self.latent.num_threads = threads
            return self.latent(self.query, key, None, self.tables[r], self.context_lens,
                               self.scale)
        kernels.paged_decode_attention(self.query, key, value, self.tables[r],
                                       self.context_lens, self.scale, out=self.out,
                                       num_threads=threads)
        return self.out

    def kernel_4k(self, r, threads):
        return self.kernel(r, threads, small_pages=True)

    def kernel_cached(self, r, threads):
        if self.latent is not None:
            self.latent.num_threads = threads
            return self.latent(self.query, self.key_cache, None, self.hot_table,
                               self.context_lens, self.scale)
        kernels.paged_decode_attention(self.query, self.key_cache, self.value_cache,
                                       self.hot_table, self.context_lens, self.scale,
                                       out=self.out, num_threads=threads)
        return self.out

    def sdpa(self, r, threads):
        q = self.query_t.unsqueeze(2)  # [batch, n_q, 1, d]
        return F.scaled_dot_product_attention(q, self.k_flat[r], self.v_flat[r], scale=self.scale,
                                              enable_gqa=True).squeeze(2)

    def bmm(self, r, threads):
        g = self.n_q // self.n_kv
        q = self.query_t.view(self.batch, self.n_kv, g, self.d)
        s = torch.matmul(q, self.k_flat[r].transpose(-1, -2)).float() * self.scale
        p = torch.softmax(s, dim=-1).to(self.dtype)
        return torch.matmul(p, self.v_flat[r]).view(self.batch, self.n_q, self.dv)


def run_case(case: Case, threads: int, repeats: int, stream_buf: torch.Tensor) -> dict:
    methods = {"kernel": case.kernel, "4k": case.kernel_4k, "cached": case.kernel_cached,
               "sdpa": case.sdpa, "bmm": case.bmm}
    ref = case.bmm(0, threads).float()
    for name, fn in methods.items():  # warm-up, and a sanity check that they agree
        if name == "cached":  # other blocks than bmm's: a warm-up only, nothing to compare
            fn(0, threads)
            continue
        err = (fn(0, threads).float() - ref).abs().max().item()
        tol = 2e-2 if case.dtype != torch.float32 else 1e-3
        if not err < tol:
            raise SystemExit(f"{name} disagrees with bmm by {err} on {case.dtype} "
                             f"{case.batch}x{case.context}")
    times = {name: [] for name in methods}
    reads = []
    for i in range(repeats):
        reads.append(read_gbps(stream_buf, threads))
        for name, fn in methods.items():
            r = (i + 1) % case.rotate
            t0 = time.perf_counter()
            fn(r, threads)
            times[name].append(time.perf_counter() - t0)
    # best of the repeats (the STREAM convention): on a shared VM the slow outliers measure the
    # neighbours, not the code
    row = {"read": max(reads)}
    for name, ts in times.items():
        t = min(ts)
        row[name] = {"s": t, "gbps": case.kv_bytes / t / 1e9,
                     "tok_s": case.batch * case.context / t}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mla", type=int, metavar="RANK",
                    help="a latent (MLA) cache: values are the first RANK dims of the keys")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rotate", type=int, default=3,
                    help="disjoint KV copies cycled through, so repeats do not hit in cache")
    ap.add_argument("--stream-mib", type=int, default=2048,
                    help="read-bandwidth buffer (must exceed the last-level cache)")
    ap.add_argument("--target", default="64x2048:bf16", help="BATCHxCONTEXT:DTYPE for RESULT")
    ap.add_argument("--isa", choices=["generic", "avx2", "avxvnni", "avx512", "avx512vnni", "avx512bf16",
                                      "amx"],
                    help="run this ISA build of the kernel (sets MOE_BATCH_ISA; default: CPUID)")
    args = ap.parse_args()
    if args.isa:
        os.environ["MOE_BATCH_ISA"] = args.isa  # the build is chosen once, at import
    global kernels, DecodeAttention, huge_page_zeros
    kernels = importlib.import_module("moe_engine.model.paged_attention")
    from moe_engine.host_alloc import huge_page_zeros
    from moe_engine.model.attention import DecodeAttention
    from moe_engine.tools.machine_info import header

    if not kernels.HAS_CYTHON_KERNELS:
        raise SystemExit("the Cython kernel is not built: python setup.py build_ext --inplace")
    torch.set_num_threads(args.threads)
    path = DecodeAttention("cython", head_dim=args.head_dim).describe()
    print(header(args.threads))
    print(f"# attention path: {path}"
          + (" (forced by MOE_BATCH_ISA)" if os.environ.get("MOE_BATCH_ISA") else " (CPUID)")
          + f", openmp={kernels.HAS_OPENMP}")
    print(f"# q_heads={args.q_heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
          f"block_size={args.block_size} mla_rank={args.mla} "
          f"repeats={args.repeats} (best of, interleaved) "
          f"rotate={args.rotate} "
          f"stream={args.stream_mib} MiB")
    stream_buf = torch.ones(args.stream_mib * (1 << 20) // 4)
    if args.threads > 1:
        # a shared VM may not deliver all its vCPUs: if N threads read no faster than one, the
        # N-thread figures below measure the host, not the code
        one = max(read_gbps(stream_buf, 1) for _ in range(3))
        many = max(read_gbps(stream_buf, args.threads) for _ in range(3))
        print(f"# read bandwidth: 1 thread {one:.1f} GB/s, {args.threads} threads {many:.1f} GB/s"
              + ("  WARNING: threads do not scale, cores are contended" if many < 1.3 * one else ""))
    gen = torch.Generator().manual_seed(0)
    header = (f"{'dtype':5} {'batch':>5} {'ctx':>5} | {'read':>6} | {'kernel':>6} {'4k':>6} "
              f"{'cached':>6} {'sdpa':>6} {'bmm':>6} GB/s | {'kernel':>7} {'sdpa':>7} {'bmm':>7} "
              f"Mtok/s | {'k/read':>6} {'c/read':>6} {'k/4k':>6} {'k/sdpa':>6} {'k/bmm':>6}")
    print(header)
    print("-" * len(header))
    results = {}
    for dname in args.dtype:
        for batch in args.batch:
            for ctx in args.context:
                case = Case(DTYPES[dname], batch, ctx, args.q_heads, args.kv_heads, args.head_dim,
                            args.block_size, args.rotate, gen, latent_rank=args.mla)
                row = run_case(case, args.threads, args.repeats, stream_buf)
                del case
                results[(batch, ctx, dname)] = row
                k, k4, c, s, b = (row[n] for n in ("kernel", "4k", "cached", "sdpa", "bmm"))
                print(f"{dname:5} {batch:5d} {ctx:5d} | {row['read']:6.1f} | {k['gbps']:6.1f} "
                      f"{k4['gbps']:6.1f} {c['gbps']:6.1f} {s['gbps']:6.1f} {b['gbps']:6.1f}      | "
                      f"{k['tok_s'] / 1e6:7.2f} {s['tok_s'] / 1e6:7.2f} {b['tok_s'] / 1e6:7.2f}"
                      f"        | {k['gbps'] / row['read']:6.2f} {c['gbps'] / row['read']:6.2f} "
                      f"{k4['s'] / k['s']:6.2f} {s['s'] / k['s']:6.2f} {b['s'] / k['s']:6.2f}",
                      flush=True)
    shape, dname = args.target.split(":")
    batch, ctx = (int(x) for x in shape.split("x"))
    row = results.get((batch, ctx, dname))
    if row is None:
        raise SystemExit(f"target {args.target} was not in the grid")
    k, c = row["kernel"], row["cached"]
    print(f"RESULT kernel_gbps={k['gbps']:.2f} read_gbps={row['read']:.2f} "
          f"bw_fraction={k['gbps'] / row['read']:.3f} vs_sdpa={row['sdpa']['s'] / k['s']:.2f} "
          f"vs_4k_pages={row['4k']['s'] / k['s']:.3f} cached_gbps={c['gbps']:.2f} "
          f"compute_ceiling={min(1.0, c['gbps'] / row['read']):.3f} isa={kernels.ISA}")


if __name__ == "__main__":
    main()
