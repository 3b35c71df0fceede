//! Settings derived from the hardware profile and the bundle's footprint: compute dtype, the CPU
//! sets of the two pipeline stages, the memory budget and the KV capacity that fits — or a
//! refusal naming the numbers when the bundle cannot fit.
//!
//! Rules (issue #7; constants from shared/reference/edge-design-notes.md §2.1–2.2, the prior
//! design's `CLASS_TABLE` and `derive_overrides`):
//!
//! - **dtype**: fp32, unless the bundle is fp16 *and* the CPU has fp16 arithmetic
//!   (`fp16_arith`, ARMv8.2 FP16); an fp16 bundle on a CPU without it runs emulated (slow), which
//!   [`Derived::notes`] says.
//! - **threads**: the big cluster (fastest CPUs, intersected with the CPUs this process may use),
//!   2/3 to the talker stage and the rest to the vocoder ([`HardwareProfile::thread_split`]).
//! - **memory budget** = available − weights − activations − class headroom, activations =
//!   max(15 % of weights, 512 MiB); headroom per class: jetson 3 GiB (the GPU carve-out shares
//!   RAM), x86 2 GiB, arm64 1 GiB, snapdragon 1 GiB.
//! - **KV capacity** = (budget − fixed caches) / (bytes per position × 3/2), capped by the
//!   model's maximum positions and the configured capacity. Bytes per position =
//!   2 (K and V) × full-attention layers × kv_heads × head_dim × dtype bytes; the 3/2 covers a
//!   cache regrowth, when the old and the doubled buffers coexist (docs/engine.md).
//! - **refusal** when that capacity is below [`MIN_KV_POSITIONS`].

use serde::Serialize;

use crate::probe::{HardwareClass, HardwareProfile};

/// 1 MiB.
const MIB: u64 = 1 << 20;
/// 1 GiB.
const GIB: u64 = 1 << 30;

/// The smallest talker KV capacity herald starts with: 256 positions, a prompt of ~30 tokens
/// plus ~18 s of speech (226 frames of 80 ms).
pub const MIN_KV_POSITIONS: u64 = 256;

/// Activations floor, 512 MiB (edge-design-notes §2.2).
pub const ACTIVATIONS_FLOOR: u64 = 512 * MIB;

/// Memory the class leaves to the rest of the system (edge-design-notes §2.1 `headroom`).
pub fn class_headroom(class: HardwareClass) -> u64 {
    match class {
        HardwareClass::Jetson => 3 * GIB,
        HardwareClass::X86Cpu => 2 * GIB,
        HardwareClass::Arm64Cpu | HardwareClass::SnapdragonNpu => GIB,
    }
}

// The dtype and the bundle's footprint are model facts (`model::footprint` computes them from
// the manifest); this crate only budgets them.
pub use model::Dtype;
pub use model::footprint::ModelFootprint;

/// The derived settings, with the arithmetic behind them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Derived {
    /// The hardware class they were derived for.
    pub class: HardwareClass,
    /// Compute dtype.
    pub dtype: Dtype,
    /// CPUs of the talker stage (talker + code predictor), pinned.
    pub talker_cpus: Vec<usize>,
    /// CPUs of the vocoder stage, pinned; equal to `talker_cpus` on a one-CPU board.
    pub vocoder_cpus: Vec<usize>,
    /// The memory pool: MemAvailable (MemTotal when the probe could not read it), bytes.
    pub available_bytes: u64,
    /// The bundle's resident weights, bytes.
    pub weights_bytes: u64,
    /// max(15 % of weights, 512 MiB), bytes.
    pub activations_bytes: u64,
    /// The class headroom, bytes.
    pub headroom_bytes: u64,
    /// available − weights − activations − headroom (may be negative), bytes.
    pub memory_budget_bytes: i64,
    /// Talker KV bytes per position.
    pub kv_bytes_per_position: u64,
    /// Talker KV positions that fit, capped by the model and the configuration.
    pub kv_capacity: u64,
    /// What the budget alone would allow, before the caps.
    pub kv_fit: u64,
    /// Remarks for the log (emulated fp16, unpinned threads, caps that applied).
    pub notes: Vec<String>,
}

