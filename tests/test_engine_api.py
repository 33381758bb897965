"""Engine API: rejections, stop conditions, chat templates, stats, result order, sampling rules."""
from __future__ import annotations

import pytest
import torch

import moe_engine
from moe_engine.config import EngineConfig
from moe_engine.engine.llm_engine import LLMEngine
from moe_engine.engine.request import Request, RequestResult, SamplingParams
from moe_engine.engine.sampling import SamplingBatch, sample, uniform_from


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir):
    return LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=0.02), dtype="float32")


def _greedy(engine, prompt, n=16, **kw):
    [r] = engine.generate([Request("x", prompt=prompt,
                                   sampling=SamplingParams(max_new_tokens=n, **kw))])
    assert r.status == "ok", r
    return r


def test_package_exports_are_lazy():
    assert moe_engine.LLMEngine is LLMEngine
    assert moe_engine.SamplingParams is SamplingParams and moe_engine.RequestResult is RequestResult
    with pytest.raises(AttributeError):
        moe_engine.NoSuchThing


def test_bad_requests_are_rejected_and_the_rest_of_the_batch_runs(engine):
    too_long = [5] * (engine.max_model_len + 3)
    requests = [
        Request("good1", prompt="Tell me about experts."),
        Request("empty", prompt=""),
        Request("empty-ids", prompt_token_ids=[]),
        Request("too-long", prompt_token_ids=too_long),
        Request("temp", prompt="hi", sampling=SamplingParams(temperature=-1.0)),
        Request("top-p", prompt="hi", sampling=SamplingParams(top_p=0.0)),
        Request("top-k", prompt="hi", sampling=SamplingParams(top_k=-2)),
        Request("max-new", prompt="hi", sampling=SamplingParams(max_new_tokens=0)),
        Request("nan", prompt="hi", sampling=SamplingParams(temperature=float("nan"))),
        Request("two-sources", prompt="hi", prompt_token_ids=[1, 2]),
        Request("no-source"),
        Request("vocab", prompt_token_ids=[1, engine.spec.vocab_size + 5]),
        Request("bad-chat", messages=[{"role": "wizard", "content": "hi"}]),
        Request("good2", prompt_token_ids=[1, 20, 30, 40]),
    ]
    results = {r.request_id: r for r in engine.generate(requests)}
    assert set(results) == {r.request_id for r in requests}
    for rid, r in results.items():
        if rid.startswith("good"):
            assert r.status == "ok" and r.completion_tokens > 0 and r.error is None
        else:
            assert r.status == "rejected" and r.error and r.token_ids == [], rid
            assert r.finish_reason is None
    assert "context limit" in results["too-long"].error
    assert results["too-long"].prompt_tokens == len(too_long)
    assert engine.stats.rejected == len(requests) - 2 and engine.stats.requests == len(requests)


def test_prompt_over_the_kv_cache_is_rejected(tiny_mixtral_dir):
    small = LLMEngine(tiny_mixtral_dir, EngineConfig(threads=2, kv_cache_gb=1e-5, block_size=4),
                      dtype="float32")
    capacity = small.allocator.num_blocks * 4
    [r] = small.generate([Request("big", prompt_token_ids=[7] * (capacity + 1))])
    assert r.status == "rejected" and "KV cache" in r.error


def test_max_new_tokens_finishes_with_length(engine):
    r = _greedy(engine, "Count to ten.", n=7, ignore_eos=True)
    assert r.finish_reason == "length" and r.completion_tokens == len(r.token_ids) == 7
    assert r.prompt_tokens == len(r.prompt_token_ids) and r.text == engine.tokenizer.decode(r.token_ids)


def test_eos_stops_unless_ignored(engine):
    base = _greedy(engine, "Name a color.", n=12, ignore_eos=True)
    eos = base.token_ids[4]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        first = base.token_ids.index(eos)
        stopped = _greedy(engine, "Name a color.", n=12)
        assert stopped.finish_reason == "stop" and stopped.token_ids == base.token_ids[:first + 1]
        ignored = _greedy(engine, "Name a color.", n=12, ignore_eos=True)
        assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"
    finally:
        engine.eos_token_ids = saved


