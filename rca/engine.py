"""Rank the root causes of one failed trace (or one set of evidence).

Plain functions over the topology (networkx) and typed results. The score of a
candidate cause is a log-linear model over interpretable features (chain prior,
how much of the observed evidence it explains, whether anything observed
explains *it*, time order, scope, depth, confidence); ``Weights`` holds the
coefficients so they can be calibrated on labelled incidents.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import networkx as nx

from graph.catalog import SEVERITY_RANK, Catalog, Severity
from graph.topology import COST, STRENGTH, ancestors, best_chain, chain_cost, descendants
from ingest.xid import sm_fault_verdict

__all__ = [
    "Evidence",
    "RootCause",
    "Diagnosis",
    "Weights",
    "Scope",
    "rank_root_causes",
    "evidence_from_rows",
    "evidence_from_groups",
    "symptom_from_spans",
    "sm_rule_edges",
]


#: How an evidence row relates to the trace under question.
class Scope:
    TRACE = "trace"
    REQUEST = "request"
    GPU = "gpu"
    HOST = "host"
    #: an Xid the driver attributes to another process than the trace's own
    OTHER_PROCESS = "other_process"


SCOPE_WEIGHT = {
    Scope.TRACE: 1.0,
    Scope.REQUEST: 1.0,
    Scope.GPU: 0.8,
    Scope.HOST: 0.6,
    Scope.OTHER_PROCESS: 0.2,
}
#: Extra cost of a chain hop onto a code, by the best scope of its evidence: a
#: chain through the trace's own evidence beats one through the host's.
SCOPE_HOP_COST = {
    Scope.TRACE: 0.0,
    Scope.REQUEST: 0.0,
    Scope.GPU: 0.3,
    Scope.HOST: 0.5,
    Scope.OTHER_PROCESS: 1.5,
}
#: Strength of the link given to evidence the topology does not connect (postmortems).
WEAK_LINK = 0.05
#: Evidence later than the symptom by more than this cannot sit on its chain.
CHAIN_TOLERANCE_NS = 250_000_000
CLOCK_SKEW_NS = 2_000_000_000  # tolerated disagreement between clocks of two sources


@dataclass(frozen=True, slots=True)
class Evidence:
    event_id: str
    code: str
    ts: int
    scope: str = Scope.TRACE
    confidence: float = 1.0
    severity: str = "error"
    message: str | None = None
    source: str | None = None
    count: int = 1  # rows this item stands for (context is aggregated per code and scope)
    more_ids: tuple[str, ...] = ()  # further event ids of the same group
    guess: bool = False  # named only by the learned fallback (a line no pattern knows)


@dataclass(frozen=True)
class Weights:
    chain: float = 1.0  # on -(cost of the chain): ln(strengths) minus unobserved hops
    coverage: float = 3.0  # fraction of the other observed codes the cause explains
    rootness: float = 2.0  # 1 if no observed code explains this one
    temporal: float = 1.0  # fraction of explained evidence that comes after it
    late: float = -4.0  # first seen after the symptom (beyond clock skew)
    scope: float = 1.0
    depth: float = 0.8  # (7 - layer) / 6
    confidence: float = 0.5
    support: float = 0.2  # ln(1 + rows of evidence)

    @classmethod
    def names(cls) -> list[str]:
        """The feature names, in the order of the fields."""
        return [f.name for f in fields(cls)]

    def to_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in self.names()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Weights:
        """Weights from a mapping; missing names keep their hand-set default."""
        unknown = set(data) - set(cls.names())
        if unknown:
            raise ValueError(f"unknown weight name(s): {', '.join(sorted(unknown))}")
        return cls(**{k: float(v) for k, v in data.items()})

    @classmethod
    def load(cls, path: str | Path) -> Weights:
        """Read weights from a TOML file (a ``[weights]`` table or top-level keys) or JSON."""
        import tomllib

        from graph.errors import InputError

        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
            if isinstance(data.get("weights"), dict):
                data = data["weights"]
            return cls.from_dict({k: v for k, v in data.items() if not isinstance(v, dict)})
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise InputError(f"cannot read weights from {p}: {exc}") from None

    def save(self, path: str | Path, *, comment: str = "") -> Path:
        """Write the weights as TOML (a ``[weights]`` table), or JSON for a ``.json`` path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".json":
            p.write_text(json.dumps({"weights": self.to_dict()}, indent=2) + "\n", "utf-8")
            return p
        head = "".join(f"# {line}\n" for line in comment.splitlines())
        body = "".join(f"{k} = {v!r}\n" for k, v in self.to_dict().items())
        p.write_text(f"{head}[weights]\n{body}", encoding="utf-8")
        return p


