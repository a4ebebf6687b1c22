import dataclasses
import json

import pytest

from skippy.mesh import cli
from skippy.stages import qkernel
from skippy.topology import families
from skippy.topology.links import BOUNDARY_MS, Link
from skippy.topology.planner import (
    MiB,
    ModelFacts,
    NodeSpec,
    PlanError,
    check_cuts,
    even_ranges,
    load_nodes,
    local_node,
    plan,
    topology_digest,
)

GiB = 2**30


@pytest.mark.parametrize("layers, stages", [(30, 1), (30, 2), (30, 7), (18, 5), (5, 5)])
def test_even_ranges_cover_all_layers_contiguously(layers, stages):
    ranges = even_ranges(layers, stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a < b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(stages - 1))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("stages", [0, -1, 31])
def test_impossible_splits_are_refused(stages):
    with pytest.raises(PlanError):
        even_ranges(30, stages)


# -- a model with round numbers: 12 layers of 100 MiB, no KV, no embeddings ---------------------
def facts(n_layers=12, layer=100 * MiB, first=0, last=0, kv=0, keep=(), digest="m" * 64):
    return ModelFacts(name="toy", architecture="llama", model_digest=digest,
                      layer_bytes=(layer,) * n_layers, kv_bytes_per_token=(kv,) * n_layers,
                      state_bytes=(0,) * n_layers, first_bytes=first, last_bytes=last,
                      context_length=1024, keep_together=tuple(keep))


def node(name, mib, **kw):
    return NodeSpec(name, mib * MiB, **kw)


def toy_plan(nodes, **kw):
    kw.setdefault("overhead_bytes", 0)
    return plan(kw.pop("model", None) or facts(), nodes, **kw)


def assert_contiguous(p, n_layers):
    assert p.ranges[0][0] == 0 and p.ranges[-1][1] == n_layers
    assert all(a < b for a, b in p.ranges)
    assert all(p.ranges[i][1] == p.ranges[i + 1][0] for i in range(len(p.ranges) - 1))


def test_one_node_when_the_model_fits_there():
    p = toy_plan([node("a", 2000), node("b", 800)])
    assert [(s.node.name, s.start, s.end) for s in p.stages] == [("a", 0, 12)]


def test_fewest_stages_that_fit():
    p = toy_plan([node(f"n{i}", 500) for i in range(5)])
    assert len(p.stages) == 3  # 1200 MiB of layers: two 500 MiB nodes are not enough
    assert_contiguous(p, 12)
    assert all(s.total_bytes <= s.node.memory for s in p.stages)


def test_max_stages_caps_the_search():
    with pytest.raises(PlanError):
        toy_plan([node(f"n{i}", 500) for i in range(5)], max_stages=2)


def test_ranges_are_proportional_to_memory():
    p = toy_plan([node("small", 400), node("big", 800)], stages=2)
    assert [s.node.name for s in p.stages] == ["big", "small"]
    assert [s.n_layers for s in p.stages] == [8, 4]
    p = toy_plan([node("a", 1000), node("b", 1000), node("c", 1000)], stages=3)
    assert [s.n_layers for s in p.stages] == [4, 4, 4]


def test_stages_go_where_their_parts_already_are():
    # equal nodes: without parts the order is by name; with them, stage by stage
    nodes = [node("a", 1000), node("b", 1000), node("c", 1000)]
    p = toy_plan(nodes, stages=3)
    assert [s.node.name for s in p.stages] == ["a", "b", "c"]
    held = [node("a", 1000, layers=frozenset(range(8, 12))),
            node("b", 1000), node("c", 1000, layers=frozenset(range(0, 4)))]
    q = toy_plan(held, stages=3)
    assert [s.node.name for s in q.stages] == ["c", "b", "a"]
    assert q.ranges == p.ranges and q.digest == p.digest  # placement only


