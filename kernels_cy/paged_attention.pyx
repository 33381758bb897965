"""CPU decode attention over a paged KV cache, and the routine that appends K/V rows to it.

Called through moe_engine.kernels, which validates shapes, dtypes and contiguity; the functions
here trust their arguments except for block and slot indices, which are bounds-checked in a
cheap pass before the parallel loop (a bad index would otherwise read or write outside the cache).

Cache layout (one layer): [num_blocks, n_kv_heads, block_size, head_dim]. A task handles one
(sequence, KV head) and all query heads of its GQA group, so it streams, per block, one
contiguous run of block_size*head_dim elements of K and one of V, each read exactly once.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from libc.math cimport INFINITY

cdef extern from "paged_attention_simd.h" nogil:
    int MOE_DT_F32
    int MOE_DT_BF16
    int MOE_DT_F16
    int MOE_LANES
    int moe_tile_heads(int remaining)
    int moe_bf16_order(int i, int d)
    double moe_read_sum(const float *p, int64_t n)
    void moe_attend_chunk(int dtype, int tile, const float *q, const void *k, const void *v,
                          int ntok, int d, float *m, float *l, float *acc, const char *pfk,
                          const char *pfv, int pf_bytes)

DTYPE_F32 = MOE_DT_F32
DTYPE_BF16 = MOE_DT_BF16
DTYPE_F16 = MOE_DT_F16
HEAD_DIM_MULTIPLE = MOE_LANES

cdef extern from *:
    """
    #ifndef MOE_HAS_OPENMP
    #define MOE_HAS_OPENMP 0
    #endif
    """
    int MOE_HAS_OPENMP

OPENMP_ENABLED = bool(MOE_HAS_OPENMP)  # False: built without OpenMP, num_threads is ignored


cdef inline int _esize(int dtype) noexcept nogil:
    return 4 if dtype == MOE_DT_F32 else 2


cdef void _attend_task(const float *q, float *out, const char *kcache, const char *vcache,
                       const int32_t *table, int ctx, int block_size, int n_kv, int kv_head,
                       int group, int d, int dtype, float scale,
                       float *qs, float *acc, float *m, float *l) noexcept nogil:
    """One (sequence, KV head): q and out are [group, d] fp32; the rest is per-thread scratch."""
    cdef int i, g, b, j0, ntok, tile, pos
    cdef float inv
    cdef int esize = _esize(dtype)
    cdef int64_t run = <int64_t>block_size * d * esize  # bytes of one (block, KV head) run
    cdef int nblocks = (ctx + block_size - 1) // block_size
    cdef const char *kb
    cdef const char *vb
    cdef const char *pfk
    cdef const char *pfv
    cdef int64_t nxt
    # chunks of up to 16 tokens per block; each prefetches its share of the next block
    cdef int nchunks = (block_size + MOE_LANES - 1) // MOE_LANES
    cdef int pf_share = <int>((run + nchunks - 1) // nchunks)
    cdef int pf_bytes
    # q and acc live in the storage's lane order (a permutation within groups of 32 for bf16,
    # see moe_load2_bf16), so the loads of K and V need no shuffles.
    for g in range(group):
        for i in range(d):
            pos = moe_bf16_order(i, d) if dtype == MOE_DT_BF16 else i
            qs[g * d + pos] = q[g * d + i] * scale
            acc[g * d + i] = 0.0
    for g in range(group):
        m[g] = -INFINITY
    for i in range(group * MOE_LANES):
        l[i] = 0.0
    for b in range(nblocks):
        kb = kcache + (<int64_t>table[b] * n_kv + kv_head) * run
        vb = vcache + (<int64_t>table[b] * n_kv + kv_head) * run
        # Blocks are scattered, so the hardware prefetcher restarts at every block; fetching the
        # next block during this one overlaps its DRAM latency with this block's arithmetic.
        nxt = (<int64_t>table[b + 1] * n_kv + kv_head) * run if b + 1 < nblocks else 0
        ntok = ctx - b * block_size
        if ntok > block_size:
            ntok = block_size
        j0 = 0
        while j0 < ntok:
            pfk = kcache + nxt + (j0 // MOE_LANES) * pf_share
            pfv = vcache + nxt + (j0 // MOE_LANES) * pf_share
            pf_bytes = 0
            if b + 1 < nblocks:
                pf_bytes = <int>min(<int64_t>pf_share, run - (j0 // MOE_LANES) * pf_share)
            g = 0
            while g < group:
                tile = moe_tile_heads(group - g)
                moe_attend_chunk(dtype, tile, qs + g * d,
                                 kb + <int64_t>j0 * d * esize, vb + <int64_t>j0 * d * esize,
                                 min(MOE_LANES, ntok - j0), d, m + g, l + g * MOE_LANES,
                                 acc + g * d, pfk, pfv, pf_bytes)
                pf_bytes = 0  # the first tile of the group prefetches for all
                g = g + tile
            j0 = j0 + MOE_LANES
    for g in range(group):
        inv = 0.0
        for i in range(MOE_LANES):
            inv = inv + l[g * MOE_LANES + i]
        # ctx == 0 leaves l == 0: the output is defined as zeros (no keys, nothing to attend to)
        inv = 1.0 / inv if inv > 0.0 else 0.0
        for i in range(d):
            pos = moe_bf16_order(i, d) if dtype == MOE_DT_BF16 else i
            out[g * d + i] = acc[g * d + pos] * inv


def decode_attention(uintptr_t query, uintptr_t out, uintptr_t key_cache, uintptr_t value_cache,
                     uintptr_t block_tables, uintptr_t context_lens, int num_seqs, int n_q_heads,
                     int n_kv_heads, int head_dim, int num_blocks, int block_size,
                     int max_blocks_per_seq, int dtype, float scale, int num_threads):
    """Paged decode attention on raw pointers of contiguous tensors.

    query/out: fp32 [num_seqs, n_q_heads, head_dim]; caches [num_blocks, n_kv_heads, block_size,
    head_dim] in `dtype` (DTYPE_*); block_tables int32 [num_seqs, max_blocks_per_seq];
    context_lens int32 [num_seqs]. Releases the GIL; num_threads >= 1 OpenMP threads.
    """
    cdef const float *q = <const float *>query
    cdef float *o = <float *>out
    cdef const char *kc = <const char *>key_cache
    cdef const char *vc = <const char *>value_cache
    cdef const int32_t *bt = <const int32_t *>block_tables
    cdef const int32_t *cl = <const int32_t *>context_lens
    cdef int group = n_q_heads // n_kv_heads
    cdef int ntasks = num_seqs * n_kv_heads
    cdef int task, s, h, b, nb, blk, bad = -1
    cdef int alloc_failed = 0
    cdef int *alloc_failed_p = &alloc_failed  # written through a pointer: shared, not private
    cdef float *scratch = NULL
    cdef int scratch_floats = 2 * group * head_dim + group + group * MOE_LANES
    if dtype != MOE_DT_F32 and dtype != MOE_DT_BF16 and dtype != MOE_DT_F16:
        raise ValueError(f"unknown storage dtype code {dtype}")
    if head_dim % MOE_LANES != 0 or n_q_heads % n_kv_heads != 0:
        raise ValueError("head_dim must be a multiple of 16 and n_q_heads of n_kv_heads")
    with nogil:
        for s in range(num_seqs):
            nb = (cl[s] + block_size - 1) // block_size
            if cl[s] < 0 or nb > max_blocks_per_seq:
                bad = s
                break
            for b in range(nb):
                blk = bt[<int64_t>s * max_blocks_per_seq + b]
                if blk < 0 or blk >= num_blocks:
                    bad = s
                    break
            if bad >= 0:
                break
    if bad >= 0:
        raise ValueError(f"sequence {bad}: context length {cl[bad]} or one of its block ids is "
                         f"out of range (num_blocks={num_blocks}, block_size={block_size}, "
                         f"max_blocks_per_seq={max_blocks_per_seq})")
    if num_threads < 1:
        num_threads = 1
    with nogil, parallel(num_threads=num_threads):
        # per-thread scratch: qs [group*d], acc [group*d], m [group], l [group*16]
        scratch = <float *>malloc(scratch_floats * sizeof(float))
        if scratch != NULL:
            # Dynamic scheduling: context lengths differ, so equal task counts are unequal work.
            for task in prange(ntasks, schedule="dynamic", chunksize=1):
                s = task // n_kv_heads
                h = task - s * n_kv_heads
                _attend_task(q + (<int64_t>s * n_q_heads + h * group) * head_dim,
                             o + (<int64_t>s * n_q_heads + h * group) * head_dim,
                             kc, vc, bt + <int64_t>s * max_blocks_per_seq, cl[s], block_size,
                             n_kv_heads, h, group, head_dim, dtype, scale,
                             scratch, scratch + group * head_dim,
                             scratch + 2 * group * head_dim, scratch + 2 * group * head_dim + group)
            free(scratch)
        else:
            alloc_failed_p[0] = 1
    if alloc_failed:
        raise MemoryError("decode_attention: per-thread scratch allocation failed")


def write_kv(uintptr_t key_cache, uintptr_t value_cache, uintptr_t key, uintptr_t value,
             uintptr_t slot_mapping, int num_tokens, int n_kv_heads, int head_dim,
             int num_blocks, int block_size, int elem_size):
    """Copy rows key/value [num_tokens, n_kv_heads, head_dim] (already in the cache dtype) to
    their slots (block * block_size + offset) of caches [num_blocks, n_kv_heads, block_size,
    head_dim]. Negative slots are padding and skipped. Single-threaded: one decode step writes
    a few hundred rows, less than a thread team costs to start."""
    cdef char *kc = <char *>key_cache
    cdef char *vc = <char *>value_cache
    cdef const char *ks = <const char *>key
    cdef const char *vs = <const char *>value
    cdef const int64_t *slots = <const int64_t *>slot_mapping
    cdef int64_t row = <int64_t>head_dim * elem_size
    cdef int64_t nslots = <int64_t>num_blocks * block_size
    cdef int64_t slot, dst, src
    cdef int t, h, bad = -1
    with nogil:
        for t in range(num_tokens):
            if slots[t] >= nslots:
                bad = t
                break
    if bad >= 0:
        raise ValueError(f"slot_mapping[{bad}] = {slots[bad]} is outside the cache "
                         f"({num_blocks} blocks x {block_size} slots)")
    with nogil:
        for t in range(num_tokens):
            slot = slots[t]
            if slot < 0:
                continue
            for h in range(n_kv_heads):
                dst = ((slot // block_size * n_kv_heads + h) * block_size + slot % block_size) * row
                src = (<int64_t>t * n_kv_heads + h) * row
                memcpy(kc + dst, ks + src, row)
                memcpy(vc + dst, vs + src, row)


def read_sum(uintptr_t data, int64_t n, int num_threads):
    """Sum of n fp32 values (n a multiple of 2**16) read by num_threads threads in 256 KiB
    pieces: the benchmark's STREAM-like read pass, built with the same compiler, flags and
    OpenMP runtime as the attention kernel so the two are comparable."""
    cdef const float *p = <const float *>data
    cdef int64_t piece = 1 << 16
    cdef int64_t i, npieces = n // piece
    cdef double total = 0.0
    if n % piece != 0:
        raise ValueError("read_sum: n must be a multiple of 65536")
    with nogil:
        for i in prange(npieces, schedule="static", num_threads=max(num_threads, 1)):
            total += moe_read_sum(p + i * piece, piece)
    return total
