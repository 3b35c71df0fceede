//! The logits processors and the token choice of the talker (codebook 0) and the code predictor
//! (codebooks 1..15), bit for bit as the Python reference decoder
//! (`tools/export/reference.py`, module docstring §3 and §4).
//!
//! Talker chain (Hugging Face order, upstream `generate` L2043-2067):
//! 1. repetition penalty over the *distinct* c0 of all earlier frames: `x / penalty` when
//!    `x > 0`, else `x * penalty`;
//! 2. eos = -inf while fewer than `min_new_tokens` frames exist;
//! 3. ids `[vocab - 1024, vocab)` other than eos = -inf;
//! 4. sampling only: `/ temperature`, top-k (ids below the k-th largest value become -inf,
//!    ties with it stay), top-p (only when `top_p < 1`; float64 softmax, descending probability,
//!    ties by ascending id, an id is kept while the mass before it is `< top_p`).
//!
//! Code predictor chain: step 4 only. All processor arithmetic is float32 on the float32 logits,
//! the parameters rounded to float32 (the manifest stores them as `f32`).
//!
//! Choice: greedy is the argmax of the processed logits (the code predictor: of the raw logits),
//! the lowest id winning ties. Sampling draws one uniform `u = (next_u64 >> 11) * 2^-53` from
//! [`SplitMix64`] per decision and picks, over the finite processed logits in ascending id order
//! with float64 weights `w_i = exp(l_i - max)` and `S` their sequential sum, the first id whose
//! running sum of `w_i / S` exceeds `u` (the last kept id if rounding leaves none).
//!
//! Nothing here allocates after [`Sampler::new`]: the scratch buffers are sized for the larger of
//! the two vocabularies up front.
//!
//! Deliberate differences from the reference, both only for logits that a sound model never
//! produces: raw logits that are NaN or +inf are rejected ([`SamplerError::NonFiniteLogit`]);
//! greedy choice over logits that are all -inf is an error ([`SamplerError::NoCandidate`]) where
//! numpy's argmax would return id 0.

use crate::manifest::Manifest;

/// Ids at the top of the talker vocabulary that are never chosen, except eos (upstream
/// `generate` L2059: `suppress_tokens = [i for i in range(vocab - 1024, vocab) if i != eos]`;
/// reference.py `SUPPRESSED_TOP_IDS`).
pub const SUPPRESSED_TOP_IDS: u32 = 1024;

/// Which decision a [`SamplerError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Codebook 0, from the talker logits.
    Talker,
    /// Codebooks 1..15, from the code-predictor logits.
    CodePredictor,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Talker => "talker",
            Stage::CodePredictor => "code predictor",
        })
    }
}

/// Why a token could not be chosen, or why sampling parameters are unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    /// A sampling parameter is outside its domain (checked by [`Sampler::new`]).
    #[error("{stage} sampling: {message}")]
    InvalidParams {
        /// The stage whose parameters are wrong.
        stage: Stage,
        /// Which parameter and why.
        message: String,
    },
    /// The logits slice does not have one value per vocabulary id.
    #[error("{stage} logits: expected {expected} values (the vocabulary), got {got}")]
    LogitsLength {
        /// The stage.
        stage: Stage,
        /// The vocabulary size.
        expected: usize,
        /// The slice length given.
        got: usize,
    },
    /// A raw logit is NaN or +inf (a broken model or graph); -inf is allowed (a masked id).
    #[error("{stage} logits: value {value} at id {index} is not a number or +inf")]
    NonFiniteLogit {
        /// The stage.
        stage: Stage,
        /// The id of the first offending value.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A previous c0 in the history is outside the talker vocabulary.
    #[error("talker history: id {id} is outside the vocabulary 0..{vocab}")]
    HistoryId {
        /// The offending id.
        id: u32,
        /// The talker vocabulary size.
        vocab: u32,
    },
    /// Every id was removed (all processed logits are -inf).
    #[error("{stage}: no candidate token left after the logits processors")]
    NoCandidate {
        /// The stage.
        stage: Stage,
    },
}

/// SplitMix64 (Steele, Lea, Flood 2014; the reference `splitmix64.c`): the RNG contract shared
/// with reference.py (module docstring §4). The state starts at the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose state is `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Next 64-bit output: `state += 0x9E3779B97F4A7C15`, then the two multiply-xorshift mixes
    /// (`0xBF58476D1CE4E5B9` after `>> 30`, `0x94D049BB133111EB` after `>> 27`) and `^ >> 31`,
    /// all modulo 2^64.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// One uniform in [0, 1): `(next_u64() >> 11) * 2^-53` (exact in float64).
    pub fn next_unit_f64(&mut self) -> f64 {
        // 2^-53, exactly representable.
        const SCALE: f64 = 1.0 / 9_007_199_254_740_992.0;
        (self.next_u64() >> 11) as f64 * SCALE
    }
}

