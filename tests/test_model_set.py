"""Several models behind one gateway (mesh/control/model_set.py, mesh/front/fronts.py).

The set's rules run first over engines the test scripts (a fake inside a unit test of the
code around it: which model loads, which idle one goes, what a request in use keeps).
Then `skippy serve` itself, as a user runs it, with three models on embedded Ray stages
and a memory budget that holds two: each answers by name, a request for the third unloads
the least recently used idle model first, and a model loaded again answers as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from skippy.mesh.control.engine import EngineInfo
from skippy.mesh.control.model_set import ModelSet, ModelSlot, UnknownModel
from skippy.topology.errors import OverCapacity
from skippy.topology.planner import PlanError
from skippy_cli import COMMAND


class ScriptedEngine:
    def __init__(self, name: str):
        self.info = EngineInfo(name, "", 64, 1, "digest-" + name)
        self.closed = False

    def status(self) -> dict:
        return {"serving": True, "detail": "1 of 1 pipeline(s) serving"}

    def stats(self) -> dict:
        return {"stages": [{"prefill_rows": 3}, {"prefill_rows": 5}],
                "plan": {"nodes": [{"name": "n1"}], "stages": [{"stage": 0}, {"stage": 1}]},
                "nodes": {"n1": {"resident_bytes": 10}}, "rebuilds": {"fault": 1}}

    async def close(self) -> None:
        self.closed = True


def scripted_set(sizes: dict[str, int], budget: int | None = None, **options):
    """A set of scripted models of these sizes, and the log of loads and unloads."""
    said: list[str] = []

    def slot(name: str, size: int) -> ModelSlot:
        return ModelSlot(name, lambda: ScriptedEngine(name), lambda: size)
    return ModelSet([slot(n, s) for n, s in sizes.items()], budget_bytes=budget,
                    say=said.append, **options), said


def loaded(models: ModelSet) -> list[str]:
    return [s.name for s in models.loaded()]


async def use(models: ModelSet, name: str) -> None:
    _, release = await models.hold(name)
    release()


def test_a_model_beyond_the_budget_unloads_the_least_recently_used_idle_one():
    async def run():
        models, said = scripted_set({"a": 1, "b": 1, "c": 1}, budget=2)
        models.load_at_start()
        assert loaded(models) == ["a", "b"]
        assert "model c loads on its first request" in said[-1]
        await use(models, "b")
        await use(models, "a")                 # b is now the least recently used
        engine, release = await models.hold("c")
        assert engine.info.model == "c" and loaded(models) == ["a", "c"]
        assert "unloading model b (to make room for c)" in said
        release()
        await use(models, None)                # the default: the first model
        assert [s.loads for s in models.slots.values()] == [1, 1, 1]
    asyncio.run(run())


def test_a_model_in_use_is_never_unloaded():
    async def run():
        models, _ = scripted_set({"a": 1, "b": 1, "c": 1}, budget=2, wait_s=0.2)
        models.load_at_start()
        _, end_a = await models.hold("a")
        _, end_b = await models.hold("b")
        with pytest.raises(OverCapacity, match="does not fit while a, b serve"):
            await models.hold("c")
        assert loaded(models) == ["a", "b"] and models.slots["c"].users == 0
        end_a()
        end_a()  # a second release of one hold changes nothing
        assert models.slots["a"].users == 0
        await use(models, "c")
        assert loaded(models) == ["b", "c"]
        end_b()
    asyncio.run(run())


def test_a_request_for_a_model_that_does_not_fit_waits_for_one_to_go_idle():
    async def run():
        models, said = scripted_set({"a": 1, "b": 1}, budget=1, wait_s=5.0)
        models.load_at_start()
        _, end_a = await models.hold("a")
        asyncio.get_running_loop().call_later(0.3, end_a)  # a's request ends meanwhile
        engine, release = await models.hold("b")
        assert engine.info.model == "b" and loaded(models) == ["b"]
        assert "unloading model a (to make room for b)" in said
        release()
    asyncio.run(run())


def test_requests_for_an_unloaded_model_share_one_load():
    async def run():
        models, said = scripted_set({"a": 1, "b": 1}, budget=1)
        models.load_at_start()
        held = await asyncio.gather(*(models.hold("b") for _ in range(4)))
        assert len({id(engine) for engine, _ in held}) == 1
        assert models.slots["b"].loads == 1 and said.count("loading model b ...") == 1
        for _, release in held:
            release()
    asyncio.run(run())


def test_a_model_larger_than_the_budget_and_an_unknown_one_are_refused():
    async def run():
        models, _ = scripted_set({"a": 1, "big": 5}, budget=2)
        models.load_at_start()
        with pytest.raises(OverCapacity, match="big needs"):
            await models.hold("big")
        with pytest.raises(UnknownModel):
            await models.hold("nope")
        assert loaded(models) == ["a"] and models.slots["a"].users == 0
    asyncio.run(run())


def test_the_planner_finding_no_room_unloads_an_idle_model_first():
    """Without a budget, the cluster's memory is the bound: the planner refuses a model
    that does not fit beside the loaded ones (PlanError), and an idle one goes."""
    async def run():
        said: list[str] = []
        slots: list[ModelSlot] = []

        def load(name: str):
            def make():
                if any(s.engine is not None for s in slots):
                    raise PlanError("no node has room for stage 0")
                return ScriptedEngine(name)
            return make
        slots += [ModelSlot(n, load(n)) for n in ("a", "b")]
        models = ModelSet(slots, say=said.append)
        models.load_at_start()
        assert loaded(models) == ["a"] and "b loads on its first request" in said[-1]
        await use(models, "b")
        assert loaded(models) == ["b"]
        _, release = await models.hold("b")
        models.wait_s = 0.2
        with pytest.raises(OverCapacity):  # b is in use: a has nowhere to go
            await models.hold("a")
        release()
    asyncio.run(run())


def test_a_model_idle_past_the_bound_unloads_and_loads_again_on_demand():
    async def run():
        models, said = scripted_set({"a": 1, "b": 1}, idle_unload_s=0.2)
        models.load_at_start()
        first, release = await models.hold("a")
        await asyncio.sleep(0.5)
        assert loaded(models) == ["a"], said  # b idled past the bound; a is held
        release()
        for _ in range(40):
            await asyncio.sleep(0.05)
            if not loaded(models):
                break
        assert not loaded(models) and first.closed, said
        again, release = await models.hold("a")
        assert again is not first and models.slots["a"].loads == 2
        release()
        await models.close()
    asyncio.run(run())


def test_the_figures_of_several_models_say_whose_stage_each_is():
    from skippy.mesh.front.metrics import stage_families
    from skippy.mesh.front.result_memo import ResultMemo
    models, _ = scripted_set({"a": 1, "b": 1})
    models.load_at_start()
    stats = models.stats()
    assert [s["label"] for s in stats["stages"]] == ["a/0", "a/1", "b/0", "b/1"]
    assert [(r["model"], r["stage"]) for r in stats["plan"]["stages"]] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert stats["nodes"] == {"n1": {"resident_bytes": 20}}
    assert stats["rebuilds"] == {"fault": 2}
    rows = {s.labels["stage"]: s.value for f in stage_families(stats, ResultMemo().stats())
            if f.name == "skippy_stage_prefill_rows" for s in f.samples}
    assert rows == {"a/0": 3, "a/1": 5, "b/0": 3, "b/1": 5}
    assert models.status()["serving"]


# -- `skippy serve` with several models ----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as r:
        return json.loads(r.read())


def _complete(url: str, model: str, prompt: str = "The capital of France is") -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read())}


def _planned(path, ctx: int) -> int:
    """What serve plans for the model on one node (the budget below is made of these)."""
    from skippy.mesh.control.ray_engine import planned_bytes
    from skippy.mesh.control.served_model import ServedModel
    from skippy.stages.runtime_kind import TORCH
    from skippy.topology.planner import NodeSpec
    node = NodeSpec(name="n", memory=2**40, cpus=2)
    return planned_bytes(ServedModel.open(path, TORCH, lambda _d: [node], n_ctx=ctx,
                                          weight_format="int4"), 1)


def test_serve_answers_each_model_by_name_and_unloads_the_idle_one_for_a_third(
        smollm2, qwen3_f32, lfm2_f32, tmp_path):
    ctx = 512
    sizes = [_planned(p, ctx) for p in (smollm2, qwen3_f32, lfm2_f32)]
    # the first two fit, the third does not beside them, but it does beside either
    budget = sizes[0] + sizes[1] + sizes[2] // 2
    assert sizes[2] // 2 < min(sizes[:2])
    port, log = _free_port(), tmp_path / "serve.log"
    names = ["smollm2", str(qwen3_f32), str(lfm2_f32)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*COMMAND, "serve", *(a for n in names for a in ("--model", n)),
             "--ctx", str(ctx), "--port", str(port),
             "--models-memory", f"{budget / 2**30:.6f}"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                _get(url + "/health")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        listed = _get(url + "/v1/models")["data"]
        assert [(m["id"], m["status"]["value"]) for m in listed] == [
            (names[0], "loaded"), (names[1], "loaded"), (names[2], "unloaded")]
        first = {n: _complete(url, n) for n in names[:2]}
        for n, answer in first.items():
            assert answer["model"] == n and answer["choices"][0]["text"], answer
        assert first[names[0]]["choices"][0]["text"] != first[names[1]]["choices"][0]["text"]
        third = _complete(url, names[2])  # smollm2 was used least recently: it goes
        assert third["model"] == names[2], third
        listed = {m["id"]: m["status"]["value"] for m in _get(url + "/v1/models")["data"]}
        assert listed == {names[0]: "unloaded", names[1]: "loaded", names[2]: "loaded"}
        text = log.read_text()
        assert f"unloading model smollm2 (to make room for {names[2]})" in text, text
        with ThreadPoolExecutor(2) as pool:  # the two loaded ones at once
            both = list(pool.map(lambda n: _complete(url, n, "Once upon a time"), names[1:]))
        assert [b["model"] for b in both] == names[1:], both
        again = _complete(url, names[0])  # loaded again: the same answer
        assert again["choices"][0]["text"] == first[names[0]]["choices"][0]["text"]
        text = log.read_text()  # one of the two idle ones, whichever ended first
        assert sum(f"unloading model {n} (to make room for smollm2)" in text
                   for n in names[1:]) == 1, text
        missing = _complete(url, "nope")
        assert missing["status"] == 404 and missing["error"]["code"] == "model_not_found"
        assert "smollm2" in missing["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