def test_stop_string_cuts_text_and_finishes_early(engine):
    base = _greedy(engine, "Write a poem about the sea.", n=24, ignore_eos=True)
    words = [w for w in base.text.split() if w.isascii() and w.isalpha() and len(w) >= 3]
    assert words, base.text
    stop = words[len(words) // 2]
    r = _greedy(engine, "Write a poem about the sea.", n=24, ignore_eos=True, stop=(stop,))
    assert r.finish_reason == "stop"
    assert r.text == base.text[:base.text.find(stop)]
    assert r.token_ids == base.token_ids[:len(r.token_ids)] and len(r.token_ids) <= 24


def test_chat_messages_go_through_the_chat_template(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    [r] = engine.generate([Request("chat", messages=messages,
                                   sampling=SamplingParams(max_new_tokens=4))])
    assert r.status == "ok"
    assert r.prompt_token_ids == engine.tokenizer.encode_messages(messages)
    assert r.prompt_token_ids != engine.tokenizer.encode_prompt("Be brief. Hi!")


def test_results_come_in_completion_order_with_consistent_stats(engine):
    lengths = [3, 20, 8, 1, 12]
    requests = [Request(f"r{n}", prompt="Tell me a story about a robot.",
                        sampling=SamplingParams(max_new_tokens=n, ignore_eos=True)) for n in lengths]
    results = list(engine.generate(requests))
    assert [r.completion_tokens for r in results] == sorted(lengths)
    s = engine.stats
    assert s.decode_tokens == sum(lengths)
    assert s.prefill_tokens == len(lengths) * results[0].prompt_tokens
    assert s.steps == max(lengths) and s.preemptions == 0
    assert 0 < s.kv_blocks_high_water <= s.kv_blocks_total
    assert s.wall_time_s > 0 and s.e2e_tok_s > 0 and s.prefill_tok_s > 0 and s.decode_tok_s > 0
    assert s.attention_time_s > 0 and s.ffn_time_s > 0
    assert s.prefill_time_s + s.decode_time_s <= s.wall_time_s
    times = [t for t, _ in s.timeline]
    tokens = [n for _, n in s.timeline]
    assert times == sorted(times) and tokens == sorted(tokens) and tokens[-1] == sum(lengths)
    d = s.to_dict()
    assert d["steps"] == s.steps and "timeline" in d and "e2e_tok_s" in d


def test_timeline_length_is_capped():
    from moe_engine.engine.stats import EngineStats

    s = EngineStats(max_timeline_points=16)
    for step in range(1000):
        s.steps = step
        s.decode_tokens = step
        s.record_step(float(step))
    s.close_timeline(1000.0)
    assert len(s.timeline) <= 16 and s.timeline[-1] == (1000.0, 999)


def test_sampling_follows_top_k_and_top_p():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0]]).repeat(2000, 1)
    n = logits.shape[0]

    def batch(temperature, top_p, top_k):
        return SamplingBatch(temperature=torch.full((n,), temperature),
                             top_p=torch.full((n,), top_p), top_k=torch.full((n,), top_k),
                             seeds=torch.arange(n), positions=torch.full((n,), 3))

    assert set(sample(logits, batch(1.0, 1.0, 2)).tolist()) == {0, 1}
    assert set(sample(logits, batch(1.0, 1e-3, 0)).tolist()) == {0}
    assert set(sample(logits, batch(0.0, 1.0, 0)).tolist()) == {0}  # greedy
    # Unrestricted sampling follows the softmax: token 0 has probability ~0.66.
    freq = (sample(logits, batch(1.0, 1.0, 0)) == 0).float().mean().item()
    assert abs(freq - torch.softmax(logits[0], 0)[0].item()) < 0.05


def test_uniforms_depend_only_on_seed_and_position():
    a = uniform_from(torch.tensor([1, 2, 3]), torch.tensor([10, 10, 10]))
    b = uniform_from(torch.tensor([3, 1]), torch.tensor([10, 10]))
    assert a[0] == b[1] and a[2] == b[0]
    assert len(set(a.tolist())) == 3 and ((a >= 0) & (a < 1)).all()


def test_sampling_params_validate():
    assert SamplingParams().validate() is None
    assert SamplingParams(top_k=5, top_p=0.5, temperature=0.7, seed=3, stop=("x",)).validate() is None
    assert SamplingParams(stop="abc").validate()  # a bare string is a likely caller bug
    assert SamplingParams(seed=-1).validate()


class _FixedLogitsRunner:
    """Prefers token 7 for every sequence; counts the steps it served."""

    def __init__(self, vocab: int):
        from moe_engine.engine.model_runner import PhaseTimes

        self.vocab, self.times, self.steps = vocab, PhaseTimes(), 0

    def forward(self, micro_batches):
        self.steps += 1
        n = sum(int(mb.logits_indices.numel()) for mb in micro_batches)
        logits = torch.zeros(n, self.vocab)
        logits[:, 7] = 1.0
        return logits


def test_engine_loop_runs_around_any_runner_without_a_checkpoint():
    runner = _FixedLogitsRunner(vocab=32)
    engine = LLMEngine.around(runner, EngineConfig(block_size=4, max_num_seqs=4), num_blocks=16,
                              vocab_size=32, max_model_len=64, eos_token_ids=frozenset({9}))
    reqs = [Request(f"r{i}", prompt_token_ids=[1, 2, 3 + i],
                    sampling=SamplingParams(max_new_tokens=5)) for i in range(3)]
    reqs.append(Request("bad", prompt_token_ids=[1, 40]))
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert results["bad"].status == "rejected" and "out of range" in results["bad"].error
    assert all(results[f"r{i}"].token_ids == [7] * 5 for i in range(3))
    assert all(results[f"r{i}"].finish_reason == "length" for i in range(3))
    assert runner.steps == engine.stats.steps == 5


def test_host_overhead_is_measured_on_the_engine_loop(monkeypatch):
    from moe_engine.tools.profile_hardware import measure_host_overhead

    steps = []
    real_step = LLMEngine._step

    def counted(self, start):
        steps.append(self)
        return real_step(self, start)

    monkeypatch.setattr(LLMEngine, "_step", counted)
    figures = measure_host_overhead(vocab_size=50, prompt=8, batches=(1, 4), steps=3, repeats=1)
    assert set(figures) == {"host_step_s", "host_seq_s", "host_token_s"}
    assert all(v >= 0 for v in figures.values())
    assert len(steps) == 2 * (1 + 3 + 1)  # per batch size: prefill, the timed steps, the last