/// Talker (codebook 0) processing parameters; defaults from the bundle's `[sampling.talker]`
/// and `[codec]` ([`TalkerParams::from_manifest`]). Fields are public so a caller can override
/// them before building the [`Sampler`].
#[derive(Debug, Clone, PartialEq)]
pub struct TalkerParams {
    /// Sample when an RNG is given (true) or always take the argmax (false).
    pub do_sample: bool,
    /// Softmax temperature, > 0 (sampling only).
    pub temperature: f32,
    /// Keep the ids whose value is at least the k-th largest; 0 or >= vocab: no filtering.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; >= 1: no filtering.
    pub top_p: f32,
    /// Repetition penalty over distinct previous c0 (HF sign rule), > 0; 1 is a no-op.
    pub repetition_penalty: f32,
    /// eos is blocked while fewer than this many frames exist.
    pub min_new_tokens: u32,
    /// The codec eos id (generation stops when c0 is eos).
    pub eos: u32,
    /// First suppressed id: ids `suppress_from..vocab` except eos are never chosen
    /// (`vocab - SUPPRESSED_TOP_IDS`).
    pub suppress_from: u32,
    /// Talker vocabulary size = length of the talker logits (3072).
    pub vocab: u32,
}

impl TalkerParams {
    /// `[sampling.talker]`, `codec.eos`, `codec.vocab_size` and
    /// `suppress_from = vocab_size - SUPPRESSED_TOP_IDS` (0 for a smaller vocabulary).
    pub fn from_manifest(m: &Manifest) -> Self {
        let s = &m.sampling.talker;
        Self {
            do_sample: s.do_sample,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: s.repetition_penalty,
            min_new_tokens: s.min_new_tokens,
            eos: m.codec.eos,
            suppress_from: m.codec.vocab_size.saturating_sub(SUPPRESSED_TOP_IDS),
            vocab: m.codec.vocab_size,
        }
    }
}

/// Code-predictor (codebooks 1..15) processing parameters; defaults from the bundle's
/// `[sampling.code_predictor]` ([`PredictorParams::from_manifest`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PredictorParams {
    /// Sample when an RNG is given (true) or always take the argmax (false).
    pub do_sample: bool,
    /// Softmax temperature, > 0 (sampling only).
    pub temperature: f32,
    /// Keep the codes whose value is at least the k-th largest; 0 or >= vocab: no filtering.
    pub top_k: u32,
    /// Nucleus mass in (0, 1]; >= 1: no filtering.
    pub top_p: f32,
    /// Codes per codebook = length of the code-predictor logits (2048).
    pub vocab: u32,
}

impl PredictorParams {
    /// `[sampling.code_predictor]` and `audio.codebook_size`.
    pub fn from_manifest(m: &Manifest) -> Self {
        let s = &m.sampling.code_predictor;
        Self { do_sample: s.do_sample, temperature: s.temperature, top_k: s.top_k, top_p: s.top_p, vocab: m.audio.codebook_size }
    }
}

/// The two choosers with their preallocated scratch. Choosing a token does not allocate.
#[derive(Debug, Clone)]
pub struct Sampler {
    talker: TalkerParams,
    predictor: PredictorParams,
    /// Bitmap over the talker vocabulary: ids already penalised in this decision.
    seen: Vec<u64>,
    /// Copy of the logits for the top-k selection.
    values: Vec<f32>,
    /// Candidate ids (finite logits).
    ids: Vec<u32>,
    /// float64 softmax weights, indexed by id (top-p) or by candidate (sampling).
    weights: Vec<f64>,
}

fn check_warpers(stage: Stage, do_sample: bool, temperature: f32, top_p: f32) -> Result<(), SamplerError> {
    if !do_sample {
        return Ok(());
    }
    if temperature.is_nan() || temperature <= 0.0 || temperature.is_infinite() {
        return Err(SamplerError::InvalidParams {
            stage,
            message: format!("temperature must be a finite number > 0, got {temperature}"),
        });
    }
    if top_p.is_nan() || top_p <= 0.0 {
        return Err(SamplerError::InvalidParams { stage, message: format!("top_p must be > 0, got {top_p}") });
    }
    Ok(())
}

