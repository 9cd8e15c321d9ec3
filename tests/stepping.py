"""The fast engine's loop stepped by hand, for tests that compare two runs bit for bit.

A prefill forward batches the prompt chunks waiting at that moment and a vision pack the images
waiting then; on some CPUs (seen on CI's machine) PyTorch's float32 operators round a row
differently in another grouping, as in any batched engine. Two runs compared bit for bit must
therefore group their admission work the same way: here every request is queued before the first
step, each step does all the admission work there is (no time budget), and every request has its
own slot, so no admission waits for a sequence to end (which drafts make happen sooner).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mineru_fast.engine.base import GenerationRequest, GenerationResult


def stepped_generate(engine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Decode ``requests`` on ``engine`` (a ``FastEngine`` whose loop thread never started, with a
    slot for each request) by stepping its scheduler in this thread, in inference mode and with the
    engine's thread count as its loop thread would; results in request order.

    Raises:
        ValueError: the loop thread runs, or fewer slots than requests.
    """
    scheduler = engine.scheduler
    if scheduler._thread is not None:
        raise ValueError("the engine's loop thread runs: build an engine used only through stepped_generate")
    if scheduler.slots < len(requests):
        raise ValueError(f"{len(requests)} requests need as many slots, the engine has {scheduler.slots}")
    scheduler.admission_budget_s = math.inf
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
