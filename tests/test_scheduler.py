"""Scheduler (MoE-Lens 6.2): decode first, preempt newest, prefill budget, KV admission."""
from moe_engine.engine.block_manager import BlockAllocator, WindowPool
from moe_engine.engine.request import SamplingParams
from moe_engine.engine.scheduler import Scheduler
from moe_engine.engine.sequence import Sequence


def _seq(n, rid="r"):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=100), 0, 10_000)


def _run(step):
    """What the engine does after a step: K/V cached, one token appended."""
    for s in step.sequences:
        s.num_cached_tokens = s.num_tokens
        s.token_ids.append(7)


def test_prefill_admission_respects_token_budget_and_max_seqs():
    sched = Scheduler(BlockAllocator(100, 4), max_num_seqs=3, max_prefill_tokens=20)
    seqs = [_seq(8, str(i)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert {s.request_id for s in step.sequences} == {"0", "1"}  # 8 + 8 <= 20 < 24
    assert step.num_prefill_tokens == 16
    _run(step)
    step = sched.schedule()
    # Both decode, and one more prefill fits under max_num_seqs=3.
    assert step.num_decode_tokens == 2 and step.num_prefill_tokens == 8
    assert len(sched.running) == 3


def test_oversized_prompt_runs_alone_when_nothing_else_runs():
    sched = Scheduler(BlockAllocator(100, 4), max_num_seqs=8, max_prefill_tokens=10)
    sched.add(_seq(30))
    step = sched.schedule()
    assert step.num_prefill_tokens == 30


def test_admission_stops_at_kv_capacity():
    alloc = BlockAllocator(5, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_prefill_tokens=1000)
    for i in range(4):
        sched.add(_seq(8, str(i)))  # 2 blocks each
    step = sched.schedule()
    assert len(step.sequences) == 2 and alloc.num_free == 1
    assert len(sched.waiting) == 2


def test_newest_sequence_is_preempted_when_blocks_run_out_and_requeued_first():
    alloc = BlockAllocator(4, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_prefill_tokens=1000, watermark=0.0)
    old, new = _seq(4, "old"), _seq(4, "new")
    sched.add(old)
    sched.add(new)
    _run(sched.schedule())  # both prefilled: 1 block each
    for _ in range(4):  # fill both blocks' tails: 5..8 tokens need 2 blocks each
        step = sched.schedule()
        _run(step)
    assert alloc.num_free == 0 and sched.num_preemptions == 0
    step = sched.schedule()  # both need a 3rd block; only by preempting `new` can `old` go on
    assert [s.request_id for s in step.sequences] == ["old"]
    assert step.preempted == [new] and sched.num_preemptions == 1
    assert new.block_table == [] and new.is_prefill and sched.waiting[0] is new
    assert step.num_prefill_tokens == 0  # no admissions in a preempting step


def test_finish_returns_blocks():
    alloc = BlockAllocator(10, 4)
    sched = Scheduler(alloc, max_num_seqs=8, max_prefill_tokens=100)
    s = _seq(9)
    sched.add(s)
    sched.schedule()
    assert alloc.num_free == 7
    sched.finish(s)
    assert alloc.num_free == 10 and not sched.has_unfinished()


def test_step_is_split_into_balanced_micro_batches_with_prefills_first():
    sched = Scheduler(BlockAllocator(1000, 4), max_num_seqs=64, max_prefill_tokens=10_000,
                      num_micro_batches=2)
    lengths = [50, 40, 30, 20, 10, 5]
    for i, n in enumerate(lengths):
        sched.add(_seq(n, str(i)))
    step = sched.schedule()
    _run(step)
    sched.add(_seq(12, "late"))
    step = sched.schedule()
    assert len(step.micro_batches) == 2
    sums = [sum(s.num_tokens for s in mb) for mb in step.micro_batches]
    assert abs(sums[0] - sums[1]) <= max(lengths) + 1
    for mb in step.micro_batches:
        kinds = [s.is_prefill for s in mb]
        assert kinds == sorted(kinds, reverse=True)


def test_oversized_prompt_is_admitted_beside_running_decodes():
    sched = Scheduler(BlockAllocator(100, 4), max_num_seqs=8, max_prefill_tokens=10)
    sched.add(_seq(5, "small"))
    _run(sched.schedule())
    sched.add(_seq(30, "big"))
    sched.add(_seq(3, "after"))
    step = sched.schedule()
    assert step.num_decode_tokens == 1 and step.num_prefill_tokens == 30
    assert [s.request_id for s in sched.waiting] == ["after"]


def _scoring_seq(n, rid):
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_new_tokens=1), 0, 10_000)


def test_prefill_only_prompts_fill_the_token_budget_whatever_max_num_seqs():
    """Scoring rows (max_new_tokens=1) end at their prefill token, so N=1 must not make a pass
    of one prompt (issue #13, item 11): the pass holds as many as the token budget takes."""
    sched = Scheduler(BlockAllocator(1000, 4), max_num_seqs=1, max_prefill_tokens=100)
    for i in range(30):
        sched.add(_scoring_seq(9, str(i)))
    step = sched.schedule()
    assert len(step.sequences) == 11 and step.num_prefill_tokens == 99  # 11 * 9 <= 100 < 108


def test_a_decoding_prompt_still_takes_the_one_slot_beside_scoring_prompts():
    sched = Scheduler(BlockAllocator(1000, 4), max_num_seqs=1, max_prefill_tokens=100)
    for rid, seq in [("a", _scoring_seq(5, "a")), ("b", _seq(5, "b")), ("c", _scoring_seq(5, "c")),
                     ("d", _seq(5, "d")), ("e", _scoring_seq(5, "e"))]:
        sched.add(seq)
    step = sched.schedule()
    # "d" would be a second decoding sequence with N=1: admission stops at it, in order.
    assert sorted(s.request_id for s in step.sequences) == ["a", "b", "c"]
    assert [s.request_id for s in sched.waiting] == ["d", "e"]


def test_window_pool_frees_blocks_that_left_the_window_and_bounds_admission():
    """Sliding-window layers (GPT-OSS) keep a sequence's last `window` positions only: blocks
    before them return to the pool as the sequence grows, table entries -1; a prompt whose
    window does not fit in the pool waits, as for the full layers' blocks."""
    window = WindowPool(BlockAllocator(6, 4), window=8)
    sched = Scheduler(BlockAllocator(100, 4), max_num_seqs=4, max_prefill_tokens=1000,
                      window_pool=window)
    a = _seq(10, "a")
    sched.add(a)
    sched.schedule()
    # 10 prompt tokens: positions 2..9 are the window, blocks 0..2; block 0 holds 2 and 3.
    assert len(a.block_table) == 3 and [b >= 0 for b in a.window_table] == [True] * 3
    for _ in range(6):  # 16 tokens: window 8..15, blocks 2 and 3 only
        a.num_cached_tokens = a.num_tokens
        a.token_ids.append(1)
        sched.schedule()
    assert a.num_tokens == 16 and [b >= 0 for b in a.window_table] == [False, False, True, True]
    assert window.allocator.num_used == 2 and len(a.block_table) == 4
    b, c = _seq(9, "b"), _seq(9, "c")
    sched.add(b)
    sched.add(c)
    sched.schedule()  # b takes 3 window blocks, c does not fit (1 left)
    assert b.window_table and not c.window_table and window.allocator.num_used == 5
    sched.finish(a)
    assert window.allocator.num_used == 3 and not a.window_table
