//! Footprint arithmetic: weight parameters per step, KV bytes per position, what a bundle needs
//! in memory. One place for every count (the board's memory budget, `herald info` and the
//! benchmark's bandwidth floor all read these), so they cannot disagree.
//!
//! Conventions: a `full` layer's cache grows by one K and one V row per position; a `sliding`
//! layer keeps a fixed ring of `window - 1` rows (docs/bundle.md "Step graphs"); the code
//! predictor's caches hold at most 16 positions (a 2-position prefill and 14 steps per frame).

use serde::Serialize;

use crate::dtype::Dtype;
use crate::frame::CODEBOOKS;
use crate::manifest::{CacheKind, Manifest, StackInfo};

/// Bytes of one position's K and V in one layer of `stack`: `2 × kv_heads × head_dim × dtype`.
pub fn kv_row_bytes(stack: &StackInfo, dtype: Dtype) -> u64 {
    2 * u64::from(stack.kv_heads) * u64::from(stack.head_dim) * dtype.bytes()
}

/// Full-attention layers of `stack` (their caches grow with the sequence).
pub fn full_layers(stack: &StackInfo) -> u64 {
    stack.cache.iter().filter(|c| matches!(c, CacheKind::Full)).count() as u64
}

/// Ring rows over all sliding layers of `stack` (`window - 1` each).
pub fn ring_rows(stack: &StackInfo) -> u64 {
    stack
        .cache
        .iter()
        .map(|c| match c {
            CacheKind::Sliding { window } => u64::from(window.saturating_sub(1)),
            CacheKind::Full => 0,
        })
        .sum()
}

/// KV bytes one more position adds to `stack`'s caches: its full-attention layers only (a ring
/// does not grow). 229,376 B for the 0.6B talker in fp32 (28 layers × 2 × 8 × 128 × 4).
pub fn kv_bytes_per_position(stack: &StackInfo, dtype: Dtype) -> u64 {
    full_layers(stack) * kv_row_bytes(stack, dtype)
}

/// KV bytes a step reads when the full caches hold `slots` slots: every full layer's `slots`
/// rows plus every sliding layer's ring (keys and values).
pub fn kv_read_bytes(stack: &StackInfo, dtype: Dtype, slots: u64) -> u64 {
    (full_layers(stack) * slots + ring_rows(stack)) * kv_row_bytes(stack, dtype)
}

/// Weight parameters of one decoder stack: every layer's q/k/v/o, gate/up/down projections,
/// the two RMSNorms and the per-head q/k norms, plus the final norm.
pub fn stack_params(s: &StackInfo) -> u64 {
    let (h, q, kv, i, d) = (
        u64::from(s.hidden),
        u64::from(s.heads * s.head_dim),
        u64::from(s.kv_heads * s.head_dim),
        u64::from(s.intermediate),
        u64::from(s.head_dim),
    );
    let layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * d;
    u64::from(s.layers) * layer + h
}

/// Weight parameters one talker decode step reads: the stack plus `codec_head` `[vocab, H]`.
pub fn talker_step_params(m: &Manifest) -> u64 {
    stack_params(&m.talker) + u64::from(m.codec.vocab_size) * u64::from(m.talker.hidden)
}

/// Weight parameters one code-predictor sub-step reads: the stack, one `lm_head`
/// `[codebook_size, H_cp]` and, when present, `small_to_mtp_projection` `[H_cp, H_talker]` + bias.
pub fn predictor_step_params(m: &Manifest) -> u64 {
    let c = &m.code_predictor;
    let proj = if c.projection.unwrap_or(false) { u64::from(c.hidden) * u64::from(m.talker.hidden) + u64::from(c.hidden) } else { 0 };
    stack_params(c) + u64::from(m.audio.codebook_size) * u64::from(c.hidden) + proj
}

/// What a bundle needs in memory (the board's budget reads it; `herald info` prints it).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelFootprint {
    /// The bundle's dtype.
    pub dtype: Dtype,
    /// Bytes that become resident when the bundle loads: the step graphs' weights and the tables
    /// read whole. The text-embedding table is memory-mapped and only touched rows load, so it
    /// is not counted.
    pub weights_bytes: u64,
    /// Talker KV bytes per position ([`kv_bytes_per_position`]).
    pub kv_bytes_per_position: u64,
    /// Caches whose size does not grow with the text: the talker's sliding-window rings and the
    /// code predictor's 16-position caches.
    pub fixed_cache_bytes: u64,
    /// The talker's maximum positions (`max_positions` in bundle.toml).
    pub max_positions: u64,
}

impl ModelFootprint {
    /// The footprint of the bundle `m` whose files (all but the tokenizer) add up to
    /// `file_bytes` on disk: the text-embedding table is subtracted (memory-mapped, a prompt
    /// touches a few rows).
    pub fn of(m: &Manifest, file_bytes: u64) -> Self {
        let dtype = m.dtype();
        let table_bytes = m.tables_dtype().bytes();
        let text_rows: u64 = m.tables.text_embedding.shape.iter().product::<u64>() * table_bytes;
        let (t, cp) = (&m.talker, &m.code_predictor);
        let fixed = ring_rows(t) * kv_row_bytes(t, dtype) + u64::from(cp.layers) * CODEBOOKS as u64 * kv_row_bytes(cp, dtype);
        ModelFootprint {
            dtype,
            weights_bytes: file_bytes.saturating_sub(text_rows),
            kv_bytes_per_position: kv_bytes_per_position(t, dtype),
            fixed_cache_bytes: fixed,
            max_positions: u64::from(t.max_positions),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 0.6B talker (config.json of Qwen3-TTS-12Hz-0.6B: 28 layers, 16 heads, 8 KV heads,
    /// head_dim 128, hidden 1024, intermediate 3072).
    fn talker(cache: Vec<CacheKind>) -> StackInfo {
        StackInfo {
            graph: "talker".into(),
            hidden: 1024,
            layers: cache.len() as u32,
            heads: 16,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 3072,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            max_positions: 32768,
            cache,
            projection: None,
            lm_heads: None,
        }
    }

    #[test]
    fn kv_bytes_of_the_real_talker_by_hand() {
        let t = talker(vec![CacheKind::Full; 28]);
        // 28 layers × (K + V) × 8 heads × 128 × 4 bytes
        assert_eq!(kv_bytes_per_position(&t, Dtype::Fp32), 28 * 2 * 8 * 128 * 4);
        assert_eq!(kv_bytes_per_position(&t, Dtype::Fp16), 114_688);
        assert_eq!(kv_read_bytes(&t, Dtype::Fp32, 64), 64 * 229_376);
    }

    #[test]
    fn a_ring_does_not_grow_but_is_read() {
        let mut cache = vec![CacheKind::Full; 2];
        cache.push(CacheKind::Sliding { window: 9 });
        let t = talker(cache);
        let row = 2 * 8 * 128 * 4;
        assert_eq!(kv_bytes_per_position(&t, Dtype::Fp32), 2 * row);
        assert_eq!(ring_rows(&t), 8);
        assert_eq!(kv_read_bytes(&t, Dtype::Fp32, 64), (2 * 64 + 8) * row);
    }

    #[test]
    fn talker_stack_parameters_by_hand() {
        let t = talker(vec![CacheKind::Full; 28]);
        // per layer: q 1024×2048, k and v 1024×1024 each, o 2048×1024, MLP 3 × 1024×3072,
        // two RMSNorms (2 × 1024), q/k norms (2 × 128); plus the final norm
        let layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128;
        assert_eq!(stack_params(&t), 28 * layer + 1024);
    }
}
