from __future__ import annotations

import pytest

from graph.topology import (
    ancestors,
    best_chain,
    build_topology,
    chain_strength,
    descendants,
    paths_to_symptom,
)
from rca.engine import Evidence, Scope, rank_root_causes, symptom_from_spans

S = 1_000_000_000


def ev(code: str, t: float, scope: str = Scope.TRACE, i: int = 0) -> Evidence:
    return Evidence(event_id=f"{code}-{i}", code=code, ts=int(t * S), scope=scope)


@pytest.fixture
def g(mini_catalog):
    return build_topology(mini_catalog)


def test_topology_paths_and_ancestors(g) -> None:
    paths = paths_to_symptom(g, "GPU_XID_48", "HTTP_500")
    assert paths[0] == ["GPU_XID_48", "CUDA_ERROR_ECC_UNCORRECTABLE", "ENGINE_DEAD", "HTTP_500"]
    assert ["GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN", "HTTP_500"] in paths
    assert chain_strength(g, paths[0]) == pytest.approx(0.9 * 0.9 * 0.9)
    assert {"GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "ENGINE_DEAD"} <= ancestors(g, "HTTP_500")
    assert "HTTP_500" in descendants(g, "GPU_XID_48")
    assert paths_to_symptom(g, "HTTP_500", "GPU_XID_48") == []
    assert ancestors(g, "NOT_A_CODE") == set()


def test_best_chain_prefers_observed_codes(g) -> None:
    assert best_chain(g, "GPU_XID_48", "HTTP_500") == [
        "GPU_XID_48",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "ENGINE_DEAD",
        "HTTP_500",
    ]
    assert best_chain(g, "GPU_XID_48", "HTTP_500", {"KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN"}) == [
        "GPU_XID_48",
        "KV_BLOCK_HASH_MISMATCH",
        "LOGITS_NAN",
        "HTTP_500",
    ]


def test_planted_hardware_root_beats_its_effects_and_noise(g, mini_catalog) -> None:
    evidence = [
        ev("SCHEDULER_PREEMPTION", 1.0, Scope.HOST),  # benign noise
        ev("KV_CACHE_NO_FREE_BLOCKS", 1.5, Scope.HOST),
        ev("GPU_XID_48", 10.0, Scope.GPU),
        ev("GPU_XID_63", 10.1, Scope.GPU),
        ev("KV_BLOCK_HASH_MISMATCH", 10.3),
        ev("LOGITS_NAN", 10.4),
    ]
    symptom, causes = rank_root_causes(
        g, evidence, catalog=mini_catalog, symptom="HTTP_500", symptom_ts=int(10.5 * S)
    )
    assert symptom == "HTTP_500"
    top = causes[0]
    assert top.code == "GPU_XID_48" and top.rank == 1
    assert top.chain == ["GPU_XID_48", "KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN", "HTTP_500"]
    assert top.evidence[:3] == ["GPU_XID_48-0", "KV_BLOCK_HASH_MISMATCH-0", "LOGITS_NAN-0"]
    assert [c.code for c in causes[1:3]] == ["KV_BLOCK_HASH_MISMATCH", "LOGITS_NAN"]
    assert sum(c.score for c in causes) <= 1.0 + 1e-9
    assert top.score > 0.5


def test_a_cause_after_the_symptom_is_not_preferred(g, mini_catalog) -> None:
    # OOM first, then the engine dies, then the 500; an Xid 48 logged a minute later
    evidence = [
        ev("TORCH_CUDA_OOM", 5.0),
        ev("ENGINE_DEAD", 5.5, Scope.HOST),
        ev("GPU_XID_48", 70.0, Scope.GPU),
    ]
    _, causes = rank_root_causes(
        g, evidence, catalog=mini_catalog, symptom="HTTP_500", symptom_ts=int(6 * S)
    )
    assert causes[0].code == "TORCH_CUDA_OOM"
    assert causes[0].chain == ["TORCH_CUDA_OOM", "ENGINE_DEAD", "HTTP_500"]


def test_without_spans_the_symptom_is_the_highest_trace_code(g, mini_catalog) -> None:
    evidence = [ev("TORCH_CUDA_OOM", 1.0), ev("ENGINE_DEAD", 2.0), ev("HTTP_500", 3.0)]
    symptom, causes = rank_root_causes(g, evidence, catalog=mini_catalog)
    assert symptom == "HTTP_500"
    assert causes[0].code == "TORCH_CUDA_OOM"


def test_without_spans_the_symptom_is_the_end_of_the_observed_chain() -> None:
    """A higher layer is not a later effect: FlashAttention refused on an old GPU
    (layer 6, at load time) stops a TGI shard (layer 5). The symptom is the code
    that explains no other observed code, whatever its layer."""
    from graph.catalog import default_catalog
    from graph.topology import default_topology

    cat, topo = default_catalog(), default_topology()
    assert cat["FLASH_ATTN_UNSUPPORTED_GPU"].layer > cat["TGI_SHARD_FAILED"].layer
    evidence = [ev("FLASH_ATTN_UNSUPPORTED_GPU", 1.0), ev("TGI_SHARD_FAILED", 2.0)]
    symptom, causes = rank_root_causes(topo, evidence, catalog=cat, unconnected=True)
    assert symptom == "TGI_SHARD_FAILED"
    assert causes[0].code == "FLASH_ATTN_UNSUPPORTED_GPU"
    assert causes[0].chain == ["FLASH_ATTN_UNSUPPORTED_GPU", "TGI_SHARD_FAILED"]
    # with no known causation between them, the highest layer is still the symptom
    other = [ev("FLASH_ATTN_UNSUPPORTED_GPU", 1.0), ev("GPU_XID_79", 2.0)]
    assert rank_root_causes(topo, other, catalog=cat)[0] == "FLASH_ATTN_UNSUPPORTED_GPU"


def test_a_postmortem_links_no_guess_and_nothing_later_to_the_symptom() -> None:
    """With no known path, a postmortem links an observed code weakly to the
    symptom - but not a code only the learned fallback guessed (a guess at a
    worker's "main process disappeared!" took a weights load failure's place,
    round 10), and not one first seen after the symptom."""
    import dataclasses

    from graph.catalog import default_catalog
    from graph.topology import default_topology

    cat, topo = default_catalog(), default_topology()
    load, worker = "MODEL_WEIGHTS_LOAD_FAILED", "DIST_WORKER_GROUP_FAILED"
    assert cat[load].layer == cat[worker].layer
    guess = dataclasses.replace(ev(worker, 1.0), confidence=0.62, guess=True)
    symptom, causes = rank_root_causes(topo, [ev(load, 1.0), guess], catalog=cat, unconnected=True)
    assert symptom == load  # a pattern's line before a guess of the same layer
    assert [c.code for c in causes] == [load]
    # named by a pattern and seen first, the other code is linked and ranked
    _, causes = rank_root_causes(
        topo, [ev(worker, 1.0), ev(load, 2.0)], catalog=cat, symptom=load, unconnected=True
    )
    assert causes[0].code == worker and causes[0].chain == [worker, load]
    # seen a minute after the symptom, it is not
    _, causes = rank_root_causes(
        topo, [ev(load, 1.0), ev(worker, 61.0)], catalog=cat, symptom=load, unconnected=True
    )
    assert [c.code for c in causes] == [load]


def test_symptom_itself_when_nothing_explains_it(g, mini_catalog) -> None:
    symptom, causes = rank_root_causes(g, [ev("HTTP_504", 1.0)], catalog=mini_catalog)
    assert symptom == "HTTP_504"
    assert [c.code for c in causes] == ["HTTP_504"] and causes[0].chain == ["HTTP_504"]


def test_symptom_from_spans_prefers_the_root_server_span(mini_catalog) -> None:
    spans = [
        {
            "kind": "INTERNAL",
            "parent_span_id": "p",
            "http_status": None,
            "status_code": "ERROR",
            "start_ns": 1,
            "end_ns": 2,
        },
        {
            "kind": "SERVER",
            "parent_span_id": None,
            "http_status": 503,
            "status_code": "ERROR",
            "start_ns": 1,
            "end_ns": 3,
        },
    ]
    assert symptom_from_spans(spans, mini_catalog) == ("HTTP_503", 3)
    assert symptom_from_spans(
        [{**spans[1], "http_status": 200, "status_code": "UNSET"}], mini_catalog
    ) == (None, 0)


def test_memoized_reachability_on_the_frozen_topology_matches_networkx() -> None:
    import networkx as nx

    from graph.topology import default_topology

    g = default_topology()
    assert nx.is_frozen(g)
    for code in list(g)[:60]:
        assert ancestors(g, code) == nx.ancestors(g, code)
        assert descendants(g, code) == nx.descendants(g, code)
    # a modified copy is not frozen and is not served from the memo
    h = g.copy()
    h.add_edge("HTTP_500", "GPU_XID_48", strength=0.5, cost=0.7)
    assert "GPU_XID_48" in descendants(h, "HTTP_500")
    assert "GPU_XID_48" not in descendants(g, "HTTP_500")
