"""AsyncCpuBackend: a test tool that makes the CPU behave like an asynchronous device.

On `CpuBackend` the compute "stream" is the calling thread: launched work has run before the
host issues the next thing, so compute can never race a copy and a missing wait cannot show.
On a GPU it can: kernels run some time after the host issued them, and copies run on another
stream. This backend reproduces that on a CPU, so CPU tests catch a missing wait as wrong tokens:

- the compute stream is a worker thread that runs launched work in launch order, each item
  after a random delay, so it lags the host by a varying amount;
- copies run on a copy worker (the same priority queue as `CpuBackend`'s) after a random delay,
  each packet in two halves with a delay between, so a reader that did not wait sees a stale or
  torn page;
- events are real cross-thread events: `record_compute_event` is set by the compute thread when
  it gets there, `compute_after` makes the compute thread (not the host) wait for a copy, and
  `copy_async(after=...)` makes the copy thread wait for the compute thread.

The delays come from seeded generators, one per stream: a seed fixes each stream's sequence of
delays, not the interleaving of the threads, which the OS decides. Timings measured on this
backend (pipeline stats, traces, the pager's wait time) mean nothing, and it is not selectable
from the configuration: tests pass it to `build_offload_pipeline(backend=...)`.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable, Optional

import torch

from moe_engine.offload.backend import ComputeEvent, CopyHandle, CopyWorker, HostMemoryBackend
from moe_engine.offload.trace import Trace


class StreamEvent(ComputeEvent):
    """Set by the compute thread when it reaches the point where the event was recorded."""

    def __init__(self) -> None:
        self._reached = threading.Event()

    def done(self) -> bool:
        return self._reached.is_set()

    def synchronize(self) -> None:
        self._reached.wait()


class _ComputeStream:
    """One thread running launched work in order, like a device's compute queue.

    A failure in launched work is kept and raised at the next host sync (as a device reports an
    asynchronous error at the next synchronizing call); work launched until then is skipped,
    since it would compute on a failed predecessor's output. Events are still set, so nothing
    waiting on them hangs.
    """

    _STOP = "stop"

    def __init__(self, rng: random.Random, max_delay_s: float, name: str):
        self._rng = rng
        self._max_delay_s = max_delay_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: tuple) -> None:
        # After stop nothing would ever run it: an event recorded now would never be reached.
        if self._stopped:
            raise RuntimeError("the compute stream is closed")
        self._queue.put(item)

    def run(self, fn: Callable[..., object], args: tuple) -> None:
        self._put(("run", fn, args))

    def wait_for(self, handle: CopyHandle) -> None:
        self._put(("wait", handle))

    def record(self) -> StreamEvent:
        event = StreamEvent()
        self._put(("event", event))
        return event

    def take_error(self) -> Optional[BaseException]:
        """The failure of launched work since the last call, if any (read after an event the
        compute thread set, so the write is visible)."""
        error, self._error = self._error, None
        return error

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._queue.put((self._STOP,))
        self._thread.join(timeout=30)

    def _run(self) -> None:
        # Inference mode is per thread; the pipeline's device work runs under it on the host.
        with torch.inference_mode():
            while True:
                item = self._queue.get()
                kind = item[0]
                if kind == self._STOP:
                    return
                if kind == "event":
                    item[1]._reached.set()
                    continue
                time.sleep(self._rng.random() * self._max_delay_s)
                if self._error is not None:
                    continue
                try:
                    if kind == "run":
                        item[1](*item[2])
                    else:  # "wait": the stream, not the host, waits for the copy
                        item[1].wait()
                except BaseException as exc:  # reported at the next host sync
                    self._error = exc


class AsyncCpuBackend(HostMemoryBackend):
    """The CPU as an asynchronous device: a compute thread and a copy thread with random delays
    and real events between them (a test tool; see the module docstring).

    `compute_delay_s` and `copy_delay_s` bound the random delay before each launched item and
    each copied packet (uniform in [0, bound)); `seed` seeds both streams' generators.
    """

    name = "cpu-async"

    def __init__(self, seed: int = 0, compute_delay_s: float = 1e-3,
                 copy_delay_s: float = 1e-3, trace: Optional[Trace] = None):
        if compute_delay_s < 0 or copy_delay_s < 0:
            raise ValueError("delays must be >= 0")
        self.device = torch.device("cpu")
        self.seed = seed
        self._copy_rng = random.Random(2 * seed + 1)
        self._copy_delay_s = copy_delay_s
        self._stream = _ComputeStream(random.Random(2 * seed), compute_delay_s,
                                      "async-cpu-compute")
        self._worker = CopyWorker(self._transfer, trace, "async-cpu-copy")

    def _transfer(self, dst: torch.Tensor, src: torch.Tensor, handle: CopyHandle,
                  after: Optional[ComputeEvent]) -> None:
        if after is not None:  # the copy stream waits for the compute stream
            after.synchronize()
        time.sleep(self._copy_rng.random() * self._copy_delay_s / 2)
        if dst.shape != src.shape or not (dst.is_contiguous() and src.is_contiguous()):
            dst.copy_(src)  # broadcasting or strided: one piece (copy_ reports a mismatch)
            return
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        half = flat_dst.numel() // 2
        flat_dst[:half].copy_(flat_src[:half])
        # A reader that did not wait for this packet sees half old and half new bytes.
        time.sleep(self._copy_rng.random() * self._copy_delay_s / 2)
        flat_dst[half:].copy_(flat_src[half:])

    def compute_after(self, handle: CopyHandle) -> None:
        self._stream.wait_for(handle)

    def record_compute_event(self) -> ComputeEvent:
        return self._stream.record()

    def launch(self, fn: Callable[..., object], *args) -> None:
        self._stream.run(fn, args)

    def host_sync(self) -> None:
        self._stream.record().synchronize()
        error = self._stream.take_error()
        if error is not None:
            raise error

    def synchronize(self) -> None:
        self.host_sync()

    def close(self) -> None:
        self._stream.stop()  # runs what is queued first, so waits on queued copies still land
        self._worker.close()
