"""The fast engine's loop stepped by hand, for tests that compare two runs bit for bit.

A prefill forward batches the prompt chunks waiting at that moment and a vision pack the images
waiting then; on some CPUs (seen on CI's machine) PyTorch's float32 operators round a row
differently in another grouping, as in any batched engine. Two runs compared bit for bit must
therefore group their admission work the same way: here every request is queued before the first
step and has its own slot, so no admission waits for a sequence to end (which drafts make happen
sooner), and the time budget between decode steps is fixed (``admission_budget_s``: unbounded,
all admission before the first decode step; 0, one admission unit per decode step once a sequence
decodes, as a loaded engine interleaves them), so the same units run in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mineru_fast.engine.base import GenerationRequest, GenerationResult


def stepped_generate(
    engine, requests: Sequence[GenerationRequest], admission_budget_s: float = math.inf
) -> list[GenerationResult]:
    """Decode ``requests`` on ``engine`` (a ``FastEngine`` whose loop thread never started, with a
    slot for each request) by stepping its scheduler in this thread, in inference mode and with the
    engine's thread count as its loop thread would, with ``admission_budget_s`` (``math.inf`` or
    0.0: see the module docstring); results in request order.

    Raises:
        ValueError: the loop thread runs, fewer slots than requests, or another budget.
    """
    scheduler = engine.scheduler
    if scheduler._thread is not None:
        raise ValueError("the engine's loop thread runs: build an engine used only through stepped_generate")
    if scheduler.slots < len(requests):
        raise ValueError(f"{len(requests)} requests need as many slots, the engine has {scheduler.slots}")
    if admission_budget_s not in (0.0, math.inf):
        raise ValueError("a budget between 0 and infinity depends on the clock: pass 0.0 or math.inf")
    scheduler.admission_budget_s = admission_budget_s
    handles = [scheduler.submit(request, start=False) for request in requests]
    threads = torch.get_num_threads()
    torch.set_num_threads(scheduler.threads)
    try:
        with torch.inference_mode():
            for _ in range(100_000):  # every request ends within its token bound; this only guards the test
                if all(handle.done() for handle in handles):
                    return [handle.result() for handle in handles]
                scheduler.step()
    finally:
        torch.set_num_threads(threads)
    raise AssertionError("requests not finished within the step bound")