/// The bundle does not fit this board.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "the model does not fit in memory: {available} MiB available{limited_by} - {weights} MiB weights - {activations} MiB activations - {headroom} MiB headroom ({class}) = {budget} MiB leaves room for {fit} KV positions of {per_position} KiB; herald needs at least {min} (use an fp16 bundle, a smaller model, or free memory)"
)]
pub struct DoesNotFit {
    /// MemAvailable (or what the cgroup still allows, when less), MiB.
    pub available: i64,
    /// ` (the cgroup's memory limit - its usage)` when a control group's limit set `available`, else empty.
    pub limited_by: &'static str,
    /// Weights, MiB.
    pub weights: i64,
    /// Activations, MiB.
    pub activations: i64,
    /// Class headroom, MiB.
    pub headroom: i64,
    /// The class.
    pub class: HardwareClass,
    /// The budget, MiB (negative when even the weights do not fit).
    pub budget: i64,
    /// KV positions the budget allows.
    pub fit: u64,
    /// KV bytes per position, KiB.
    pub per_position: u64,
    /// [`MIN_KV_POSITIONS`].
    pub min: u64,
}

fn mib(b: u64) -> i64 {
    i64::try_from(b / MIB).unwrap_or(i64::MAX)
}

/// Derive the settings for `model` on `hw`.
///
/// `allowed_cpus` are the CPUs this process may run on (`sched_getaffinity`); the stage sets are
/// taken from the big cluster within them (all allowed CPUs when the big cluster is not among
/// them). `configured_kv_capacity` (synthesis.kv_capacity) caps the result.
///
/// # Errors
/// [`DoesNotFit`] when fewer than [`MIN_KV_POSITIONS`] positions fit.
pub fn derive(
    hw: &HardwareProfile,
    model: &ModelFootprint,
    allowed_cpus: &[usize],
    configured_kv_capacity: u64,
) -> Result<Derived, DoesNotFit> {
    let mut notes = Vec::new();
    let fp16_arith = hw.has(&["fp16_arith"]);
    let dtype = if model.dtype == Dtype::Fp16 && fp16_arith { Dtype::Fp16 } else { Dtype::Fp32 };
    if model.dtype == Dtype::Fp16 && !fp16_arith {
        notes.push(
            "the bundle is fp16 but this CPU has no fp16 arithmetic: products run emulated; an fp32 bundle is faster here".into(),
        );
    }

    // stage CPU sets: the probe's split, restricted to the CPUs we may use
    let (t, v) = hw.thread_split();
    let keep = |s: Vec<usize>| -> Vec<usize> { s.into_iter().filter(|c| allowed_cpus.contains(c)).collect() };
    let (mut talker_cpus, mut vocoder_cpus) = (keep(t), keep(v));
    if talker_cpus.is_empty() || vocoder_cpus.is_empty() {
        // the big cluster is (partly) outside our cpuset: split what we have instead
        let n = allowed_cpus.len();
        if n == 0 {
            notes.push("no CPU set known: threads are not pinned".into());
            talker_cpus.clear();
            vocoder_cpus.clear();
        } else if n == 1 {
            talker_cpus = allowed_cpus.to_vec();
            vocoder_cpus = allowed_cpus.to_vec();
        } else {
            let n0 = ((2 * n + 1) / 3).clamp(1, n - 1);
            talker_cpus = allowed_cpus[..n0].to_vec();
            vocoder_cpus = allowed_cpus[n0..].to_vec();
            notes.push(format!("the big cluster is outside this process's CPUs {allowed_cpus:?}; split those instead"));
        }
    }

    let available = if hw.ram_available_bytes > 0 { hw.ram_available_bytes } else { hw.ram_total_bytes };
    let weights = model.weights_bytes;
    let activations = (weights * 15 / 100).max(ACTIVATIONS_FLOOR);
    let headroom = class_headroom(hw.class);
    // i128: a profile may claim any u64 of RAM
    let budget = (i128::from(available) - i128::from(weights) - i128::from(activations) - i128::from(headroom))
        .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    let per_position = model.kv_bytes_per_position.max(1);
    if available == 0 {
        // The probe could not read /proc/meminfo (or an override left RAM out): nothing to
        // check against, so do not refuse; keep the configured capacity.
        notes.push("RAM size unknown: memory budget not checked".into());
        let kv_capacity =
            if model.max_positions > 0 { configured_kv_capacity.min(model.max_positions) } else { configured_kv_capacity };
        return Ok(Derived {
            class: hw.class,
            dtype,
            talker_cpus,
            vocoder_cpus,
            available_bytes: 0,
            weights_bytes: weights,
            activations_bytes: activations,
            headroom_bytes: headroom,
            memory_budget_bytes: 0,
            kv_bytes_per_position: model.kv_bytes_per_position,
            kv_capacity,
            kv_fit: kv_capacity,
            notes,
        });
    }
    let kv_fit =
        if budget > model.fixed_cache_bytes as i64 { (budget as u64 - model.fixed_cache_bytes) * 2 / (per_position * 3) } else { 0 };
    if kv_fit < MIN_KV_POSITIONS {
        let limited_by = if hw.cgroup_memory_room_bytes == Some(available) { " (the cgroup's memory limit - its usage)" } else { "" };
        return Err(DoesNotFit {
            available: mib(available),
            limited_by,
            weights: mib(weights),
            activations: mib(activations),
            headroom: mib(headroom),
            class: hw.class,
            budget: budget / MIB as i64,
            fit: kv_fit,
            per_position: per_position.div_ceil(1024),
            min: MIN_KV_POSITIONS,
        });
    }
    let mut kv_capacity = kv_fit;
    if model.max_positions > 0 && kv_capacity > model.max_positions {
        kv_capacity = model.max_positions;
    }
    if configured_kv_capacity > 0 && kv_capacity > configured_kv_capacity {
        kv_capacity = configured_kv_capacity;
    } else if kv_capacity < configured_kv_capacity {
        notes.push(format!("KV capacity limited by memory to {kv_capacity} positions (configured {configured_kv_capacity})"));
    }
    Ok(Derived {
        class: hw.class,
        dtype,
        talker_cpus,
        vocoder_cpus,
        available_bytes: available,
        weights_bytes: weights,
        activations_bytes: activations,
        headroom_bytes: headroom,
        memory_budget_bytes: budget,
        kv_bytes_per_position: model.kv_bytes_per_position,
        kv_capacity,
        kv_fit,
        notes,
    })
}

