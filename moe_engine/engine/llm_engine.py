"""LLMEngine: requests in, results out, in completion order.

The loop is: top up the waiting queue from the request iterator (rejecting bad requests at once),
schedule a step, build the packed micro-batch inputs, run the model, sample, and retire finished
sequences immediately so their KV blocks serve the next admissions.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Optional

import torch

from moe_engine.config import (DeviceKind, DType, EngineConfig, ExpertDType, GemmImpl,
                               MatmulPrecision)
from moe_engine.engine.block_manager import BlockAllocator, WindowPool
from moe_engine.engine.calibrate import find_or_record_routing, record_bundled_routing
from moe_engine.engine.memory import rss_bytes
from moe_engine.engine.model_runner import ModelRunner
from moe_engine.engine.request import Request, RequestResult, stable_seed
from moe_engine.engine.sampling import sample
from moe_engine.engine.scheduler import ScheduledStep, Scheduler
from moe_engine.engine.sequence import Sequence
from moe_engine.engine.stats import EngineStats
from moe_engine.engine.step_inputs import micro_batch_input, sampling_batch
from moe_engine.engine.tokenizer import load_tokenizer
from moe_engine.cpu_features import bf16_tiles
from moe_engine.host_alloc import tune_host_allocator
from moe_engine.model.attention import DecodeAttention
from moe_engine.model.kv_cache import KVCache, kv_pool_blocks
from moe_engine.model import packed
from moe_engine.model.loader import load_weights, resolve_dtype
from moe_engine.model.spec import EXPERT_STORAGE_BITS, load_spec, precision_storage
from moe_engine.offload.disk import DiskReadError
from moe_engine.offload.build import build_offload_pipeline, expert_source, offload_settings
from moe_engine.offload.routing import find_profile
from moe_engine.offload.pipeline import OffloadPipeline, OffloadStats
from moe_engine.offload.trace import Trace

log = logging.getLogger(__name__)

LogitsObserver = Callable[[list[Sequence], torch.Tensor], None]


class LLMEngine:
    """Offline batch generation for a HF MoE checkpoint.

    A fully resident CPU run uses the plain runner; otherwise (CUDA, r_w < 1, an emulated link,
    or engine.offload_pipeline) construction goes on in two more steps: the routing profile is
    found or calibrated on the plain runner (engine/calibrate.py), then the offload pipeline is
    built around that runner and serves the steps. Call `close` (or use the engine as a context
    manager) to stop its worker threads; a closed engine serves no more.
    """

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig = EngineConfig(),
                 dtype: str = "auto", trace: Optional[Trace] = None):
        threads = config.threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        self.spec = load_spec(model_dir)
        self.dtype = resolve_dtype(dtype, self.spec)  # the weights' storage
        self.gemm = _gemm_impl(config)
        act_dtype = torch.float32 if self.gemm == "packed" else self.dtype
        kv = DType(config.kv_dtype)
        kv_dtype = self.dtype if kv is DType.auto else resolve_dtype(kv.value, self.spec)
        tokenizer = load_tokenizer(model_dir)
        max_model_len = min(self.spec.max_position_embeddings, tokenizer.model_max_length)
        settings = offload_settings(config)
        disk_tier = settings is not None and settings.disk_tier
        # With the disk tier the experts are not loaded here: the host tier is read from disk
        # when the pager is built, the rest on demand.
        rss_before = rss_bytes()
        weights = load_weights(model_dir, self.spec, self.dtype, experts=not disk_tier,
                               keep_quantized=self.gemm == "packed")
        self.expert_storage: Optional[str] = None
        self.weight_storage: Optional[str] = None  # the packed projections' storage
        if self.gemm == "packed":
            precision = MatmulPrecision(config.matmul_precision).value
            storage = packed.storage_name(self.dtype)
            experts = ExpertDType(config.expert_dtype)
            tiles = bf16_tiles()  # as the policy stage prices it
            self.expert_storage = precision_storage(
                (self.spec.expert_storage or storage) if experts is ExpertDType.auto
                else experts.value, precision, tiles)
            self.weight_storage = precision_storage(storage, precision, tiles)
            held = ({self.weight_storage, self.expert_storage}
                    & {*packed.PAIR_STORAGES, packed.QUAD_STORAGE})
            if precision == "high" and not tiles and storage == "bf16":
                log.info("engine.matmul_precision=high runs as highest here: no AMX tiles (or "
                         "MOE_BATCH_ISA=%s), where bf16x3's three products a weight would be "
                         "emulated at 0.2-0.3x highest's speed; the precision is the same",
                         os.environ.get("MOE_BATCH_ISA", "unset"))
            elif precision != "highest" and not held:
                log.warning("engine.matmul_precision=%s changes nothing here: weights %s, "
                            "experts %s (medium applies to bf16 and fp32 weights and int8 "
                            "experts, high to bf16)",
                            precision, self.weight_storage, self.expert_storage)
            # each held storage the build emulates says so (medium can hold bf16 pairs and
            # int8 quads at once, and a build can lack either instruction)
            if packed.PAIR_STORAGE in held and packed.ISA not in packed.NATIVE_BF16_ISAS:
                log.warning("engine.matmul_precision=medium on the %s kernel build, which has "
                            "no vdpbf16ps: the bf16 products run as fp32 FMAs (the same "
                            "results, no faster than highest)", packed.ISA)
            if packed.QUAD_STORAGE in held and packed.ISA not in packed.NATIVE_INT8_DOT_ISAS:
                log.warning("engine.matmul_precision=medium on int8 experts on the %s kernel "
                            "build, which has no vpdpbusd (AVX512-VNNI or AVX-VNNI): the int8 "
                            "products run as vpmaddwd (the same results, no faster than "
                            "highest)", packed.ISA)
            if packed.BF16X3_STORAGE in held and packed.ISA not in packed.TILE_ISAS:
                log.warning("engine.matmul_precision=high: the CPU has AMX tiles but the %s "
                            "kernel build runs (built without them, or the OS refused the "
                            "tile state): bf16x3's three bf16 products a weight are emulated "
                            "(vdpbf16ps or fp32 FMAs), 0.2-0.3x highest's speed for the same "
                            "precision (use highest here)", packed.ISA)
            weights = packed.pack_model(weights, self.weight_storage, self.expert_storage)
        elif self.spec.expert_storage is not None:
            log.warning("%s experts widened to %s in memory: torch's GEMMs (engine.gemm=torch or "
                        "a device backend) have no %s path; the packed CPU kernels run them as "
                        "stored", self.spec.expert_storage, self.dtype, self.spec.expert_storage)
        # The spec describes what is held (the performance model and the pager size experts
        # by it): quantized experts at their storage's bits, widened ones at the dtype.
        held = self.expert_storage if self.expert_storage in EXPERT_STORAGE_BITS else None
        self.spec = self.spec.with_expert_storage(held)
        self.weights_bytes = weights.nbytes()
        # What loading cost in RSS (packing leaves allocator slack the tensors do not show):
        # the disk tier sizes its ring against this, not against the tensors' bytes.
        rss_after = rss_bytes()
        loaded_rss = (rss_after - rss_before) if None not in (rss_before, rss_after) else 0
        self.loaded_bytes = max(self.weights_bytes, loaded_rss)
        # From here on the steps' activations reuse freed heap pages (host_alloc: ~10% of a
        # small model's step time went to faulting them in again); loading kept the defaults.
        self.host_allocator = tune_host_allocator()
        num_blocks, window_blocks = kv_pool_blocks(self.spec, kv_dtype, config.kv_cache_gb,
                                                   config.block_size, config.max_num_seqs)
        cache = KVCache.allocate(self.spec, num_blocks, config.block_size, kv_dtype,
                                 window_blocks)
        runner = ModelRunner(self.spec, weights, cache,
                             DecodeAttention(config.attention, threads,
                                             head_dim=self.spec.kv_cache_layout[1],
                                             latent_value_dim=(self.spec.mla.kv_lora_rank
                                                               if self.spec.mla else None),
                                             features=self.spec.attention_features),
                             max_model_len, act_dtype)
        eos = frozenset(tokenizer.eos_token_ids) or frozenset(self.spec.eos_token_ids)
        self._init_loop(runner, config, num_blocks, self.spec.vocab_size, max_model_len, eos,
                        tokenizer)
        self.window_blocks = window_blocks
        self.threads = threads
        if settings is not None:
            # With the disk tier the plain runner has no experts to calibrate on: the pipeline
            # records a missing routing profile for the next run (this one ranks by index).
            routing = (find_profile(model_dir) if disk_tier
                       else find_or_record_routing(self, model_dir, settings.resident_ratio))
            source = (expert_source(model_dir, self.spec, self.dtype, self.expert_storage)
                      if disk_tier else None)
            self.offload = build_offload_pipeline(self.runner, settings, routing=routing,
                                                  experts=source, loaded_bytes=self.loaded_bytes,
                                                  trace=trace)
            self.runner = self.offload
            if disk_tier and routing is None:
                record_bundled_routing(self, model_dir)

    @classmethod
    def around(cls, runner, config: EngineConfig, num_blocks: int, vocab_size: int,
               max_model_len: int, eos_token_ids: frozenset[int] = frozenset(),
               tokenizer=None) -> "LLMEngine":
        """The engine's loop around a given runner (anything with `forward(batches) -> logits`
        and `times`), reading no checkpoint: requests then need prompt_token_ids unless a
        tokenizer is given. The hardware profiler times the real step loop this way, with a
        runner that returns logits at once."""
        engine = cls.__new__(cls)
        engine.spec = None
        engine.threads = config.threads or torch.get_num_threads()
        engine.host_allocator = tune_host_allocator()
        engine._init_loop(runner, config, num_blocks, vocab_size, max_model_len, eos_token_ids,
                          tokenizer)
        return engine

    def _init_loop(self, runner, config: EngineConfig, num_blocks: int, vocab_size: int,
                   max_model_len: int, eos_token_ids: frozenset[int], tokenizer) -> None:
        self.config = config
        self.runner = runner
        self.allocator = BlockAllocator(num_blocks, config.block_size)
        # Blocks of the sliding-window layers' own pool (kv_pool_blocks), None without one.
        self.window_blocks: Optional[int] = None
        self.window_pool: Optional[WindowPool] = None
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.offload: Optional[OffloadPipeline] = None
        self.stats = EngineStats()
        # Tests and profilers may observe each step's logits (sequences in batch order).
        self.logits_observer: Optional[LogitsObserver] = None

    def close(self) -> None:
        """Stop the offload pipeline's worker threads (a no-op for the plain runner)."""
        if self.offload is not None:
            self.offload.close()
            self.offload.backend.close()
            if self.offload.pager.disk is not None:
                self.offload.pager.disk.close()
            self.offload = None

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def attention_impl(self) -> str:
        """The decode-attention path that runs ('cython' or 'torch'); see attention_path."""
        return self.runner.attention.name

    @property
    def gemm_path(self) -> str:
        """What runs the projections and experts (for stats and benchmarks); empty for a runner
        given to `around`."""
        if self.spec is None:
            return ""
        if self.gemm == "packed":
            return (f"packed kernels, ISA {packed.ISA}, weights {self.weight_storage}, "
                    f"experts {self.expert_storage}")
        return f"torch {str(self.dtype).replace('torch.', '')}"

    @property
    def attention_path(self) -> str:
        """What runs decode attention ('cython avx2', ...), and why when it is the fallback (for
        stats/benchmarks)."""
        return self.runner.attention.describe()

    def generate(self, requests: Iterable[Request]) -> Iterator[RequestResult]:
        """Run all requests; yield each result as it completes (rejected ones at once)."""
        self.allocator = BlockAllocator(self.allocator.num_blocks, self.allocator.block_size)
        self.window_pool = None if self.window_blocks is None else WindowPool(
            BlockAllocator(self.window_blocks, self.allocator.block_size), self.spec.sliding_window)
        self.scheduler = Scheduler(self.allocator, self.config.max_num_seqs,
                                   self.config.max_prefill_tokens, self.config.num_micro_batches,
                                   window_pool=self.window_pool)
        self.stats = EngineStats(kv_blocks_total=self.allocator.num_blocks,
                                 kv_block_size=self.allocator.block_size,
                                 gemm_path=self.gemm_path,
                                 attention_path=self.attention_path if self.spec else "",
                                 host_allocator=self.host_allocator)
        self.runner.times = type(self.runner.times)()
        offload_before = replace(self.offload.totals) if self.offload is not None else None
        start = time.perf_counter()
        pending = iter(requests)
        exhausted = False
        try:
            while True:
                # Read ahead N requests, or more while they hold fewer tokens than one prefill
                # pass: prefill-only prompts are admitted beyond N (see Scheduler._admit_prefills).
                queued_tokens = sum(s.num_tokens for s in self.scheduler.waiting)
                while not exhausted and (len(self.scheduler.waiting) < self.config.max_num_seqs
                                         or queued_tokens < self.config.max_prefill_tokens):
                    request = next(pending, None)
                    if request is None:
                        exhausted = True
                        break
                    self.stats.requests += 1
                    admitted = self._admit(request)
                    if isinstance(admitted, RequestResult):
                        self.stats.rejected += 1
                        yield admitted
                    else:
                        self.scheduler.add(admitted)
                        queued_tokens += admitted.num_tokens
                if not self.scheduler.has_unfinished():
                    if exhausted:
                        break
                    continue
                yield from self._step(start)
        finally:
            self._finish_stats(start, offload_before)

    def _admit(self, request: Request) -> Sequence | RequestResult:
        """Validate and tokenize a request: a Sequence to schedule, or a rejection."""
        rid = request.request_id
        error = request.sampling.validate()
        if error:
            return RequestResult.rejected(rid, error)
        sources = [s for s in (request.prompt, request.messages, request.prompt_token_ids)
                   if s is not None]
        if len(sources) != 1:
            return RequestResult.rejected(
                rid, "give exactly one of prompt, messages or prompt_token_ids")
        try:
            if request.prompt is not None:
                ids = self.tokenizer.encode_prompt(request.prompt) if request.prompt else []
            elif request.messages is not None:
                ids = self.tokenizer.encode_messages(request.messages) if request.messages else []
            else:
                ids = [int(t) for t in request.prompt_token_ids]
        except Exception as exc:  # a malformed request must not stop the batch
            return RequestResult.rejected(rid, f"cannot tokenize request: {exc}")
        if not ids:
            return RequestResult.rejected(rid, "empty prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return RequestResult.rejected(rid, f"token id out of range [0, {self.vocab_size})",
                                          ids)
        if len(ids) >= self.max_model_len:
            return RequestResult.rejected(
                rid, f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len} "
                     "(prompt plus at least one new token)", ids)
        worst = min(len(ids) + request.sampling.max_new_tokens, self.max_model_len)
        if self.allocator.blocks_needed(worst) > self.allocator.num_blocks:
            return RequestResult.rejected(
                rid, f"needs {worst} tokens of KV cache; the cache holds "
                     f"{self.allocator.num_blocks * self.allocator.block_size}", ids)
        seed = request.sampling.seed
        if seed is None:
            # From the id, not a generator of this engine: a resumed run samples the same.
            seed = stable_seed(0, rid)
        return Sequence(rid, ids, request.sampling, seed, self.max_model_len)

    def _step(self, start: float) -> Iterator[RequestResult]:
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        if step.is_empty:
            raise RuntimeError("scheduler produced an empty step with work pending "
                               "(KV cache too small for any waiting sequence)")
        seqs = step.sequences
        inputs = [micro_batch_input(mb, self.allocator.block_size, self.window_pool is not None)
                  for mb in step.micro_batches]
        t1 = time.perf_counter()
        try:
            logits = self.runner.forward(inputs)
            t2 = time.perf_counter()
            if self.logits_observer is not None:
                self.logits_observer(seqs, logits)
            tokens = sample(logits, sampling_batch(seqs)).tolist()
        except DiskReadError:
            # The machine's fault, not the rows': the job fails and its rerun resumes from the
            # checkpointed rows, instead of every later row failing on the same file.
            raise
        except Exception as exc:  # fail the step's sequences, keep the engine serving
            # The rows carry the message; the log keeps the traceback (an engine bug fails every
            # row the same way, and only the traceback says where).
            log.warning("a step failed; its %d sequences end with status error", len(seqs),
                        exc_info=True)
            for seq in seqs:
                self.scheduler.finish(seq)
                self.stats.errors += 1
                yield self._result(seq, status="error", error=f"{type(exc).__name__}: {exc}")
            return
        t3 = time.perf_counter()
        finished = []
        for seq, token in zip(seqs, tokens):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)
            if self._check_finished(seq, token):
                self.scheduler.finish(seq)
                finished.append(seq)
        t4 = time.perf_counter()
        self._record_step(step, len(seqs), t0, t1, t2, t3, t4, start)
        for seq in finished:
            yield self._result(seq)

    def _check_finished(self, seq: Sequence, token: int) -> bool:
        sp = seq.sampling
        if not sp.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif sp.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif seq.num_completion_tokens >= sp.max_new_tokens or seq.num_tokens >= seq.max_total_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self._decode(seq.completion_token_ids)
        cut = min((i for i in (text.find(s) for s in seq.sampling.stop) if i >= 0), default=-1)
        if cut < 0:
            return False
        seq.stop_text = text[:cut]
        return True

    def _decode(self, ids: list[int]) -> str:
        # An engine built `around` a runner may have no tokenizer: its results carry ids only.
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _result(self, seq: Sequence, status: str = "ok",
                error: Optional[str] = None) -> RequestResult:
        completion = seq.completion_token_ids
        text = seq.stop_text if seq.stop_text is not None else self._decode(completion)
        return RequestResult(
            request_id=seq.request_id, status=status,
            finish_reason=seq.finish_reason if status == "ok" else None,
            prompt_token_ids=seq.prompt_token_ids, token_ids=completion, text=text,
            prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(completion), error=error)

    def _record_step(self, step: ScheduledStep, num_seqs: int, t0: float, t1: float, t2: float,
                     t3: float, t4: float, start: float) -> None:
        s = self.stats
        s.steps += 1
        s.prefill_tokens += step.num_prefill_tokens
        s.decode_tokens += num_seqs
        s.decode_step_tokens += step.num_decode_tokens
        s.sampling_time_s += t3 - t2
        s.schedule_time_s += (t1 - t0) + (t4 - t3)
        total = step.num_prefill_tokens + step.num_decode_tokens
        share = step.num_prefill_tokens / total if total else 0.0
        s.prefill_time_s += (t4 - t0) * share
        s.decode_time_s += (t4 - t0) * (1 - share)
        s.preemptions = self.scheduler.num_preemptions
        s.kv_blocks_high_water = self.allocator.high_water
        s.record_step(t4 - start)

    def _finish_stats(self, start: float, offload_before: Optional[OffloadStats]) -> None:
        s, times = self.stats, self.runner.times
        s.wall_time_s = time.perf_counter() - start
        s.attention_time_s = times.attention_s
        s.ffn_time_s = times.ffn_s
        s.dense_time_s = times.dense_s
        s.head_time_s = times.head_s
        s.kv_blocks_high_water = self.allocator.high_water
        s.close_timeline(s.wall_time_s)
        if getattr(self, "scheduler", None) is not None:
            s.preemptions = self.scheduler.num_preemptions
        if self.offload is not None and offload_before is not None:
            moved = self.offload.totals.since(offload_before)
            s.offload = moved.to_dict()
            s.transfer_wait_time_s = moved.transfer_wait_time_s
            s.bytes_moved = moved.bytes_moved


def _gemm_impl(config: EngineConfig) -> str:
    """'packed' (the CPU kernels) or 'torch', from engine.gemm, the backend and whether the
    kernels are built (every architecture's experts run on them)."""
    gemm = GemmImpl(config.gemm)
    if gemm is GemmImpl.torch or DeviceKind(config.backend) is not DeviceKind.cpu:
        return "torch"
    if not packed.HAS_PACKED_KERNELS:
        if (gemm is GemmImpl.packed or ExpertDType(config.expert_dtype).quantized
                or MatmulPrecision(config.matmul_precision) is not MatmulPrecision.highest):
            raise RuntimeError("engine.gemm=packed (or quantized experts, or "
                               "engine.matmul_precision medium or high) needs the packed CPU kernels, "
                               "which are not built (python setup.py build_ext --inplace)")
        return "torch"
    return "packed"
