"""Streams that end before they got going still abort their engine requests.

In-process app on a tiny model, driven through raw ASGI calls so that the client can go away at a chosen
moment: a streamed request the engine has accepted but not scheduled yet (the batch is held by another
request) whose client disconnects while the first chunk is being sent must leave the engine at once, not
when it would have produced its first token.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from server_utils import make_tiny_model

pytestmark = pytest.mark.server


class _Call:
    """One POST through the ASGI app; the client disconnects while the first body chunk is being sent (or, with
    ``at_start``, once the response has started)."""

    def __init__(self, app, path: str, body: dict, at_start: bool = False):
        self.app, self.path, self.body = app, path, json.dumps(body).encode()
        self.at_start = at_start
        self.gone = asyncio.Event()
        self.chunks: list[str] = []
        self.status: int | None = None
        self._sent_body = False

    async def receive(self):
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.at_start:
                self.gone.set()
        elif message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"].decode())
            if len(self.chunks) == 1:   # the client goes away while this send is in flight
                self.gone.set()
                await asyncio.sleep(0.2)

    async def run(self):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await self.app(scope, self.receive, self.send)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-cleanup"))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/completions"])
def test_a_waiting_stream_whose_client_leaves_is_aborted_at_once(model_dir, path):
    """(completions sends nothing before its first token: its client leaves once the response has started)"""
    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import SamplingParams
    from plinth.entrypoints.openai.api_server import build_app

    front = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off",
                                                              max_model_len=1024, max_num_seqs=1)))
    scheduler = front._engine.scheduler

    async def main() -> tuple[int | None, list[str]]:
        app = build_app(front)
        hog_started = asyncio.Event()

        async def hog():   # holds the only batch slot for far longer than the test
            async for _ in front.generate("hog", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True)):
                hog_started.set()

        hog_task = asyncio.create_task(hog())
        await hog_started.wait()
        body = {"model": front.served_model_name, "stream": True}
        if path == "/v1/chat/completions":
            body.update(messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        elif path == "/v1/responses":
            body.update(input="hi", max_output_tokens=5)
        else:
            body.update(prompt="hi", max_tokens=5)
        call = _Call(app, path, body, at_start=path == "/v1/completions")
        await asyncio.wait_for(call.run(), 30)
        await asyncio.sleep(0.3)   # the engine thread applies the abort on its next loop
        left = [r.request_id for q in (scheduler.running, scheduler.waiting) for r in list(q)]
        hog_task.cancel()
        return call.status, left

    try:
        status, left = asyncio.run(main())
    finally:
        front.shutdown()
    assert status == 200
    assert left == ["hog"], left


def test_a_caller_that_stops_reading_holds_one_output(model_dir):
    """Outputs are cumulative: while a caller does not read (a client that stops taking its stream), its request
    keeps only the newest output, not one per step; reading again gives the finished output, whole."""
    import gc

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import RequestOutput, SamplingParams

    front = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off",
                                                              max_model_len=1024)))

    def held() -> int:
        return sum(type(o) is RequestOutput and o.request_id == "slow" for o in gc.get_objects())

    async def main() -> tuple[int, RequestOutput]:
        stream = front.generate("slow", [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True))
        first = await anext(stream)
        assert not first.finished
        for _ in range(600):   # the engine runs the request to its end meanwhile
            await asyncio.sleep(0.05)
            if not front._engine.has_unfinished_requests():
                break
        await asyncio.sleep(0.1)   # the last outputs reach this loop
        del first
        count = held()
        last = await anext(stream)
        await stream.aclose()
        return count, last

    try:
        count, last = asyncio.run(main())
    finally:
        front.shutdown()
    assert count <= 2, count   # the mailbox's, and the engine thread's last step (300 were queued before)
    assert last.finished and len(last.outputs[0].token_ids) == 300


def test_a_cancelled_duplicate_id_leaves_the_live_request_alone(model_dir):
    """A second generate() with an id in use, cancelled before the engine answers it (its add then refused),
    must not abort the live request that holds the id."""
    import time

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=1024))
    step = engine.step

    def slow_step(*args, **kwargs):   # commands queue up while a step runs, as with a larger model
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.step = slow_step
    front = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        async def live():
            last = None
            async for out in front.generate("x", [5, 6, 7], params):
                last = out
            return last

        a = asyncio.create_task(live())
        await asyncio.sleep(0.2)   # "x" is running

        async def duplicate():
            async for _ in front.generate("x", [8, 9], params):
                pass

        b = asyncio.create_task(duplicate())
        await asyncio.sleep(0)     # its add is queued...
        b.cancel()                 # ...and its caller leaves before the engine refuses it
        await asyncio.gather(b, return_exceptions=True)
        return await a

    try:
        out = asyncio.run(main())
    finally:
        front.shutdown()
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_a_reader_that_stops_reading_holds_one_output_per_prompt():
    """Several prompts' streams merged (a completions request with a list of prompts): while the reader does not
    read, the merge stops pulling from the streams (their mailboxes merge outputs), instead of queueing every
    step's output without bound; reading on, every stream's outputs still come, each stream's last one last."""
    from types import SimpleNamespace

    from plinth.entrypoints.openai.serving import Started, merge

    steps, pulled = 500, [0, 0]

    class Stream:
        def __init__(self, i):
            self.i = i

        def __aiter__(self):
            return self

        async def __anext__(self):
            if pulled[self.i] == steps:
                raise StopAsyncIteration
            pulled[self.i] += 1
            await asyncio.sleep(0)
            return SimpleNamespace(finished=pulled[self.i] == steps, step=pulled[self.i])

        async def aclose(self):
            pass

    async def main():
        loop = asyncio.get_running_loop()
        firsts = [loop.create_future() for _ in range(2)]
        for f in firsts:
            f.set_result(SimpleNamespace(finished=False, step=0))
        merged = merge(Started([Stream(0), Stream(1)], firsts))
        got = [await merged.__anext__()]
        await asyncio.sleep(0.2)   # the reader stops reading for a while
        held = sum(pulled)
        async for item in merged:
            got.append(item)
        await merged.aclose()
        return held, got

    held, got = asyncio.run(main())
    assert held <= 4, held   # (it was every step of both streams: 1,000)
    for i in range(2):
        mine = [out.step for j, out in got if j == i]
        assert mine == list(range(steps + 1)) and got[[k for k, (j, _) in enumerate(got) if j == i][-1]][1].finished