@dataclass(frozen=True)
class RootCause:
    rank: int
    code: str
    family: str
    layer: int
    score: float
    chain: list[str]
    evidence: list[str]
    action: str
    observed: list[str] = field(default_factory=list)  # codes on the chain with evidence
    features: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "code": self.code,
            "family": self.family,
            "layer": self.layer,
            "score": round(self.score, 4),
            "chain": list(self.chain),
            "evidence": list(self.evidence),
            "action": self.action,
            "observed": list(self.observed),
        }


@dataclass(frozen=True)
class Diagnosis:
    trace_id: str | None
    symptom: str | None
    causes: list[RootCause]
    window: tuple[int, int] | None = None
    evidence_rows: int = 0
    topology_version: int = 1
    notes: list[str] = field(default_factory=list)
    evidence: list[dict[str, Any]] = field(default_factory=list)
    #: postmortem: lines that read like faults but that no code names (file,
    #: line, redacted text, the model's family hint and its probability): not
    #: evidence, shown so an unfamiliar error is not silently dropped
    unclassified: list[dict[str, Any]] = field(default_factory=list)
    unclassified_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = {
            "trace_id": self.trace_id,
            "symptom": self.symptom,
            "causes": [c.to_dict() for c in self.causes],
        }
        if self.unclassified_count:
            out["unclassified"] = {"count": self.unclassified_count, "lines": self.unclassified}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _http_code(status: int | None) -> str | None:
    return f"HTTP_{status}" if status else None


def symptom_from_spans(spans: list[dict[str, Any]], catalog: Catalog) -> tuple[str | None, int]:
    """The user-visible failure of a trace: the worst HTTP status on its spans.

    Returns (code, time in ns). Server spans and roots come first; a span with
    status ERROR and no HTTP status counts as HTTP 500.
    """
    best: tuple[int, int, str] | None = None
    for sp in spans:
        status = sp.get("http_status")
        code = _http_code(status) if status and status >= 400 else None
        if code is None and sp.get("status_code") == "ERROR":
            code = "HTTP_500"
        if code is None or code not in catalog:
            continue
        rank = (1 if sp.get("kind") == "SERVER" else 0) + (1 if not sp.get("parent_span_id") else 0)
        t = int(sp.get("end_ns") or sp.get("start_ns") or 0)
        key = (rank, int(code[5:]))
        if best is None or key > best[:2]:
            best = (key[0], key[1], f"{code}|{t}")
    if best is None:
        return None, 0
    code, t = best[2].split("|")
    return code, int(t)


def evidence_from_groups(groups: Iterable[dict[str, Any]]) -> list[Evidence]:
    """Evidence from aggregated context rows (see ``ingest.queries.fetch_context``)."""
    return [
        Evidence(
            event_id=g["event_ids"][0],
            code=g["code"],
            ts=int(g["first_ts"]),
            scope=g["scope"],
            confidence=float(g["confidence"]) if g.get("confidence") is not None else 1.0,
            severity=g.get("severity") or "error",
            count=int(g["n"]),
            more_ids=tuple(g["event_ids"][1:]),
        )
        for g in groups
    ]


def evidence_from_rows(rows: Iterable[dict[str, Any]], scope: str) -> list[Evidence]:
    return [
        Evidence(
            event_id=r["event_id"],
            code=r["code"],
            ts=int(r["ts"]),
            scope=scope,
            confidence=float(r["confidence"]) if r.get("confidence") is not None else 1.0,
            severity=r.get("severity") or "error",
            message=r.get("message"),
            source=r.get("source"),
        )
        for r in rows
    ]


