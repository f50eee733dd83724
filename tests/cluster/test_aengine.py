"""The async engine's one thread, with a fake engine (no Ray): a request queued at the moment a step
fails for good is answered with the error instead of hanging, and so is one submitted afterwards."""

import asyncio
import threading

import pytest

from cluster.aengine import AsyncEngine
from model.sampling import SamplingParams


class FailingEngine:
    """Runs one request; its first step waits until a second request is queued, then fails."""

    def __init__(self):
        self.requests, self.scheduler = {}, type("S", (), {"waiting": []})()
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

    def advance(self):
        pass

    def launch(self):
        return "step 1"

    def finish(self, launched):
        assert launched == "step 1"
        assert self.queued.wait(30), "the test never queued its second request"
        raise RuntimeError("a collective failed and nothing can be recovered")

    def record(self):
        pass

    def abort(self, sid):
        self.requests.pop(sid, None)

    def release(self, sid):
        return self.requests.pop(sid, None)


def test_queued_and_later_requests_get_the_error_not_a_hang():
    eng = FailingEngine()
    aeng = AsyncEngine(eng).start()
    params = SamplingParams(max_tokens=4)

    async def run():
        first = aeng.generate([1, 2], params)
        running = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0.2)  # the first request runs; its step waits for the second
        second = asyncio.ensure_future(aeng.generate([3], params).__anext__())
        await asyncio.sleep(0.1)
        eng.queued.set()
        results = await asyncio.wait_for(asyncio.gather(running, second, return_exceptions=True), 30)
        with pytest.raises(RuntimeError, match="engine is not running"):
            await asyncio.wait_for(aeng.generate([4], params).__anext__(), 30)
        return results

    try:
        results = asyncio.run(run())
    finally:
        aeng.stop()
    assert all(isinstance(r, RuntimeError) for r in results), results
    assert "nothing can be recovered" in str(results[0]) and not aeng.healthy
