//! Host-side KV-cache arithmetic shared by every backend: slot counts, ring slots, masks and
//! RoPE angles (docs/bundle.md "Step graphs").
//!
//! Per layer the host keeps a position-major cache `[1, slots, KV, head_dim]`:
//! - a `full` layer has slot = position; its slot count grows geometrically ([`slots_for`]) and
//!   slots at or past the filled length are masked;
//! - a `sliding` layer with window `w` is a ring of `w - 1` slots, slot = position mod (w - 1)
//!   ([`Ring`]); a slot is visible to a query while it holds a position inside the query's
//!   window. Softmax does not care about slot order and every cached key carries its own rotary
//!   phase, so a ring needs no reordering.
//!
//! Masks are additive float32: 0 where a key is visible, the manifest's `mask_fill` where not.

/// Smallest number of slots a `full` cache is allocated with.
pub const MIN_SLOTS: usize = 64;

/// Slots of the full caches for a sequence of `needed` positions: the next power of two, at
/// least [`MIN_SLOTS`] (or `capacity` when that is smaller: the code predictor's 16).
pub fn slots_for(needed: usize, capacity: usize) -> usize {
    needed.max(MIN_SLOTS.min(capacity)).next_power_of_two()
}

/// Masks of a step over `s` new positions starting at `start`, against `slots` full-cache slots:
/// `past` `[s, slots]` shows the `start` filled slots; `new` `[s, s]` is causal.
pub fn fill_full_masks(start: usize, s: usize, slots: usize, fill: f32, past: &mut [f32], new: &mut [f32]) {
    for q in 0..s {
        for j in 0..slots {
            past[q * slots + j] = if j < start { 0.0 } else { fill };
        }
        for k in 0..s {
            new[q * s + k] = if k <= q { 0.0 } else { fill };
        }
    }
}

/// RoPE angles: rotate-half with `inv_freq[j] = 1 / theta^(2j / D)` in float32, as transformers
/// computes it.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Angles for `head_dim` (even) and `theta` (`rope_theta`, 1e6 for the talker).
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let theta = theta as f32;
        let d = head_dim;
        Rope { inv_freq: (0..d / 2).map(|j| 1.0f32 / theta.powf((2 * j) as f32 / d as f32)).collect() }
    }

    /// Write `cos` and `sin` `[s, head_dim]` for positions `start..start + s`; both halves of a
    /// row repeat the same angles.
    pub fn fill(&self, start: usize, s: usize, cos: &mut [f32], sin: &mut [f32]) {
        let d = 2 * self.inv_freq.len();
        for r in 0..s {
            let p = (start + r) as f32;
            for (j, f) in self.inv_freq.iter().enumerate() {
                let a = p * f;
                let (c, si) = (a.cos(), a.sin());
                cos[r * d + j] = c;
                cos[r * d + j + d / 2] = c;
                sin[r * d + j] = si;
                sin[r * d + j + d / 2] = si;
            }
        }
    }
}

/// The ring of a sliding-window layer: `window - 1` slots and the position each holds.
#[derive(Debug, Clone)]
pub struct Ring {
    window: usize,
    /// Position held by each slot (-1: never written).
    slot_pos: Vec<i64>,
}

impl Ring {
    /// A ring for `window` (≥ 2): `window - 1` empty slots.
    pub fn new(window: usize) -> Self {
        let w = window.max(2);
        Ring { window: w, slot_pos: vec![-1; w - 1] }
    }

    /// Slots in the ring (`window - 1`).
    pub fn len(&self) -> usize {
        self.slot_pos.len()
    }

    /// Always false: a ring has at least one slot.
    pub fn is_empty(&self) -> bool {
        self.slot_pos.is_empty()
    }

    /// The window, positions.
    pub fn window(&self) -> usize {
        self.window
    }

    /// The slot of `position`.
    pub fn slot(&self, position: usize) -> usize {
        position % self.slot_pos.len()
    }