impl Sampler {
    /// A sampler for these parameters, with scratch sized for the larger vocabulary.
    ///
    /// # Errors
    /// [`SamplerError::InvalidParams`] when a vocabulary is empty, eos or `suppress_from` lie
    /// outside the talker vocabulary, the repetition penalty is not a finite number > 0, or (for
    /// a stage with `do_sample`) the temperature is not a finite number > 0 or top_p is not > 0.
    pub fn new(talker: TalkerParams, predictor: PredictorParams) -> Result<Self, SamplerError> {
        let bad = |stage, message: String| Err(SamplerError::InvalidParams { stage, message });
        if talker.vocab == 0 {
            return bad(Stage::Talker, "the vocabulary is empty".into());
        }
        if predictor.vocab == 0 {
            return bad(Stage::CodePredictor, "the vocabulary is empty".into());
        }
        if talker.eos >= talker.vocab {
            return bad(Stage::Talker, format!("eos {} is outside the vocabulary 0..{}", talker.eos, talker.vocab));
        }
        if talker.suppress_from > talker.vocab {
            return bad(
                Stage::Talker,
                format!("suppress_from {} is beyond the vocabulary size {}", talker.suppress_from, talker.vocab),
            );
        }
        let p = talker.repetition_penalty;
        if p.is_nan() || p <= 0.0 || p.is_infinite() {
            return bad(Stage::Talker, format!("repetition_penalty must be a finite number > 0, got {p}"));
        }
        check_warpers(Stage::Talker, talker.do_sample, talker.temperature, talker.top_p)?;
        check_warpers(Stage::CodePredictor, predictor.do_sample, predictor.temperature, predictor.top_p)?;
        let n = talker.vocab.max(predictor.vocab) as usize;
        Ok(Self {
            seen: vec![0; (talker.vocab as usize).div_ceil(64)],
            values: Vec::with_capacity(n),
            ids: Vec::with_capacity(n),
            weights: vec![0.0; n],
            talker,
            predictor,
        })
    }

    /// [`Sampler::new`] with both parameter sets from the bundle manifest.
    ///
    /// # Errors
    /// As [`Sampler::new`].
    pub fn from_manifest(m: &Manifest) -> Result<Self, SamplerError> {
        Self::new(TalkerParams::from_manifest(m), PredictorParams::from_manifest(m))
    }

    /// The talker parameters in use.
    pub fn talker_params(&self) -> &TalkerParams {
        &self.talker
    }

    /// The code-predictor parameters in use.
    pub fn predictor_params(&self) -> &PredictorParams {
        &self.predictor
    }

    /// Run the talker's processors in place: penalty over the distinct ids of `history`, eos
    /// block while `history.len() < min_new_tokens`, suppression, and when `sampling` the
    /// temperature, top-k and top-p warpers. `logits` is `[vocab]` float32; `history` the c0 of
    /// every earlier frame of this utterance, oldest first (repeats allowed), so
    /// `history.len()` is the frame index.
    ///
    /// # Errors
    /// [`SamplerError::LogitsLength`], [`SamplerError::NonFiniteLogit`] (NaN or +inf in the
    /// input), [`SamplerError::HistoryId`]; all checked before `logits` is touched.
    pub fn process_c0(&mut self, logits: &mut [f32], history: &[u32], sampling: bool) -> Result<(), SamplerError> {
        let t = &self.talker;
        check_logits(Stage::Talker, logits, t.vocab)?;
        if let Some(&id) = history.iter().find(|&&id| id >= t.vocab) {
            return Err(SamplerError::HistoryId { id, vocab: t.vocab });
        }
        repetition_penalty(logits, history, t.repetition_penalty, &mut self.seen);
        block_eos(logits, t.eos, history.len(), t.min_new_tokens);
        suppress(logits, t.suppress_from, t.eos);
        if sampling {
            apply_temperature(logits, t.temperature);
            top_k_filter(logits, t.top_k, &mut self.values);
            top_p_filter(logits, t.top_p, &mut self.ids, &mut self.weights);
        }
        Ok(())
    }