def test_parts_never_move_a_stage_onto_a_node_it_does_not_fit():
    # "small" holds the first layers, but stage 0 (8 layers) needs the big node
    nodes = [node("small", 450, layers=frozenset(range(0, 8))), node("big", 800)]
    p = toy_plan(nodes, stages=2)
    assert [(s.node.name, s.n_layers) for s in p.stages] == [("big", 8), ("small", 4)]
    # parts of the right stage on the small node: it keeps stage 1
    nodes = [node("small", 450, layers=frozenset(range(8, 12))), node("big", 800)]
    assert [s.node.name for s in toy_plan(nodes, stages=2).stages] == ["big", "small"]


def test_nodes_file_layers_take_numbers_and_ranges(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps([{"name": "a", "memory": "1GiB", "layers": [0, "3-5"]}]))
    assert load_nodes(path)[0].layers == frozenset({0, 3, 4, 5})
    path.write_text(json.dumps([{"name": "a", "memory": "1GiB", "layers": ["x"]}]))
    with pytest.raises(PlanError, match="layers must be numbers or ranges"):
        load_nodes(path)


def test_embeddings_and_head_count_against_the_end_stages():
    model = facts(first=200 * MiB, last=200 * MiB)
    p = toy_plan([node("a", 1000), node("b", 1000)], model=model, stages=2)
    assert [s.n_layers for s in p.stages] == [6, 6]
    assert p.stages[0].weight_bytes == 800 * MiB
    model = facts(first=400 * MiB)
    p = toy_plan([node("a", 1000), node("b", 1000)], model=model, stages=2)
    assert [s.n_layers for s in p.stages] == [4, 8]


def test_kv_for_context_and_lanes_is_part_of_every_stage():
    model = facts(kv=1024)  # 1 KiB per token per layer
    p = toy_plan([node("a", 4000)], model=model, n_ctx=512, lanes=2)
    assert p.stages[0].kv_bytes == 12 * 512 * 2 * 1024
    p = toy_plan([node("a", 4000)], model=model, n_ctx=10**6, lanes=1)
    assert p.n_ctx == 1024  # capped at the model's context length


def test_every_stage_gets_at_least_one_layer():
    model = facts(n_layers=3, first=900 * MiB)
    p = toy_plan([node("a", 1000), node("b", 10000), node("c", 10000)], model=model, stages=3)
    assert all(s.n_layers >= 1 for s in p.stages)
    with pytest.raises(PlanError, match="at least one layer"):
        toy_plan([node("a", 1000)] * 4, model=model, stages=4)


def test_more_stages_than_nodes_share_a_node():
    p = toy_plan([node("local", 3000)], stages=3)
    assert [s.node.name for s in p.stages] == ["local"] * 3
    assert [s.memory_share for s in p.stages] == [1000 * MiB] * 3
    assert_contiguous(p, 12)


def test_on_one_node_the_split_is_even_whatever_its_memory():
    """Stages sharing one node share its memory: it cannot weigh them against each other,
    so an in-process engine and an embedded Ray plan the same split anywhere."""
    model = facts(n_layers=30, first=150 * MiB, last=50 * MiB)
    for mib in (5000, 9000, 64000):
        p = toy_plan([node("local", mib)], model=model, stages=4)
        assert p.ranges == even_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(PlanError, match="exactly 4"):
        toy_plan([node("local", 3500)], model=model, stages=4)  # stage 0 holds 950 of 875


def test_a_callers_ranges_are_planned_as_given():
    nodes = [node("a", 2000), node("b", 800)]
    p = toy_plan(nodes, ranges=[(0, 10), (10, 12)])
    assert p.ranges == [(0, 10), (10, 12)] and [s.node.name for s in p.stages] == ["a", "b"]
    assert p.digest == topology_digest("m" * 64, [(0, 10), (10, 12)], "f16")
    assert [s.weight_bytes for s in p.stages] == [1000 * MiB, 200 * MiB]
    with pytest.raises(PlanError, match="exactly 2"):  # 1000 MiB of layers on 800 MiB
        toy_plan(nodes, ranges=[(0, 2), (2, 12)])
    for bad in ([(0, 5), (6, 12)], [(0, 12), (12, 12)], [(0, 5)], []):
        with pytest.raises(PlanError, match="contiguous"):
            toy_plan(nodes, ranges=bad)
    with pytest.raises(PlanError, match="keeps in one stage"):
        toy_plan(nodes, model=facts(keep=[(4, 8)]), ranges=[(0, 6), (6, 12)])


