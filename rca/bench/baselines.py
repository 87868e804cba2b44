"""Baselines for the accuracy benchmark, on the same evidence our ranking sees.

Each takes one incident's :class:`rca.query.Gathered` and returns catalog
codes, best first:

* :func:`earliest_error`: the earliest error record first (ties: lower layer);
* :func:`most_severe`: catalog severity, then lower layer, then earliest;
* :func:`pagerank`: MicroRCA-style personalized PageRank on the topology
  induced on the observed codes plus the symptom, edges reversed (effect ->
  cause) so rank flows from symptoms to causes, personalized by how anomalous
  each code is (rows, severity, confidence).

The RCAEval methods (BARO, NSigma, CIRCA) are in :mod:`rca.bench.rcaeval_adapter`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import networkx as nx

from graph.catalog import SEVERITY_RANK, Catalog, Severity, default_catalog
from graph.topology import STRENGTH, default_topology

if TYPE_CHECKING:
    from rca.engine import Evidence
    from rca.query import Gathered

__all__ = ["BASELINES", "earliest_error", "most_severe", "pagerank"]

_ERROR = SEVERITY_RANK[Severity.ERROR]


def _rank(severity: str | None, default: int = 0) -> int:
    try:
        return SEVERITY_RANK[Severity(severity)]
    except (KeyError, ValueError):
        return default


def _sev(code: str, catalog: Catalog) -> int:
    c = catalog.get(code)
    return _rank(c.severity) if c else 0


def _layer(code: str, catalog: Catalog) -> int:
    c = catalog.get(code)
    return c.layer if c else 8


def _dedupe(codes: list[str]) -> list[str]:
    return list(dict.fromkeys(codes))


def _evidence(g: Gathered, catalog: Catalog) -> list[Evidence]:
    return [e for e in g.evidence if e.code in catalog]


def earliest_error(g: Gathered, catalog: Catalog | None = None) -> list[str]:
    """Codes by their earliest record: error-level records first, ties by lower layer."""
    cat = catalog or default_catalog()
    evs = _evidence(g, cat)

    def key(e: Evidence) -> tuple[bool, int, int, str]:
        return (_rank(e.severity, _ERROR) < _ERROR, e.ts, _layer(e.code, cat), e.code)

    return _dedupe([e.code for e in sorted(evs, key=key)])


def most_severe(g: Gathered, catalog: Catalog | None = None) -> list[str]:
    """Codes by catalog severity (highest first), then lower layer, then earliest."""
    cat = catalog or default_catalog()
    first: dict[str, int] = {}
    for e in _evidence(g, cat):
        first[e.code] = min(e.ts, first.get(e.code, e.ts))
    return sorted(first, key=lambda c: (-_sev(c, cat), _layer(c, cat), first[c], c))


def pagerank(g: Gathered, catalog: Catalog | None = None, *, alpha: float = 0.85) -> list[str]:
    """Personalized PageRank over the observed part of the topology (MicroRCA-style)."""
    cat = catalog or default_catalog()
    topo = default_topology()
    evs = _evidence(g, cat)
    if not evs:
        return []
    strength: dict[str, float] = {}
    for code in {e.code for e in evs}:
        mine = [e for e in evs if e.code == code]
        rows = sum(e.count for e in mine)
        conf = max(e.confidence for e in mine)
        strength[code] = math.log1p(rows) * (1 + _sev(code, cat)) * max(conf, 0.05)
    nodes = set(strength) | ({g.symptom} if g.symptom else set())
    sub = nx.DiGraph()
    sub.add_nodes_from(nodes)
    for u, v, d in topo.subgraph([n for n in nodes if n in topo]).edges(data=True):
        sub.add_edge(v, u, weight=d.get(STRENGTH, 1.0))  # effect -> cause
    for u, v, p in g.extra_edges:
        if u in nodes and v in nodes:
            sub.add_edge(v, u, weight=p)
    for u, v in g.drop_edges:
        if sub.has_edge(v, u):
            sub.remove_edge(v, u)
    pers = dict(strength)
    if g.symptom and g.symptom not in pers:  # the walk starts from the symptom too
        pers[g.symptom] = max(strength.values())
    pr = nx.pagerank(sub, alpha=alpha, personalization=pers, weight="weight")
    ranked = sorted(strength, key=lambda c: (-pr.get(c, 0.0), _layer(c, cat), c))
    if g.symptom in ranked and len(ranked) > 1:  # the symptom is the effect, not an answer
        ranked.remove(g.symptom)
        ranked.append(g.symptom)
    return ranked


#: name -> function, in the order the benchmark prints them
BASELINES = {"earliest": earliest_error, "most_severe": most_severe, "pagerank": pagerank}
