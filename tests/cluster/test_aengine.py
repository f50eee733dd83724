"""The async engine's one thread, with fake engines (no Ray): a request queued at the moment a step
fails for good is answered with the error instead of hanging, and so is one submitted afterwards; the
sequences of one request (n > 1, a list of prompts) enter the engine together (issue 10)."""

import asyncio
import threading
import time

import pytest
from types import SimpleNamespace

from cluster.aengine import AsyncEngine
from cluster.stream import EngineRequest, StreamChunk
from cluster.stats import EngineStats
from model.sampling import SamplingParams


class FakeEngine:
    """What the async engine needs of an engine beyond the step: requests by id, an empty scheduler
    queue, statistics, and no epoch changes."""

    def __init__(self):
        self.requests, self.snapshot = {}, SimpleNamespace(waiting=0)
        self.stats = EngineStats(0)  # the async engine adds its delivery time to the breakdown
        self.inflight = []  # the steps in flight (the async engine clears them when a step fails)

    def admit(self, request):  # checked by validate() when submitted, as the real engine's
        return self.add_request(list(request.prompt_ids), request.params)

    def publish(self):
        pass

    @property
    def busy(self):
        return self.has_work or bool(self.inflight)

    def advance(self):
        pass

    def record(self):
        pass

    def pipelined(self):  # no async scheduling: each step waits for the last one's results
        events = self.finish(self.inflight.pop(0) if self.inflight else self.launch())
        if self.has_work:
            self.inflight.append(self.launch())
        return events

    def abort(self, sid):
        self.requests.pop(sid, None)

    def release(self, sid):
        return self.requests.pop(sid, None)


class FailingEngine(FakeEngine):
    """Runs one request; its first step waits until a second request is queued, then fails."""

    def __init__(self):
        super().__init__()
        self.queued = threading.Event()
        self._ids = iter(range(100))

    def validate(self, prompt_ids, params):
        pass

    def add_request(self, prompt_ids, params):
        sid = next(self._ids)
        self.requests[sid] = object()
        return sid

    @property
    def has_work(self):
        return bool(self.requests)

    def launch(self):
        return "step 1"

    def finish(self, launched):
        assert launched == "step 1"
        assert self.queued.wait(30), "the test never queued its second request"
        raise RuntimeError("a collective failed and nothing can be recovered")



def _req(ids, params) -> EngineRequest:
    return EngineRequest(tuple(ids), params)


def _reqs(jobs) -> list[EngineRequest]:
    return [_req(ids, params) for ids, params in jobs]


def test_queued_and_later_requests_get_the_error_not_a_hang():
    eng = FailingEngine()
    aeng = AsyncEngine(eng).start()
    params = SamplingParams(max_tokens=4)

    async def run():
        first = aeng.generate(_req([1, 2], params))
        running = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.2)  # the first request runs; its step waits for the second
        second = asyncio.ensure_future(aeng.generate(_req([3], params)).__anext__())
        await asyncio.sleep(0.1)
        eng.queued.set()
        results = await asyncio.wait_for(asyncio.gather(running, second, return_exceptions=True), 30)
        with pytest.raises(RuntimeError, match="engine is not running"):
            await asyncio.wait_for(aeng.generate(_req([4], params)).__anext__(), 30)
        return results

    try:
        results = asyncio.run(run())
    finally:
        aeng.stop()
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert "nothing can be recovered" in str(results[0]) and not aeng.healthy


