"""CPU decode attention over a paged KV cache, and the routine that appends K/V rows to it.

Called through moe_engine.model.paged_attention, which validates shapes, dtypes and contiguity;
the functions here trust their arguments except for block and slot indices, which are
bounds-checked in a cheap pass before the parallel loop (a bad index would otherwise read or
write outside the cache). The attention itself runs in the ISA build named by the caller's ISA
code (kernels_cy/paged_attention_impl.h, one build per ISA, see moe_isa.h); a code the CPU lacks
is refused.
"""
from libc.stdint cimport int32_t, int64_t, uintptr_t
from libc.string cimport memcpy

from moe_isa cimport MOE_W_BF16, MOE_W_F16, MOE_W_F32, isa_ops, moe_attn_args, moe_isa_ops

DTYPE_F32 = MOE_W_F32
DTYPE_BF16 = MOE_W_BF16
DTYPE_F16 = MOE_W_F16

cdef extern from *:
    """
    #ifndef MOE_HAS_OPENMP
    #define MOE_HAS_OPENMP 0
    #endif
    """
    int MOE_HAS_OPENMP

OPENMP_ENABLED = bool(MOE_HAS_OPENMP)  # False: built without OpenMP, num_threads is ignored


def head_dim_multiple(int isa):
    """head_dim must be a multiple of this (the ISA's fp32 lanes) for the kernel to run."""
    return isa_ops(isa).lanes


def decode_attention(uintptr_t query, uintptr_t out, uintptr_t key_cache, uintptr_t value_cache,
                     uintptr_t block_tables, uintptr_t context_lens, int num_seqs, int n_q_heads,
                     int n_kv_heads, int head_dim, int num_blocks, int block_size,
                     int max_blocks_per_seq, int dtype, float scale, int num_threads, int isa,
                     uintptr_t sinks=0, int window=0):
    """Paged decode attention on raw pointers of contiguous tensors.

    query/out: fp32 [num_seqs, n_q_heads, head_dim]; caches [num_blocks, n_kv_heads, block_size,
    head_dim] in `dtype` (DTYPE_*); block_tables int32 [num_seqs, max_blocks_per_seq];
    context_lens int32 [num_seqs]. sinks: 0, or fp32 [n_q_heads] logits joining each head's
    softmax denominator; window > 0: only the last `window` tokens of a context are attended
    (and only their blocks' ids are read). Releases the GIL; num_threads >= 1 OpenMP threads.
    """
    cdef const moe_isa_ops *ops = isa_ops(isa)
    cdef const int32_t *bt = <const int32_t *>block_tables
    cdef const int32_t *cl = <const int32_t *>context_lens
    cdef int s, b, nb, blk, first, bad = -1, rc
    cdef moe_attn_args args
    if dtype != MOE_W_F32 and dtype != MOE_W_BF16 and dtype != MOE_W_F16:
        raise ValueError(f"unknown storage dtype code {dtype}")
    if head_dim <= 0 or head_dim % ops.lanes != 0 or n_kv_heads <= 0 \
            or n_q_heads % n_kv_heads != 0:
        raise ValueError(f"head_dim must be a multiple of {ops.lanes} on {ops.name.decode()} "
                         "and n_q_heads of n_kv_heads")
    with nogil:
        for s in range(num_seqs):
            nb = (cl[s] + block_size - 1) // block_size
            if cl[s] < 0 or nb > max_blocks_per_seq:
                bad = s
                break
            first = (cl[s] - window) // block_size if window > 0 and cl[s] > window else 0
            for b in range(first, nb):
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
    args.query = <const float *>query
    args.out = <float *>out
    args.key_cache = <const void *>key_cache
    args.value_cache = <const void *>value_cache
    args.block_tables = bt
    args.context_lens = cl
    args.num_seqs = num_seqs
    args.n_q_heads = n_q_heads
    args.n_kv_heads = n_kv_heads
    args.head_dim = head_dim
    args.block_size = block_size
    args.max_blocks_per_seq = max_blocks_per_seq
    args.dtype = dtype
    args.scale = scale
    args.sinks = <const float *>sinks
    args.window = window
    with nogil:
        rc = ops.decode_attention(&args, max(num_threads, 1))
    if rc != 0:
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


def read_sum(uintptr_t data, int64_t n, int num_threads, int isa):
    """Sum of n fp32 values (n a multiple of 2**16) read by num_threads threads in 256 KiB
    pieces with the ISA's vectors: the benchmark's STREAM-like read pass, built with the same
    compiler, flags and OpenMP runtime as the attention kernel so the two are comparable."""
    cdef const moe_isa_ops *ops = isa_ops(isa)
    cdef double total
    if n % (1 << 16) != 0:
        raise ValueError("read_sum: n must be a multiple of 65536")
    with nogil:
        total = ops.read_sum(<const float *>data, n, max(num_threads, 1))
    return total
