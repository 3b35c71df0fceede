"""Host side of the step-graph contract, in plain numpy: KV caches, masks, RoPE feeds.

This is what the Rust engine does on the device, written as simply as possible so the
reference decoder and the tests can drive the exported graphs through onnxruntime.

Cache kinds (bundle.toml ``[[talker.cache]]``):
- ``full``: slot = position; the graph gets the filled prefix [1, KV, P, D].
- ``sliding`` with window W: a ring of W-1 slots, slot = position mod (W-1); never-written
  slots are masked. Every cached key carries its own rotary phase and softmax ignores slot
  order, so the ring needs no reordering. ``layout="roll"`` keeps the same W-1 entries in
  chronological order instead (shift left on overflow); tests use it to prove the ring right.

Cache tensors are position-major, [1, positions, KV, head_dim], as the graphs take them.

Masks are additive float32: 0 where a key is visible, ``MASK_FILL`` where it is not. A query at
position q sees key position p when p <= q (and, for sliding layers, p > q - W).
"""

from __future__ import annotations

import numpy as np

from .checkpoint import LMSpec
from .lm import MASK_FILL, rope_tables


class StaleStep(ValueError):
    """A step whose positions do not continue the cache (repeated or skipped positions)."""


class StackCache:
    """The per-layer KV caches of one decoder stack (talker or code predictor)."""

    def __init__(self, lm: LMSpec, dtype=np.float32, layout: str = "ring"):
        if layout not in ("ring", "roll"):
            raise ValueError(layout)
        self.lm, self.dtype, self.layout = lm, np.dtype(dtype), layout
        self.clear()

    def clear(self) -> None:
        """Retire the sequence: empty full caches, all ring slots never-written."""
        lm = self.lm
        self.next_pos = 0
        self.full: dict[int, list[np.ndarray]] = {}
        self.ring: dict[int, list[np.ndarray]] = {}
        self.window = None
        for i, (kind, w) in enumerate(lm.layer_kinds):
            if kind == "full":
                z = np.zeros((1, 0, lm.kv_heads, lm.head_dim), self.dtype)
                self.full[i] = [z, z.copy()]
            else:
                self.window = w
                z = np.zeros((1, w - 1, lm.kv_heads, lm.head_dim), self.dtype)
                self.ring[i] = [z, z.copy()]
        # position held by each ring slot (-1 = never written); shared by all sliding layers
        self.slot_pos = np.full(self.window - 1, -1, np.int64) if self.window else None

    def feeds(self, n_new: int) -> dict[str, np.ndarray]:
        """cos/sin, masks and caches for a step over positions next_pos .. next_pos+n_new-1."""
        lm, start = self.lm, self.next_pos
        pos = np.arange(start, start + n_new)
        cos, sin = rope_tables(pos, lm.head_dim, lm.rope_theta)
        f = {"cos": cos[None], "sin": sin[None]}
        q = pos[:, None]
        new_vis = pos[None, :] <= q
        if self.full:
            f["mask_full_past"] = _mask(np.ones((n_new, start), bool))
            f["mask_full_new"] = _mask(new_vis)
        if self.ring:
            W = self.window
            sp = self.slot_pos[None, :]
            ring_vis = (sp >= 0) & (sp > q - W)
            f["mask_sliding_ring"] = _mask(ring_vis)
            f["mask_sliding_new"] = _mask(new_vis & (pos[None, :] > q - W))
        for i in range(lm.layers):
            k, v = self.full[i] if i in self.full else self.ring[i]
            f[f"k_cache_{i}"], f[f"v_cache_{i}"] = k, v
        return f

    def write(self, outputs: dict[str, np.ndarray], n_new: int, start: int | None = None) -> None:
        """Validate every layer's k_new/v_new, then commit them (all or nothing)."""
        lm = self.lm
        if start is not None and start != self.next_pos:
            raise StaleStep(f"step starts at position {start}, cache expects {self.next_pos}")
        want = (1, n_new, lm.kv_heads, lm.head_dim)
        for i in range(lm.layers):
            for kv in ("k", "v"):
                a = outputs.get(f"{kv}_new_{i}")
                if a is None or a.shape != want:
                    raise ValueError(f"{kv}_new_{i}: expected shape {want}, got {None if a is None else a.shape}")
                if not np.all(np.isfinite(a)):
                    raise ValueError(f"{kv}_new_{i}: non-finite values")
        pos = np.arange(self.next_pos, self.next_pos + n_new)
        for i in self.full:
            for j, kv in enumerate("kv"):
                self.full[i][j] = np.concatenate([self.full[i][j], outputs[f"{kv}_new_{i}"].astype(self.dtype)], axis=1)
        if self.ring:
            R = self.window - 1
            keep = pos[-R:]                       # a long prefill keeps only the last W-1 positions
            sel = slice(n_new - len(keep), n_new)
            for i in self.ring:
                for j, kv in enumerate("kv"):
                    new = outputs[f"{kv}_new_{i}"][:, sel].astype(self.dtype)
                    if self.layout == "ring":
                        self.ring[i][j][:, keep % R] = new
                    else:
                        buf = np.concatenate([self.ring[i][j], new], axis=1)
                        self.ring[i][j] = np.ascontiguousarray(buf[:, -R:])
            if self.layout == "ring":
                self.slot_pos[keep % R] = keep
            else:
                self.slot_pos = np.concatenate([self.slot_pos, keep])[-R:]
        self.next_pos += n_new


def _mask(visible: np.ndarray) -> np.ndarray:
    return np.where(visible, 0.0, MASK_FILL).astype(np.float32)[None, None]


def step(session, cache: StackCache, x: np.ndarray, extra: dict | None = None) -> dict[str, np.ndarray]:
    """Run one step graph over x [S, H] through an onnxruntime session and commit the cache.

    Returns all outputs by name (logits [1,S,V], hidden when present, k_new/v_new).
    """
    n = x.shape[0]
    feeds = cache.feeds(n)
    feeds["x"] = np.ascontiguousarray(x, dtype=np.float32)[None]
    if extra:
        feeds.update(extra)
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    outs = dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))
    cache.write(outs, n)
    return outs