def _pick_symptom(
    evidence: list[Evidence], catalog: Catalog, g: nx.DiGraph | None = None
) -> str | None:
    """Without spans: the end of the observed chain. Among the observed codes
    that explain no other observed code (the topology, with any observed
    causation added, reaches none of them), the highest-layer, most severe,
    latest trace-scoped one. A layer-6 load-time error (FlashAttention on an
    old GPU) that stopped a TGI shard (layer 5) is the cause, not the symptom.
    Between ends of one layer, evidence a pattern or probe named goes before
    the learned fallback's guess (``Evidence.guess``) about a later line."""
    observed = {e.code for e in evidence}
    explains = set()
    if g is not None:
        explains = {c for c in observed if c in g and descendants(g, c) & (observed - {c})}
    ends = [e for e in evidence if e.code not in explains] or evidence
    best = None
    for ev in ends:
        code = catalog.get(ev.code)
        if code is None:
            continue
        key = (
            ev.scope in (Scope.TRACE, Scope.REQUEST),
            code.layer,
            not ev.guess,
            SEVERITY_RANK.get(Severity(code.severity), 0),
            ev.ts,
        )
        if best is None or key > best[0]:
            best = (key, ev.code)
    return best[1] if best else None


def rank_root_causes(
    g: nx.DiGraph,
    evidence: list[Evidence],
    *,
    catalog: Catalog,
    symptom: str | None = None,
    symptom_ts: int | None = None,
    weights: Weights | None = None,
    top: int = 5,
    extra_edges: Iterable[tuple[str, str, float]] = (),
    drop_edges: Iterable[tuple[str, str]] = (),
    unconnected: bool = False,
) -> tuple[str | None, list[RootCause]]:
    """Rank candidate root causes of ``symptom`` among the observed evidence.

    A candidate is an observed code from which the topology reaches the
    symptom. Returns (symptom, causes best first); ``score`` is a softmax over
    candidates, so the scores of one answer sum to at most 1.
    """
    w = weights or Weights()
    evidence = [e for e in evidence if e.code in catalog]
    extra = [(u, v, p) for u, v, p in extra_edges if u != v and u in g and v in g]
    drop = [(u, v) for u, v in drop_edges if g.has_edge(u, v)]
    if extra or drop or unconnected:
        g = g.copy()
        g.remove_edges_from(drop)
        for u, v, p in extra:  # observed causation (e.g. a chained traceback)
            if not g.has_edge(u, v) or g.edges[u, v][STRENGTH] < p:
                g.add_edge(u, v, **{STRENGTH: p, COST: -math.log(p)})
    if symptom is None:
        symptom = _pick_symptom(evidence, catalog, g)
    if symptom is None:
        return None, []
    by_code: dict[str, list[Evidence]] = defaultdict(list)
    for ev in evidence:
        by_code[ev.code].append(ev)
    observed = set(by_code)
    t_sym = symptom_ts or max((e.ts for e in by_code.get(symptom, [])), default=None)
    if t_sym is None:
        t_sym = max((e.ts for e in evidence), default=0)
    if unconnected:
        # a postmortem ranks every observed code: one with no known path to the
        # symptom gets a weak, explicitly inferred link - unless it was first
        # seen after the symptom (what came later cannot have caused it) or
        # only the learned fallback's guesses name it (an invented link needs
        # evidence a pattern or probe named: a guess at "main process
        # disappeared!" after a weights load failure took the cause's place)
        effects = descendants(g, symptom)  # what the symptom itself explains
        for code in observed - {symptom} - effects:
            if code.startswith("HTTP_"):  # another response's status is a symptom, not a cause
                continue
            if min(e.ts for e in by_code[code]) > t_sym + CLOCK_SKEW_NS:
                continue
            if all(e.guess for e in by_code[code]):
                continue
            if code in g and symptom in g and not nx.has_path(g, code, symptom):
                g.add_edge(code, symptom, **{STRENGTH: WEAK_LINK, COST: -math.log(WEAK_LINK)})
    sym_anc = ancestors(g, symptom)
    relevant = (observed & sym_anc) - {symptom}
    candidates = sorted(relevant)
    if not candidates and symptom in observed:
        candidates = [symptom]
    desc_cache = {c: descendants(g, c) for c in candidates}
    hop_cost = {
        code: min(SCOPE_HOP_COST.get(e.scope, 1.0) for e in evs)
        for code, evs in by_code.items()
        if any(e.ts <= t_sym + CHAIN_TOLERANCE_NS for e in evs)
    }
    scored: list[tuple[float, str, list[str], dict[str, float]]] = []
    for cand in candidates:
        chain = best_chain(g, cand, symptom, hop_cost) or [cand]
        evs = by_code[cand]
        t_c = min(e.ts for e in evs)
        explained = (desc_cache[cand] & relevant) - {cand}
        coverage = len(explained) / max(1, len(relevant) - 1) if cand != symptom else 0.0
        explainers = [o for o in relevant if o != cand and cand in desc_cache.get(o, set())]
        after = [e for o in explained for e in by_code[o]]
        temporal = (
            sum(1 for e in after if e.ts + CLOCK_SKEW_NS >= t_c) / len(after) if after else 0.5
        )
        feats = {
            "chain": -chain_cost(g, chain, hop_cost),
            "coverage": coverage,
            "rootness": 0.0 if explainers else 1.0,
            "temporal": temporal,
            "late": 1.0 if t_c > t_sym + CLOCK_SKEW_NS else 0.0,
            "scope": max(SCOPE_WEIGHT.get(e.scope, 0.5) for e in evs),
            "depth": (7 - catalog[cand].layer) / 6,
            "confidence": max(e.confidence for e in evs),
            "support": math.log1p(sum(e.count for e in evs)),
        }
        s = sum(getattr(w, k) * v for k, v in feats.items())
        scored.append((s, cand, chain, feats))
    if not scored:
        return symptom, []
    scored.sort(key=lambda x: (-x[0], catalog[x[1]].layer, x[1]))
    mx = scored[0][0]
    z = sum(math.exp(s - mx) for s, *_ in scored)
    causes: list[RootCause] = []
    for i, (s, cand, chain, feats) in enumerate(scored[:top]):
        code = catalog[cand]
        chain_obs = [c for c in chain if c in observed]
        ev_ids = [
            i
            for c in chain_obs
            for e in sorted(by_code[c], key=lambda e: e.ts)
            for i in (e.event_id, *e.more_ids)
        ]
        causes.append(
            RootCause(
                rank=i + 1,
                code=cand,
                family=code.family,
                layer=code.layer,
                score=math.exp(s - mx) / z,
                chain=chain,
                evidence=ev_ids,
                action=code.action,
                observed=chain_obs,
                features=feats,
            )
        )
    return symptom, causes


def sm_rule_edges(
    sm_errors: list[dict[str, Any]], xid_codes: set[str], observed: set[str], catalog: Any
) -> tuple[list[tuple[str, str, float]], list[tuple[str, str]], str]:
    """NVIDIA's reading of Xid 13/31 SM faults, as edges for the ranking.

    Faults scattered across SMs point at the application: its own illegal
    access error (if seen) becomes the cause of the Xid lines, not their
    effect. The same SM faulting again and again points at the hardware: the
    Xid stays the root. Returns (edges to add, edges to drop, note).
    """
    if not sm_errors:
        return [], [], ""
    verdict = sm_fault_verdict(sm_errors)
    note = f"Xid 13/31 SM faults: {verdict['verdict']} ({verdict['why']})"
    if verdict["verdict"] != "application":
        return [], [], note
    apps = {
        c
        for c in observed - xid_codes
        if catalog.get(c) and catalog[c].family == "illegal_memory_access"
    }
    return (
        [(a, x, 0.9) for a in apps for x in xid_codes],
        [(x, a) for a in apps for x in xid_codes],
        note,
    )