def test_caches_get_their_budget_or_the_room_a_node_leaves():
    nodes = [NodeSpec("big", 4000 * MiB), NodeSpec("small", 1100 * MiB)]
    p = plan(facts(n_layers=8, layer=100 * MiB), nodes, stages=2, overhead_bytes=0,
             cache_bytes=1000 * MiB)
    by_node = {s.node.name: s for s in p.stages}
    assert by_node["big"].cache_bytes == 1000 * MiB            # room for all it asks
    small = by_node["small"]                                   # only what is left
    assert small.cache_bytes == small.memory_share - small.total_bytes < 1000 * MiB
    # caches never move a stage or refuse a model: the same cut with or without them
    assert p.ranges == plan(facts(n_layers=8, layer=100 * MiB), nodes, stages=2,
                            overhead_bytes=0).ranges
    assert plan(facts(), [NodeSpec("n", 2000 * MiB)]).stages[0].cache_bytes is None


def test_a_stages_cache_settings_are_scaled_into_its_room():
    from skippy.cache.config import CacheConfig
    c = CacheConfig(max_bytes=3 * GiB, activation_max_bytes=1 * GiB)
    assert c.stage_bytes == 4 * GiB and c.within(None) is c and c.within(5 * GiB) is c
    half = c.within(2 * GiB)
    assert (half.max_bytes, half.activation_max_bytes) == (1536 * MiB, 512 * MiB)
    assert half.stage_bytes <= 2 * GiB and half.block_store_max_bytes == c.block_store_max_bytes


def test_overhead_is_counted_per_stage():
    p = plan(facts(), [node("a", 1300)], overhead_bytes=64 * MiB)
    assert p.stages[0].total_bytes == 1200 * MiB + 64 * MiB
    with pytest.raises(PlanError):
        plan(facts(), [node("a", 1300)], overhead_bytes=200 * MiB, max_stages=1)


def test_too_little_memory_in_total_says_needed_and_available():
    with pytest.raises(PlanError, match=r"needs at least 1\.17 GiB in total .* 0\.98 GiB"):
        toy_plan([node("a", 500), node("b", 500)])


def test_a_layer_larger_than_every_node_names_both():
    model = facts(n_layers=2, layer=700 * MiB)
    with pytest.raises(PlanError, match=r"largest layer 0 needs 700 MiB .* node, a, has 600 MiB"):
        toy_plan([node("a", 600), node("b", 600), node("c", 600)], model=model)


def test_keep_together_groups_are_never_cut():
    model = facts(keep=[(4, 8)])
    p = toy_plan([node("a", 1000), node("b", 1000)], model=model, stages=2)
    assert p.ranges in ([(0, 4), (4, 12)], [(0, 8), (8, 12)])
    plain = toy_plan([node("a", 1000), node("b", 1000)], stages=2)
    assert plain.ranges == [(0, 6), (6, 12)]
    with pytest.raises(PlanError, match="keeps in one stage"):
        check_cuts([(0, 6), (6, 12)], [(4, 8)])
    check_cuts([(0, 4), (4, 12)], [(4, 8)])


def test_a_group_larger_than_every_node_is_named():
    model = facts(keep=[(0, 8)])
    with pytest.raises(PlanError, match=r"layers 0-7 \(kept together\) needs 800 MiB"):
        toy_plan([node("a", 700), node("b", 700)], model=model)


