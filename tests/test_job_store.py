"""The job store (``mineru_fast.serve.store``) and two job managers sharing one, as Ray Serve
replicas do, without Ray: take-over of a lost replica's jobs, bounded re-claims, expiry, key
isolation. A fake clock drives heartbeats and expiry; no test waits on the wall clock."""

from __future__ import annotations

import threading
import time

from mineru_fast.serve.jobs import Job, JobManager
from mineru_fast.serve.store import JobError, JobRecord, MemoryJobStore


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(job_id: str, replica: str = "a", owner: str | None = "alpha", cost: int = 0) -> JobRecord:
    return JobRecord(id=job_id, owner=owner, replica=replica, payload=f"bytes of {job_id}", cost=cost)


def wait_for(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_key_sees_only_its_own_jobs_and_lookups_carry_no_upload():
    store = MemoryJobStore(result_ttl=60)
    store.add(record("j1", owner="alpha"))
    store.add(record("j2", owner=None))
    assert store.get("j1", "beta") is None and store.get("j1", None) is None and store.get("j2", "alpha") is None
    assert store.get("nope", "alpha") is None
    seen = store.get("j1", "alpha")
    assert seen is not None and (seen.id, seen.status, seen.payload, seen.replica) == ("j1", "queued", None, "a")
    assert store.update("j1", 0, status="done", result={"markdown": "# hi"})
    assert store.get("j1", "alpha").result is None  # a status lookup does not ship the result
    done = store.get("j1", "alpha", with_result=True)
    assert done.result == {"markdown": "# hi"} and done.finished_at is not None and done.describe()["attempts"] == 1


def test_a_job_ends_once_and_later_changes_are_refused():
    store = MemoryJobStore(result_ttl=60)
    store.add(record("j"))
    assert store.update("j", 0, status="running") and store.get("j", "alpha").started_at is not None
    assert store.update("j", 0, pages_done=1, pages_total=3)
    assert store.update("j", 0, status="failed", error=JobError(422, "corrupt_document", "not a PDF"))
    assert not store.update("j", 0, status="done", result={"x": 1})
    assert not store.update("unknown", 0, status="running")
    ended = store.get("j", "alpha", with_result=True)
    assert (ended.status, ended.result, ended.pages_done, ended.pages_total) == ("failed", None, 1, 3)
    assert ended.describe()["error"] == {"code": "corrupt_document", "message": "not a PDF"}
    try:
        store.add(record("j"))
    except ValueError as exc:
        assert "stored already" in str(exc)
    else:
        raise AssertionError("a second job with the same id was stored")


def test_a_lost_replica_s_jobs_are_claimed_once_by_a_live_one():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, lost_after=10, clock=clock)
    store.add(record("running"))
    store.add(record("queued"))
    store.add(record("finished"))
    assert store.update("running", 0, status="running", pages_done=2)
    assert store.update("finished", 0, status="done", result={})
    assert store.claim("b", 10, None) == []  # a heartbeated within lost_after
    clock.now = 10.0
    assert store.claim("b", 10, None) == []  # exactly at the bound: not lost yet
    clock.now = 10.5
    taken = store.claim("b", 10, None)
    assert [(r.id, r.replica, r.claims, r.status, r.pages_done, r.payload) for r in taken] == [
        ("running", "b", 1, "queued", 0, "bytes of running"),
        ("queued", "b", 1, "queued", 0, "bytes of queued"),
    ]
    assert store.claim("c", 10, None) == []  # b holds them now and is alive
    assert not store.update("running", 0, status="done", result={"by": "a"})  # a came back: its claim is stale
    assert store.update("running", 1, status="running")
    assert store.update("running", 1, status="done", result={"by": "b"})
    final = store.get("running", "alpha", with_result=True)
    assert final.result == {"by": "b"} and final.describe()["attempts"] == 2