    /// Run the code predictor's processors in place: nothing when greedy, else temperature,
    /// top-k and top-p. `logits` is `[vocab]` float32 (one codebook's head).
    ///
    /// # Errors
    /// [`SamplerError::LogitsLength`], [`SamplerError::NonFiniteLogit`].
    pub fn process_code(&mut self, logits: &mut [f32], sampling: bool) -> Result<(), SamplerError> {
        let p = &self.predictor;
        check_logits(Stage::CodePredictor, logits, p.vocab)?;
        if sampling {
            apply_temperature(logits, p.temperature);
            top_k_filter(logits, p.top_k, &mut self.values);
            top_p_filter(logits, p.top_p, &mut self.ids, &mut self.weights);
        }
        Ok(())
    }

    /// Choose c0 of the frame `history.len()` from the talker logits of the last position.
    ///
    /// Samples (drawing exactly one uniform) when `rng` is given and `do_sample` is set; else
    /// greedy, drawing nothing. `logits` is overwritten with the processed values (see
    /// [`Sampler::process_c0`]). The result may be eos (the caller stops then).
    ///
    /// # Errors
    /// As [`Sampler::process_c0`], and [`SamplerError::NoCandidate`] when every id is removed.
    pub fn choose_c0(&mut self, logits: &mut [f32], history: &[u32], rng: Option<&mut SplitMix64>) -> Result<u32, SamplerError> {
        let rng = rng.filter(|_| self.talker.do_sample);
        self.process_c0(logits, history, rng.is_some())?;
        self.choose(Stage::Talker, logits, rng)
    }

    /// Choose one code c_k (k = 1..15) from the code-predictor logits of head k-1.
    ///
    /// Samples (drawing exactly one uniform) when `rng` is given and `do_sample` is set; else
    /// greedy on the raw logits, drawing nothing. `logits` is overwritten with the processed
    /// values (see [`Sampler::process_code`]).
    ///
    /// # Errors
    /// As [`Sampler::process_code`], and [`SamplerError::NoCandidate`] when every id is removed.
    pub fn choose_code(&mut self, logits: &mut [f32], rng: Option<&mut SplitMix64>) -> Result<u32, SamplerError> {
        let rng = rng.filter(|_| self.predictor.do_sample);
        self.process_code(logits, rng.is_some())?;
        self.choose(Stage::CodePredictor, logits, rng)
    }

    fn choose(&mut self, stage: Stage, logits: &[f32], rng: Option<&mut SplitMix64>) -> Result<u32, SamplerError> {
        let id = match rng {
            Some(rng) => {
                let u = rng.next_unit_f64();
                sample_from_logits(logits, u, &mut self.ids, &mut self.weights)
            }
            None => greedy_choice(logits),
        };
        id.ok_or(SamplerError::NoCandidate { stage })
    }
}

/// Length and NaN/+inf check of raw logits.
fn check_logits(stage: Stage, logits: &[f32], vocab: u32) -> Result<(), SamplerError> {
    if logits.len() != vocab as usize {
        return Err(SamplerError::LogitsLength { stage, expected: vocab as usize, got: logits.len() });
    }
    match logits.iter().position(|x| x.is_nan() || *x == f32::INFINITY) {
        Some(index) => Err(SamplerError::NonFiniteLogit { stage, index, value: logits[index] }),
        None => Ok(()),
    }
}

/// HF `RepetitionPenaltyLogitsProcessor` over the distinct ids of `history` (all < len, checked
/// by the caller): `x / p` when `x > 0`, else `x * p`, in float32. `seen` is a bitmap with at
/// least `len / 64` words; it is cleared first.
fn repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32, seen: &mut [u64]) {
    seen.fill(0);
    for &id in history {
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        let (Some(w), Some(x)) = (seen.get_mut(word), logits.get_mut(id as usize)) else { continue };
        if *w & bit != 0 {
            continue;
        }
        *w |= bit;
        *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
    }
}

/// HF `MinNewTokensLengthLogitsProcessor`: eos = -inf while `n_generated < min_new_tokens`.
fn block_eos(logits: &mut [f32], eos: u32, n_generated: usize, min_new_tokens: u32) {
    if n_generated < min_new_tokens as usize
        && let Some(x) = logits.get_mut(eos as usize)
    {
        *x = f32::NEG_INFINITY;
    }
}

