"""The job store (``mineru_fast.serve.store``) and two job managers sharing one, as Ray Serve
replicas do, without Ray: take-over of a lost replica's jobs, bounded re-claims, expiry, key
isolation, idempotency keys. A fake clock drives heartbeats and expiry; no test waits on the wall
clock."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from mineru_fast.serve.jobs import AlreadySubmitted, Job, JobManager
from mineru_fast.serve.store import JobError, JobRecord, MemoryJobStore


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(job_id: str, replica: str = "a", owner: str | None = "alpha", cost: int = 0) -> JobRecord:
    return JobRecord(id=job_id, owner=owner, replica=replica, payload=f"bytes of {job_id}", cost=cost)


def keyed(job_id: str, key: str, owner: str | None = "alpha", fingerprint: str = "f1") -> JobRecord:
    return replace(record(job_id, owner=owner), idempotency_key=key, fingerprint=fingerprint)


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


def test_an_idempotency_key_names_one_job_per_owner_until_the_job_expires():
    clock = Clock()
    store = MemoryJobStore(result_ttl=60, clock=clock)
    assert store.add(keyed("j1", "k")) is None and store.find("alpha", "k").id == "j1"
    repeat = store.add(keyed("j2", "k", fingerprint="f2"))  # the store does not judge fingerprints
    assert (repeat.id, repeat.fingerprint, repeat.payload, repeat.status) == ("j1", "f1", None, "queued")
    assert store.get("j2", "alpha") is None  # nothing was stored for the repeat
    assert store.add(keyed("j3", "k", owner="beta")) is None and store.add(keyed("j4", "k", owner=None)) is None
    assert [store.find(owner, "k").id for owner in ("alpha", "beta", None)] == ["j1", "j3", "j4"]
    assert store.find("alpha", "K") is None and store.find("gamma", "k") is None
    assert store.add(record("j5")) is None and store.add(record("j6")) is None  # no key: no check
    assert store.update("j1", 0, status="done", result={"markdown": "# one"})
    clock.now = 59.9
    assert store.expire() == 0 and store.add(keyed("j7", "k")).id == "j1"  # done, not expired: still j1
    assert store.find("alpha", "k").result is None  # a lookup never ships the result
    clock.now = 60.0
    assert store.expire() == 1 and store.find("alpha", "k") is None  # the key went with its job
    assert store.add(keyed("j7", "k")) is None and store.find("alpha", "k").id == "j7"


def test_concurrent_adds_with_one_key_store_one_job():
    store = MemoryJobStore(result_ttl=60)
    threads, start = 16, threading.Barrier(16)
    answers: dict[int, JobRecord | None] = {}

    def add(index: int) -> None:
        start.wait()
        answers[index] = store.add(keyed(f"j{index}", "k"))

    workers = [threading.Thread(target=add, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(10)
    created = [index for index, answer in answers.items() if answer is None]
    assert len(answers) == threads and len(created) == 1
    winner = f"j{created[0]}"
    assert {answer.id for answer in answers.values() if answer is not None} == {winner}
    assert [index for index in range(threads) if store.get(f"j{index}", "alpha") is not None] == created


def test_two_replicas_given_one_key_queue_and_run_one_job():
    store = MemoryJobStore(result_ttl=60)
    ran: list[str] = []

    def runner(job: Job) -> dict:
        ran.append(job.id)
        return {"payload": job.payload}

    managers = [JobManager([runner], max_queued=4, store=store, replica=name, heartbeat=3600) for name in "ab"]
    start = threading.Barrier(2)
    outcomes: list[tuple[str, str]] = []

    def submit(manager: JobManager) -> None:
        job = Job("the upload", owner="alpha", idempotency_key="k", fingerprint="f")
        start.wait()
        try:
            outcomes.append(("queued", manager.submit(job).id))
        except AlreadySubmitted as exc:
            outcomes.append(("repeat", exc.record.id))

    for manager in managers:
        manager.start()
    try:
        submitters = [threading.Thread(target=submit, args=(manager,)) for manager in managers]
        for submitter in submitters:
            submitter.start()
        for submitter in submitters:
            submitter.join(10)
        assert sorted(kind for kind, _ in outcomes) == ["queued", "repeat"]
        assert len({job_id for _, job_id in outcomes}) == 1
        job_id = outcomes[0][1]
        assert wait_for(lambda: store.get(job_id, "alpha").status == "done", 5)
        assert ran == [job_id] and store.get(job_id, "alpha", with_result=True).result == {"payload": "the upload"}
        assert managers[0].queue_length == managers[1].queue_length == 0
    finally:
        for manager in managers:
            manager.shutdown(5)
