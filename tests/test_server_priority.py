"""vLLM's `priority` field on the API: chat and text completions hand it to the engine's
scheduler; anything but an integer is a 400 that names it."""

from __future__ import annotations

import httpx
import pytest

BODIES = {"/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
          "/completions": {"prompt": "hi"}}


@pytest.mark.parametrize("path", BODIES)
def test_the_priority_field_reaches_the_engine(api, path, monkeypatch):
    engine = api.client.transport.engine
    priorities = []

    def add_request(*args, priority: int = 0, **options) -> str:
        priorities.append(priority)
        return add(*args, priority=priority, **options)

    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", add_request)
    for priority in (-3, 0, 7):
        body = {**BODIES[path], "priority": priority, "max_tokens": 2}
        assert httpx.post(api.url + path, json=body, timeout=120).status_code == 200
    assert httpx.post(api.url + path, json={**BODIES[path], "max_tokens": 2, "n": 2},
                      timeout=120).status_code == 200
    assert priorities == [-3, 0, 7, 0, 0]


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("priority", ["1", 1.5, True, None])
def test_a_priority_that_is_no_integer_is_a_400_naming_it(api, path, priority):
    response = httpx.post(api.url + path, json={**BODIES[path], "priority": priority,
                                                "max_tokens": 2}, timeout=120)
    assert response.status_code == 400
    assert "priority" in response.json()["error"]["message"]
