"""Operator fault checks inside the serving process (torch).

Four layers of checks, all of which report through a :class:`probes.sink.Sink`
and none of which ever raises into the serving process:

* **numerical**: NaN, +-inf and value-range violations on module outputs. One row
  reduction per tensor (``torch.aminmax`` on CUDA; ``amin`` + ``amax`` on CPU,
  where the fused kernel is 20-40x slower than the two vectorized ones), written
  into fixed device buffers ``[slot, batch row]``; NaN propagates through
  min/max, so a failing row maps back to a request.
* **memory**: index bounds (token ids vs the vocabulary, positions vs the cache
  length and the position table, block-table entries vs the block pool,
  ``cu_seqlens`` monotone and within the batch) and the allocator's counters.
* **state**: KV length vs position ids; KV shapes and heads consistent across
  layers.
* **semantic**: pluggable rules run when a request ends (JSON schema of the
  output or of a tool call, finish reason in an allowed set, empty completion).

Nothing in a check reads a device value on the host: checks only launch kernels
that accumulate into fixed buffers, and :meth:`Checker.end_step` reads one small
flag matrix once per step (on CUDA through a pinned buffer on a side stream, as
vLLM's NaN counter does). Device-side asserts are never used: they kill the CUDA
context. The batch row -> trace id map is captured on the host when the step is
launched (:meth:`Checker.begin_step`), since the read-back happens later.

Attach checks three ways: :func:`instrument` (every module of a torch model is a
check site, tapped: see :class:`_ForwardTap`), the :meth:`Checker.op` decorator on a
function, or explicit calls (:meth:`Checker.check`, :meth:`Checker.check_token_ids`,
...). Each site has a tier (``off`` / ``numerical`` / ``full``); :func:`set_tiers`
changes them at run time without re-instrumenting. Eager hooks read a host-side
tier table; the per-site device mask applied when the flags are evaluated is what
a compiled or CUDA-graph-captured model obeys (instrument it with
``modules="all"`` before compiling: real forward hooks, traced once, that stay).
In eager mode a forward hook sends every call of its module through PyTorch's
slow call path (~3-4 us), so the default ``modules="auto"`` taps only the sites
that are on, with a bound ``forward`` wrapper that keeps the fast path, and lets
:func:`set_tiers` add or remove taps at a step boundary.

Typical use::

    checker = instrument(model)                 # production tier
    checker.begin_step(trace_ids)               # row i -> trace_ids[i], on the host
    logits = model(input_ids=ids, cache=cache)
    records = checker.end_step()                # one read; records went to the sink
    checker.end_request(RequestOutput(trace_id=t, text=..., finish_reason=...))
    set_tiers(checker, "numerical")             # or POST /health/checker_status
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import json
import logging
import math
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import FunctionType, MethodType
from typing import Any

import numpy as np
import torch
from torch import nn

from ingest import schema as S
from probes.rules import (
    EmptyCompletionRule,
    FinishReasonRule,
    JsonSchemaRule,
    RequestOutput,
    Rule,
    ToolCallSchemaRule,
    Violation,
    validate_json_schema,
)
from probes.sink import RateLimitedLog, Sink, default_sink

__all__ = [
    "Tier",
    "PRESETS",
    "CHECKER_STATUS_PATH",
    "Checker",
    "instrument",
    "set_tiers",
    "handle_checker_status",
    "checker_status_handler",
    "RequestOutput",
    "Violation",
    "Rule",
    "FinishReasonRule",
    "JsonSchemaRule",
    "ToolCallSchemaRule",
    "EmptyCompletionRule",
    "validate_json_schema",
    "memory_stats",
]

log = logging.getLogger("rca.probes.ops")

SOURCE = "probe:ops"
CHECKER_STATUS_PATH = "/health/checker_status"


class Tier(IntEnum):
    """What one check site does: nothing, NaN/inf/range, or that plus more."""

    OFF = 0
    NUMERICAL = 1
    FULL = 2


#: ``default`` is meant to stay on in production: the logits row min/max and the
#: index bounds of the inputs, nothing else.
PRESETS = ("off", "default", "numerical", "full")

_F32_MAX = float(torch.finfo(torch.float32).max)
_I64_MAX = 2**63 - 1
_I64_MIN = -(2**63)
_ROOT = "<root>"
#: steps in a row a container must return its last child's output before its
#: tap goes (see Checker._note_aliases)
ALIAS_STEPS = 8
_DIMS = {n: tuple(range(1, n)) for n in range(2, 9)}
_TIER_NAMES = {t.name.lower(): t for t in Tier}
#: past this many bytes of check buffers a GPU reads only the cells in use
#: (gathers) instead of whole buffers into pinned host twins
MIRROR_MAX_BYTES = 4 << 20
_NEUTRAL_MINMAX = np.array([math.inf, -math.inf], dtype=np.float32)[:, None, None]


def _tier(value: Any) -> Tier:
    if isinstance(value, Tier):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Tier(value)
    if isinstance(value, str) and value.lower() in _TIER_NAMES:
        return _TIER_NAMES[value.lower()]
    raise ValueError(f"unknown tier {value!r} (off | numerical | full)")


def _num(v: float) -> float | str:
    """A float for JSON: NaN and infinities as strings (DuckDB's JSON rejects them)."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return float(f"{v:.6g}")


# ---------------------------------------------------------------------------
# slots
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class _FSlot:
    """A numerical check site: a module output or an explicit tensor check."""

    name: str
    code: str
    origin: str  # module | explicit
    lo: float = -_F32_MAX
    hi: float = _F32_MAX
    logits: bool = False


@dataclass(slots=True)
class _ISlot:
    """An index/state check site: per-row integer min/max vs [lo, hi)."""

    name: str
    code: str
    check: str  # token_bounds | position_bounds | block_table | cu_seqlens | kv_length
    gate: str  # bounds | state
    static: bool = False  # limits written once, at registration


@dataclass(slots=True)
class _Fail:
    code: str
    check: str
    row: int | None  # None: the whole batch (unattributed)
    attrs: dict[str, Any]
    message: str
    order: float = 0.0
    confidence: float = 1.0


# ---------------------------------------------------------------------------
# the checker
# ---------------------------------------------------------------------------
class Checker:
    """Fixed device buffers, check sites, tiers, and the per-step read-back.

    Parameters
    ----------
    sink:
        where records go (default: the process spool, opened at the first record).
    max_rows:
        batch rows tracked per step (vLLM's ``max_num_seqs`` default is 256); a
        bigger batch is checked as a whole (records carry all its trace ids).
    max_slots:
        capacity for numerical check sites beyond the instrumented modules.
    sample_every:
        check 1 request in N (a stable hash of the trace id picks them, so a
        request is checked on every step or on none, on every rank).
    stats_sample:
        elements per row kept by ``full`` sites for mean/std in reports.
    snapshot:
        opt-in: keep ``snapshot_elems`` input values per row and put them in the
        record's ``attrs["snapshot"]`` (for ``rca repro``). Token ids are user
        content: leave it off unless the operator asked for it.
    value_limits:
        ``{glob: (lo, hi)}``: finite bounds for numerical sites (beyond them is a
        ``range`` violation); NaN and infinities are always violations.
    max_records_per_step:
        records emitted per step at most; the rest are counted in the last one.
    """

    def __init__(
        self,
        sink: Sink | None = None,
        *,
        device: torch.device | str | None = None,
        max_rows: int = 256,
        max_slots: int = 64,
        max_index_slots: int = 32,
        sample_every: int = 1,
        stats_sample: int = 32,
        snapshot: bool = False,
        snapshot_elems: int = 16,
        value_limits: Mapping[str, tuple[float, float]] | None = None,
        max_records_per_step: int = 64,
        log_interval_s: float = 10.0,
        catalog: Any = None,
    ) -> None:
        self._sink = sink
        self._catalog = catalog
        self.device = torch.device(device) if device is not None else None
        self.max_rows = int(max_rows)
        self._cols = self.max_rows + 1  # column 0: the whole batch (unattributed)
        self._spare = int(max_slots)
        self._ispare = int(max_index_slots)
        self.sample_every = max(1, int(sample_every))
        self.stats_sample = max(0, int(stats_sample))
        self.snapshot = bool(snapshot)
        self.snapshot_elems = max(1, int(snapshot_elems))
        self.value_limits = dict(value_limits or {})
        self.max_records_per_step = int(max_records_per_step)
        self.log = RateLimitedLog(log_interval_s, log)
        self._errlog = RateLimitedLog(log_interval_s, log)
        self._lock = threading.Lock()

        self._fslots: list[_FSlot] = []
        self._islots: list[_ISlot] = []
        self._fbyname: dict[str, int] = {}
        self._ibyname: dict[str, int] = {}
        self._ftier: list[int] = []
        self._fzero: list[int] = []
        self._feff: list[int] = self._ftier
        self._bounds = True
        self._state = False
        self._ion: list[bool] = []
        self._izero: list[bool] = []
        self._ieff: list[bool] = self._ion
        self._pending_limits: list[tuple[int, int, int]] = []
        self._spec: Any = "default"
        self._mask_dirty = True
        self._allocated = False

        # per-step host state
        self._stepno = 1
        self._fstamp: list[int] = []
        self._wstamp: list[int] = []
        self._sstamp: list[int] = []
        self._istamp: list[int] = []
        # float sites in the order their hooks ran; a drained batch of outputs is
        # one list entry until a failure needs it (_materialize)
        self._order: list[Any] = []
        self._written: list[int] = []  # float sites with min/max cells written
        self._sorder: list[int] = []  # float sites with row-sum cells written
        self._fast: list[bool] = []  # per float site: NaN/inf only (one row sum)
        self._refs: dict[int, torch.Tensor] = {}  # site -> its output, for details
        self._ref_elems = 0
        self._lazy = False  # _order holds drained outputs not expanded yet
        #: outputs of at most this many elements keep a reference until end_step
        #: (no copy), so a failure reports their exact min/max and a sample
        self.detail_max_elems = 1 << 18
        #: elements kept by reference per step at most
        self.detail_budget_elems = 1 << 22
        self._splan: list[tuple[Any, ...] | None] = []
        self._plan_version = 0  # bumped by every new plan: _drain's ``ready`` list follows
        self._group_ids: dict[Any, int] = {}
        # containers whose output is their last child's very tensor: after
        # ALIAS_STEPS steps in a row their tap goes (the child checks it)
        self._alias_seen: list[int] = []
        self._alias_run: dict[int, tuple[int, int]] = {}  # slot -> (last step, run)
        self._aliased: set[int] = set()
        self._ready: list[tuple[Any, ...] | None] = []
        self._ready_key: Any = None
        #: outputs of at most this many elements are summed in groups (:meth:`_flush`)
        self.group_max_elems = 1 << 14
        self._pending: list[tuple[int, torch.Tensor, tuple[Any, ...]]] = []
        self._cover: dict[int, list[Any]] = {}  # group cell's site -> its groups
        self._container: list[bool] = []
        #: on the CPU, a few integers (a decode step's token ids) are checked in
        #: Python and a step's few cells are cleared through memoryviews (host
        #: memory: nothing to sync); off, the CPU takes the device path (kernels
        #: into the buffers, the all-clear test on host copies), as a GPU does
        self.host_shortcuts = True
        #: check queued outputs at the end of every layer (a child of a
        #: ModuleList) instead of once per step: a narrower window for an
        #: in-place write to hide a NaN, for a few more reductions a step
        self.flush_each_layer = False
        self._queue: list[tuple[int, Any]] = []  # (site, output) queued by hooks
        self._direct = self.snapshot  # hooks check at once (input snapshots, flattened tokens)
        self._iviews: dict[int, list[Any]] = {}
        self._dirty = True  # cells to reset at the end of the step
        self._iorder: list[int] = []
        self._width = 0
        self._last_x: torch.Tensor | None = None
        self._graph_mode = False
        self._idx_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        self._lim_cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._lim_py: dict[tuple[int, ...], list[tuple[float, float]]] = {}
        self._fmeta: dict[int, dict[str, Any]] = {}
        self._imeta: dict[int, dict[str, Any]] = {}
        self._touched = False
        self._rows: int | None = None
        self._token_rows: torch.Tensor | None = None
        self._launch_ids: list[str | None] | None = None
        self._launch_req: list[str | None] | None = None
        self._row_on: list[bool] | None = None
        self._rowmask_host: list[bool] | None = None
        self._active = True
        self._in_step = False
        self._stage: str | None = None
        self._stage_fixed = False
        self._host_fails: list[_Fail] = []
        self._fviews: dict[int, list[Any]] = {}
        self._sviews: dict[int, list[Any]] = {}
        self._idx_cache: dict[tuple[int, int], torch.Tensor] = {}
        self._sampled: dict[str, bool] = {}
        self._rules: list[Rule] = [
            FinishReasonRule(),
            JsonSchemaRule(),
            ToolCallSchemaRule(),
            EmptyCompletionRule(),
        ]

        # model wiring
        self._handles: list[Any] = []
        self._mods: list[nn.Module | None] = []
        self._fhandles: list[Any] = []
        self._arm_all = False
        self._arm_dirty = False
        self._post_handle: Any = None
        self._static_order: dict[int, int] = {}
        self._model: nn.Module | None = None
        self._logits_name: str | None = None
        self._root_slot: int | None = None
        self._max_positions: int | None = None
        self._fwd_params: list[str] | None = None
        self._mem_last: dict[str, int] = {}

        # counters (status endpoint)
        self.steps = 0
        self.failures: dict[str, int] = {}
        self.errors = 0
        self.suppressed_records = 0
        self._side_stream: Any = None
        #: tests: take a GPU's read and reset path (host twins) on the CPU
        self._force_mirror = False
        self._mirror: Any = None
        self._clear_cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> Checker:
        # a deep copy of an instrumented model (its hooks are bound to this
        # checker) reports to the same checker: one per process, like its sink
        return self

    # ------------------------------------------------------------------ setup
    def _code(self, name: str) -> Any:
        if self._catalog is None:
            from graph.catalog import default_catalog

            self._catalog = default_catalog()
        return self._catalog[name]

    @property
    def sink(self) -> Sink:
        if self._sink is None:
            self._sink = default_sink()
        return self._sink

    def _register_f(self, name: str, code: str, origin: str, *, logits: bool = False) -> int:
        lo, hi = -_F32_MAX, _F32_MAX
        for pat, (a, b) in self.value_limits.items():
            if fnmatch.fnmatchcase(name, pat):
                lo, hi = float(a), float(b)
        self._fslots.append(_FSlot(name, code, origin, lo, hi, logits))
        self._mods.append(None)
        self._fhandles.append(None)
        self._fbyname[name] = len(self._fslots) - 1
        self._ftier.append(int(self._tier_for(name, origin, logits)))
        self._fzero.append(0)
        self._fstamp.append(0)
        self._wstamp.append(0)
        self._sstamp.append(0)
        self._splan.append(None)
        self._container.append(False)
        self._fast.append(lo == -_F32_MAX and hi == _F32_MAX)
        self._plan_version += 1
        return len(self._fslots) - 1

    def _register_i(
        self, name: str, code: str, check: str, gate: str, *, lo: int = 0, hi: int | None = None
    ) -> int:
        slot = len(self._islots)
        self._islots.append(_ISlot(name, code, check, gate, static=hi is not None))
        self._ibyname[name] = slot
        self._ion.append(self._bounds if gate == "bounds" else self._state)
        self._izero.append(False)
        self._istamp.append(0)
        if hi is not None:
            if self._allocated:
                self._ilo[slot].fill_(lo)
                self._ihi[slot].fill_(hi)
            else:
                self._pending_limits.append((slot, lo, hi))
        return slot

    def _alloc(self, device: torch.device) -> None:
        """Fixed buffers: allocated once; hooks and compiled graphs write into them."""
        self.device = device
        nf = len(self._fslots) + self._spare
        ni = len(self._islots) + self._ispare
        c = self._cols
        with torch.inference_mode(False), torch.no_grad():
            kw = {"device": device}
            # [min, max] x slot x column; column 0 is the whole batch, 1 + r is row r
            self._fbuf = torch.empty((2, nf, c), dtype=torch.float32, **kw)
            self._fbuf[0].fill_(math.inf)
            self._fbuf[1].fill_(-math.inf)
            self._fmin, self._fmax = self._fbuf[0], self._fbuf[1]
            # per row: the float32 sum of a NaN/inf-only site's output (0: unwritten)
            self._sbuf = torch.zeros((nf, c), dtype=torch.float32, **kw)
            self._flo = torch.full((nf,), -_F32_MAX, dtype=torch.float32, **kw)
            self._fhi = torch.full((nf,), _F32_MAX, dtype=torch.float32, **kw)
            self._fmask = torch.zeros(nf, dtype=torch.bool, **kw)
            # [min, max, lo, hi) x slot x column
            self._ibuf = torch.empty((4, ni, c), dtype=torch.int64, **kw)
            for i, v in enumerate((_I64_MAX, _I64_MIN, 0, _I64_MAX)):
                self._ibuf[i].fill_(v)
            self._imin, self._imax, self._ilo, self._ihi = self._ibuf.unbind(0)
            self._imask = torch.zeros(ni, dtype=torch.bool, **kw)
            self._rowmask = torch.ones(c, dtype=torch.bool, **kw)
            self._fsample: torch.Tensor | None = None
            self._fsnap: torch.Tensor | None = None
            self._isnap: torch.Tensor | None = None
        self._fcap, self._icap = nf, ni
        # on CPU the host reads the buffers through numpy views: no torch op at all
        # (right after a forward pass, each torch op costs 20-50 us of cold caches)
        cpu = device.type == "cpu" and not self._force_mirror
        self._fnp = self._fbuf.numpy() if cpu else None
        self._snp = self._sbuf.numpy() if cpu else None
        self._inp = self._ibuf.numpy() if cpu else None
        # flat views of the same memory, for the plain-Python all-clear test
        self._fmv = memoryview(self._fnp.reshape(-1)) if cpu else None
        self._smv = memoryview(self._snp.reshape(-1)) if cpu else None
        self._imv = memoryview(self._inp.reshape(-1)) if cpu else None
        self._make_mirrors(device)
        self._allocated = True
        if self._fslots:
            n = len(self._fslots)
            self._flo[:n].copy_(torch.tensor([s.lo for s in self._fslots]))
            self._fhi[:n].copy_(torch.tensor([s.hi for s in self._fslots]))
        for slot, lo, hi in self._pending_limits:
            self._ilo[slot].fill_(lo)
            self._ihi[slot].fill_(hi)
        self._pending_limits = []
        self._ensure_aux()
        self._mask_dirty = True

    def _ensure_aux(self) -> None:
        """Sample and snapshot buffers, only once a site needs them."""
        if not self._allocated:
            return
        with torch.inference_mode(False), torch.no_grad():
            if self.stats_sample and self._fsample is None and any(t >= 2 for t in self._ftier):
                self._fsample = torch.full(
                    (self._fcap, self._cols, self.stats_sample), math.nan, device=self.device
                )
            if self.snapshot and self._fsnap is None:
                shape = (self._cols, self.snapshot_elems)
                kw = {"dtype": torch.float64, "device": self.device}
                self._fsnap = torch.full((self._fcap, *shape), math.nan, **kw)
                self._isnap = torch.full((self._icap, *shape), math.nan, **kw)

    # ------------------------------------------------------------------ tiers
    def _tier_for(self, name: str, origin: str, logits: bool) -> Tier:
        spec = self._spec
        base, patterns = _parse_spec(spec)
        if base == "off":
            t = Tier.OFF
        elif base == "default":
            t = Tier.NUMERICAL if (logits or origin == "explicit") else Tier.OFF
        elif base == "numerical":
            t = Tier.NUMERICAL
        else:
            t = Tier.FULL
        for pat, tier in patterns:
            if fnmatch.fnmatchcase(name, pat):
                t = tier
        return t

    def set_tiers(self, spec: str | Mapping[str, Any] = "default", **switches: Any) -> dict:
        """Change what is checked, at run time, without re-instrumenting.

        ``spec``: a preset (``off``, ``default``, ``numerical``, ``full``) or a
        mapping ``{"preset": "default", "model.layers.*.mlp*": "full", ...}``
        (module-name globs, applied in order, the last match wins; the root module
        is ``<root>``), optionally with ``"bounds": bool`` (index-bound checks,
        on unless the preset is ``off``), ``"state": bool`` (KV length/shape
        checks, on with ``full``), ``"sample_every": int``, ``"snapshot": bool``.
        Safe to call from another thread: the host table is swapped at once; the
        device mask (all a compiled graph obeys) is copied, and with
        ``modules="auto"`` hooks are added or removed, by the serving thread at
        its next step boundary (at once when no step is open).
        """
        if switches:
            spec = {**_as_mapping(spec), **switches}
        base, patterns = _parse_spec(spec)  # validates before anything changes
        opts = spec if isinstance(spec, Mapping) else {}
        with self._lock:
            self._spec = spec
            self._bounds = bool(opts.get("bounds", base != "off"))
            self._state = bool(opts.get("state", base == "full"))
            if "sample_every" in opts:
                self.sample_every = max(1, int(opts["sample_every"]))
                self._sampled.clear()
            if "snapshot" in opts:
                self.snapshot = bool(opts["snapshot"])
            self._direct = self.snapshot or self._token_rows is not None
            tiers = [int(self._tier_for(s.name, s.origin, s.logits)) for s in self._fslots]
            ion = [self._bounds if s.gate == "bounds" else self._state for s in self._islots]
            self._ftier = tiers
            self._ion = ion
            self._plan_version += 1
            self._aliased = {x for x in self._aliased if tiers[x] <= 1}
            self._feff = tiers if self._active else self._fzero
            self._ieff = ion if self._active else self._izero
            self._mask_dirty = True
            self._ensure_aux()
            if self._in_step:
                self._arm_dirty = True
            else:
                self._arm()
        return self.status()

    def _arm(self) -> None:
        """Taps on the modules whose tier is not off (forward hooks on all of
        them with ``modules="all"``): an idle hook still costs a call, so
        production taps only what it checks. Runs in the serving thread at a
        step boundary when a step is open."""
        self._arm_dirty = False
        model = self._model
        want_post = model is not None and (self._arm_all or self._state)
        if want_post and self._post_handle is None:
            self._post_handle = model.register_forward_hook(self._root_post_hook, with_kwargs=True)
        elif not want_post and self._post_handle is not None:
            self._post_handle.remove()
            self._post_handle = None
        for slot, mod in enumerate(self._mods):
            if mod is None:
                continue
            want = self._arm_all or (self._ftier[slot] > 0 and slot not in self._aliased)
            h = self._fhandles[slot]
            if want and h is None:
                hook = self._output_hook(slot)
                self._fhandles[slot] = (
                    mod.register_forward_hook(hook) if self._arm_all else _ForwardTap(mod, hook)
                )
            elif not want and h is not None:
                h.remove()
                self._fhandles[slot] = None

    def _sync_mask(self) -> None:
        if not (self._mask_dirty and self._allocated):
            return
        self._mask_dirty = False
        nf, ni = len(self._ftier), len(self._ion)
        fm = torch.zeros(self._fcap, dtype=torch.bool)
        fm[:nf] = torch.tensor([t > 0 for t in self._ftier], dtype=torch.bool) if nf else fm[:0]
        im = torch.zeros(self._icap, dtype=torch.bool)
        im[:ni] = torch.tensor(self._ion, dtype=torch.bool) if ni else im[:0]
        self._fmask.copy_(fm, non_blocking=True)
        self._imask.copy_(im, non_blocking=True)

    def status(self) -> dict[str, Any]:
        """What is checked now, and what was found: the ``/health/checker_status`` body."""
        counts = {t.name.lower(): 0 for t in Tier}
        for t in self._ftier:
            counts[Tier(t).name.lower()] += 1
        active = {
            s.name: Tier(t).name.lower()
            for s, t in zip(self._fslots, self._ftier, strict=False)
            if t > 0
        }
        if len(active) > 64:
            active = dict(list(active.items())[:64]) | {"...": f"{len(active) - 64} more"}
        return {
            "spec": self._spec,
            "bounds": self._bounds,
            "state": self._state,
            "sample_every": self.sample_every,
            "snapshot": self.snapshot,
            "sites": counts,
            "active": active,
            "index_sites": [s.name for s in self._islots],
            "logits_module": self._logits_name,
            "max_rows": self.max_rows,
            "device": str(self.device) if self.device is not None else None,
            "steps": self.steps,
            "failures": dict(self.failures),
            "suppressed_records": self.suppressed_records,
            "suppressed_logs": dict(self.log.suppressed),
            "probe_errors": self.errors,
            "aliased": [self._fslots[x].name for x in sorted(self._aliased)][:64],
        }

    # ------------------------------------------------------------------ wiring
    def attach(
        self,
        model: nn.Module,
        *,
        logits: str | None = None,
        max_positions: int | None = None,
        modules: str = "auto",
    ) -> Checker:
        """Register every module of ``model`` as a check site.

        ``modules="auto"``: taps (:class:`_ForwardTap`) only on the sites whose
        tier is not off (added and removed by :func:`set_tiers`, at a step
        boundary);
        ``modules="all"``: hooks on every module from the start, tiers switched
        by the host table and the device mask only: use it before
        ``torch.compile`` or CUDA-graph capture, which trace the hooks once."""
        if modules not in ("auto", "all"):
            raise ValueError(f"modules must be 'auto' or 'all', not {modules!r}")
        self._arm_all = modules == "all"
        self._model = model
        names = {id(m): n for n, m in model.named_modules()}
        self._logits_name = logits if logits is not None else _find_logits(model, names)
        cfg = getattr(model, "config", None)
        self._max_positions = max_positions or getattr(cfg, "max_position_embeddings", None)
        token_emb = _input_embeddings(model)
        # with flush_each_layer, queued outputs are checked at the end of each
        # layer (a child of a ModuleList / ModuleDict) and of the whole model
        layers = {id(model)}
        for mod in model.modules():
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
                layers.update(id(m) for m in mod.children())
        for name, mod in model.named_modules():
            label = name or _ROOT
            if isinstance(mod, nn.Embedding):
                is_tok = mod is token_emb or (token_emb is None and "pos" not in name.lower())
                code = "TOKEN_ID_OUT_OF_VOCAB" if is_tok else "POSITION_OUT_OF_RANGE"
                check = "token_bounds" if is_tok else "position_bounds"
                islot = self._register_i(
                    f"{label}:ids", code, check, "bounds", lo=0, hi=mod.num_embeddings
                )
                self._handles.append(mod.register_forward_pre_hook(self._embedding_hook(islot)))
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
                continue
            is_logits = label == self._logits_name
            code = "LOGITS_NAN" if is_logits else "ACTIVATION_INF"
            slot = self._register_f(label, code, "module", logits=is_logits)
            self._mods[slot] = mod
            self._container[slot] = id(mod) in layers
            if mod is model:
                self._root_slot = slot
        # completion order of forward hooks (children before parents): the order a
        # compiled model's failures are ranked in, where no hook ran on the host
        rank = {id(m): i for i, m in enumerate(_post_order(model))}
        self._static_order = {
            slot: rank.get(id(m), len(rank) + slot)
            for slot, m in enumerate(self._mods)
            if m is not None
        }
        self._pos_slot = self._register_i(
            "<root>:position_ids", "POSITION_OUT_OF_RANGE", "position_bounds", "bounds"
        )
        self._kvlen_slot = self._register_i(
            "<root>:kv_length", "KV_LENGTH_POSITION_MISMATCH", "kv_length", "state", lo=0, hi=1
        )
        try:
            self._fwd_params = list(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            self._fwd_params = None
        self._handles.append(model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True))
        self.set_tiers(self._spec)
        dev = _model_device(model)
        if dev is not None and not self._allocated:
            self._alloc(dev)
        return self

    def detach(self) -> None:
        """Remove every hook this checker installed."""
        extra = [self._post_handle] if self._post_handle is not None else []
        for h in self._handles + [h for h in self._fhandles if h is not None] + extra:
            h.remove()
        self._post_handle = None
        self._model = None
        self._handles.clear()
        self._fhandles = [None] * len(self._fhandles)
        self._mods = [None] * len(self._mods)

    # ------------------------------------------------------------------ steps
    def begin_step(
        self,
        trace_ids: Sequence[str | None] | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
        token_rows: torch.Tensor | None = None,
        stage: str | None = None,
    ) -> None:
        """Start a step: batch row i belongs to ``trace_ids[i]`` (captured now,
        on the host, because the flags are read later). ``token_rows`` maps a
        flattened token dimension (vLLM layout) to batch rows."""
        try:
            self._sync_mask()
            self._in_step = True
            self._stage = stage
            self._stage_fixed = stage is not None
            self._token_rows = token_rows
            self._direct = self.snapshot or token_rows is not None
            if trace_ids is None:
                self._launch_ids = None
                self._launch_req = list(request_ids) if request_ids is not None else None
                self._rows = None
                self._set_rowmask(None)
                return
            ids = list(trace_ids)
            req = list(request_ids) if request_ids is not None else [None] * len(ids)
            self._launch_ids, self._launch_req = ids, req
            if len(ids) > self.max_rows:
                self._rows = -1
                self.log.warning("probe.ops.rows", f"batch of {len(ids)} > max_rows")
            else:
                self._rows = len(ids)
            if self.sample_every == 1:
                self._set_rowmask(None)
            else:
                pairs = enumerate(zip(ids, req, strict=False))
                self._set_rowmask([self._is_sampled(t, r, i) for i, (t, r) in pairs])
        except Exception as exc:  # never into the serving process
            self._error("begin_step", exc)

    def _is_sampled(self, trace_id: str | None, request_id: str | None, row: int) -> bool:
        if self.sample_every == 1:
            return True
        key = trace_id or request_id
        if key is None:
            return (self._stepno + row) % self.sample_every == 0
        hit = self._sampled.get(key)
        if hit is None:
            if len(self._sampled) > 65536:
                self._sampled.clear()
            hit = self._sampled[key] = zlib.crc32(key.encode()) % self.sample_every == 0
        return hit

    def _set_rowmask(self, on: list[bool] | None) -> None:
        self._row_on = on
        active = on is None or any(on)
        self._active = active
        self._feff = self._ftier if active else self._fzero
        self._ieff = self._ion if active else self._izero
        if not self._allocated:
            return
        host = (
            [True] * self._cols if on is None else [True, *on] + [True] * (self._cols - 1 - len(on))
        )
        if host != self._rowmask_host:
            self._rowmask_host = host
            self._rowmask.copy_(torch.tensor(host, dtype=torch.bool), non_blocking=True)

    def step(self, trace_ids: Sequence[str | None] | None = None, **kw: Any) -> _Step:
        """``with checker.step(trace_ids): model(...)`` -> ``.records`` after the block."""
        return _Step(self, trace_ids, kw)

    # ------------------------------------------------------------------ hooks
    def _output_hook(self, slot: int) -> Callable[..., None]:
        # TorchDynamo reads this as True while it traces the hook; in eager mode
        # it is one call that returns False (is_compiling() makes two)
        compiling = torch.compiler.is_dynamo_compiling

        container = self._container[slot]
        tensor = torch.Tensor

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if compiling():
                self._traced_output(slot, output)
            elif self._feff[slot]:
                if self._direct:
                    self._on_output(slot, args, output)
                    return
                queue = self._queue
                if type(output) is tensor and output.numel() > self.group_max_elems:
                    # a big output (prefill) is reduced at once, while it is
                    # still in the CPU caches (by the end of its layer it has
                    # been evicted: 3-4x the time); what was queued before it
                    # is checked first, so the hook order is kept
                    if queue or self._pending:
                        self._flush()
                    self._on_output(slot, args, output)
                    return
                queue.append((slot, output))
                if (container and self.flush_each_layer) or len(queue) > 512:
                    self._flush()

        return hook

    def _embedding_hook(self, islot: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if self._ieff[islot] and args and isinstance(args[0], torch.Tensor):
                try:
                    self._index(islot, args[0])
                except Exception as exc:
                    self._error("embedding", exc)

        return hook

    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling() or not self._active:
            return
        try:
            self._inputs(args, kwargs)
        except Exception as exc:
            self._error("inputs", exc)

    def _root_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if torch.compiler.is_compiling() or not (self._state and self._active):
            return
        try:
            cache = _get_arg(kwargs, args, self._fwd_params, ("cache", "past_key_values"))
            if cache is None:
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            if cache is not None:
                self._kv_shapes(cache)
        except Exception as exc:
            self._error("state", exc)

    def _inputs(self, args: tuple, kwargs: dict) -> None:
        """Root pre-hook: positions vs the cache length and the position table; the
        KV length vs the positions (state)."""
        names = self._fwd_params
        ids = _get_arg(kwargs, args, names, ("input_ids",))
        pos = _get_arg(kwargs, args, names, ("position_ids", "positions"))
        cache = _get_arg(kwargs, args, names, ("cache", "past_key_values", "kv_cache"))
        mask = _get_arg(kwargs, args, names, ("attention_mask",))
        ref = ids if isinstance(ids, torch.Tensor) else kwargs.get("inputs_embeds")
        t = ref.shape[1] if isinstance(ref, torch.Tensor) and ref.dim() >= 2 else None
        if t is not None and not self._stage_fixed:
            self._stage = "prefill" if t > 1 else "decode"
        past = _past_length(cache)
        limit = self._max_positions
        cache_len = past + t if (past is not None and t is not None) else None
        if cache_len is not None and limit is not None:
            limit = min(limit, cache_len)
        elif cache_len is not None:
            limit = cache_len
        if not isinstance(pos, torch.Tensor):
            mp = self._max_positions
            if self._bounds and cache_len is not None and mp is not None and cache_len > mp:
                self._host_fail(
                    "POSITION_OUT_OF_RANGE",
                    "position_bounds",
                    {"cache_len": cache_len, "max_positions": mp},
                    f"sequence of {cache_len} positions > max_position_embeddings",
                )
            return
        if self._ieff[self._pos_slot] and limit is not None:
            self._index(self._pos_slot, pos, lo=0, hi=int(limit))
            meta = {"cache_len": cache_len, "max_positions": self._max_positions}
            self._imeta[self._pos_slot]["extra"] = meta
        if self._ieff[self._kvlen_slot] and pos.dim() >= 1:
            last = pos[..., -1] if pos.dim() >= 2 else pos[-1:]
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                diff = last + 1 - mask.sum(-1)
                meta = {"expected": "attention_mask row sums"}
            elif cache_len is not None:
                diff = last + (1 - cache_len)
                meta = {"expected_kv_len": cache_len}
            else:
                return
            self._index(self._kvlen_slot, diff)
            self._imeta[self._kvlen_slot]["extra"] = meta

    def _kv_shapes(self, cache: Any) -> None:
        """KV shapes and heads consistent across layers (host metadata only)."""
        shapes = _kv_layer_shapes(cache)
        groups: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        for i, kind, shape in shapes:
            groups.setdefault(kind, []).append((i, shape))
        for kind, items in groups.items():
            ref = items[0][1]
            bad = [(i, s) for i, s in items if s != ref]
            if bad:
                self._host_fail(
                    "KV_LENGTH_POSITION_MISMATCH",
                    "kv_shapes",
                    {
                        "layer_kind": kind,
                        "reference": {"layer": items[0][0], "shape": list(ref)},
                        "mismatched": [{"layer": i, "shape": list(s)} for i, s in bad[:8]],
                    },
                    f"KV shapes differ across layers ({len(bad)} of {len(items)})",
                )

    # ------------------------------------------------------------------ reductions
    def _resolve_rows(self, x: torch.Tensor) -> tuple[str, int]:
        """('row', n) per batch row, ('tok', n) flattened tokens, ('all', 1) whole."""
        if x.dim() == 0:
            return "all", 1
        n = x.shape[0]
        rows = self._rows
        if rows is None:
            if 0 < n <= self.max_rows:
                return "row", n
        elif rows > 0 and n == rows:
            return "row", n
        tr = self._token_rows
        if tr is not None and rows is not None and rows > 0 and n == tr.shape[0]:
            return "tok", n
        return "all", 1

    def _cols_of(self, mode: str, n: int) -> slice:
        """Buffer columns: 0 is the whole batch, 1 + r is batch row r."""
        if mode == "row":
            return slice(1, n + 1)
        if mode == "tok":
            return slice(1, self.max_rows + 1)
        return slice(0, 1)

    def _fview(self, slot: int, mode: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = n if mode == "row" else (-2 if mode == "tok" else -1)
        lst = self._fviews.get(key)
        if lst is None:
            if len(self._fviews) > 16:
                self._fviews.clear()
            lst = self._fviews[key] = [None] * self._fcap
        v = lst[slot]
        if v is None:
            cols = self._cols_of(mode, n)
            v = lst[slot] = (self._fmin[slot, cols], self._fmax[slot, cols])
        return v

    def _on_output(self, slot: int, args: tuple, output: Any) -> None:
        try:
            x = output if type(output) is torch.Tensor else _first_float(output)
            if x is None or x is self._last_x:
                return  # a container returning its last child's output: checked already
            if not x.is_floating_point():
                return
            if not self._allocated:
                self._alloc(x.device)
            self._last_x = x
            tier = self._feff[slot]
            if self._fast[slot] and not self.snapshot and self._token_rows is None:
                self._sum(slot, x)
                if tier >= 2 and type(output) is not torch.Tensor:
                    for y in _other_floats(output, x):
                        self._sum(slot, y)
                return
            mode, n = self._float(slot, x)
            if tier >= 2:
                if type(output) is not torch.Tensor:
                    for y in _other_floats(output, x):
                        self._float(slot, y)
                if self._fsample is not None:
                    self._sample(slot, x, mode, n)
            if self.snapshot and self._fsnap is not None:
                inp = _first_tensor(args)
                if inp is not None:
                    self._snap(self._fsnap, slot, inp)
        except Exception as exc:
            self._error(self._fslots[slot].name, exc)

    def _float(self, slot: int, x: torch.Tensor) -> tuple[str, int]:
        """Row min/max of ``x`` into the slot's buffers: no host read. Returns the
        row layout used, ``(mode, n)``."""
        if x.requires_grad:
            x = x.detach()
        mode, n = self._resolve_rows(x)
        step = self._stepno
        if self._fstamp[slot] != step:
            self._fstamp[slot] = step
            self._order.append(slot)
            self._touched = True
        first = self._wstamp[slot] != step  # neutral cells: overwrite them
        if first:
            self._wstamp[slot] = step
            self._written.append(slot)
            self._fmeta[slot] = {"shape": x.shape, "dtype": x.dtype}
        width = n + 1 if mode == "row" else (self._cols if mode == "tok" else 1)
        if width > self._width:
            self._width = width
        mn, mx = self._fview(slot, mode, n)
        nd = x.dim()
        if mode == "row":
            if nd == 1:
                a = b = x
            elif x.is_cuda and x.is_contiguous():
                a, b = torch.aminmax(x.view(n, -1), dim=1)  # one fused pass
            elif first and x.dtype == torch.float32:
                # CPU: two vectorized reductions beat aminmax(dim) by 20-40x
                torch.amin(x, dim=_DIMS[nd], out=mn)
                torch.amax(x, dim=_DIMS[nd], out=mx)
                return mode, n
            else:
                a, b = torch.amin(x, dim=_DIMS[nd]), torch.amax(x, dim=_DIMS[nd])
        elif mode == "tok":
            if nd == 1:
                a = b = x
            elif x.is_cuda and x.is_contiguous():
                a, b = torch.aminmax(x.view(n, -1), dim=1)
            else:
                a, b = torch.amin(x, dim=_DIMS[nd]), torch.amax(x, dim=_DIMS[nd])
            # scatter min/max do not propagate NaN: make it -inf / +inf (non-finite)
            a = torch.nan_to_num(a.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
            b = torch.nan_to_num(b.float(), nan=math.inf, posinf=math.inf, neginf=-math.inf)
            mn.scatter_reduce_(0, self._token_rows, a, "amin")
            mx.scatter_reduce_(0, self._token_rows, b, "amax")
            return mode, n
        elif x.is_cuda:
            a, b = torch.aminmax(x)
        else:
            a, b = torch.amin(x), torch.amax(x)
        if first:
            mn.copy_(a)
            mx.copy_(b)
        else:
            torch.minimum(mn, a.to(mn.dtype), out=mn)
            torch.maximum(mx, b.to(mx.dtype), out=mx)
        return mode, n

    def _sum(self, slot: int, x: torch.Tensor) -> None:
        """NaN/inf check of ``x`` with a float32 sum per batch row into the
        slot's cells (no host read). NaN and infinities propagate through a
        sum, so a row with one has a non-finite sum; a finite sum only turns
        infinite by overflowing 3.4e38, itself a numerical fault. Sites with
        value limits keep min/max instead.

        A small output (decode) is not reduced here: it waits, by reference, for
        the next big output or end_step (or the end of its layer with
        ``flush_each_layer``), where the waiting outputs that
        share their leading dims are concatenated and summed once
        (:meth:`_flush`): one reduction per group instead of one per module. An
        output written in place between its hook and that flush is checked as
        it is then (a rotation, a residual add: NaN and inf survive). The cells
        and reduction dims are planned once per output shape; a small output
        keeps a reference until end_step, for the failure's exact min/max and
        sample."""
        plan = self._splan[slot]
        if plan is None or plan[0] != x.shape or plan[1] != self._rows or plan[2] != x.dtype:
            plan = self._plan_sum(slot, x)
            if plan is None:  # flattened tokens: scattered min/max
                self._float(slot, x)
                return
        if x.requires_grad:
            x = x.detach()
        step = self._stepno
        if self._fstamp[slot] != step:
            self._fstamp[slot] = step
            self._order.append(slot)
            self._touched = True
            keep = plan[6]
            if keep and self._ref_elems < self.detail_budget_elems:
                self._refs[slot] = x
                self._ref_elems += keep
        if plan[7]:
            self._pending.append((slot, x, plan))
            return
        self._sum_into(slot, x, plan, step)

    def _sum_into(self, slot: int, x: torch.Tensor, plan: tuple[Any, ...], step: int) -> None:
        view, dims, width = plan[3], plan[4], plan[5]
        if self._sstamp[slot] != step:
            self._sstamp[slot] = step
            self._sorder.append(slot)
            if width > self._width:
                self._width = width
            if dims is None:
                view.copy_(x)
            else:
                torch.sum(x, dim=dims, dtype=torch.float32, out=view)
        elif dims is None:
            view.add_(x)
        else:
            view.add_(torch.sum(x, dim=dims, dtype=torch.float32))

    def _flush(self) -> None:
        """Check the queued module outputs. A hook only queues its output (an
        append: in the middle of a forward pass every line of Python runs on
        cold caches); they are checked here, in one loop, at the end of each
        layer (a child of a ModuleList), of the model, or at end_step. Then the
        small ones, per group of equal leading dims and dtype: one
        concatenation along the last dim and one row sum, into the cells of the
        group's first site; the group is remembered for the failure path
        (:meth:`_sum_fails`). Never raises."""
        try:
            groups = self._drain()
            step = self._stepno
            for group in groups.values():
                slot, x, plan = group[0]
                if len(group) > 1:
                    x = torch.cat([item[1] for item in group], -1)
                    self._cover.setdefault(slot, []).append(group)  # flattened on failure
                self._sum_into(slot, x, plan, step)
        except Exception as exc:
            self._queue = []
            self._pending = []
            self._error("flush", exc)

    def _drain(self) -> dict[Any, list[tuple[int, torch.Tensor, tuple[Any, ...]]]]:
        """The queue in one tight loop (locals only): an output whose shape has a
        plan waits in its group; anything else takes :meth:`_on_output`.

        Right after a forward pass every line runs on cold caches (~1 us each),
        so the per-site conditions that change only with a new plan, new tiers
        or a new batch size are folded into one list, ``ready[slot]``: the
        site's plan when its output may wait in a group, else None."""
        groups: dict[Any, list[tuple[int, torch.Tensor, tuple[Any, ...]]]] = {}
        for slot, x, plan in self._pending:
            groups.setdefault(plan[8], []).append((slot, x, plan))
        self._pending = []
        queue = self._queue
        if not queue:
            return groups
        self._queue = []
        feff, rows = self._feff, self._rows
        key = (rows, self._plan_version, id(feff))
        if self._ready_key != key:
            self._ready_key = key
            self._ready = [
                p if (p is not None and p[7] and fast and t and p[1] == rows) else None
                for p, fast, t in zip(self._splan, self._fast, feff, strict=False)
            ]
        ready, tensor, last = self._ready, torch.Tensor, self._last_x
        grad = torch.is_grad_enabled()  # else no output can require grad
        # the outputs that wait, in hook order: one entry of _order, expanded
        # (order, references for details) only on failure (_materialize)
        items: list[tuple[int, torch.Tensor, tuple[Any, ...]]] = []
        self._order.append(items)
        self._lazy = True
        aliases = self._alias_seen
        for slot, output in queue:
            x = output if type(output) is tensor else _first_float(output)
            if x is None:
                continue
            if x is last:  # a container returning its last child's output
                aliases.append(slot)
                continue
            plan = ready[slot]
            if (
                plan is None
                or plan[0] != x.shape
                or (grad and x.requires_grad)
                or (type(output) is not tensor and feff[slot] >= 2)  # its other outputs too
            ):
                self._last_x = last
                self._on_output(slot, (), output)
                last = self._last_x
                if items:  # keep the hook order: later items go after that site
                    items = []
                    self._order.append(items)
                continue
            last = x
            item = (slot, x, plan)
            items.append(item)
            gid = plan[8]
            group = groups.get(gid)
            if group is None:
                groups[gid] = [item]
            else:
                group.append(item)
        self._last_x = last
        self._touched = True
        for slot, x, plan in self._pending:  # queued by _on_output above
            groups.setdefault(plan[8], []).append((slot, x, plan))
        self._pending = []
        return groups

    def _materialize(self) -> None:
        """Failure path: expand the drained outputs kept in ``_order`` into site
        order (first occurrence) and references for the details, within the
        budget, as if each had been booked when it was drained."""
        if not self._lazy:
            return
        self._lazy = False
        order: list[int] = []
        seen: set[int] = set()
        refs, elems, budget = self._refs, self._ref_elems, self.detail_budget_elems
        for entry in self._order:
            if type(entry) is int:
                if entry not in seen:
                    seen.add(entry)
                    order.append(entry)
                continue
            for slot, x, plan in entry:
                if slot in seen:
                    continue
                seen.add(slot)
                order.append(slot)
                if plan[6] and slot not in refs and elems < budget:
                    refs[slot] = x
                    elems += plan[6]
        self._order, self._ref_elems = order, elems

    def _plan_sum(self, slot: int, x: torch.Tensor) -> tuple[Any, ...] | None:
        """(shape, rows, dtype, cells, dims, width, elements kept) for ``x``."""
        mode, n = self._resolve_rows(x)
        if mode == "tok":
            return None
        nd = x.dim()
        if mode == "row":
            view = self._sbuf[slot, 1 : n + 1]
            dims = _DIMS[nd] if nd >= 2 else None
            width = n + 1
        else:
            view = self._sbuf[slot, 0] if nd else self._sbuf[slot, 0:1].view(())
            dims = tuple(range(nd)) if nd else None
            width = 1
        numel = x.numel()
        keep = numel if numel <= self.detail_max_elems else 0
        wait = dims is not None and mode == "row" and numel <= self.group_max_elems
        key = (x.shape[:-1], x.dtype, x.device) if wait else ("single", slot)
        group = self._group_ids.setdefault(key, len(self._group_ids))  # an int: cheap to hash
        plan = (x.shape, self._rows, x.dtype, view, dims, width, keep, wait, group)
        self._splan[slot] = plan
        self._plan_version += 1
        return plan

    def _traced_output(self, slot: int, output: Any) -> None:
        """The hook as torch.compile traces it: no host state, accumulate only;
        the device mask in end_step decides whether it counts."""
        self._graph_mode = True
        x = output if isinstance(output, torch.Tensor) else _first_float(output)
        if x is None or not x.is_floating_point() or x.dim() < 2:
            return
        n = x.shape[0]
        if n > self.max_rows:
            return
        dims = _DIMS[x.dim()]
        a = torch.amin(x.detach(), dim=dims).float()
        b = torch.amax(x.detach(), dim=dims).float()
        self._fmin[slot, 1 : n + 1] = torch.minimum(self._fmin[slot, 1 : n + 1], a)
        self._fmax[slot, 1 : n + 1] = torch.maximum(self._fmax[slot, 1 : n + 1], b)

    def _sample(self, slot: int, x: torch.Tensor, mode: str, n: int) -> None:
        """A bounded, evenly spaced sample per row, for mean/std in reports."""
        if mode == "tok":
            return
        xr = (x.detach() if x.requires_grad else x).reshape(n, -1)
        length = xr.shape[1]
        k = min(self.stats_sample, length)
        idx = self._spaced(length, k, x.device)
        key = n if mode == "row" else -1
        lst = self._sviews.get(key)
        if lst is None:
            if len(self._sviews) > 16:
                self._sviews.clear()
            lst = self._sviews[key] = [None] * self._fcap
        view = lst[slot]
        if view is None:
            assert self._fsample is not None
            view = lst[slot] = self._fsample[slot, self._cols_of(mode, n)]
        if k < self.stats_sample:
            view[:, :k].copy_(xr.index_select(1, idx))
        elif xr.dtype == torch.float32:
            torch.index_select(xr, 1, idx, out=view)
        else:
            view.copy_(xr.index_select(1, idx))
        meta = self._fmeta.get(slot)
        if meta is not None:
            meta["k"] = k

    def _snap(self, buf: torch.Tensor, slot: int, t: torch.Tensor) -> None:
        """Opt-in: a few input values per row, for a later ``rca repro``."""
        mode, n = self._resolve_rows(t)
        if mode == "tok":
            mode, n = "all", 1
        tr = t.detach().reshape(n, -1)
        k = min(self.snapshot_elems, tr.shape[1])
        if k == 0:
            return
        view = buf[slot, self._cols_of(mode, n), :k]
        view.copy_(tr.index_select(1, self._spaced(tr.shape[1], k, t.device)).to(view.dtype))
        meta = (self._fmeta if buf is self._fsnap else self._imeta).get(slot)
        if meta is not None:
            dtype = str(t.dtype).replace("torch.", "")
            meta["snap"] = {"shape": list(t.shape), "dtype": dtype, "k": k}

    def _spaced(self, length: int, k: int, device: torch.device) -> torch.Tensor:
        key = (length, k)  # one device per checker
        idx = self._idx_cache.get(key)
        if idx is None:
            if len(self._idx_cache) > 256:
                self._idx_cache.clear()
            with torch.inference_mode(False):
                idx = torch.linspace(0, length - 1, k).round().long().to(device)
            self._idx_cache[key] = idx
        return idx

    def _index(
        self,
        islot: int,
        t: torch.Tensor,
        *,
        lo: int | torch.Tensor | None = None,
        hi: int | torch.Tensor | None = None,
    ) -> None:
        """Per-row integer min/max of ``t`` vs [lo, hi): no host read."""
        if not self._allocated:
            self._alloc(t.device)
        mode, n = self._resolve_rows(t)
        first = self._istamp[islot] != self._stepno
        if first:
            self._istamp[islot] = self._stepno
            self._iorder.append(islot)
            self._touched = True
            self._imeta[islot] = {"shape": t.shape, "dtype": t.dtype}
        key = n if mode == "row" else (-2 if mode == "tok" else -1)
        lst = self._iviews.get(key)
        if lst is None:
            if len(self._iviews) > 16:
                self._iviews.clear()
            lst = self._iviews[key] = [None] * self._icap
        views = lst[islot]
        if views is None:
            cols = self._cols_of(mode, n)
            views = lst[islot] = (
                cols.stop,
                self._imin[islot, cols],
                self._imax[islot, cols],
                self._ilo[islot, cols],
                self._ihi[islot, cols],
            )
        stop, mn, mx, lov, hiv = views
        if stop > self._width:
            self._width = stop
        if (
            mode == "row"
            and self._imv is not None
            and self.host_shortcuts
            and t.device.type == "cpu"
            and t.numel() <= 512
            and not t.is_floating_point()
            and not isinstance(lo, torch.Tensor)
            and not isinstance(hi, torch.Tensor)
        ):
            self._index_cpu_small(islot, t, n, first, lo, hi)
            if self.snapshot and self._isnap is not None:
                self._snap(self._isnap, islot, t)
            return
        if lo is not None:
            lov.copy_(lo) if isinstance(lo, torch.Tensor) else lov.fill_(lo)
        if hi is not None:
            hiv.copy_(hi) if isinstance(hi, torch.Tensor) else hiv.fill_(hi)
        if mode == "row":
            if t.dim() == 1:
                torch.minimum(mn, t.long(), out=mn)
                torch.maximum(mx, t.long(), out=mx)
                return
            dims = _DIMS[t.dim()]
            if first and t.dtype == torch.int64:
                torch.amin(t, dim=dims, out=mn)
                torch.amax(t, dim=dims, out=mx)
            else:
                torch.minimum(mn, torch.amin(t, dim=dims).long(), out=mn)
                torch.maximum(mx, torch.amax(t, dim=dims).long(), out=mx)
        elif mode == "tok":
            tr = self._token_rows
            vals = t.reshape(n, -1).long()
            mn.scatter_reduce_(0, tr, vals.amin(1), "amin")
            mx.scatter_reduce_(0, tr, vals.amax(1), "amax")
        else:
            torch.minimum(mn, t.min().long(), out=mn)
            torch.maximum(mx, t.max().long(), out=mx)
        if self.snapshot and self._isnap is not None:
            self._snap(self._isnap, islot, t)

    def _index_cpu_small(
        self, islot: int, t: torch.Tensor, n: int, first: bool, lo: int | None, hi: int | None
    ) -> None:
        """:meth:`_index` for a few integers on the CPU (token ids and positions
        of a decode step): per-row min/max in Python, written into the buffer
        cells through a flat memoryview; no torch op, whose dispatch costs more
        than the work right after a forward pass."""
        imv, c = self._imv, self._cols
        k, o = self._icap * c, islot * c + 1
        rows = t.reshape(n, -1).tolist()
        if lo is not None:
            for r in range(n):
                imv[2 * k + o + r] = lo
        if hi is not None:
            for r in range(n):
                imv[3 * k + o + r] = hi
        for r, row in enumerate(rows):
            if not row:
                continue
            a, b = min(row), max(row)
            if not first:
                a, b = min(a, imv[o + r]), max(b, imv[k + o + r])
            imv[o + r] = a
            imv[k + o + r] = b

    # ------------------------------------------------------------------ explicit
    def check(
        self,
        name: str,
        x: torch.Tensor,
        *,
        lo: float | None = None,
        hi: float | None = None,
        code: str = "ACTIVATION_INF",
    ) -> None:
        """NaN/inf (and, with ``lo``/``hi``, range) check of ``x`` per batch row."""
        try:
            slot = self._fbyname.get(name)
            if slot is None:
                slot = self._new_explicit(name, code, lo, hi)
                if slot is None:
                    return
            if self._feff[slot]:
                self._on_output(slot, (), x)
        except Exception as exc:
            self._error(name, exc)

    def check_probs(self, probs: torch.Tensor, *, name: str = "sampler.probs") -> None:
        """Sampling probabilities: NaN, inf or negative -> SAMPLER_PROB_INF_NAN."""
        self.check(name, probs, lo=0.0, hi=_F32_MAX, code="SAMPLER_PROB_INF_NAN")

    def _new_explicit(self, name: str, code: str, lo: float | None, hi: float | None) -> int | None:
        with self._lock:
            if len(self._fslots) >= getattr(self, "_fcap", 1 << 30):
                self.log.warning("probe.ops.slots", f"no slot left for check {name!r}")
                return None
            slot = self._register_f(name, code, "explicit")
            s = self._fslots[slot]
            if lo is not None:
                s.lo = float(lo)
            if hi is not None:
                s.hi = float(hi)
            self._fast[slot] = s.lo == -_F32_MAX and s.hi == _F32_MAX
            self._plan_version += 1
            if self._allocated:
                self._flo[slot] = s.lo
                self._fhi[slot] = s.hi
            self._mask_dirty = True
            self._ensure_aux()
            return slot

    def _islot(self, name: str, code: str, check: str, gate: str = "bounds") -> int | None:
        slot = self._ibyname.get(name)
        if slot is not None:
            return slot
        with self._lock:
            if self._allocated and len(self._islots) >= self._icap:
                self.log.warning("probe.ops.slots", f"no index slot left for {name!r}")
                return None
            slot = self._register_i(name, code, check, gate)
            self._mask_dirty = True
            return slot

    def _explicit_index(
        self, name: str, code: str, check: str, t: torch.Tensor, lo: Any, hi: Any, gate: str
    ) -> None:
        try:
            slot = self._islot(name, code, check, gate)
            if slot is not None and self._ieff[slot]:
                self._index(slot, t, lo=lo, hi=hi)
        except Exception as exc:
            self._error(name, exc)

    def check_token_ids(
        self, ids: torch.Tensor, vocab_size: int, *, name: str = "input_ids"
    ) -> None:
        """Token ids in [0, vocab_size) -> else TOKEN_ID_OUT_OF_VOCAB."""
        self._explicit_index(
            name, "TOKEN_ID_OUT_OF_VOCAB", "token_bounds", ids, 0, int(vocab_size), "bounds"
        )

    def check_positions(
        self, positions: torch.Tensor, limit: int | torch.Tensor, *, name: str = "positions"
    ) -> None:
        """Positions in [0, limit) (``limit``: the cache length, per row or scalar,
        or the position table size) -> else POSITION_OUT_OF_RANGE."""
        if isinstance(limit, torch.Tensor) and positions.dim() >= 2 and limit.dim() == 1:
            pos = positions.amax(dim=_DIMS[positions.dim()]) - limit  # must be < 0
            lo_pos = positions.amin(dim=_DIMS[positions.dim()])
            self._explicit_index(
                name + ":lo", "POSITION_OUT_OF_RANGE", "position_bounds", lo_pos, 0, None, "bounds"
            )
            self._explicit_index(
                name, "POSITION_OUT_OF_RANGE", "position_bounds", pos, _I64_MIN, 0, "bounds"
            )
            return
        self._explicit_index(
            name, "POSITION_OUT_OF_RANGE", "position_bounds", positions, 0, limit, "bounds"
        )

    def check_block_table(
        self,
        block_table: torch.Tensor,
        num_blocks: int,
        *,
        blocks_used: torch.Tensor | None = None,
        name: str = "block_table",
    ) -> None:
        """Block-table entries (per row, the first ``blocks_used`` of them) inside
        the block pool; outside it a kernel reads or writes outside the KV cache
        (reported as the CUDA illegal-address precondition)."""
        bt = block_table
        if blocks_used is not None and bt.dim() == 2:
            cols = torch.arange(bt.shape[1], device=bt.device)
            bt = torch.where(cols[None, :] < blocks_used[:, None], bt, 0)
        self._explicit_index(
            name, "CUDA_ERROR_ILLEGAL_ADDRESS", "block_table", bt, 0, int(num_blocks), "bounds"
        )

    def check_cu_seqlens(
        self, cu_seqlens: torch.Tensor, num_tokens: int, *, name: str = "cu_seqlens"
    ) -> None:
        """``cu_seqlens`` ([rows + 1]): non-decreasing, from >= 0, up to the batch's
        ``num_tokens``; else varlen kernels index outside the batch."""
        start, end = cu_seqlens[:-1], cu_seqlens[1:]
        bounds = torch.stack((start, end), dim=1)
        self._explicit_index(
            name,
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "cu_seqlens",
            bounds,
            0,
            int(num_tokens) + 1,
            "bounds",
        )
        self._explicit_index(
            name + ":monotone",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
            "cu_seqlens",
            end - start,
            0,
            None,
            "bounds",
        )

    def check_kv_length(
        self, kv_lens: torch.Tensor, positions: torch.Tensor, *, name: str = "kv_length"
    ) -> None:
        """State: per row, the KV length after this step == last position + 1."""
        last = positions[..., -1] if positions.dim() >= 2 else positions
        self._explicit_index(
            name, "KV_LENGTH_POSITION_MISMATCH", "kv_length", last + 1 - kv_lens, 0, 1, "state"
        )

    def check_kv_shapes(self, layers: Sequence[torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        """State: one KV tensor (or (K, V)) per layer; shapes must agree (host only)."""
        try:
            if not (self._state and self._active):
                return
            shapes = []
            for i, layer in enumerate(layers):
                ts = layer if isinstance(layer, (tuple, list)) else (layer,)
                shapes.append((i, "kv", tuple(tuple(t.shape) for t in ts)))
            self._kv_shapes(_Shapes(shapes))
        except Exception as exc:
            self._error("kv_shapes", exc)

    def op(self, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: check the tensor a function returns (rows = its first dim)."""

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            label = name or getattr(fn, "__qualname__", repr(fn))

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                x = out if isinstance(out, torch.Tensor) else _first_float(out)
                if x is not None:
                    self.check(label, x)
                return out

            return wrapper

        return deco

    # ------------------------------------------------------------------ read-back
    def end_step(
        self,
        trace_ids: Sequence[str | None] | None = None,
        *,
        request_ids: Sequence[str | None] | None = None,
        rerun: Callable[[], Any] | None = None,
    ) -> list[S.ErrorContext]:
        """Read the flags once, emit a record per failure, reset the buffers.

        Trace ids captured by :meth:`begin_step` win over ``trace_ids`` here.
        ``rerun``: optional, side-effect-free re-execution of the step (same
        inputs, a copy of the cache). A numerical fault that reproduces is
        persistent (``state_pollution``: weights, cache or inputs); one that does
        not is ``transient`` (Megatron's rerun state machine, one rerun).
        """
        records: list[S.ErrorContext] = []
        try:
            self._sync_mask()
            ids = self._launch_ids if self._launch_ids is not None else _opt_list(trace_ids)
            req = self._launch_req if self._launch_req is not None else _opt_list(request_ids)
            on = self._row_on
            if on is None and ids is not None and self.sample_every > 1:
                on = [self._is_sampled(t, None, i) for i, t in enumerate(ids)]
            fails = self._collect() if (self._touched or self._graph_mode) else []
            if rerun is not None and any(f.check == "numerical" for f in fails):
                self._rerun(fails, rerun)
            fails.extend(self._host_fails)
            mem = self._memory() if self._state else None
            records = self._records(fails, ids, req, on, mem)
        except Exception as exc:
            self._error("end_step", exc)
        finally:
            self._reset()
            if self._arm_dirty:
                self._arm()
        for rec in records:
            self._emit(rec)
        return records

    def _evaluate(self) -> torch.Tensor:
        """[fslots + islots + fslots, cols] bool on the device: which (site, row)
        failed, by min/max, by index bounds, by row sum."""
        fbad = ~((self._fmin >= self._flo[:, None]) & (self._fmax <= self._fhi[:, None]))
        fbad &= self._fmask[:, None]
        ibad = ~((self._imin >= self._ilo) & (self._imax < self._ihi))
        ibad &= self._imask[:, None]
        sbad = ~torch.isfinite(self._sbuf)
        sbad &= self._fmask[:, None]
        bad = torch.cat((fbad, ibad, sbad))
        bad &= self._rowmask[None, :]
        return bad

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The one device->host read of a step (pinned buffer, side stream on CUDA)."""
        return self._to_host_many([t])[0]

    def _idx(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        t = self._idx_tensors.get(key)
        if t is None:
            if len(self._idx_tensors) > 64:
                self._idx_tensors.clear()
            with torch.inference_mode(False):
                t = self._idx_tensors[key] = torch.tensor(key, dtype=torch.long, device=self.device)
        return t

    def _collect(self) -> list[_Fail]:
        """Which (site, row) failed: one device->host read."""
        if self._graph_mode:
            # compiled/captured hooks leave no host trace: evaluate every site
            self._flush()  # explicit checks made outside the graph
            pairs = self._to_host(self._evaluate()).nonzero().tolist()
            nf, ni = self._fcap, self._icap
            fpairs = [(s, c) for s, c in pairs if s < nf and s < len(self._fslots)]
            ipairs = [(s - nf, c) for s, c in pairs if nf <= s < nf + ni]
            ipairs = [(s, c) for s, c in ipairs if s < len(self._islots)]
            sp = [(s - nf - ni, c) for s, c in pairs if s >= nf + ni]
            sums = [float(self._sbuf[s, c]) for s, c in sp]  # failure path only
            spairs = [(s, c, v) for (s, c), v in zip(sp, sums, strict=True)]
            return self._fails(fpairs, ipairs, spairs)
        # eager: only the sites written this step, only the columns in use
        self._flush()
        fs, ss, ins, w = self._written, self._sorder, self._iorder, self._width
        if w == 0 or not (fs or ss or ins):
            return []
        if self._fnp is not None and self._inp is not None and self._snp is not None:
            # CPU: a step with few cells is cleared in plain Python, slicing flat
            # memoryviews of the buffers (after a forward pass, caches are cold
            # and each numpy call costs 5-20 us); then numpy views, no torch op
            tested = self.host_shortcuts and (2 * len(fs) + len(ss) + 4 * len(ins)) * w <= 2048
            if tested and self._clear_cpu(fs, ss, ins, w):
                return []
            ff = _rows(self._fnp, fs, w, 1) if fs else None
            sv = _rows(self._snp, ss, w, 0) if ss else None
            ii = _rows(self._inp, ins, w, 1) if ins else None
        elif self._mirror is not None:
            # a GPU: whole buffers into pinned host twins (one copy each, one
            # wait), then the sites and columns in use picked on the host
            tested = False
            fh, sh, ih = self._read_mirrors(bool(fs), bool(ss), bool(ins))
            ff = fh[:, fs, :w] if fs else None
            sv = sh[ss, :w] if ss else None
            ii = ih[:, ins, :w] if ins else None
        else:
            tested = False
            dev = []
            if fs:
                dev.append(self._fbuf.index_select(1, self._idx(fs))[:, :, :w])
            if ss:
                dev.append(self._sbuf.index_select(0, self._idx(ss))[:, :w])
            if ins:
                dev.append(self._ibuf.index_select(1, self._idx(ins))[:, :, :w])
            host = [t.numpy() for t in self._to_host_many(dev)]
            ff = host.pop(0) if fs else None
            sv = host.pop(0) if ss else None
            ii = host.pop(0) if ins else None
        # fast all-clear test on the host copies, unless the CPU one just failed;
        # a few cells: in plain Python (after a forward pass each numpy call
        # costs 5-15 us)
        if (
            not tested
            and _small(ff)
            and _small(sv)
            and _small(ii)
            and self._host_clear(ff, sv, ii, fs)
        ):
            return []
        sok = sv is None or bool(np.isfinite(sv.sum()))
        fbad = ibad = None
        if ff is not None:
            lims = self._limits(fs)
            fbad = ~((ff[0] >= lims[0]) & (ff[1] <= lims[1]))
        if ii is not None:
            ibad = (ii[0] < ii[2]) | (ii[1] >= ii[3])
        if sok and not ((fbad is not None and fbad.any()) or (ibad is not None and ibad.any())):
            return []
        self._dirty = True  # out-of-range cells: reset them at the end of the step
        cols_on = np.ones(w, dtype=bool)
        if self._row_on is not None:
            on = self._row_on[: w - 1]
            cols_on[1 : len(on) + 1] = on
        fpairs: list[tuple[int, int]] = []
        ipairs: list[tuple[int, int]] = []
        if fbad is not None:
            on = np.array([self._ftier[s] > 0 for s in fs])[:, None]
            bad = fbad & on & cols_on[None, :]
            fpairs = [(fs[i], int(c)) for i, c in zip(*np.nonzero(bad), strict=True)]
        spairs: list[tuple[int, int, float]] = []
        if not sok and sv is not None:
            on = np.array([self._ftier[s] > 0 for s in ss])[:, None]
            bad = ~np.isfinite(sv) & on & cols_on[None, :]
            spairs = [
                (ss[i], int(c), float(sv[i, c])) for i, c in zip(*np.nonzero(bad), strict=True)
            ]
        if ibad is not None:
            on = np.array([self._ion[s] for s in ins])[:, None]
            bad = ibad & on & cols_on[None, :]
            ipairs = [(ins[i], int(c)) for i, c in zip(*np.nonzero(bad), strict=True)]
        return self._fails(fpairs, ipairs, spairs)

    def _host_clear(
        self, ff: np.ndarray | None, sv: np.ndarray | None, ii: np.ndarray | None, fs: list[int]
    ) -> bool:
        """:func:`_cells_clear` on host arrays: ``sv`` [site, col] row sums,
        ``ii`` [min/max/lo/hi, site, col], ``ff`` [min/max, site, col]."""
        minmax: Iterable[tuple[Any, ...]] = ()
        if ff is not None:
            mn, mx = ff.tolist()
            minmax = (
                (a, b, lo, hi) for a, b, (lo, hi) in zip(mn, mx, self._limits_py(fs), strict=True)
            )
        return _cells_clear(
            sv.tolist() if sv is not None else (),
            zip(*ii.tolist(), strict=True) if ii is not None else (),
            minmax,
        )

    def _clear_cpu(self, fs: list[int], ss: list[int], ins: list[int], w: int) -> bool:
        """:func:`_cells_clear` on the CPU buffers, read through flat memoryviews
        (rows sliced only as far as the test gets)."""
        c = self._cols
        smv, imv, fmv = self._smv, self._imv, self._fmv
        ki, kf = self._icap * c, self._fcap * c
        sums = (smv[s * c : s * c + w].tolist() for s in ss)
        ints = (
            tuple(imv[j * ki + s * c : j * ki + s * c + w].tolist() for j in range(4)) for s in ins
        )
        minmax = (
            (fmv[s * c : s * c + w].tolist(), fmv[kf + s * c : kf + s * c + w].tolist(), lo, hi)
            for s, (lo, hi) in zip(fs, self._limits_py(fs) if fs else (), strict=True)
        )
        return _cells_clear(sums, ints, minmax)

    def _limits(self, fs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(fs)
        lims = self._lim_cache.get(key)
        if lims is None:
            if len(self._lim_cache) > 64:
                self._lim_cache.clear()
            lo = np.array([self._fslots[s].lo for s in fs], dtype=np.float32)[:, None]
            hi = np.array([self._fslots[s].hi for s in fs], dtype=np.float32)[:, None]
            lims = self._lim_cache[key] = (lo, hi)
        return lims

    def _limits_py(self, fs: list[int]) -> list[tuple[float, float]]:
        """Per site (lo, hi) as Python floats of their float32 values (what the
        buffers are compared with)."""
        key = tuple(fs)
        lims = self._lim_py.get(key)
        if lims is None:
            if len(self._lim_py) > 64:
                self._lim_py.clear()
            lo, hi = self._limits(fs)
            lims = self._lim_py[key] = list(zip(lo[:, 0].tolist(), hi[:, 0].tolist(), strict=True))
        return lims

    def _make_mirrors(self, device: torch.device) -> None:
        """On a GPU: pinned host twins of the three check buffers (their numpy
        views made once) and neutral device twins for the reset, so the eager
        step's read is three copies and one wait, and its reset three ops,
        instead of a gather, a pinned allocation and a numpy view per buffer
        (~25 torch ops, ~300 us of host time per step on an H200 host).
        Skipped past ``MIRROR_MAX_BYTES`` (a huge ``max_rows`` x slots): the
        gather path reads only the cells in use."""
        self._mirror = None
        self._clear_cache = {}
        if device.type == "cpu" and not self._force_mirror:
            return
        # the integer buffer whole: its lo/hi rows are per-step bounds too
        f, s_, i = self._fbuf, self._sbuf, self._ibuf
        nbytes = sum(t.numel() * t.element_size() for t in (f, s_, i))
        if nbytes > MIRROR_MAX_BYTES:
            return
        pin = device.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (f, s_, i)]
            f0 = torch.empty_like(f)
            f0[0].fill_(math.inf)
            f0[1].fill_(-math.inf)
            i0 = torch.empty_like(i[:2])
            i0[0].fill_(_I64_MAX)
            i0[1].fill_(_I64_MIN)
        self._mirror = (host, [h.numpy() for h in host], f0, i0, (f, s_, i))

    def _clear_views(self, w: int) -> tuple[torch.Tensor, ...]:
        views = self._clear_cache.get(w)
        if views is None:
            assert self._mirror is not None
            _, _, f0, i0, _ = self._mirror
            views = self._clear_cache[w] = (
                self._fbuf[:, :, :w],
                self._sbuf[:, :w],
                self._ibuf[:2, :, :w],
                f0[:, :, :w],
                i0[:, :, :w],
            )
        return views

    def _read_mirrors(self, f: bool, s_: bool, i: bool) -> list[Any]:
        """The step's one device->host read: the buffers asked for, whole, into
        their pinned twins (a side stream after the main one, one wait); returns
        the numpy views."""
        assert self._mirror is not None
        host, views, _, _, dev = self._mirror
        pairs = [(h, d) for want, h, d in zip((f, s_, i), host, dev, strict=True) if want]
        if self._fbuf.is_cuda:
            self._copy_to_host(pairs, temporaries=False)
        else:
            for h, d in pairs:
                h.copy_(d)
        return views

    def _to_host_many(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Several small tensors to the host with one synchronization."""
        if not tensors or not tensors[0].is_cuda:
            return tensors
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self._copy_to_host(list(zip(out, tensors, strict=True)), temporaries=True)
        return out

    def _copy_to_host(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], *, temporaries: bool
    ) -> None:
        """Each (pinned host, device) pair copied on a side stream that follows
        the main one, then one wait. ``temporaries``: the caller drops the
        device tensors at once, so they are recorded on the side stream (the
        allocator must not hand their memory out before the copy is done)."""
        dev = pairs[0][1].device
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=dev)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for h, d in pairs:
                h.copy_(d, non_blocking=True)
                if temporaries:
                    d.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()

    def _fails(
        self,
        fpairs: list[tuple[int, int]],
        ipairs: list[tuple[int, int]],
        spairs: Sequence[tuple[int, int, float]] = (),
    ) -> list[_Fail]:
        """Failure details (values, samples, snapshots): a second read, only on failure."""
        fails: list[_Fail] = []
        self._materialize()
        if self._graph_mode or not self._order:
            order = self._static_order  # no hook ran on the host: module completion order
        else:
            order = {s: i for i, s in enumerate(self._order)}  # as the hooks ran
        for s, r, total in spairs:
            for site, f in self._sum_fails(s, r, total):
                f.order = order.get(site, len(order) + site)
                fails.append(f)
        if fpairs:
            si = torch.tensor([s for s, _ in fpairs], device=self.device)
            ri = torch.tensor([r for _, r in fpairs], device=self.device)
            vals = torch.stack((self._fmin[si, ri], self._fmax[si, ri])).double().cpu()
            samples = self._fsample[si, ri].double().cpu() if self._fsample is not None else None
            snaps = self._fsnap[si, ri].cpu() if self._fsnap is not None else None
            for k, (s, r) in enumerate(fpairs):
                fails.append(
                    self._float_fail(s, r, float(vals[0, k]), float(vals[1, k]), samples, snaps, k)
                )
                fails[-1].order = order.get(s, len(order) + s)
        if ipairs:
            si = torch.tensor([s for s, _ in ipairs], device=self.device)
            ri = torch.tensor([r for _, r in ipairs], device=self.device)
            vals = torch.stack(
                (self._imin[si, ri], self._imax[si, ri], self._ilo[si, ri], self._ihi[si, ri])
            ).cpu()
            snaps = self._isnap[si, ri].cpu() if self._isnap is not None else None
            for k, (s, r) in enumerate(ipairs):
                fails.append(self._index_fail(s, r, vals[:, k].tolist(), snaps, k))
        return fails

    @staticmethod
    def _row(col: int) -> int | None:
        return None if col == 0 else col - 1

    def _float_fail(
        self,
        s: int,
        r: int,
        mn: float,
        mx: float,
        samples: torch.Tensor | None,
        snaps: torch.Tensor | None,
        k: int,
    ) -> _Fail:
        slot = self._fslots[s]
        if math.isnan(mn) or math.isnan(mx):
            kind = "nan"
        elif mx == math.inf:
            kind = "+inf"
        elif mn == -math.inf:
            kind = "-inf"
        else:
            kind = "range"
        meta = self._fmeta.get(s, {})
        attrs: dict[str, Any] = {
            "check": "numerical",
            "module" if slot.origin == "module" else "site": slot.name,
            "kind": kind,
            "min": _num(mn),
            "max": _num(mx),
            "tier": Tier(self._ftier[s]).name.lower(),
        }
        if meta:
            attrs["shape"] = list(meta["shape"])
            attrs["dtype"] = str(meta["dtype"]).replace("torch.", "")
        if kind == "range":
            attrs["range"] = [_num(slot.lo), _num(slot.hi)]
        if samples is not None and meta.get("k"):
            attrs["sample"] = _sample_stats(samples[k, : meta["k"]])
        snap = meta.get("snap")
        if snaps is not None and snap:
            values = _values(snaps[k, : snap["k"]])
            attrs["snapshot"] = {**snap, "of": "input", "values": values}
        code = slot.code
        what = "logits" if slot.logits else "output"
        msg = f"{kind} in {what} of {slot.name} (min {_num(mn)}, max {_num(mx)})"
        return _Fail(
            code, "numerical", self._row(r), attrs, msg, confidence=0.5 if kind == "range" else 1.0
        )

    def _sum_fails(self, s: int, r: int, total: float) -> list[tuple[int, _Fail]]:
        """Row ``r`` of a sum cell is not finite: which sites of its group (the
        cell's own and the ones summed with it) hold the NaN/inf, with their
        exact min/max and, for ``full`` sites, a sample, from the outputs kept
        by reference. When every site of the group kept its output and none
        shows a NaN/inf, the sum overflowed on finite values: nothing to
        report. When some output was too big to keep, the cell's site is
        reported from the sum alone."""
        self._materialize()
        covered = (item[0] for group in self._cover.get(s, ()) for item in group)
        sites = [s, *dict.fromkeys(x for x in covered if x != s)]
        out = []
        for site in sites:
            found = self._exact(site, r)
            if found is not None:
                mn, mx, samples = found
                out.append((site, self._float_fail(site, r, mn, mx, samples, None, 0)))
        if not out and all(site in self._refs for site in sites):
            return []
        if not out:
            plan = self._splan[s]
            if plan is not None:
                self._fmeta[s] = {"shape": plan[0], "dtype": plan[2]}
            fail = self._float_fail(s, r, total, total, None, None, 0)
            fail.attrs["row_sum"] = _num(total)
            if len(sites) > 1:
                fail.attrs["summed_with"] = [self._fslots[x].name for x in sites[1:9]]
            out.append((s, fail))
        return out

    def _exact(self, s: int, r: int) -> tuple[float, float, torch.Tensor | None] | None:
        """(min, max, sample) of row ``r`` of site ``s``'s kept output, when it is
        not finite; else None."""
        x = self._refs.get(s)
        plan = self._splan[s]
        if x is None or plan is None:
            return None
        try:
            self._fmeta[s] = {"shape": plan[0], "dtype": plan[2]}
            n = plan[5] - 1  # rows (0: the whole batch in one cell)
            xr = x.detach().reshape(n, -1)[r - 1] if n and r >= 1 else x.detach().reshape(-1)
            a, b = float(xr.amin()), float(xr.amax())
            if math.isfinite(a) and math.isfinite(b):
                return None
            samples = None
            if self._ftier[s] >= 2 and self.stats_sample:
                k = min(self.stats_sample, xr.numel())
                idx = self._spaced(xr.numel(), k, xr.device)
                samples = xr.index_select(0, idx).double().cpu()[None]
                self._fmeta[s]["k"] = k
            return a, b, samples
        except Exception as exc:
            self._error("details", exc)
            return None

    def _index_fail(
        self, s: int, r: int, v: list[int], snaps: torch.Tensor | None, k: int
    ) -> _Fail:
        slot = self._islots[s]
        mn, mx, lo, hi = v
        meta = self._imeta.get(s, {})
        attrs: dict[str, Any] = {"check": slot.check, "site": slot.name, "min": mn, "max": mx}
        if lo != _I64_MIN:
            attrs["lo"] = lo
        if hi != _I64_MAX:
            attrs["hi_exclusive"] = hi
        if meta:
            attrs["shape"] = list(meta["shape"])
            attrs["dtype"] = str(meta["dtype"]).replace("torch.", "")
            attrs.update(meta.get("extra") or {})
        snap = meta.get("snap")
        if snaps is not None and snap:
            values = _values(snaps[k, : snap["k"]])
            attrs["snapshot"] = {**snap, "of": "checked", "values": values}
        if slot.check == "kv_length":
            off = mn if mn < lo else mx
            msg = f"{slot.name}: last position + 1 - KV length = {off} (expected 0)"
        else:
            msg = f"{slot.name}: values in [{mn}, {mx}], allowed [{lo}, {hi})"
        return _Fail(slot.code, slot.check, self._row(r), attrs, msg)

    def _rerun(self, fails: list[_Fail], rerun: Callable[[], Any]) -> None:
        host_fails = self._host_fails
        self._clear()
        try:
            rerun()
            again = self._collect() if (self._touched or self._graph_mode) else []
            err = None
        except Exception as exc:
            again, err = [], f"{type(exc).__name__}: {exc}"
        self._host_fails = host_fails
        seen = {(f.attrs.get("module") or f.attrs.get("site"), f.row) for f in again}
        for f in fails:
            if f.check != "numerical":
                continue
            if err is not None:
                f.attrs["rerun"] = {"error": err[:200]}
                continue
            key = (f.attrs.get("module") or f.attrs.get("site"), f.row)
            reproduced = key in seen
            f.attrs["rerun"] = {"reproduced": reproduced}
            f.attrs["recoverability"] = "state_pollution" if reproduced else "transient"

    def _memory(self) -> dict[str, Any] | None:
        stats = memory_stats(self.device)
        if stats is None:
            return None
        ooms = stats.get("num_ooms", 0) - self._mem_last.get("num_ooms", stats.get("num_ooms", 0))
        retries = stats.get("num_alloc_retries", 0) - self._mem_last.get(
            "num_alloc_retries", stats.get("num_alloc_retries", 0)
        )
        self._mem_last = {k: v for k, v in stats.items() if isinstance(v, int)}
        out = {**stats, "new_ooms": ooms, "new_alloc_retries": retries}
        if ooms > 0:
            self._host_fails.append(
                _Fail(
                    "TORCH_CUDA_OOM",
                    "allocator",
                    None,
                    {"check": "allocator", "memory": out},
                    f"{ooms} allocator OOM(s) during the step",
                )
            )
        return out

    def _records(
        self,
        fails: list[_Fail],
        ids: list[str | None] | None,
        req: list[str | None] | None,
        on: list[bool] | None,
        mem: dict[str, Any] | None,
    ) -> list[S.ErrorContext]:
        if not fails:
            return []
        nrows = len(ids) if ids is not None else None

        def rows_of(f: _Fail) -> list[int | None]:
            if f.row is not None:
                return [f.row]
            if nrows:
                return list(range(nrows))
            return [None]

        per_row: dict[int | None, list[_Fail]] = {}
        for f in fails:
            for r in rows_of(f):
                if r is not None and on is not None and r < len(on) and not on[r]:
                    continue
                per_row.setdefault(r, []).append(f)
        chosen: list[tuple[int | None, _Fail]] = []
        for r, fs in per_row.items():
            others = [f for f in fs if f.check != "numerical"]
            nums = sorted((f for f in fs if f.check == "numerical"), key=lambda f: f.order)
            chosen.extend((r, f) for f in others)
            if nums:
                head = nums[0]
                rest = nums[1:]
                if rest:
                    head = _copy_fail(head)
                    names = [f.attrs.get("module") or f.attrs.get("site") for f in rest]
                    head.attrs["downstream"] = {"count": len(rest), "first": names[:5]}
                chosen.append((r, head))
                # the first failure of every other code too (the NaN logits a bad
                # activation led to, a sampler check): symptoms the chain explains
                seen = {head.code}
                for f in rest:
                    if f.code not in seen:
                        seen.add(f.code)
                        chosen.append((r, f))
        chosen.sort(key=lambda rf: (rf[1].check == "numerical", rf[0] if rf[0] is not None else -1))
        cap = self.max_records_per_step
        dropped = max(0, len(chosen) - cap)
        chosen = chosen[:cap]
        self.suppressed_records += dropped
        out: list[S.ErrorContext] = []
        for i, (r, f) in enumerate(chosen):
            attrs = dict(f.attrs)
            rec_kw: dict[str, Any] = {}
            recov = attrs.pop("recoverability", None)
            if recov is not None:
                rec_kw["recoverability"] = recov
            if r is not None:
                attrs["row"] = r
            attrs["step"] = self.steps
            if self.sample_every > 1:
                attrs["sample_every"] = self.sample_every
            if mem is not None:
                attrs.setdefault("memory", mem)
            if i == len(chosen) - 1 and dropped:
                attrs["suppressed_records"] = dropped
            trace = ids[r] if (ids is not None and r is not None and r < len(ids)) else None
            rid = req[r] if (req is not None and r is not None and r < len(req)) else None
            if r is None and ids:
                attrs["trace_ids"] = [t for t in ids if t][:16]
            code = self._code(f.code)
            stage = self._stage if (self._stage and f.check in ("numerical",)) else None
            rec = S.ErrorContext.from_catalog(
                code,
                source=SOURCE,
                stage=stage or str(code.stage),
                trace_id=trace,
                request_id=rid,
                message=f.message,
                attrs=attrs,
                confidence=f.confidence,
                gpu_index=self.device.index
                if self.device is not None and self.device.type == "cuda"
                else None,
                **rec_kw,
            )
            _plain_enums(rec)
            out.append(rec)
        return out

    def _host_fail(self, code: str, check: str, attrs: dict[str, Any], msg: str) -> None:
        self._touched = True
        self._host_fails.append(_Fail(code, check, None, {"check": check, **attrs}, msg))

    def _clear(self) -> None:
        """Neutral buffers (min +inf, max -inf) and a new stamp: the next write of
        every site is its first of the step."""
        if self._allocated and (self._touched or self._graph_mode):
            w = self._cols if self._graph_mode else self._width
            if w and self._fnp is not None and self._inp is not None and not self._graph_mode:
                # whole column ranges (slots x w cells, already neutral where
                # unwritten): a slice assignment is cheaper than a fancy one
                if self._written:
                    self._fnp[:, :, :w] = _NEUTRAL_MINMAX  # min +inf, max -inf: one call
                # row sums and integer min/max: only after a failure. Left over
                # cells are then in range (finite sums, allowed indices): they
                # can neither fail a check nor hide a new violation (min/max
                # only widen), and a site's first write of a step overwrites.
                if self._dirty:
                    if self._snp is not None:
                        self._snp[:, :w] = 0.0
                    self._inp[0, :, :w] = _I64_MAX
                    self._inp[1, :, :w] = _I64_MIN
            elif w and self._mirror is not None and not self._graph_mode:
                # a GPU in eager mode: one copy from a neutral twin per buffer
                # (a torch op costs ~10 us of host time on a serving host: the
                # step's fixed cost is the number of ops)
                f_view, s_view, i_view, f0, i0 = self._clear_views(w)
                f_view.copy_(f0)
                s_view.zero_()
                i_view.copy_(i0)
            elif w:
                self._fbuf[0, :, :w].fill_(math.inf)
                self._fbuf[1, :, :w].fill_(-math.inf)
                self._sbuf[:, :w].zero_()
                self._ibuf[0, :, :w].fill_(_I64_MAX)
                self._ibuf[1, :, :w].fill_(_I64_MIN)
        self._touched = False
        self._dirty = False
        self._host_fails = []
        self._order = []
        self._written = []
        self._sorder = []
        self._pending = []
        self._queue = []
        if self._cover:
            self._cover = {}
        if self._refs:
            self._refs = {}
        self._ref_elems = 0
        self._lazy = False
        self._iorder = []
        self._width = 0
        self._last_x = None
        self._stepno += 1

    def _reset(self) -> None:
        if self._alias_seen:
            self._note_aliases()
        self._clear()
        self.steps += 1
        self._in_step = False
        self._launch_ids = self._launch_req = None
        self._token_rows = None
        if not self._stage_fixed:
            self._stage = None

    def _note_aliases(self) -> None:
        """At a step boundary: a container that returned its last child's very
        output tensor on ALIAS_STEPS steps in a row checks nothing of its own
        (the child's check covers that tensor), so its tap goes. Only for
        eager taps at the ``numerical`` tier (``full`` also checks a
        container's other outputs); ``set_tiers`` to ``full`` brings it back."""
        step, seen = self.steps, set(self._alias_seen)
        self._alias_seen = []
        for slot in seen:
            last, run = self._alias_run.get(slot, (-2, 0))
            run = run + 1 if last == step - 1 else 1
            self._alias_run[slot] = (step, run)
            h = self._fhandles[slot]
            if (
                run >= ALIAS_STEPS
                and not self._arm_all
                and self._ftier[slot] == 1
                and isinstance(h, _ForwardTap)
            ):
                h.remove()
                self._fhandles[slot] = None
                self._aliased.add(slot)

    def _emit(self, rec: S.ErrorContext) -> None:
        self.failures[rec.code] = self.failures.get(rec.code, 0) + 1
        self.log.warning(rec.code, f"{rec.message} (trace {rec.trace_id})")
        try:
            self.sink.emit(rec)
        except Exception as exc:
            self._error("sink", exc)

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._errlog.warning("probe.ops.error", f"{where}: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ semantic
    def add_rule(self, rule: Rule) -> None:
        """A semantic rule run by :meth:`end_request`."""
        self._rules.append(rule)

    @property
    def rules(self) -> list[Rule]:
        return self._rules

    def end_request(self, output: RequestOutput) -> list[S.ErrorContext]:
        """Run the semantic rules on a finished request; emit one record per
        violation (lengths and paths only, never the content)."""
        if _parse_spec(self._spec)[0] == "off":
            return []
        records = []
        for rule in list(self._rules):
            try:
                found = rule(output)
            except Exception as exc:
                self._error(f"rule {getattr(rule, 'name', rule)!r}", exc)
                continue
            if found is None:
                continue
            for v in [found] if isinstance(found, Violation) else list(found):
                attrs = {"check": "semantic", "rule": getattr(rule, "name", type(rule).__name__)}
                attrs.update(v.attrs)
                if output.text is not None:
                    attrs.setdefault("output_chars", len(output.text))
                if output.completion_tokens is not None:
                    attrs.setdefault("completion_tokens", output.completion_tokens)
                rec = S.ErrorContext.from_catalog(
                    self._code(v.code),
                    source=SOURCE,
                    trace_id=output.trace_id,
                    request_id=output.request_id,
                    message=v.message,
                    attrs=attrs,
                )
                records.append(_plain_enums(rec))
        for rec in records:
            self._emit(rec)
        return records


def _tapped_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module.forward`` while a :class:`_ForwardTap` is on: the module's own
    forward, then the checker's hook on its output."""
    out = module._rca_forward(*args, **kwargs)
    tap = module._rca_tap
    if module._forward_hooks:
        tap.promote()  # someone else's forward hooks: check after them, as a hook
    else:
        tap.hook(module, args, out)
    return out


def _forward_like(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of :func:`_tapped_forward` that shows ``inner``'s signature:
    callers inspect ``model.forward`` (transformers' ``generate`` decides which
    arguments to pass, e.g. ``logits_to_keep``, from it)."""
    fn = FunctionType(_tapped_forward.__code__, _tapped_forward.__globals__, "forward", None, None)
    try:
        sig = inspect.signature(inner)
        me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
        fn.__signature__ = sig.replace(parameters=[me, *sig.parameters.values()])  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    fn.__doc__ = getattr(inner, "__doc__", None)
    return fn


class _ForwardTap:
    """A forward hook without PyTorch's slow call path.

    Any forward hook sends every call of its module through
    ``Module._call_impl``'s general path (~3-4 us a call in eager mode, which
    is 1.5-2 % of a small decoder step when every module is hooked). The tap
    instead sets the module's ``forward`` to :func:`_tapped_forward` bound to
    the module (an instance attribute, as ``accelerate`` does), which calls
    the forward it replaced and then the hook: the call keeps PyTorch's fast
    path. Bound to the module, it follows ``copy.deepcopy`` to the copy.

    The hook must see what a forward hook would (the output after the
    module's own forward hooks, which may replace it): when the module has
    forward hooks at a call, the tap turns into a real forward hook,
    registered last, in that same call. ``remove()`` restores the forward it
    replaced; if something wrapped the module's forward after the tap, the
    tap only goes inert. Used for eager ``modules="auto"`` hooks;
    ``modules="all"`` (before ``torch.compile``) keeps real forward hooks."""

    __slots__ = ("_mod", "_prev", "hook", "_handle")

    def __init__(self, mod: nn.Module, hook: Callable[..., None]) -> None:
        d = mod.__dict__
        self._mod, self.hook, self._handle = mod, hook, None
        self._prev = d.get("forward")  # an instance forward someone set before (or None)
        inner = self._prev if self._prev is not None else mod.forward
        d["_rca_forward"] = inner
        d["_rca_tap"] = self
        d["forward"] = MethodType(_forward_like(inner), mod)
        if mod._forward_hooks:
            self.promote()

    def promote(self) -> None:
        """From a tap to a forward hook (the module's call takes the slow path anyway)."""
        if self._handle is None:
            hook = self.hook
            self._unwrap()
            self._handle = self._mod.register_forward_hook(hook)

    def _unwrap(self) -> None:
        mod, d = self._mod, self._mod.__dict__
        fwd = d.get("forward")
        func = getattr(fwd, "__func__", None)
        if getattr(func, "__code__", None) is _tapped_forward.__code__ and fwd.__self__ is mod:
            if self._prev is None:
                del d["forward"]
            else:
                d["forward"] = self._prev
            d.pop("_rca_forward", None)
            d.pop("_rca_tap", None)
        else:  # wrapped again since: keep the chain, silence the tap
            self.hook = _no_hook

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        else:
            self._unwrap()
        self.hook = _no_hook


def _no_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    return None


class _Step:
    def __init__(self, checker: Checker, trace_ids: Any, kw: dict[str, Any]) -> None:
        self.checker, self.trace_ids, self.kw = checker, trace_ids, kw
        self.records: list[S.ErrorContext] = []

    def __enter__(self) -> _Step:
        rerun = self.kw.pop("rerun", None)
        self._rerun = rerun
        self.checker.begin_step(self.trace_ids, **self.kw)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.records = self.checker.end_step(rerun=self._rerun)


class _Shapes:
    """Adapter so :meth:`Checker.check_kv_shapes` reuses the cache-shape check."""

    def __init__(self, shapes: list[tuple[int, str, Any]]) -> None:
        self.shapes = shapes


# ---------------------------------------------------------------------------
# module-level API
# ---------------------------------------------------------------------------
def instrument(
    model: nn.Module,
    tiers: str | Mapping[str, Any] = "default",
    *,
    checker: Checker | None = None,
    sink: Sink | None = None,
    logits: str | None = None,
    max_positions: int | None = None,
    modules: str = "auto",
    **checker_kw: Any,
) -> Checker:
    """Hook every module of ``model`` and return its :class:`Checker`.

    With no arguments this is the production tier: per-row min/max of the final
    logits, and the index bounds of the inputs (token ids vs the embedding size,
    positions vs the cache length and ``max_position_embeddings``); only the
    logits module, the embeddings and the root carry hooks. Switch tiers later
    with :func:`set_tiers`. For ``torch.compile`` or CUDA graphs, instrument
    with ``modules="all"`` before compiling: every hook is traced once and the
    tiers then act through the device mask.
    """
    ck = checker if checker is not None else Checker(sink, **checker_kw)
    _parse_spec(tiers)
    ck._spec = tiers
    return ck.attach(model, logits=logits, max_positions=max_positions, modules=modules)


def set_tiers(
    target: Checker | nn.Module, spec: str | Mapping[str, Any] = "default", **switches: Any
) -> dict:
    """Change tiers of a checker (or of the checker :func:`instrument` put on a
    model) at run time; returns the new status."""
    ck = target if isinstance(target, Checker) else _checker_of(target)
    return ck.set_tiers(spec, **switches)


def _checker_of(model: nn.Module) -> Checker:
    for hook in getattr(model, "_forward_pre_hooks", {}).values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, Checker):
            return owner
    raise ValueError("this model has no checker: call instrument(model) first")


def handle_checker_status(
    checker: Checker, method: str = "GET", body: bytes | str | Mapping[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """``/health/checker_status``: GET returns the status; POST/PUT a JSON body
    ``{"tiers": "full" | {...}, "sample_every": 4, "snapshot": false,
    "bounds": true}`` changes it. Returns ``(http_status, json_body)``; never raises."""
    try:
        m = method.upper()
        if m in ("GET", "HEAD"):
            return 200, checker.status()
        if m not in ("POST", "PUT", "PATCH"):
            return 405, {"error": f"method {method} not allowed", "allow": ["GET", "POST"]}
        if isinstance(body, (bytes, bytearray)):
            body = body.decode("utf-8")
        data = json.loads(body) if isinstance(body, str) else dict(body or {})
        if not isinstance(data, dict):
            return 400, {"error": "body must be a JSON object"}
        unknown = set(data) - {"tiers", "sample_every", "snapshot", "bounds", "state"}
        if unknown:
            return 400, {"error": f"unknown keys: {sorted(unknown)}"}
        spec = data.get("tiers", checker._spec)
        switches = {
            k: data[k] for k in ("sample_every", "snapshot", "bounds", "state") if k in data
        }
        return 200, checker.set_tiers(spec, **switches)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        return 400, {"error": str(exc)}
    except Exception as exc:  # never into the server
        checker._error("status handler", exc)
        return 500, {"error": type(exc).__name__}


def checker_status_handler(checker: Checker) -> Callable[..., tuple[int, dict[str, Any]]]:
    """A ``handler(method, body) -> (status, dict)`` bound to ``checker``, to mount
    at :data:`CHECKER_STATUS_PATH` in any web framework."""
    return functools.partial(handle_checker_status, checker)


def memory_stats(device: torch.device | str | None) -> dict[str, int] | None:
    """Allocator counters where the device has them (CUDA): bytes in use and
    reserved, the fragmentation signal (inactive split bytes), OOMs and retries."""
    if device is None or torch.device(device).type != "cuda":
        return None
    try:
        st = torch.cuda.memory_stats(device)
    except Exception:
        return None
    keys = {
        "allocated_bytes": "allocated_bytes.all.current",
        "reserved_bytes": "reserved_bytes.all.current",
        "inactive_split_bytes": "inactive_split_bytes.all.current",
        "num_ooms": "num_ooms",
        "num_alloc_retries": "num_alloc_retries",
    }
    return {k: int(st.get(v, 0)) for k, v in keys.items()}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _as_mapping(spec: Any) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        return dict(spec)
    return {"preset": spec}


def _parse_spec(spec: Any) -> tuple[str, list[tuple[str, Tier]]]:
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown tier preset {spec!r} (one of {', '.join(PRESETS)})")
        return spec, []
    if not isinstance(spec, Mapping):
        raise ValueError(f"tiers must be a preset name or a mapping, not {type(spec).__name__}")
    base = spec.get("preset", "off" if any(k not in _SWITCHES for k in spec) else "default")
    if base not in PRESETS:
        raise ValueError(f"unknown tier preset {base!r}")
    patterns = [(str(k), _tier(v)) for k, v in spec.items() if k not in _SWITCHES]
    return base, patterns


_SWITCHES = frozenset({"preset", "bounds", "state", "sample_every", "snapshot"})


def _post_order(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            walk(child)
        out.append(m)

    walk(model)
    return out


def _find_logits(model: nn.Module, names: dict[int, str]) -> str:
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            m = get()
        except Exception:
            m = None
        if isinstance(m, nn.Module) and id(m) in names:
            return names[id(m)] or _ROOT
    emb = _input_embeddings(model)
    vocab = emb.num_embeddings if emb is not None else None
    last = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (vocab is None or mod.out_features == vocab):
            last = name
    return last if last else _ROOT


def _input_embeddings(model: nn.Module) -> nn.Embedding | None:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            m = get()
            if isinstance(m, nn.Embedding):
                return m
        except Exception:
            pass
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return mod
    return None


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return None


def _get_arg(kwargs: dict, args: tuple, params: list[str] | None, names: tuple[str, ...]) -> Any:
    for n in names:
        if n in kwargs:
            return kwargs[n]
    if args and params:
        for n in names:
            if n in params:
                i = params.index(n)
                if i < len(args):
                    return args[i]
    return None


def _past_length(cache: Any) -> int | None:
    """Tokens already in a transformers cache, from shapes only (no device read)."""
    if cache is None:
        return None
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if not layers:
            return 0
        layer = layers[0]
        if hasattr(layer, "max_cache_len") or getattr(layer, "is_sliding", False):
            return None  # static/sliding: the shape is the capacity, not the length
        keys = getattr(layer, "keys", None)
        if keys is None or not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            return 0
        return int(keys.shape[-2])
    if isinstance(cache, (tuple, list)):
        if not cache:
            return 0
        first = cache[0]
        if isinstance(first, (tuple, list)) and first and isinstance(first[0], torch.Tensor):
            return int(first[0].shape[-2])
    return None


def _kv_layer_shapes(cache: Any) -> list[tuple[int, str, Any]]:
    if isinstance(cache, _Shapes):
        return cache.shapes
    out: list[tuple[int, str, Any]] = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.numel():
                out.append((i, type(layer).__name__, (tuple(k.shape), tuple(v.shape))))
    elif isinstance(cache, (tuple, list)):
        for i, layer in enumerate(cache):
            if isinstance(layer, (tuple, list)) and len(layer) >= 2:
                out.append((i, "kv", tuple(tuple(t.shape) for t in layer[:2])))
    return out


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                return o
    return None


def _first_float(obj: Any) -> torch.Tensor | None:
    """The output a site checks: the tensor, a model output's ``logits``, or the
    first float tensor of a tuple / list / mapping. The cheap type tests come
    first: an ABC ``isinstance(obj, Mapping)`` costs microseconds on a tuple."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if type(obj) is not tuple and type(obj) is not list and not isinstance(obj, (tuple, list)):
        if not isinstance(obj, (dict, Mapping)):
            return None
        logits = obj.get("logits") if hasattr(obj, "get") else None
        if isinstance(logits, torch.Tensor):
            return logits
        obj = list(obj.values())
    for o in obj[:4]:
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            return o
    return None


def _other_floats(obj: Any, first: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return []
    if isinstance(obj, (tuple, list)):
        vals = obj
    elif isinstance(obj, (dict, Mapping)):
        vals = list(obj.values())
    else:
        return []
    return [
        o
        for o in vals[:4]
        if isinstance(o, torch.Tensor) and o.is_floating_point() and o is not first
    ]


def _small(a: np.ndarray | None) -> bool:
    return a is None or a.size <= 1024


def _cells_clear(
    sums: Iterable[list[float]],
    ints: Iterable[tuple[list[int], list[int], list[int], list[int]]],
    minmax: Iterable[tuple[list[float], list[float], float, float]],
) -> bool:
    """The all-clear test over plain-Python rows of cells, one row per site:
    finite row sums, integer (min, max, lo, hi) with min >= lo and max < hi,
    float (min, max, lo, hi) inside the site's [lo, hi]. Neutral cells pass;
    NaN fails."""
    for row in sums:
        if not math.isfinite(sum(row)):
            return False
    for mn, mx, lo, hi in ints:
        for a, b, p, q in zip(mn, mx, lo, hi, strict=True):
            if a < p or b >= q:
                return False
    for mn, mx, lo, hi in minmax:
        for x in mn:
            if not x >= lo:
                return False
        for y in mx:
            if not y <= hi:
                return False
    return True


def _rows(a: np.ndarray, idx: list[int], w: int, axis: int) -> np.ndarray:
    """Rows ``idx`` (along ``axis``) and the first ``w`` columns of a buffer: a
    view when they are consecutive, else a copy."""
    lo = idx[0]
    if idx[-1] - lo + 1 == len(idx) and (len(idx) < 3 or idx == list(range(lo, lo + len(idx)))):
        return a[:, lo : lo + len(idx), :w] if axis else a[lo : lo + len(idx), :w]
    return a[:, idx, :w] if axis else a[idx, :w]


def _copy_fail(f: _Fail) -> _Fail:
    return _Fail(f.code, f.check, f.row, dict(f.attrs), f.message, f.order, f.confidence)


def _sample_stats(v: torch.Tensor) -> dict[str, Any]:
    finite = v[torch.isfinite(v)]
    out: dict[str, Any] = {"n": int(v.numel()), "nonfinite": int(v.numel() - finite.numel())}
    if finite.numel():
        out["min"] = _num(float(finite.min()))
        out["max"] = _num(float(finite.max()))
        out["mean"] = _num(float(finite.mean()))
        out["std"] = _num(float(finite.std(unbiased=False)))
    return out


def _values(v: torch.Tensor) -> list[float | int | str]:
    out: list[float | int | str] = []
    for x in v.tolist():
        if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
            out.append(int(x))
        else:
            out.append(_num(float(x)))
    return out


def _opt_list(x: Sequence[Any] | None) -> list[Any] | None:
    return list(x) if x is not None else None


def _plain_enums(rec: S.ErrorContext) -> S.ErrorContext:
    """Catalog enums as plain strings on the record."""
    for key in ("stage", "recoverability", "severity"):
        value = getattr(rec, key)
        if value is not None:
            setattr(rec, key, str(value))
    return rec
