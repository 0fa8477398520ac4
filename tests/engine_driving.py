"""Drive an engine through requests that arrive at given steps and aborts at given steps (tests)."""

from __future__ import annotations

from typing import Any


def drive(engine: Any, reqs: list, aborts: dict[str, int], max_steps: int) -> dict[str, Any]:
    """Step ``engine`` until every request of ``reqs`` (``(arrival step, id, prompt, params)``) has finished,
    aborting ``aborts`` (``{id: step}``) on their steps; returns ``{id: final RequestOutput}``. Asserts that
    each request finishes once, all of them finish within ``max_steps`` and every KV block is free after."""
    done, step = {}, 0
    todo = sorted(reqs, key=lambda r: r[0])
    while todo or engine.has_unfinished_requests():
        while todo and todo[0][0] <= step:
            _, rid, prompt, params = todo.pop(0)
            engine.add_request(rid, prompt, params)
        engine.abort_request([rid for rid, at in aborts.items() if at == step])
        for o in engine.step():
            if o.finished:
                assert o.request_id not in done
                done[o.request_id] = o
        step += 1
        assert step < max_steps
    assert set(done) == {r[1] for r in reqs}
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    return done
