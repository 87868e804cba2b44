"""KV-cache block fingerprints: find cached blocks whose content changed.

A finished KV block (all its slots written) is immutable until it is freed;
prefix caching hands it to later requests as is. A block that changes anyway (a
DMA or ECC fault, a kernel writing through a stale block table, a block reused
while still referenced) silently corrupts every request that reads it. This
probe fingerprints finished blocks on the device, one int64 per block, and
reports a block whose fingerprint changed as ``KV_BLOCK_HASH_MISMATCH``.

The fingerprint of a block reads its bytes as 64-bit words ``w_i`` (i = the
word's position in the block) and mixes two reductions:

* ``torch.hash_tensor`` (an xor reduction): any single-word change flips it, but
  it is blind to order (swapping two words keeps it);
* a position-weighted sum ``sum_i c_i * v_i mod 2**32`` over the block's 32-bit
  words ``v_i`` with fixed odd constants ``c_i``: a change of one word by d
  changes it by ``c_i * d != 0``, and a swap of words a, b changes it by
  ``(c_a - c_b) * (v_b - v_a)``.

Both are exact integer reductions (no rounding, independent of the reduction
order), so a block's fingerprint does not depend on the device, the batch of
blocks it was computed with, or the kernel. Nothing is copied to the host but
the indices of mismatched blocks (one read per step; empty when all is well).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ingest import schema as S
from probes.sink import RateLimitedLog, Sink, default_sink

__all__ = [
    "block_fingerprints",
    "KVSnapshot",
    "snapshot",
    "diff",
    "KVBlockChecker",
    "fingerprint_hex",
    "PRODUCTION_VERIFY_PER_STEP",
]

log = logging.getLogger("rca.probes.kvcache")

SOURCE = "probe:kvcache"
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (odd)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights_cache: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

#: The recommended budget for a serving process: re-verify 4 finished blocks
#: per step (a per-sequence cache: ``max(1, 4 // rows)`` blocks of every row).
#: Detection latency: every finished block within ``ceil(known / 4)`` steps
#: (``rca bench probes``: 10 blocks per row, so 10 steps). On a GPU the bytes
#: are cheap (a block of an 8B model's cache is ~2 MB, under a microsecond of
#: HBM bandwidth): raise it there to shorten the latency.
PRODUCTION_VERIFY_PER_STEP = 4


def fingerprint_hex(value: int) -> str:
    """An int64 fingerprint as 16 lowercase hex digits (its two's complement)."""
    return f"{int(value) & 0xFFFFFFFFFFFFFFFF:016x}"


def _splitmix64(n: int) -> np.ndarray:
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _weights(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Fixed odd 32-bit constants, one per word position in a block (cached)."""
    key = (shape, str(device))
    w = _weights_cache.get(key)
    if w is None:
        n = int(np.prod(shape)) if shape else 1
        odd = (_splitmix64(n) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
        with torch.inference_mode(False):
            w = torch.from_numpy(odd.astype(np.uint32).view(np.int32)).reshape(shape).to(device)
        if len(_weights_cache) > 64:
            _weights_cache.clear()
        _weights_cache[key] = w
    return w


def _words(x: torch.Tensor, lead: int, nbytes: int) -> torch.Tensor:
    """The block contents as ``nbytes``-wide signed words where the layout allows
    a free view, else as signed integers of the element's own width."""
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    size = x.element_size()
    if size != nbytes and x.dim() > lead and x.stride(-1) == 1:
        try:
            return x.view(_INT_OF_SIZE[nbytes])
        except RuntimeError:  # last dim or strides not divisible: no free view
            pass
    return x.view(_INT_OF_SIZE[size])


def block_fingerprints(
    blocks: torch.Tensor, *, lead: int = 1, chunk_bytes: int = 64 << 20
) -> torch.Tensor:
    """One int64 fingerprint per block, computed where ``blocks`` lives.

    ``blocks``: ``[*index_dims, *content_dims]`` with ``lead`` index dims (a
    paged cache ``[num_blocks, block_size, heads, head_dim]`` has ``lead=1``);
    any dtype, any strides (views are fine: nothing is copied where the layout
    allows). Returns ``int64`` of shape ``blocks.shape[:lead]``: the xor of the
    block's 64-bit words (``torch.hash_tensor``) times an odd constant, plus the
    sum of its 32-bit words weighted by fixed odd constants (mod 2**32; 32-bit
    lanes because CPUs have no vector 64-bit multiply). Temporaries are bounded
    by ``chunk_bytes``.

    >>> import torch
    >>> cache = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    >>> fp = block_fingerprints(cache)
    >>> cache[2, 0, 0, 0] = 1.0
    >>> (block_fingerprints(cache) != fp).nonzero().flatten().tolist()
    [2]
    """
    hashed, weighted = _reductions(blocks, lead, chunk_bytes)
    return _combine(hashed, weighted)


def _reductions(
    blocks: torch.Tensor, lead: int, chunk_bytes: int = 64 << 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two per-block reductions (xor of 64-bit words, weighted sum of 32-bit
    words), before they are mixed: callers with many tensors mix them once."""
    if blocks.dim() <= lead:
        blocks = blocks.unsqueeze(-1)
    content = tuple(range(lead, blocks.dim()))
    hashed = torch.hash_tensor(_words(blocks, lead, 8), dim=content).view(torch.int64)
    w32 = _words(blocks, lead, 4)
    c = _weights(tuple(w32.shape[lead:]), w32.device)
    step = max(1, chunk_bytes // max(1, w32[0].numel() * 4)) if w32.dim() else 1
    if step >= w32.shape[0]:
        return hashed, (w32 * c).sum(dim=content, dtype=torch.int32)
    parts = [(ch * c).sum(dim=content, dtype=torch.int32) for ch in w32.split(step, dim=0)]
    return hashed, torch.cat(parts)


def _combine(hashed: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    return hashed * _MIX + weighted.long()


# ---------------------------------------------------------------------------
# snapshots
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Fingerprints of some blocks of every (layer, part), still on the device."""

    names: tuple[tuple[str, str], ...]  # (layer, part) per row of ``fingerprints``
    block_ids: tuple[int, ...]
    fingerprints: torch.Tensor  # int64 [len(names), len(block_ids)]


def _parts(caches: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(layer, part, tensor) for a mapping or sequence of per-layer caches: a
    tensor (part ``kv``) or a (K, V) pair (parts ``k``, ``v``)."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(caches, torch.Tensor):
        items = [("0", caches)]
    elif isinstance(caches, Mapping):
        items = caches.items()
    else:
        items = enumerate(caches)
    out = []
    for name, layer in items:
        if isinstance(layer, torch.Tensor):
            out.append((str(name), "kv", layer))
        else:
            for part, t in zip(("k", "v"), layer, strict=False):
                out.append((str(name), part, t))
    return out


def _select(t: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Fingerprints of blocks ``ids`` of a paged tensor: gather (copy) a few, or
    fingerprint the whole pool when most of it is asked for."""
    if n * 2 >= t.shape[0]:
        return block_fingerprints(t).index_select(0, ids)
    return block_fingerprints(t.index_select(0, ids))


#: gathers of at most this many bytes go through one buffer and one reduction
#: (a per-part loop costs ~6 small ops per part; a big gather costs a copy)
_STACK_BYTES = 4 << 20
#: on a GPU a copy is cheap and each op costs ~10 us of host time: a 1B model's
#: 16 layers x K/V at batch 8 (17 MB a verified window) were ~190 ops a decode
#: step (2.5 ms on an H200 host) through the per-part loop
_STACK_BYTES_CUDA = 64 << 20


def _fingerprint_parts(tensors: Sequence[torch.Tensor], ids: torch.Tensor, n: int) -> torch.Tensor:
    """``[len(tensors), n]`` fingerprints of blocks ``ids`` of paged tensors that
    share a layout: one gather per part into one buffer, then one reduction for
    all of them (not a reduction per part)."""
    t0 = tensors[0]
    same = all(t.shape == t0.shape and t.dtype == t0.dtype for t in tensors)
    per_block = t0[0].numel() * t0.element_size() if t0.dim() else 0
    if not same or n * 2 >= t0.shape[0] or n * per_block * len(tensors) > _STACK_BYTES:
        return torch.stack([_select(t, ids, n) for t in tensors])
    buf = torch.empty((len(tensors), n, *t0.shape[1:]), dtype=t0.dtype, device=t0.device)
    for i, t in enumerate(tensors):
        torch.index_select(t, 0, ids, out=buf[i])
    return block_fingerprints(buf, lead=2)


def snapshot(caches: Any, block_ids: Sequence[int] | None = None) -> KVSnapshot:
    """Fingerprint blocks ``block_ids`` (default: all) of a paged cache: per layer
    a tensor ``[num_blocks, ...]`` or a (K, V) pair of them."""
    parts = _parts(caches)
    if not parts:
        return KVSnapshot((), (), torch.zeros(0, 0, dtype=torch.int64))
    nblocks = parts[0][2].shape[0]
    ids = list(range(nblocks)) if block_ids is None else [int(b) for b in block_ids]
    dev = parts[0][2].device
    idx = torch.tensor(ids, dtype=torch.int64, device=dev)
    fps = _fingerprint_parts([t for _, _, t in parts], idx, len(ids))
    return KVSnapshot(tuple((a, b) for a, b, _ in parts), tuple(ids), fps)


def diff(before: KVSnapshot, after: KVSnapshot) -> list[tuple[str, str, int, int, int]]:
    """(layer, part, block, old, new) for every block whose fingerprint changed
    between two snapshots of the same blocks (one host read)."""
    if before.names != after.names or before.block_ids != after.block_ids:
        raise ValueError("snapshots of different layers or blocks")
    changed = (before.fingerprints != after.fingerprints).nonzero().tolist()
    if not changed:
        return []
    li = torch.tensor([r for r, _ in changed])
    bi = torch.tensor([c for _, c in changed])
    old = before.fingerprints.cpu()[li, bi].tolist()
    new = after.fingerprints.cpu()[li, bi].tolist()
    return [
        (*before.names[r], before.block_ids[c], o, n)
        for (r, c), o, n in zip(changed, old, new, strict=True)
    ]


# ---------------------------------------------------------------------------
# the checker
# ---------------------------------------------------------------------------
@dataclass(slots=True)
class _Holder:
    trace_id: str | None
    request_id: str | None


class KVBlockChecker:
    """Finished blocks must keep their fingerprint until they are released.

    Paged caches (vLLM's layout): call :meth:`seal` when a block fills up (with
    the request that wrote it), :meth:`share` when a prefix-cache hit hands it
    to another request, :meth:`release` when it is freed, and :meth:`step` once
    per engine step with the per-layer caches. Per-sequence caches
    (transformers' ``DynamicCache``: ``[batch, heads, seq, head_dim]`` per
    layer): :meth:`step_sequences`, which treats every full ``block_size``-token
    slice of a row as a finished block.

    A block is fingerprinted once, when it is sealed (paged: at the first
    :meth:`step` after :meth:`seal`; sequences: the step its last slot is
    written), and then re-verified. ``verify_per_step``: re-verify at most this
    many finished blocks per step, round-robin, so a step costs O(new blocks +
    budget) whatever the cache holds; every finished block is re-verified at
    least once every ``ceil(known / verify_per_step)`` steps (sequences: a
    window of ``k = max(1, verify_per_step // rows)`` blocks of every row, so
    ``ceil(known_per_row / k)`` steps). ``None`` (the default) re-verifies every
    finished block every step. Production: :data:`PRODUCTION_VERIFY_PER_STEP`
    (what ``rca bench probes`` measures).
    """

    def __init__(
        self,
        sink: Sink | None = None,
        *,
        verify_per_step: int | None = None,
        max_records_per_step: int = 64,
        log_interval_s: float = 10.0,
        catalog: Any = None,
    ) -> None:
        self._sink = sink
        self._catalog = catalog
        self.verify_per_step = verify_per_step
        self.max_records_per_step = max_records_per_step
        self.log = RateLimitedLog(log_interval_s, log)
        self._errlog = RateLimitedLog(log_interval_s, log)
        # paged state
        self._holders: dict[int, list[_Holder]] = {}
        self._known: dict[int, None] = {}  # sealed with a reference (insertion order)
        self._new: dict[int, None] = {}  # sealed, reference taken at the next step
        self._refs: torch.Tensor | None = None  # int64 [parts, num_blocks]
        self._names: tuple[tuple[str, str], ...] = ()
        self._cursor = 0
        # per-sequence state
        self._seq_refs: torch.Tensor | None = None  # int64 [parts, rows, blocks]
        self._seq_blocks = 0
        self._seq_cursor = 0
        self._seq_names: tuple[tuple[str, str], ...] = ()
        self.steps = 0
        self.mismatches = 0
        self.errors = 0
        self.suppressed_records = 0

    @property
    def sink(self) -> Sink:
        if self._sink is None:
            self._sink = default_sink()
        return self._sink

    def _code(self) -> Any:
        if self._catalog is None:
            from graph.catalog import default_catalog

            self._catalog = default_catalog()
        return self._catalog["KV_BLOCK_HASH_MISMATCH"]

    # ------------------------------------------------------------------ paged
    def seal(
        self,
        block_ids: Iterable[int],
        *,
        trace_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Blocks that just filled up: immutable from now on."""
        for b in block_ids:
            b = int(b)
            if b not in self._known:
                self._new[b] = None
            self._holders.setdefault(b, []).append(_Holder(trace_id, request_id))

    def share(
        self,
        block_ids: Iterable[int],
        *,
        trace_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """Another request reads these sealed blocks (a prefix-cache hit)."""
        for b in block_ids:
            holders = self._holders.setdefault(int(b), [])
            if all(h.trace_id != trace_id or h.request_id != request_id for h in holders):
                holders.append(_Holder(trace_id, request_id))

    def release(
        self,
        block_ids: Iterable[int],
        *,
        trace_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        """A request lets go of blocks; with no holder left (or with no request
        named) a block is free to be rewritten and is forgotten."""
        for b in block_ids:
            b = int(b)
            holders = self._holders.get(b, [])
            if trace_id is not None or request_id is not None:
                holders = [
                    h for h in holders if h.trace_id != trace_id or h.request_id != request_id
                ]
            else:
                holders = []
            if holders:
                self._holders[b] = holders
                continue
            self._holders.pop(b, None)
            self._known.pop(b, None)
            self._new.pop(b, None)

    def step(self, caches: Any) -> list[S.ErrorContext]:
        """Fingerprint sealed blocks on the device; report the changed ones."""
        try:
            found = self._step_paged(caches)
        except Exception as exc:
            self._error("step", exc)
            found = []
        self.steps += 1
        return self._emit_all(found)

    def _step_paged(self, caches: Any) -> list[tuple[int, list[str], int, int, dict[str, Any]]]:
        parts = _parts(caches)
        if not parts or not (self._known or self._new):
            return []
        names = tuple((a, b) for a, b, _ in parts)
        nblocks = parts[0][2].shape[0]
        dev = parts[0][2].device
        if self._refs is None or self._names != names or self._refs.shape[1] != nblocks:
            with torch.inference_mode(False):
                self._refs = torch.zeros(len(parts), nblocks, dtype=torch.int64, device=dev)
            self._names = names
            self._new.update(self._known)
            self._known = {}
        known = list(self._known)
        if self.verify_per_step is not None and len(known) > self.verify_per_step:
            start = self._cursor % len(known)
            known = (known[start:] + known[:start])[: self.verify_per_step]
            self._cursor = start + len(known)
        new = list(self._new)
        ids = known + new
        idx = torch.tensor(ids, dtype=torch.int64, device=dev)
        fps = _fingerprint_parts([t for _, _, t in parts], idx, len(ids))  # [P, n]
        kn = len(known)
        refs = self._refs
        found: list[tuple[int, list[str], int, int, dict[str, Any]]] = []
        if kn:
            old = refs.index_select(1, idx[:kn])
            bad = (fps[:, :kn] != old).nonzero()  # the one host read of the step
            if bad.numel():
                found = self._paged_found(bad.tolist(), known, fps[:, :kn], old, names)
        refs.index_copy_(1, idx, fps)  # new references; mismatched blocks re-baselined
        for b in new:
            self._known[b] = None
        self._new = {}
        return found

    def _paged_found(
        self,
        bad: list[list[int]],
        known: list[int],
        fps: torch.Tensor,
        old: torch.Tensor,
        names: tuple[tuple[str, str], ...],
    ) -> list[tuple[int, list[str], int, int, dict[str, Any]]]:
        p = torch.tensor([r for r, _ in bad])
        c = torch.tensor([k for _, k in bad])
        new_v = fps.cpu()[p, c].tolist()
        old_v = old.cpu()[p, c].tolist()
        by_block: dict[int, list[tuple[str, str, int, int]]] = {}
        for (pi, ci), nv, ov in zip(bad, new_v, old_v, strict=True):
            by_block.setdefault(known[ci], []).append((*names[pi], ov, nv))
        out = []
        for block, hits in by_block.items():
            holders = self._holders.get(block, [])
            out.append(
                (
                    block,
                    [h.trace_id for h in holders if h.trace_id],
                    hits[0][2],
                    hits[0][3],
                    {
                        "layout": "paged",
                        "hits": hits,
                        "request_ids": [h.request_id for h in holders if h.request_id][:16],
                    },
                )
            )
        return out

    # ------------------------------------------------------------------ sequences
    def step_sequences(
        self,
        cache: Any,
        trace_ids: Sequence[str | None] | None = None,
        *,
        block_size: int = 16,
        request_ids: Sequence[str | None] | None = None,
        reset_rows: Iterable[int] = (),
    ) -> list[S.ErrorContext]:
        """Per-sequence caches (transformers ``Cache`` or legacy ``((k, v), ...)``):
        every full ``block_size`` slice of a row is a finished block; its
        fingerprint is taken when it fills and checked on every later step.
        ``reset_rows``: rows that now hold a different sequence."""
        try:
            found = self._step_seq(cache, block_size, list(reset_rows))
        except Exception as exc:
            self._error("step_sequences", exc)
            found = []
        self.steps += 1
        ids = list(trace_ids) if trace_ids is not None else []
        req = list(request_ids) if request_ids is not None else []
        out = []
        for row, block, old, new, attrs in found:
            attrs["row"] = row
            attrs["token_range"] = [block * block_size, (block + 1) * block_size]
            trace = [ids[row]] if row < len(ids) and ids[row] else []
            if row < len(req) and req[row]:
                attrs["request_ids"] = [req[row]]
            out.append((block, trace, old, new, attrs))
        return self._emit_all(out)

    def _step_seq(
        self, cache: Any, block_size: int, reset_rows: list[int]
    ) -> list[tuple[int, int, int, int, dict[str, Any]]]:
        layers = _sequence_layers(cache)
        if not layers:
            return []
        names = tuple((a, b) for a, b, _ in layers)
        rows, seq = layers[0][2].shape[0], layers[0][2].shape[-2]
        nb = seq // block_size
        if nb == 0:
            return []
        dev = layers[0][2].device
        refs = self._seq_refs
        if refs is None or self._seq_names != names or refs.shape[1] != rows:
            refs, self._seq_blocks = None, 0
        if refs is None or refs.shape[2] < nb:
            with torch.inference_mode(False):
                shape = (len(layers), rows, 2 * nb + 2)
                grown = torch.zeros(shape, dtype=torch.int64, device=dev)
                if refs is not None:
                    grown[:, :, : refs.shape[2]] = refs
            refs = grown
        self._seq_refs, self._seq_names = refs, names
        known = min(self._seq_blocks, nb)  # a cropped cache forgets the cut blocks
        tensors = [t for _, _, t in layers]
        found: list[tuple[int, int, int, int, dict[str, Any]]] = []
        if known and reset_rows:  # new sequences in these rows: new references
            refs[:, reset_rows, :known] = _seq_range(tensors, 0, known, block_size)[:, reset_rows]
        if known:
            lo, hi = self._seq_window(known, rows)
            fps = _seq_range(tensors, lo, hi, block_size)  # [P, rows, hi - lo]
            old = refs[:, :, lo:hi]
            neq = fps != old
            if reset_rows:
                neq[:, reset_rows] = False
            bad = neq.nonzero()  # the one host read of the step
            if bad.numel():
                found = self._seq_found(bad.tolist(), fps, old, names, lo)
                old.copy_(fps)  # reported once, then re-baselined
        if nb > known:  # blocks that just filled: fingerprinted once, now
            refs[:, :, known:nb] = _seq_range(tensors, known, nb, block_size)
        self._seq_blocks = nb
        return found

    def _seq_window(self, known: int, rows: int) -> tuple[int, int]:
        """The finished blocks re-verified this step: all of them, or with
        ``verify_per_step`` a window of ``k = max(1, verify_per_step // rows)``
        blocks of every row that moves round-robin (its last position is pulled
        back to end at ``known``), so every finished block is re-verified at least
        once every ``ceil(known / k)`` steps."""
        budget = self.verify_per_step
        if budget is None:
            return 0, known
        k = min(known, max(1, budget // max(1, rows)))
        lo = self._seq_cursor if self._seq_cursor < known else 0
        if lo + k >= known:
            lo, self._seq_cursor = known - k, 0
        else:
            self._seq_cursor = lo + k
        return lo, lo + k

    def _seq_found(
        self,
        bad: list[list[int]],
        fps: torch.Tensor,
        old: torch.Tensor,
        names: tuple[tuple[str, str], ...],
        offset: int = 0,
    ) -> list[tuple[int, int, int, int, dict[str, Any]]]:
        p, r, b = (torch.tensor(col) for col in zip(*bad, strict=True))
        new_v = fps.cpu()[p, r, b].tolist()
        old_v = old.cpu()[p, r, b].tolist()
        by_block: dict[tuple[int, int], list[tuple[str, str, int, int]]] = {}
        for (pi, ri, bi), nv, ov in zip(bad, new_v, old_v, strict=True):
            by_block.setdefault((ri, offset + bi), []).append((*names[pi], ov, nv))
        return [
            (row, block, hits[0][2], hits[0][3], {"layout": "sequence", "hits": hits})
            for (row, block), hits in by_block.items()
        ]

    # ------------------------------------------------------------------ records
    def _emit_all(
        self, found: list[tuple[int, list[str], int, int, dict[str, Any]]]
    ) -> list[S.ErrorContext]:
        if not found:
            return []
        records = []
        cap = self.max_records_per_step
        dropped = max(0, len(found) - cap)
        self.suppressed_records += dropped
        for i, (block, traces, old, new, extra) in enumerate(found[:cap]):
            hits = extra.pop("hits")
            layers = sorted({h[0] for h in hits}, key=_natural)
            attrs: dict[str, Any] = {
                "check": "fingerprint",
                "layer": hits[0][0],
                "part": hits[0][1],
                "layers": layers[:64],
                "parts_changed": len(hits),
                "expected": fingerprint_hex(old),
                "found": fingerprint_hex(new),
                "requests": traces[:16],
                "step": self.steps,
                **extra,
            }
            if i == min(len(found), cap) - 1 and dropped:
                attrs["suppressed_records"] = dropped
            code = self._code()
            rec = S.ErrorContext.from_catalog(
                code,
                source=SOURCE,
                stage=str(code.stage),
                recoverability=str(code.recoverability),
                trace_id=traces[0] if traces else None,
                request_id=(extra.get("request_ids") or [None])[0],
                kv_block=int(block),
                kv_hash=fingerprint_hex(new),
                message=(
                    f"KV block {block} changed after it was finished "
                    f"(layer {hits[0][0]} {hits[0][1]}, {len(layers)} layer(s), "
                    f"{len(traces)} request(s))"
                ),
                attrs=attrs,
            )
            rec.severity = str(rec.severity)
            records.append(rec)
        for rec in records:
            self.mismatches += 1
            self.log.warning(rec.code, f"{rec.message} (trace {rec.trace_id})")
            try:
                self.sink.emit(rec)
            except Exception as exc:
                self._error("sink", exc)
        return records

    def _error(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._errlog.warning("probe.kvcache.error", f"{where}: {type(exc).__name__}: {exc}")


def _natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _sequence_layers(cache: Any) -> list[tuple[str, str, torch.Tensor]]:
    """(layer, part, [batch, heads, seq, head_dim]) from a transformers cache."""
    out = []
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.numel():
                out.append((str(i), "k", k))
                out.append((str(i), "v", v))
        return out
    if isinstance(cache, (tuple, list)):
        for i, layer in enumerate(cache):
            if isinstance(layer, (tuple, list)) and len(layer) >= 2:
                out.append((str(i), "k", layer[0]))
                out.append((str(i), "v", layer[1]))
    return out


def _seq_range(tensors: Sequence[torch.Tensor], lo: int, hi: int, block_size: int) -> torch.Tensor:
    """``[len(tensors), rows, hi - lo]`` fingerprints of blocks ``lo..hi`` of
    per-sequence caches ``[rows, heads, seq, head_dim]``; a block is
    ``[heads, block_size, head_dim]`` (the same value as
    :func:`block_fingerprints` of that slice). The blocks are reduced where they
    lie (both reductions are exact and order-free, so the weights just follow
    the layout). A window is copied into one buffer for as many layers as fit
    in ``_STACK_BYTES`` (``_STACK_BYTES_CUDA`` on a GPU) and reduced once per
    buffer; a part bigger than that is reduced on its own, without a copy."""
    n = hi - lo
    t0 = tensors[0]
    rows, heads, _, dim = t0.shape
    nbytes = dim * t0.element_size()
    same = all(t.shape == t0.shape and t.dtype == t0.dtype for t in tensors)
    if not same or t0.stride(-1) != 1 or nbytes % 8 or t0.dtype == torch.bool:
        hashes, sums = [], []
        for t in tensors:
            view = t[:, :, lo * block_size : hi * block_size].unflatten(2, (n, block_size))
            h, w = _reductions(view.transpose(1, 2), 2)
            hashes.append(h)
            sums.append(w)
        return _combine(torch.stack(hashes), torch.stack(sums))
    c = _weights((heads, block_size, nbytes // 4), t0.device).view(-1)
    parts = [t.narrow(2, lo * block_size, n * block_size) for t in tensors]
    per = rows * heads * n * block_size * nbytes  # bytes of one part's window
    limit = _STACK_BYTES_CUDA if t0.is_cuda else _STACK_BYTES
    if per <= limit:
        if n > 1:  # the copy puts every block's [heads, block_size, dim] together
            parts = [p.unflatten(2, (n, block_size)).transpose(1, 2) for p in parts]
        g = max(1, limit // per)  # parts per buffer
        hs, ws = [], []
        for i in range(0, len(parts), g):
            chunk = parts[i : i + g]
            flat = torch.stack(chunk).view(len(chunk), rows, n, -1)
            hs.append(torch.hash_tensor(flat.view(torch.int64), dim=3).view(torch.int64))
            ws.append((flat.view(torch.int32) * c).sum(dim=3, dtype=torch.int32))
        if len(hs) == 1:
            return _combine(hs[0], ws[0])
        return _combine(torch.cat(hs), torch.cat(ws))
    hashes, sums = [], []
    for t in parts:
        h, w = _reduce_seq(
            t.view(rows, heads, n, block_size, dim), c.view(heads, 1, block_size, -1), 1
        )
        hashes.append(h)
        sums.append(w)
    return _combine(torch.stack(hashes), torch.stack(sums))


def _reduce_seq(x: torch.Tensor, c: torch.Tensor, hdim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two reductions of blocks laid out ``[..., heads, n, block_size, dim]``
    (``hdim``: the heads dimension) over heads, block_size and dim."""
    # contiguous trailing dims first, then the heads (xor and sum both associate)
    inner = (hdim + 2, hdim + 3)
    hashed = torch.hash_tensor(x.view(torch.int64), dim=inner)
    hashed = torch.hash_tensor(hashed.view(torch.int64), dim=hdim).view(torch.int64)
    weighted = (x.view(torch.int32) * c).sum(dim=inner, dtype=torch.int32)
    return hashed, weighted.sum(dim=hdim, dtype=torch.int32)