def test_claims_respect_the_claimer_s_room_and_cost_budget():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, lost_after=5, clock=clock)
    for name, cost in (("big", 80), ("small", 10), ("mid", 30)):
        store.add(record(name, cost=cost))
    clock.now = 6.0
    assert [r.id for r in store.claim("b", 0, None)] == []  # no room: a heartbeat only
    assert [r.id for r in store.claim("b", 5, 50)] == ["small", "mid"]  # big does not fit, the rest do
    assert [r.id for r in store.claim("c", 1, None)] == ["big"]  # a's last job
    assert [r.id for r in store.claim("c", 5, None)] == []  # b holds the rest and is alive


def test_a_job_lost_more_than_max_claims_times_fails_replica_lost():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, lost_after=5, max_claims=1, clock=clock)
    store.add(record("j"))
    clock.now = 6.0
    assert [r.claims for r in store.claim("b", 1, None)] == [1]
    clock.now = 12.0  # b is lost too
    assert store.claim("c", 1, None) == []
    failed = store.get("j", "alpha")
    assert failed.status == "failed" and failed.finished_at is not None
    assert failed.error.code == "replica_lost" and failed.error.status == 500
    assert "lost 2 times" in failed.error.message and failed.describe()["attempts"] == 2
    assert not store.update("j", 1, status="done", result={})


def test_finished_jobs_expire_after_the_ttl_and_unfinished_ones_never():
    clock = Clock()
    store = MemoryJobStore(result_ttl=30, lost_after=5, clock=clock)
    store.add(record("done"))
    store.add(record("waiting", replica="b"))
    clock.now = 1.0
    assert store.update("done", 0, status="done", result={})
    store.collect("done")
    assert store.get("done", "alpha").collected and not store.get("waiting", "alpha").collected
    clock.now = 30.9
    assert store.expire() == 0
    clock.now = 31.0
    assert store.expire() == 1 and store.get("done", "alpha") is None
    clock.now = 1000.0
    assert store.expire() == 0 and store.get("waiting", "alpha").status == "queued"


def test_a_surviving_manager_takes_over_and_finishes_a_lost_replica_s_job():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, lost_after=10, clock=clock)
    gate = threading.Event()
    payloads = []

    def stuck(job: Job) -> dict:  # replica a: dies mid-document (never returns in time)
        job.report_progress(1, 3)
        assert gate.wait(10)
        return {"by": "a"}

    def survivor(job: Job) -> dict:
        payloads.append(job.payload)
        job.report_progress(3, 3)
        return {"by": "b"}

    # heartbeat=3600: each manager heartbeats once at start; the test drives b's rounds itself
    lost = JobManager([stuck], max_queued=4, store=store, replica="a", heartbeat=3600)
    alive = JobManager([survivor], max_queued=4, store=store, replica="b", heartbeat=3600)
    lost.start()
    alive.start()
    try:
        job = lost.submit(Job("the upload", owner="alpha", pages_total=3))
        assert wait_for(lambda: store.get(job.id, "alpha").pages_done == 1, 5)
        assert store.get(job.id, "alpha").status == "running"
        clock.now = 5.0
        assert alive.maintain() == []
        clock.now = 11.0
        taken = alive.maintain()
        assert [(t.id, t.claims, t.owner) for t in taken] == [(job.id, 1, "alpha")]
        assert wait_for(lambda: store.get(job.id, "alpha").status == "done", 5)
        gate.set()  # a wakes up and finishes its stale run: its outcome is dropped
        assert wait_for(lambda: job.status == "done", 5)
        final = store.get(job.id, "alpha", with_result=True)
        assert final.result == {"by": "b"} and final.replica == "b" and final.pages_done == 3
        assert final.describe()["attempts"] == 2 and payloads == ["the upload"]
    finally:
        gate.set()
        lost.shutdown(5)
        alive.shutdown(5)


def test_a_draining_manager_claims_nothing():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, lost_after=1, clock=clock)
    store.add(record("orphan", replica="gone"))
    manager = JobManager([lambda job: {}], max_queued=4, store=store, replica="b", heartbeat=3600)
    manager.start()
    try:
        manager.stop_accepting()
        clock.now = 5.0
        assert manager.maintain() == [] and store.get("orphan", "alpha").replica == "gone"
    finally:
        manager.shutdown(5)
