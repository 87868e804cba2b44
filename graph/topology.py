"""The error-code topology: a networkx DiGraph over catalog codes.

Edges point from a cause to its effect and carry the catalog's prior
``strength`` (a probability-like weight in (0, 1]) and ``cost = -ln(strength)``,
so the most probable chain is a shortest path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import cache

import networkx as nx

from graph.catalog import Catalog, default_catalog

__all__ = [
    "STRENGTH",
    "COST",
    "LAYER",
    "FAMILY",
    "build_topology",
    "default_topology",
    "validate_topology",
    "paths_to_symptom",
    "ancestors",
    "descendants",
    "best_chain",
    "chain_strength",
    "chain_cost",
]

STRENGTH = "strength"
COST = "cost"
LAYER = "layer"
FAMILY = "family"


def build_topology(catalog: Catalog) -> nx.DiGraph:
    """One node per code (attributes ``layer``, ``family``), one edge per prior."""
    g = nx.DiGraph(catalog_version=catalog.version)
    for code in catalog:
        g.add_node(code.name, **{LAYER: code.layer, FAMILY: code.family})
    for code in catalog:
        for edge in code.causes:
            g.add_edge(
                code.name, edge.code, **{STRENGTH: edge.strength, COST: -math.log(edge.strength)}
            )
    validate_topology(g)
    return g


@cache
def default_topology() -> nx.DiGraph:
    """The shipped topology, frozen (so reachability can be cached on it)."""
    return nx.freeze(build_topology(default_catalog()))


def validate_topology(g: nx.DiGraph) -> None:
    """Raise ValueError naming the first node or edge that breaks the rules."""
    for node, data in g.nodes(data=True):
        if LAYER not in data or FAMILY not in data:
            raise ValueError(f"topology node {node} lacks '{LAYER}' or '{FAMILY}'")
    for u, v, data in g.edges(data=True):
        s = data.get(STRENGTH)
        if s is None or not 0 < s <= 1:
            raise ValueError(f"topology edge {u} -> {v} has strength {s!r}, not in (0, 1]")


def _reach(g: nx.DiGraph, code: str, up: bool) -> set[str]:
    if code not in g:
        return set()
    if not nx.is_frozen(g):
        return nx.ancestors(g, code) if up else nx.descendants(g, code)
    memo = g.graph.setdefault("_reach", {})  # frozen graphs never change: memoize
    key = (code, up)
    if key not in memo:
        memo[key] = frozenset(nx.ancestors(g, code) if up else nx.descendants(g, code))
    return set(memo[key])


def ancestors(g: nx.DiGraph, code: str) -> set[str]:
    """Every code from which ``code`` can be reached: its possible causes."""
    return _reach(g, code, up=True)


def descendants(g: nx.DiGraph, code: str) -> set[str]:
    """Every code reachable from ``code``: its possible effects."""
    return _reach(g, code, up=False)


def paths_to_symptom(
    g: nx.DiGraph, cause: str, symptom: str, *, cutoff: int = 8, limit: int = 20
) -> list[list[str]]:
    """Simple paths from a candidate cause to a symptom, most probable first.

    >>> from graph.catalog import load_catalog
    >>> g = build_topology(load_catalog())
    >>> paths_to_symptom(g, "GPU_XID_48", "HTTP_500")[0][0]
    'GPU_XID_48'
    """
    if cause not in g or symptom not in g:
        return []
    try:
        gen = nx.shortest_simple_paths(g, cause, symptom, weight=COST)
        out: list[list[str]] = []
        for path in gen:
            if len(path) - 1 > cutoff:
                continue
            out.append(path)
            if len(out) >= limit:
                break
        return out
    except nx.NetworkXNoPath:
        return []


def chain_strength(g: nx.DiGraph, chain: list[str]) -> float:
    """Product of the prior strengths along a chain (1.0 for a single node)."""
    p = 1.0
    for u, v in zip(chain, chain[1:], strict=False):
        p *= g.edges[u, v][STRENGTH]
    return p


def best_chain(
    g: nx.DiGraph,
    cause: str,
    symptom: str,
    observed: Iterable[str] | Mapping[str, float] = (),
    *,
    unobserved_cost: float = 1.0,
) -> list[str] | None:
    """The most probable chain from cause to symptom, preferring observed codes.

    Each hop costs ``-ln(strength)``, plus ``unobserved_cost`` when it lands on a
    code with no evidence: a chain through what was actually seen beats a
    slightly stronger one through what was not. ``observed`` may map a code to
    its own extra hop cost (e.g. by how close its evidence is to the trace).
    """
    if cause not in g or symptom not in g:
        return None
    if cause == symptom:
        return [cause]
    extra = dict(observed) if isinstance(observed, Mapping) else dict.fromkeys(observed, 0.0)
    extra[symptom] = 0.0

    def weight(u: str, v: str, data: dict) -> float:
        return data[COST] + extra.get(v, unobserved_cost)

    try:
        return nx.dijkstra_path(g, cause, symptom, weight=weight)
    except nx.NetworkXNoPath:
        return None


def chain_cost(
    g: nx.DiGraph,
    chain: list[str],
    observed: Mapping[str, float],
    *,
    unobserved_cost: float = 1.0,
) -> float:
    """The cost :func:`best_chain` minimizes, for a given chain (0 for one node)."""
    extra = dict(observed)
    extra[chain[-1]] = 0.0
    return sum(
        g.edges[u, v][COST] + extra.get(v, unobserved_cost)
        for u, v in zip(chain, chain[1:], strict=False)
    )