/// Upstream `suppress_tokens`: ids `from..len` other than eos = -inf.
fn suppress(logits: &mut [f32], from: u32, eos: u32) {
    let from = (from as usize).min(logits.len());
    for (id, x) in logits.iter_mut().enumerate().skip(from) {
        if id != eos as usize {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// HF `TemperatureLogitsWarper`: `x / temperature` in float32.
fn apply_temperature(logits: &mut [f32], temperature: f32) {
    for x in logits.iter_mut() {
        *x /= temperature;
    }
}

/// HF `TopKLogitsWarper`: values below the k-th largest value (counting repeats) become -inf;
/// ties with it stay. `k == 0` or `k >= len`: no filtering. `values` is scratch with capacity
/// `len`.
fn top_k_filter(logits: &mut [f32], k: u32, values: &mut Vec<f32>) {
    let k = k as usize;
    if k == 0 || k >= logits.len() {
        return;
    }
    values.clear();
    values.extend_from_slice(logits);
    let (_, kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    for x in logits.iter_mut() {
        if *x < kth {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// Ids of the finite values, ascending, into `ids`; returns their largest value as float64.
fn finite_ids(logits: &[f32], ids: &mut Vec<u32>) -> Option<f64> {
    ids.clear();
    let mut max: Option<f64> = None;
    for (id, &x) in logits.iter().enumerate() {
        if x.is_finite() {
            ids.push(id as u32);
            let v = f64::from(x);
            if max.is_none_or(|m| v > m) {
                max = Some(v);
            }
        }
    }
    max
}

/// HF `TopPLogitsWarper` as reference.py's `top_p_filter`: float64 softmax of the finite
/// logits (weights `exp(x - max)`, total summed in ascending id order), ids visited in
/// descending weight (ties: ascending id); an id is removed once the mass of the ids visited
/// before it is `>= top_p`. `top_p >= 1`: no filtering. `weights` is indexed by id.
fn top_p_filter(logits: &mut [f32], top_p: f32, ids: &mut Vec<u32>, weights: &mut [f64]) {
    let top_p = f64::from(top_p);
    if top_p >= 1.0 {
        return;
    }
    let Some(m) = finite_ids(logits, ids) else { return };
    let mut total = 0.0f64;
    for &id in ids.iter() {
        let w = (f64::from(logits[id as usize]) - m).exp();
        weights[id as usize] = w;
        total += w;
    }
    ids.sort_unstable_by(|&a, &b| weights[b as usize].total_cmp(&weights[a as usize]).then(a.cmp(&b)));
    let mut mass_before = 0.0f64;
    for &id in ids.iter() {
        if mass_before >= top_p {
            logits[id as usize] = f32::NEG_INFINITY;
        }
        mass_before += weights[id as usize] / total;
    }
}

/// reference.py `sample_from_logits`: over the finite logits in ascending id order, float64
/// weights `exp(x - max)`, `S` their sequential sum, the first id whose running sum of `w / S`
/// exceeds `u`; the last finite id if none does. `None` when no value is finite.
fn sample_from_logits(logits: &[f32], u: f64, ids: &mut Vec<u32>, weights: &mut [f64]) -> Option<u32> {
    let m = finite_ids(logits, ids)?;
    let mut total = 0.0f64;
    for (w, &id) in weights.iter_mut().zip(ids.iter()) {
        *w = (f64::from(logits[id as usize]) - m).exp();
        total += *w;
    }
    let mut cumulative = 0.0f64;
    for (w, &id) in weights.iter().zip(ids.iter()) {
        cumulative += w / total;
        if cumulative > u {
            return Some(id);
        }
    }
    ids.last().copied()
}

/// Argmax, the lowest id winning ties; `None` when every value is -inf (or the slice is empty).
fn greedy_choice(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (id, &x) in logits.iter().enumerate() {
        if x == f32::NEG_INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((id, x));
        }
    }
    best.map(|(id, _)| id as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEG: f32 = f32::NEG_INFINITY;

    fn params(vocab: u32, do_sample: bool) -> (TalkerParams, PredictorParams) {
        let t = TalkerParams {
            do_sample,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            min_new_tokens: 0,
            eos: vocab - 1,
            suppress_from: vocab,
            vocab,
        };
        let p = PredictorParams { do_sample, temperature: 1.0, top_k: 0, top_p: 1.0, vocab };
        (t, p)
    }

    #[test]
    fn splitmix64_known_values() {
        // Computed with the published algorithm in Python (big integers, masked to 64 bits).
        let cases: [(u64, [u64; 4]); 3] = [
            (0, [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f, 0xf88bb8a8724c81ec]),
            // seed 1234567: the first output 6457827717110365317 is the value published with
            // splitmix64.c test vectors.
            (1234567, [0x599ed017fb08fc85, 0x2c73f08458540fa5, 0x883ebce5a3f27c77, 0x3fbef740e9177b3f]),
            (u64::MAX, [0xe4d971771b652c20, 0xe99ff867dbf682c9, 0x382ff84cb27281e9, 0x6d1db36ccba982d2]),
        ];
        for (seed, want) in cases {
            let mut r = SplitMix64::new(seed);
            let got: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
            assert_eq!(got, want, "seed {seed}");
        }
        assert_eq!(SplitMix64::new(1234567).next_u64(), 6457827717110365317);
        // (0xe220a8397b1dcdaf >> 11) * 2^-53
        assert_eq!(SplitMix64::new(0).next_unit_f64(), 0.8833108082136426);
    }

    #[test]
    fn unit_uniform_is_in_range() {
        let mut r = SplitMix64::new(42);
        for _ in 0..10_000 {
            let u = r.next_unit_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn repetition_penalty_sign_rule_and_distinct_ids() {
        let mut seen = vec![0u64; 1];
        let mut x = [2.0f32, -2.0, 0.0, 1.0, 3.0];
        // id 0 appears twice: penalised once. 0.0 is not > 0: multiplied (stays 0).
        repetition_penalty(&mut x, &[0, 1, 2, 0, 0], 2.0, &mut seen);
        assert_eq!(x, [1.0, -4.0, 0.0, 1.0, 3.0]);
        // float32 arithmetic: 1/1.05 rounded to f32.
        let mut y = [1.0f32];
        repetition_penalty(&mut y, &[0], 1.05, &mut seen);
        assert_eq!(y[0], 1.0f32 / 1.05f32);
        assert_eq!(y[0].to_bits(), 0x3f73_cf3e); // numpy: np.float32(1) / np.float32(1.05)
    }

    #[test]
    fn eos_blocked_only_before_min_new_tokens() {
        let mut x = [1.0f32, 2.0, 3.0];
        block_eos(&mut x, 2, 1, 2);
        assert_eq!(x, [1.0, 2.0, NEG]);
        let mut x = [1.0f32, 2.0, 3.0];
        block_eos(&mut x, 2, 2, 2);
        assert_eq!(x, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn suppression_range_spares_eos() {
        let mut x = vec![0.5f32; 3072];
        suppress(&mut x, 3072 - SUPPRESSED_TOP_IDS, 2150);
        assert!(x[..2048].iter().all(|&v| v == 0.5));
        for (id, &v) in x.iter().enumerate().skip(2048) {
            assert_eq!(v == 0.5, id == 2150, "id {id}");
        }
    }

    #[test]
    fn temperature_divides_in_f32() {
        let mut x = [1.0f32, -0.5, NEG, 0.3];
        apply_temperature(&mut x, 0.5);
        assert_eq!(x, [2.0, -1.0, NEG, 0.3f32 / 0.5f32]);
        let mut y = [1.0f32];
        apply_temperature(&mut y, 0.9);
        assert_eq!(y[0].to_bits(), 0x3f8e_38e4); // numpy: np.float32(1) / np.float32(0.9)
    }

    #[test]
    fn top_k_keeps_ties_with_the_kth() {
        let mut scratch = Vec::with_capacity(8);
        let mut x = [1.0f32, 3.0, 3.0, 2.0];
        top_k_filter(&mut x, 2, &mut scratch);
        assert_eq!(x, [NEG, 3.0, 3.0, NEG]);
        let mut x = [1.0f32, 3.0, 3.0, 2.0];
        top_k_filter(&mut x, 3, &mut scratch);
        assert_eq!(x, [NEG, 3.0, 3.0, 2.0]);
        // k = 1 with a three-way tie at the top keeps all three.
        let mut x = [3.0f32, 1.0, 3.0, 3.0];
        top_k_filter(&mut x, 1, &mut scratch);
        assert_eq!(x, [3.0, NEG, 3.0, 3.0]);
        // k = 0 and k >= len: no filtering.
        let mut x = [3.0f32, 1.0];
        top_k_filter(&mut x, 0, &mut scratch);
        top_k_filter(&mut x, 2, &mut scratch);
        assert_eq!(x, [3.0, 1.0]);
        // -inf values count as values: k-th largest is -inf, nothing is below it.
        let mut x = [NEG, 1.0, NEG];
        top_k_filter(&mut x, 2, &mut scratch);
        assert_eq!(x, [NEG, 1.0, NEG]);
    }

    #[test]
    fn top_p_mass_before_rule_and_ties() {
        let mut ids = Vec::with_capacity(8);
        let mut w = vec![0.0; 8];
        // Uniform over 4: masses before = 0, .25, .5, .75 in id order (ties: ascending id).
        let mut x = [0.0f32; 4];
        top_p_filter(&mut x, 0.5, &mut ids, &mut w);
        assert_eq!(x, [0.0, 0.0, NEG, NEG]);
        let mut x = [0.0f32; 4];
        top_p_filter(&mut x, 0.6, &mut ids, &mut w);
        assert_eq!(x, [0.0, 0.0, 0.0, NEG]);
        // The most likely id always stays; p(1) = e/(e+2) = 0.576 >= 0.5 removes the rest.
        let mut x = [0.0f32, 1.0, 0.0, NEG];
        top_p_filter(&mut x, 0.5, &mut ids, &mut w);
        assert_eq!(x, [NEG, 1.0, NEG, NEG]);
        // top_p >= 1: untouched.
        let mut x = [0.0f32, 1.0, -30.0];
        top_p_filter(&mut x, 1.0, &mut ids, &mut w);
        assert_eq!(x, [0.0, 1.0, -30.0]);
    }

    #[test]
    fn sampling_rule_cumulative_exceeds_u() {
        let mut ids = Vec::with_capacity(8);
        let mut w = vec![0.0; 8];
        let x = [0.0f32, 0.0, NEG, 0.0];
        // p = 1/3 each over ids 0, 1, 3.
        assert_eq!(sample_from_logits(&x, 0.0, &mut ids, &mut w), Some(0));
        assert_eq!(sample_from_logits(&x, 0.3, &mut ids, &mut w), Some(0));
        assert_eq!(sample_from_logits(&x, 0.5, &mut ids, &mut w), Some(1));
        assert_eq!(sample_from_logits(&x, 0.7, &mut ids, &mut w), Some(3));
        // Strictly greater: p = 1/2 each, a running sum equal to u does not pick the id.
        assert_eq!(sample_from_logits(&[0.0, 0.0], 0.5, &mut ids, &mut w), Some(1));
        assert_eq!(sample_from_logits(&[0.0, 0.0], 0.4999999999999999, &mut ids, &mut w), Some(0));
        // A u no running sum exceeds (rounding): the last kept id.
        assert_eq!(sample_from_logits(&x, 1.0, &mut ids, &mut w), Some(3));
        // +inf is not finite: not a candidate (as reference.py's isfinite).
        let y = [f32::INFINITY, 0.0];
        assert_eq!(sample_from_logits(&y, 0.9, &mut ids, &mut w), Some(1));
        assert_eq!(sample_from_logits(&[NEG, NEG], 0.5, &mut ids, &mut w), None);
    }

    #[test]
    fn greedy_lowest_id_wins_ties() {
        assert_eq!(greedy_choice(&[1.0, 3.0, 3.0]), Some(1));
        assert_eq!(greedy_choice(&[NEG, -5.0, NEG]), Some(1));
        assert_eq!(greedy_choice(&[-0.0, 0.0]), Some(0));
        assert_eq!(greedy_choice(&[NEG, NEG]), None);
    }

    #[test]
    fn talker_chain_greedy() {
        let (mut t, p) = params(8, true);
        t.repetition_penalty = 2.0;
        t.min_new_tokens = 2;
        t.eos = 5;
        t.suppress_from = 4;
        let mut s = Sampler::new(t, p).unwrap();
        // frame 1 (one earlier frame): eos blocked, 4 and 6..7 suppressed, id 3 penalised.
        let mut x = [0.0f32, 1.0, 1.5, 4.0, 9.0, 9.0, 9.0, 9.0];
        assert_eq!(s.choose_c0(&mut x, &[3], None).unwrap(), 3);
        assert_eq!(x, [0.0, 1.0, 1.5, 2.0, NEG, NEG, NEG, NEG]);
        // with history [3, 3]: frame 2, eos allowed and the best.
        let mut x = [0.0f32, 1.0, 1.5, 4.0, 9.0, 9.0, 9.0, 9.0];
        assert_eq!(s.choose_c0(&mut x, &[3, 3], None).unwrap(), 5);
        assert_eq!(x, [0.0, 1.0, 1.5, 2.0, NEG, 9.0, NEG, NEG]);
    }

    #[test]
    fn do_sample_false_draws_nothing() {
        let (t, p) = params(4, false);
        let mut s = Sampler::new(t, p).unwrap();
        let mut rng = SplitMix64::new(9);
        let before = rng.clone();
        let mut x = [0.0f32, 2.0, 1.0, 0.0];
        assert_eq!(s.choose_code(&mut x, Some(&mut rng)).unwrap(), 1);
        assert_eq!(rng, before);
        let (t, p) = params(4, true);
        let mut s = Sampler::new(t, p).unwrap();
        let mut x = [0.0f32, 2.0, 1.0, 0.0];
        s.choose_code(&mut x, Some(&mut rng)).unwrap();
        assert_ne!(rng, before, "a sampling decision draws one uniform");
        let mut once = before.clone();
        once.next_u64();
        assert_eq!(rng, once);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let (t, p) = params(4, true);
        let mut s = Sampler::new(t, p).unwrap();
        let mut short = [0.0f32; 3];
        assert_eq!(
            s.choose_code(&mut short, None),
            Err(SamplerError::LogitsLength { stage: Stage::CodePredictor, expected: 4, got: 3 })
        );
        let mut nan = [0.0f32, f32::NAN, 0.0, 0.0];
        assert!(matches!(s.choose_c0(&mut nan, &[], None), Err(SamplerError::NonFiniteLogit { index: 1, .. })));
        let mut inf = [0.0f32, 0.0, f32::INFINITY, 0.0];
        assert!(matches!(s.choose_code(&mut inf, None), Err(SamplerError::NonFiniteLogit { index: 2, .. })));
        let mut x = [0.0f32; 4];
        assert_eq!(s.choose_c0(&mut x, &[1, 4], None), Err(SamplerError::HistoryId { id: 4, vocab: 4 }));
        let mut all = [NEG; 4];
        assert_eq!(s.choose_code(&mut all, None), Err(SamplerError::NoCandidate { stage: Stage::CodePredictor }));
        let mut all = [NEG; 4];
        let mut rng = SplitMix64::new(1);
        assert_eq!(s.choose_code(&mut all, Some(&mut rng)), Err(SamplerError::NoCandidate { stage: Stage::CodePredictor }));
    }

    #[test]
    fn invalid_params_are_rejected() {
        let (t, p) = params(4, true);
        for temperature in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let e = Sampler::new(TalkerParams { temperature, ..t.clone() }, p.clone()).unwrap_err();
            assert!(matches!(e, SamplerError::InvalidParams { stage: Stage::Talker, .. }), "{e}");
        }
        // An unused temperature (do_sample = false) is not checked.
        assert!(Sampler::new(TalkerParams { temperature: 0.0, do_sample: false, ..t.clone() }, p.clone()).is_ok());
        for top_p in [0.0, -0.5, f32::NAN] {
            let e = Sampler::new(t.clone(), PredictorParams { top_p, ..p.clone() }).unwrap_err();
            assert!(matches!(e, SamplerError::InvalidParams { stage: Stage::CodePredictor, .. }), "{e}");
        }
        for repetition_penalty in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(Sampler::new(TalkerParams { repetition_penalty, ..t.clone() }, p.clone()).is_err());
        }
        assert!(Sampler::new(TalkerParams { eos: 4, ..t.clone() }, p.clone()).is_err());
        assert!(Sampler::new(TalkerParams { suppress_from: 5, ..t.clone() }, p.clone()).is_err());
        assert!(Sampler::new(t.clone(), PredictorParams { vocab: 0, ..p.clone() }).is_err());
    }

    #[test]
    fn scratch_is_not_reallocated() {
        let (mut t, mut p) = params(3072, true);
        t.top_k = 50;
        t.top_p = 0.8;
        t.repetition_penalty = 1.05;
        t.suppress_from = 2048;
        t.eos = 2150;
        p.vocab = 2048;
        p.top_k = 50;
        p.top_p = 0.9;
        let mut s = Sampler::new(t, p).unwrap();
        let ptrs = |s: &Sampler| (s.seen.as_ptr(), s.values.as_ptr(), s.ids.as_ptr(), s.weights.as_ptr());
        let before = ptrs(&s);
        let mut rng = SplitMix64::new(3);
        let history: Vec<u32> = (0..500).map(|i| (i * 7) % 2048).collect();
        for f in 0..20usize {
            let mut x: Vec<f32> = (0..3072).map(|i| ((i * 31 + f * 17) % 101) as f32 * 0.05).collect();
            s.choose_c0(&mut x, &history[..f * 20], Some(&mut rng)).unwrap();
            let mut y: Vec<f32> = (0..2048).map(|i| ((i * 13 + f) % 97) as f32 * 0.1).collect();
            s.choose_code(&mut y, Some(&mut rng)).unwrap();
        }
        assert_eq!(ptrs(&s), before);
    }
}