    /// Mark every slot never-written.
    pub fn clear(&mut self) {
        self.slot_pos.iter_mut().for_each(|p| *p = -1);
    }

    /// The step's positions that land in the ring: a step longer than the ring keeps only its
    /// last `window - 1` (offsets into the step).
    pub fn kept(&self, s: usize) -> std::ops::Range<usize> {
        s - s.min(self.len())..s
    }

    /// Masks of a step over `s` positions from `start`: `past` `[s, window - 1]` shows a slot
    /// that is written and within the query's window; `new` `[s, s]` is causal and within it.
    pub fn fill_masks(&self, start: usize, s: usize, fill: f32, past: &mut [f32], new: &mut [f32]) {
        let (r, w) = (self.len(), self.window);
        for q in 0..s {
            let qpos = (start + q) as i64;
            for (j, &p) in self.slot_pos.iter().enumerate() {
                past[q * r + j] = if p >= 0 && p > qpos - w as i64 { 0.0 } else { fill };
            }
            for k in 0..s {
                new[q * s + k] = if k <= q && q - k < w { 0.0 } else { fill };
            }
        }
    }

    /// Record that the step over `s` positions from `start` wrote its kept positions.
    pub fn commit(&mut self, start: usize, s: usize) {
        for j in self.kept(s) {
            let slot = self.slot(start + j);
            self.slot_pos[slot] = (start + j) as i64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: f32 = -1e9;

    #[test]
    fn slot_counts_double_from_64() {
        assert_eq!(slots_for(1, 4096), 64);
        assert_eq!(slots_for(65, 4096), 128);
        assert_eq!(slots_for(3, 16), 16);
    }

    #[test]
    fn ring_slots_wrap_and_hide_what_left_the_window() {
        // window 4: a ring of 3 slots
        let mut r = Ring::new(4);
        r.commit(0, 5); // a 5-position prefill keeps positions 2, 3, 4
        assert_eq!(r.kept(5), 2..5);
        assert_eq!((r.slot(2), r.slot(3), r.slot(4)), (2, 0, 1));
        // a 2-position step at 5, 6: position 5 sees all three (2..=5 is its window), position 6
        // no longer sees 2 (its window is 3..=6), which slot 2 still holds
        let (mut past, mut new) = (vec![9.0; 2 * 3], vec![9.0; 2 * 2]);
        r.fill_masks(5, 2, F, &mut past, &mut new);
        assert_eq!(past, vec![0.0, 0.0, 0.0, 0.0, 0.0, F]);
        assert_eq!(new, vec![0.0, F, 0.0, 0.0]);
        r.commit(5, 2);
        assert_eq!((r.slot(5), r.slot(6)), (2, 0));
        r.clear();
        let (mut past, mut new) = (vec![0.0; 3], vec![0.0; 1]);
        r.fill_masks(0, 1, F, &mut past, &mut new);
        assert_eq!(past, vec![F; 3]);
    }

    #[test]
    fn full_masks_show_the_filled_slots_and_are_causal() {
        let (mut past, mut new) = (vec![9.0; 2 * 4], vec![9.0; 4]);
        fill_full_masks(2, 2, 4, F, &mut past, &mut new);
        assert_eq!(past, vec![0.0, 0.0, F, F, 0.0, 0.0, F, F]);
        assert_eq!(new, vec![0.0, F, 0.0, 0.0]);
    }

    #[test]
    fn rope_angles_by_formula() {
        let rope = Rope::new(4, 10_000.0);
        let (mut c, mut s) = (vec![0.0; 4], vec![0.0; 4]);
        rope.fill(3, 1, &mut c, &mut s);
        let f1 = 1.0f32 / 10_000f32.powf(0.5);
        assert_eq!(c, vec![3f32.cos(), (3.0 * f1).cos(), 3f32.cos(), (3.0 * f1).cos()]);
        assert_eq!(s[1], (3.0 * f1).sin());
    }
}