def test_an_id_is_free_again_once_its_stream_is_left_or_aborted(model_dir):
    """A caller that leaves its stream (or aborts the id) and at once asks again under the same id gets a new
    request, not "already in use" (the aborted one's end is reported first); a caller still waiting on an aborted
    stream gets its end; non-string ids are refused to their caller and the loop goes on."""
    import time

    from plinth.config import EngineConfig
    from plinth.core.async_engine import AsyncLLMEngine
    from plinth.core.engine import LLMEngine
    from plinth.core.request import SamplingParams
    from plinth.core.scheduler import RequestRejectedError

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), selection="off", max_model_len=1024))
    step = engine.step

    def slow_step(*args, **kwargs):   # commands queue up while a step runs: the abort and the new add drain together
        time.sleep(0.03)
        return step(*args, **kwargs)

    engine.step = slow_step
    front = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = None

    async def full(rid):
        last = None
        async for out in front.generate(rid, [5, 6, 7, 8], params):
            last = out
        return last

    async def main():
        nonlocal alone
        alone = (await full("first")).outputs[0].token_ids
        for trial in range(3):
            rid = f"x{trial}"
            stream = front.generate(rid, [5, 6, 7, 8], params)
            async for _ in stream:
                break
            await stream.aclose()   # leaves early: aborted
            assert (await full(rid)).outputs[0].token_ids == alone
        # an abort by id while its caller still reads: that caller gets the abort, the id's new request runs
        waiting = front.generate("y", [5, 6, 7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(waiting)
        front.abort("y")
        new = asyncio.create_task(full("y"))
        ends = [out async for out in waiting]
        assert ends[-1].finished and ends[-1].outputs[0].finish_reason == "abort"
        assert (await new).outputs[0].token_ids == alone
        with pytest.raises(TypeError, match="request_id must be a string"):
            front.abort(123)
        for bad in (7, ["x"]):   # (a list cannot even key the loop's streams)
            with pytest.raises(RequestRejectedError, match="must be a string"):
                async for _ in front.generate(bad, [5, 6], params):
                    pass
        assert (await full("after")).outputs[0].token_ids == alone   # the loop went on
        assert front.is_healthy

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
    assert not engine.has_unfinished_requests()