def test_family_cut_rule_hook_reaches_the_plan(smollm2, monkeypatch):
    llama = families.FAMILIES["llama"]
    fake = dataclasses.replace(llama, keep_together=lambda cfg: [(cfg.n_layers // 2 - 2,
                                                                  cfg.n_layers // 2 + 2)])
    monkeypatch.setitem(families.FAMILIES, "llama", fake)
    model = ModelFacts.from_gguf(smollm2)
    assert model.keep_together == ((13, 17),)
    p = plan(model, [NodeSpec("a", 4 * GiB), NodeSpec("b", 4 * GiB)], stages=2)
    assert all(not (13 < end < 17) for _, end in p.ranges[:-1])
    assert p.ranges != [(0, 15), (15, 30)]


# -- digest --------------------------------------------------------------------------------------
def test_digest_ignores_node_names_and_order():
    nodes = [node("a", 600), node("b", 900), node("c", 600)]
    renamed = [node("z", 600, latency_ms=2.0), node("x", 600), node("y", 900)]
    p1, p2 = toy_plan(nodes, stages=3), toy_plan(renamed, stages=3)
    assert p1.ranges == p2.ranges
    assert p1.digest == p2.digest
    assert p1.digest == topology_digest("m" * 64, p1.ranges, "f16")


def test_digest_changes_with_ranges_model_and_wire():
    base = topology_digest("m" * 64, [(0, 6), (6, 12)], "f16")
    assert topology_digest("m" * 64, [(0, 5), (5, 12)], "f16") != base
    assert topology_digest("n" * 64, [(0, 6), (6, 12)], "f16") != base
    assert topology_digest("m" * 64, [(0, 6), (6, 12)], "f32") != base
    assert topology_digest("m" * 64, [(0, 12)], "f16") != base
    p1 = toy_plan([node("a", 1000), node("b", 1000)], stages=2)
    p2 = toy_plan([node("a", 1000), node("b", 500)], stages=2)
    assert p1.ranges != p2.ranges and p1.digest != p2.digest


# -- real models ---------------------------------------------------------------------------------
def test_smollm2_facts(smollm2):
    m = ModelFacts.from_gguf(smollm2)
    assert m.architecture == "llama" and m.n_layers == 30
    # tied head: the 49152 x 576 embeddings, fp32, on the first and again on the last stage
    assert m.first_bytes == 49152 * 576 * 4
    assert m.last_bytes == 49152 * 576 * 4 + 576 * 4
    # one layer: q, o 576x576; k, v 576x192; gate, up, down 576x1536; two norms
    per_layer = (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) * 4
    assert m.layer_bytes == (per_layer,) * 30
    assert m.kv_bytes_per_token == (3 * (64 + 64) * 4,) * 30  # 3 KV heads of 64, fp32
    assert m.state_bytes == (0,) * 30
    assert m.model_digest == ModelFacts.from_gguf(smollm2).model_digest


def test_gemma3_facts_and_split(gemma3):
    m = ModelFacts.from_gguf(gemma3)
    assert m.architecture == "gemma3" and m.n_layers == 18
    assert m.first_bytes == 262144 * 640 * 4
    assert m.kv_bytes_per_token == (1 * (256 + 256) * 4,) * 18
    p = plan(m, [NodeSpec("a", 2 * GiB), NodeSpec("b", 2 * GiB)], n_ctx=2048, lanes=2)
    assert len(p.stages) == 2  # 1.25 GiB of fp32 embeddings + head: one 2 GiB node is short
    assert all(s.total_bytes <= s.memory_share for s in p.stages)
    assert p.ranges[0][0] == 0 and p.ranges[-1][1] == 18


def test_different_models_have_different_digests(smollm2, gemma3):
    a, b = ModelFacts.from_gguf(smollm2), ModelFacts.from_gguf(gemma3)
    assert a.model_digest != b.model_digest
    assert ModelFacts.from_gguf(smollm2, model_digest="w" * 64).model_digest == "w" * 64


def test_synthetic_hybrid_counts_recurrent_state(lfm2_f32):
    m = ModelFacts.from_gguf(lfm2_f32)
    assert any(kv == 0 and st > 0 for kv, st in zip(m.kv_bytes_per_token, m.state_bytes))


# -- links ---------------------------------------------------------------------------------------
def test_links_choose_the_nodes_and_their_order():
    """A model that needs 2 of 3 equal nodes: the pair with the short link, in the order
    whose ends are near the gateway."""
    ab, ac, bc = Link(20.0), Link(1.0), Link(20.0)
    nodes = [node("a", 700, latency_ms=5.0, links={"b": ab, "c": ac}),
             node("b", 700, latency_ms=1.0, links={"c": bc}), node("c", 700, latency_ms=1.0)]
    p = toy_plan(nodes)
    assert [s.node.name for s in p.stages] == ["c", "a"] and len(p.ranges) == 2
    assert p.link_ms == pytest.approx(1.0 + 1.0 + BOUNDARY_MS + 5.0)
    assert "links: 8.0 ms a token (3 hops" in p.table()
    # without link figures: the memory order (names break the tie), as before
    plain = [dataclasses.replace(n, latency_ms=None, links={}) for n in nodes]
    p = toy_plan(plain)
    assert [s.node.name for s in p.stages] == ["a", "b"] and p.link_ms is None


def test_two_near_nodes_beat_one_far_node_and_one_near_node_beats_two():
    far = node("far", 2000, latency_ms=30.0)
    near = [node("n1", 700, latency_ms=1.0, links={"n2": Link(0.5)}),
            node("n2", 700, latency_ms=1.0)]
    p = toy_plan([far, *near])  # the whole model fits `far` alone
    assert sorted(s.node.name for s in p.stages) == ["n1", "n2"]
    assert p.link_ms == pytest.approx(1.0 + 0.5 + BOUNDARY_MS + 1.0)
    big_near = node("big", 1300, latency_ms=1.0)
    p = toy_plan([far, big_near, *near])  # one stage: 2 ms a token; two: 3.5
    assert [s.node.name for s in p.stages] == ["big"] and p.link_ms == 2.0


def test_a_slow_links_frame_transfer_counts():
    """Equal latencies: the link whose bandwidth takes longer for a frame loses (a 512-wide
    f16 row, 1 KiB, over 100 KiB/s is 10 ms)."""
    model = dataclasses.replace(facts(), hidden=512)
    nodes = [node("a", 700, latency_ms=1.0, links={"b": Link(1.0, 100 * 1024),
                                                   "c": Link(1.0, 1e9)}),
             node("b", 700, latency_ms=1.0), node("c", 700, latency_ms=1.0)]
    p = toy_plan(nodes, model=model)
    assert {s.node.name for s in p.stages} == {"a", "c"}
    assert p.link_ms < 6.0
    p = toy_plan(nodes, model=model, wire_dtype="f32")  # twice the bytes: still a-c
    assert {s.node.name for s in p.stages} == {"a", "c"}


def test_nodes_file_links(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps([
        {"name": "a", "memory": "1GiB", "latency_ms": 1, "links": {"b": 2.5}},
        {"name": "b", "memory": "1GiB", "links": {"a": {"latency_ms": 3, "bandwidth": 1e8}}}]))
    a, b = load_nodes(path)
    assert a.links == {"b": Link(2.5)} and b.links == {"a": Link(3.0, 1e8)}
    for bad, message in (({"b": -1}, "latency_ms must be a number >= 0"),
                         ({"b": {"bandwidth": 0}}, "bandwidth must be a number >= 1"),
                         ({"b": {"latency": 1}}, "must be a latency in ms or"),
                         (["b"], "links must map node names")):
        path.write_text(json.dumps([{"name": "a", "memory": "1GiB", "links": bad}]))
        with pytest.raises(PlanError, match=message):
            load_nodes(path)


# -- nodes ---------------------------------------------------------------------------------------
def test_nodes_file_accepts_sizes_and_bytes(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps([
        {"name": "a", "memory": "8GiB", "cpus": 4, "resources": {"skippy_node_0": 1}},
        {"name": "b", "memory": 1500000000, "latency_ms": 0.5}]))
    a, b = load_nodes(path)
    assert a.memory == 8 * GiB and a.cpus == 4 and a.resources == {"skippy_node_0": 1}
    assert b.memory == 1500000000 and b.latency_ms == 0.5 and b.cpus == 1


@pytest.mark.parametrize("entry, message", [
    ({"name": "a", "memory": "8G"}, "not a byte size"),
    ({"name": "a", "memory": -1}, "positive"),
    ({"memory": "1GiB"}, "name"),
    ({"name": "a", "memory": "1GiB", "ram": 3}, "unknown field"),
    ({"name": "a", "memory": "1GiB", "cpus": 0}, "cpus"),
])
def test_bad_nodes_are_refused(tmp_path, entry, message):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(PlanError, match=message):
        load_nodes(path)


def test_local_node_reads_mem_available(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:  16000000 kB\nMemAvailable:   8000000 kB\n")
    assert local_node(info).memory == 8000000 * 1024
    assert local_node().memory > 0


# -- the command ---------------------------------------------------------------------------------
def nodes_file(tmp_path, *mib):
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps([{"name": f"n{i}", "memory": f"{m}GiB" if isinstance(m, str)
                                 else m * MiB} for i, m in enumerate(mib)]))
    return str(path)


def test_cli_plan_table(smollm2, tmp_path, capsys):
    nodes = nodes_file(tmp_path, 1200, 1200)
    rc = cli.main(["plan", "--model", "smollm2", "--nodes", nodes, "--ctx", "1024",
                   "--lanes", "4", "--weight-format", "fp32"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["STAGE", "NODE", "LAYERS"]
    # fp32: more than one node holds at this context; the last stage has the fp32 head;
    # each stage's caches get what its node leaves (2.5 GiB asked: more than there is)
    assert lines[0].split()[7:9] == ["CACHES", "MiB"]
    assert lines[1].split() == ["0", "n0", "0-15", "246.4", "96.0", "346", "1200", "/", "1200"]
    assert lines[2].split() == ["1", "n1", "16-29", "297.1", "84.0", "307", "1200", "/", "1200"]
    assert lines[-1].startswith("topology digest ") and len(lines[-1].split()[-1]) == 64
    # int4 (serve's default): the file's Q4_1 blocks with a scale (a half) and a zero per block,
    # (a bf16 copy for prefill only on torch's int kernels, without a C compiler): the
    # whole model fits one node
    assert cli.main(["plan", "--model", "smollm2", "--nodes", nodes, "--ctx", "1024",
                     "--lanes", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    weights, total = ("162.6", "855") if qkernel.library() is not None else ("373.1", "1065")
    cache = str(1200 - int(total))
    assert lines[1].split() == ["0", "n0", "0-29", weights, "180.0", cache, "1200", "/", "1200"]


def test_cli_plan_json_with_stages(smollm2, capsys):
    rc = cli.main(["plan", "--model", "smollm2", "--stages", "3", "--ctx", "512", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [s["layers"] for s in data["stages"]] == [[0, 10], [10, 20], [20, 30]]
    assert len(data["topology_digest"]) == 64
    assert all(s["total_bytes"] <= s["memory_share"] for s in data["stages"])


def test_cli_plan_errors_are_one_line_exit_2(smollm2, tmp_path, capsys):
    rc = cli.main(["plan", "--model", "smollm2", "--nodes", nodes_file(tmp_path, 300, 300)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("skippy: error: ") and err.count("\n") == 1
    assert "GiB in total" in err
    assert cli.main(["plan", "--model", "smollm2", "--nodes", str(tmp_path / "none")]) == 2
    assert "cannot read nodes file" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "no-such-model"]) == 2