class RecordingEngine(FakeEngine):
    """Admits every queued request at the next step and gives each running request one token per
    step; logs each admission with the step it waited for and each step with the requests in it."""

    def __init__(self, step_s: float = 0.02):
        super().__init__()
        self.log, self.steps, self.step_s = [], 0, step_s
        self._ids = iter(range(1000))

    def validate(self, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("the prompt is empty")

    def add_request(self, prompt_ids, params):
        sid = next(self._ids)
        self.requests[sid] = params.max_tokens
        self.log.append(("add", sid, self.steps))
        return sid

    @property
    def has_work(self):
        return any(left > 0 for left in self.requests.values())

    def launch(self):
        running = sorted(s for s, left in self.requests.items() if left > 0)
        if not running:
            return None
        self.log.append(("step", tuple(running)))
        return running

    def finish(self, running):
        if running is None:
            return []
        time.sleep(self.step_s)  # a step takes time: submissions that trickle in land in later steps
        self.steps += 1
        events = []
        for sid in running:
            if sid not in self.requests:  # aborted while its step ran
                continue
            self.requests[sid] -= 1
            events.append(StreamChunk((sid,), "length" if self.requests[sid] == 0 else None, seq_id=sid))
        return events



def test_one_requests_sequences_are_admitted_together_before_its_first_token():
    """n = 4 choices (or 4 prompts) of one request: all four are added before any step runs and the
    first step holds all four, so their first tokens come from the same step (no TTFT growth with n)."""
    eng = RecordingEngine()
    aeng = AsyncEngine(eng).start()
    jobs = [([1, 2, 3], SamplingParams(max_tokens=3))] * 2 + [([4], SamplingParams(max_tokens=2)),
                                                            ([5, 6], SamplingParams(max_tokens=3))]

    async def run():
        firsts, chunks = {}, []
        async for index, seq_id, chunk in aeng.generate_many(_reqs(jobs)):
            firsts.setdefault(index, (seq_id, eng.steps))
            chunks.append((index, chunk))
        return firsts, chunks

    try:
        firsts, chunks = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        aeng.stop()
    adds = [e for e in eng.log if e[0] == "add"]
    assert [e[2] for e in adds] == [0, 0, 0, 0] and eng.log[:4] == adds, eng.log
    assert eng.log[4] == ("step", (0, 1, 2, 3)), eng.log
    assert sorted(firsts) == [0, 1, 2, 3] and {sid for sid, _ in firsts.values()} == {0, 1, 2, 3}
    assert [len([c for i, c in chunks if i == j]) for j in range(4)] == [3, 3, 2, 3]
    assert all(c.finish_reason is not None for c in [next(c for i, c in reversed(chunks) if i == j)
                                                      for j in range(4)])


def test_a_bad_prompt_queues_nothing_and_closing_aborts_the_rest():
    eng = RecordingEngine()
    aeng = AsyncEngine(eng).start()
    jobs = [([1], SamplingParams(max_tokens=50))] * 3

    async def run():
        with pytest.raises(ValueError, match="empty"):
            await aeng.generate_many(_reqs([([1], SamplingParams()), ([], SamplingParams())])).__anext__()
        stream = aeng.generate_many(_reqs(jobs))
        seen = [await stream.__anext__() for _ in range(3)]  # the first step's three tokens
        await stream.aclose()
        for _ in range(100):  # the aborts reach the engine thread between steps
            if not eng.requests:
                break
            await asyncio.sleep(0.05)
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        aeng.stop()
    assert sorted(i for i, _, _ in seen) == [0, 1, 2]
    assert [e[1] for e in eng.log if e[0] == "add"] == [0, 1, 2]  # the bad request added nothing
    assert eng.requests == {}, "closing the stream must abort every sequence still running"


def test_the_record_tells_one_by_one_submission_apart():
    """The check above can fail: the old Ingress opened choices one by one, awaiting each first token;
    the record then shows four admissions at four different steps."""
    eng = RecordingEngine()
    aeng = AsyncEngine(eng).start()

    async def run():
        streams = []
        for _ in range(4):
            streams.append(aeng.generate(_req([1, 2], SamplingParams(max_tokens=6))))
            await streams[-1].__anext__()
        for s in streams:
            await s.aclose()

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        aeng.stop()
    waited = [e[2] for e in eng.log if e[0] == "add"]
    assert waited[0] == 0 and all(a < b for a, b in zip(waited, waited[1:])), eng.log  # each behind the last


def test_one_sequence_of_a_request_is_aborted_alone():
    """AsyncEngine.abort(seq_id): that sequence leaves the engine and its stream ends with an 'abort'
    chunk; the request's other sequences run to their end (a choice that met its stop string)."""
    eng = RecordingEngine()
    aeng = AsyncEngine(eng).start()
    jobs = [([1], SamplingParams(max_tokens=40)), ([2], SamplingParams(max_tokens=6))]

    async def run():
        chunks, aborted = {0: [], 1: []}, None
        async for index, seq_id, chunk in aeng.generate_many(_reqs(jobs)):
            chunks[index].append(chunk)
            if index == 0 and aborted is None:
                aborted = seq_id
                aeng.abort(seq_id)
        return chunks, aborted

    try:
        chunks, aborted = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        aeng.stop()
    assert chunks[0][-1].finish_reason == "abort" and len(chunks[0]) < 6, chunks[0]
    assert [c.finish_reason for c in chunks[1]] == [None] * 5 + ["length"]
    assert aborted not in eng.requests and eng.requests == {}
    steps_with_it = [e for e in eng.log if e[0] == "step" and aborted in e[1]]
    assert len(steps_with_it) < 6  # it stopped decoding, not ran on beside the other to its 40 tokens


class IdleEngine(FakeEngine):
    has_work = False


def test_a_control_call_its_caller_gave_up_on_is_not_run_and_the_thread_lives_on():
    """A control route (/status, chaos, a change) waits its timeout, answers 503 and cancels its call
    (asyncio.wait_for on the wrapped future). The engine thread, busy meanwhile (a recovery), must skip
    the call when it gets to it: answering a cancelled future raised InvalidStateError and ended the
    thread, so the replica failed its health check and Serve replaced it, cutting every stream."""
    aeng = AsyncEngine(IdleEngine()).start()
    release, ran = threading.Event(), []
    try:
        busy = aeng.control(lambda e: release.wait(30))  # the engine thread is inside this one

        async def give_up():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(aeng.control(lambda e: ran.append(1))), 0.2)

        asyncio.run(give_up())
        release.set()
        assert busy.result(10) is True
        assert aeng.control(lambda e: "still here").result(10) == "still here"
        assert ran == [] and aeng.healthy
    finally:
        aeng.stop()