impl Derived {
    /// Human-readable lines for `herald probe` and the log.
    pub fn describe(&self) -> String {
        let m = |b: u64| b / MIB;
        format!(
            "dtype {}\ntalker CPUs {:?}, vocoder CPUs {:?}\nmemory budget {} MiB = {} available - {} weights - {} activations - {} headroom ({})\nKV capacity {} positions ({} fit, {:.1} KiB each)",
            self.dtype.as_str(),
            self.talker_cpus,
            self.vocoder_cpus,
            self.memory_budget_bytes / MIB as i64,
            m(self.available_bytes),
            m(self.weights_bytes),
            m(self.activations_bytes),
            m(self.headroom_bytes),
            self.class,
            self.kv_capacity,
            self.kv_fit,
            self.kv_bytes_per_position as f64 / 1024.0,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::Cluster;

    /// Qwen3-TTS 0.6B talker in fp32: 28 full layers × 8 KV heads × 128 → 229,376 B/position
    /// (edge-design-notes §2.2 quotes exactly this number).
    fn qwen06(dtype: Dtype, weights: u64) -> ModelFootprint {
        ModelFootprint {
            dtype,
            weights_bytes: weights,
            kv_bytes_per_position: 2 * 28 * 8 * 128 * dtype.bytes(),
            fixed_cache_bytes: 0,
            max_positions: 32768,
        }
    }

    fn board(class: HardwareClass, flags: &[&str], big: &[usize], little: &[usize], avail_gib: f64) -> HardwareProfile {
        let mut clusters = vec![Cluster { max_khz: 2_400_000, cpus: big.to_vec() }];
        if !little.is_empty() {
            clusters.push(Cluster { max_khz: 1_800_000, cpus: little.to_vec() });
        }
        HardwareProfile {
            class,
            cpu_flags: flags.iter().map(|s| s.to_string()).collect(),
            n_logical: big.len() + little.len(),
            clusters,
            ram_total_bytes: (avail_gib * 1.25 * GIB as f64) as u64,
            ram_available_bytes: (avail_gib * GIB as f64) as u64,
            ..HardwareProfile::default()
        }
    }

    #[test]
    fn bytes_per_position_of_the_real_model() {
        assert_eq!(qwen06(Dtype::Fp32, 0).kv_bytes_per_position, 229_376);
        assert_eq!(qwen06(Dtype::Fp16, 0).kv_bytes_per_position, 114_688);
    }

    #[test]
    fn budget_and_capacity_by_hand() {
        // 8 GiB available, 2 GiB weights: activations = max(0.3 GiB, 0.5 GiB) = 0.5 GiB,
        // arm64 headroom 1 GiB -> budget 4.5 GiB = 4,831,838,208 B;
        // capacity = 4,831,838,208 × 2 / (229,376 × 3) = 14,043 positions.
        let hw = board(HardwareClass::Arm64Cpu, &["neon"], &[4, 5, 6, 7], &[0, 1, 2, 3], 8.0);
        let d = derive(&hw, &qwen06(Dtype::Fp32, 2 * GIB), &(0..8).collect::<Vec<_>>(), 100_000).unwrap();
        assert_eq!(d.activations_bytes, 512 * MIB);
        assert_eq!(d.memory_budget_bytes, 4_831_838_208);
        assert_eq!(d.kv_fit, 14_043);
        assert_eq!(d.kv_capacity, 14_043);
        // big cluster 4..7 split 3 + 1
        assert_eq!(d.talker_cpus, vec![4, 5, 6]);
        assert_eq!(d.vocoder_cpus, vec![7]);
        assert_eq!(d.dtype, Dtype::Fp32);
    }

    #[test]
    fn activations_are_15_percent_of_large_weights() {
        // 10 GiB of weights: 15 % = 1.5 GiB > 512 MiB
        let hw = board(HardwareClass::Jetson, &["neon", "fp16_arith"], &[0, 1, 2, 3, 4, 5], &[], 30.0);
        let d = derive(&hw, &qwen06(Dtype::Fp16, 10 * GIB), &(0..6).collect::<Vec<_>>(), 4096).unwrap();
        assert_eq!(d.activations_bytes, 10 * GIB * 15 / 100);
        assert_eq!(d.headroom_bytes, 3 * GIB);
        assert_eq!(d.dtype, Dtype::Fp16);
        // capped by the configuration
        assert_eq!(d.kv_capacity, 4096);
        assert_eq!((d.talker_cpus.len(), d.vocoder_cpus.len()), (4, 2));
    }

    #[test]
    fn fp16_bundle_without_fp16_arithmetic_computes_in_fp32_and_says_so() {
        let hw = board(HardwareClass::X86Cpu, &["avx2", "fma"], &[0, 1], &[], 16.0);
        let d = derive(&hw, &qwen06(Dtype::Fp16, GIB), &[0, 1], 4096).unwrap();
        assert_eq!(d.dtype, Dtype::Fp32);
        assert!(d.notes.iter().any(|n| n.contains("emulated")), "{:?}", d.notes);
        assert_eq!((d.talker_cpus.clone(), d.vocoder_cpus.clone()), (vec![0], vec![1]));
    }

    #[test]
    fn a_cgroup_limit_below_the_need_is_refused_and_named() {
        // 8 GiB of RAM free, but the service's MemoryMax leaves 1 GiB
        let mut hw = board(HardwareClass::Arm64Cpu, &["neon"], &[0, 1, 2, 3], &[], 8.0);
        hw.cgroup_memory_room_bytes = Some(GIB);
        hw.ram_available_bytes = GIB;
        let err = derive(&hw, &qwen06(Dtype::Fp32, 2662 * MIB), &[0, 1, 2, 3], 4096).unwrap_err();
        assert_eq!(err.available, 1024);
        let msg = err.to_string();
        assert!(msg.contains("1024 MiB available (the cgroup's memory limit - its usage)"), "{msg}");
    }

    #[test]
    fn refusal_names_the_numbers() {
        // 4 GiB Pi with 3 GiB available and 2.6 GiB of fp32 weights: 3072 - 2662 - 512 - 1024 < 0
        let hw = board(HardwareClass::Arm64Cpu, &["neon"], &[0, 1, 2, 3], &[], 3.0);
        let weights = 2662 * MIB;
        let err = derive(&hw, &qwen06(Dtype::Fp32, weights), &[0, 1, 2, 3], 4096).unwrap_err();
        assert_eq!(err.available, 3072);
        assert_eq!(err.weights, 2662);
        assert_eq!(err.budget, 3072 - 2662 - 512 - 1024);
        assert_eq!(err.fit, 0);
        let msg = err.to_string();
        assert!(msg.contains("3072 MiB available") && msg.contains("2662 MiB weights") && msg.contains("at least 256"), "{msg}");
    }

    #[test]
    fn just_below_the_minimum_is_refused_and_just_above_fits() {
        let hw = board(HardwareClass::X86Cpu, &[], &[0, 1], &[], 4.0);
        let per = 229_376u64;
        // budget such that exactly 256 positions fit: budget = 256 × per × 3/2
        let budget = 256 * per * 3 / 2;
        let weights = 4 * GIB - ACTIVATIONS_FLOOR - 2 * GIB - budget;
        let ok = derive(&hw, &qwen06(Dtype::Fp32, weights), &[0, 1], 4096).unwrap();
        assert_eq!(ok.kv_fit, 256);
        let err = derive(&hw, &qwen06(Dtype::Fp32, weights + 1), &[0, 1], 4096).unwrap_err();
        assert_eq!(err.fit, 255);
    }

    #[test]
    fn absurd_ram_does_not_overflow() {
        let mut hw = board(HardwareClass::Arm64Cpu, &["neon"], &[0, 1], &[], 1.0);
        hw.ram_available_bytes = u64::MAX;
        hw.ram_total_bytes = u64::MAX;
        let d = derive(&hw, &qwen06(Dtype::Fp32, GIB), &[0, 1], 4096).unwrap();
        assert!(d.memory_budget_bytes > 0);
        assert_eq!(d.kv_capacity, 4096);
    }

    #[test]
    fn unknown_ram_is_not_a_refusal() {
        let mut hw = board(HardwareClass::SnapdragonNpu, &["neon"], &[7], &[0, 1, 2, 3], 0.0);
        hw.ram_total_bytes = 0;
        let d = derive(&hw, &qwen06(Dtype::Fp32, GIB), &[0, 1, 2, 3, 7], 4096).unwrap();
        assert_eq!(d.kv_capacity, 4096);
        assert!(d.notes.iter().any(|n| n.contains("RAM size unknown")));
        assert_eq!((d.talker_cpus.clone(), d.vocoder_cpus.clone()), (vec![7], vec![7]));
    }

    #[test]
    fn cpus_outside_the_cpuset_are_not_used() {
        // big cluster 4-7 but the service runs in a cpuset of 0-3
        let hw = board(HardwareClass::Arm64Cpu, &["neon"], &[4, 5, 6, 7], &[0, 1, 2, 3], 8.0);
        let d = derive(&hw, &qwen06(Dtype::Fp32, GIB), &[0, 1, 2, 3], 4096).unwrap();
        assert_eq!(d.talker_cpus, vec![0, 1, 2]);
        assert_eq!(d.vocoder_cpus, vec![3]);
        // single CPU: both stages share it
        let d = derive(&hw, &qwen06(Dtype::Fp32, GIB), &[2], 4096).unwrap();
        assert_eq!((d.talker_cpus.clone(), d.vocoder_cpus.clone()), (vec![2], vec![2]));
    }
}
