//! herald's tract backend: the bundle's ONNX graphs on tract, behind [`model::backend`]'s traits.
//!
//! This is the only crate that names tract. [`Tract`] loads the three graphs of a bundle
//! (sanitized, checked against the manifest's IO contract, optimized: [`graph`]); a
//! [`stack::Stack`] runs a step graph with host-owned KV buffers that grow by doubling (tract
//! takes a symbolic slot count); [`vocoder::TractVocoder`] runs the windowed vocoder and
//! [`vocoder::TractStreamVocoder`] the stateful one;
//! [`compute`] gives each pipeline stage its own matrix-product threads. [`sanitize`] rewrites
//! torch-exported graphs into a form tract loads (also `herald sanitize`).

pub mod cache;
pub mod compute;
mod fp16;
mod graph;
mod heads;
mod im2col;
mod inplace;
mod nnef_text;
pub mod profile;
mod q4gemv;
mod q4pack;
mod runtime_matmul;
pub mod sanitize;
pub mod snake;
pub mod stack;
pub mod vocoder;

/// A xorshift64 sequence from `seed` (made odd, so never all zeros): deterministic test data.
#[cfg(test)]
pub(crate) fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
    let mut s = seed | 1;
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    })
}

use std::path::Path;

use model::backend::{
    Backend, BackendError, LoadTimes, LoadedGraphs, PinThread, StackRole, StageCompute, StepError, StepSession, StepSpec,
    VocoderError, VocoderForm, VocoderSession,
};
use model::manifest::Manifest;

pub use cache::set_graph_cache_dir;
pub use compute::set_compute_threads;

/// Whether this backend, on this CPU and under `HERALD_Q4_KERNEL`, runs the bundle's q4
/// products with int8 activations per block of 32 (herald's AVX-512 VNNI kernel on a bundle
/// whose gate measured them, `[quantization] activations = "int8"`), as onnxruntime does with
/// `accuracy_level = 4`; false means float32 activations (herald's float kernels or tract's),
/// and always for float and q8 bundles. Tests that compare codes with onnxruntime use it to
/// run the reference in the same numerics.
pub fn q4_int8_activations(manifest: &Manifest) -> bool {
    manifest.weights() == model::dtype::WeightFormat::Q4
        && q4gemv::chosen(manifest.int8_activations()).is_some_and(kernels::q4::Kernel::int8)
}

/// The arithmetic of the stateful vocoder's convolutions on tract (`runtime.vocoder_precision`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum VocoderPrecision {
    /// float32, as exported.
    #[default]
    Fp32,
    /// float16 weights and activations in the convolutions ([`fp16`]'s conversion), the rest
    /// float32; used only when [`vocoder::fp16_gate`] passes at load, else the load fails with
    /// [`BackendError::Unsupported`] naming the measured SNR.
    Fp16,
    /// [`VocoderPrecision::Fp16`] on a CPU with half-precision arithmetic ([`fp16_arithmetic`]),
    /// falling back to float32 (with a warning) when the gate fails; float32 elsewhere.
    Auto,
}

/// Whether this CPU has half-precision arithmetic (aarch64 `fphp` + `asimdhp`), on which tract
/// runs [`VocoderPrecision::Fp16`]'s products on its native fp16 kernels (elsewhere they run on
/// kernels that widen f16 to float32: the same results without the speed).
pub fn fp16_arithmetic() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("fp16")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// A deliberate fault in the half-precision vocoder, to show [`fp16_vocoder_gate`] failing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fp16Fault {
    /// The first converted convolution's f16 kernel multiplied by this factor (2: a scale off
    /// by 2×; 1e6: weights past f16's largest finite value, 65504, i.e. an overflow).
    KernelScale(f32),
}

/// The half-precision gate on `dir`'s stateful vocoder, by itself: loads its fp16 and float32
/// plans ([`vocoder::STREAM_PLAN_FRAMES`]'s first) and returns what [`vocoder::fp16_gate`]
/// measured, passed or not, with `fault` applied to the fp16 plan first. For `herald bench`'s
/// report and the tests that show the gate failing.
///
/// # Errors
/// [`BackendError`] when the bundle has no stream graph or a plan cannot load or run.
pub fn fp16_vocoder_gate(dir: &Path, manifest: &Manifest, fault: Option<Fp16Fault>) -> Result<vocoder::Fp16Gate, BackendError> {
    let key = manifest
        .vocoder_graph(VocoderForm::Stateful)
        .ok_or_else(|| BackendError::Unsupported("the bundle has no stateful vocoder graph ([vocoder].stream_graph)".into()))?;
    let info = manifest.graphs.get(key).ok_or_else(|| BackendError::Unsupported(format!("bundle.toml has no graph {key:?}")))?;
    let frames = vocoder::STREAM_PLAN_FRAMES[0];
    let edit = move |m: &mut tract_onnx::prelude::TypedModel| -> tract_onnx::prelude::TractResult<()> {
        match fault {
            Some(Fp16Fault::KernelScale(k)) => fp16::scale_first_kernel(m, k),
            None => Ok(()),
        }
    };
    let plans = graph::load_plans(dir, key, info, &[Some(frames)], false, false, &[true, false], Some(&edit))?;
    let spf = manifest.audio.samples_per_frame as usize;
    vocoder::fp16_gate(frames, &plans[1], &plans[0], info, spf, manifest.vocoder.codebook_size)
        .map_err(|e| BackendError::Unsupported(format!("the half-precision vocoder gate could not run: {e}")))
}

/// The tract backend. Stateless: every [`Backend::load`] reads and optimizes the graphs anew.
/// The unit struct loads the vocoder in float32; [`TractWith`] chooses.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tract;

impl Backend for Tract {
    fn name(&self) -> &'static str {
        "tract"
    }

    fn load(&self, dir: &Path, manifest: &Manifest, form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        load(dir, manifest, form, true, VocoderPrecision::Fp32)
    }
}

/// The tract backend with its options: [`Tract`] (`steps`) or [`TractVocoderOnly`] (`!steps`)
/// with the vocoder in `vocoder` precision.
#[derive(Debug, Clone, Copy)]
pub struct TractWith {
    /// Whether the talker and code predictor load too (false: the vocoder only).
    pub steps: bool,
    /// The stateful vocoder's precision (the windowed vocoder is always float32).
    pub vocoder: VocoderPrecision,
}

impl Backend for TractWith {
    fn name(&self) -> &'static str {
        "tract"
    }

    fn load(&self, dir: &Path, manifest: &Manifest, form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        load(dir, manifest, form, self.steps, self.vocoder)
    }
}

/// The vocoder alone on tract, for a backend that runs the step graphs elsewhere (the QNN
/// backend on the NPU): loads only the vocoder graph; its graphs have no step sessions.
#[derive(Debug, Clone, Copy, Default)]
pub struct TractVocoderOnly;

impl Backend for TractVocoderOnly {
    fn name(&self) -> &'static str {
        "tract"
    }

    fn load(&self, dir: &Path, manifest: &Manifest, form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        load(dir, manifest, form, false, VocoderPrecision::Fp32)
    }
}

fn load(
    dir: &Path,
    manifest: &Manifest,
    form: VocoderForm,
    steps: bool,
    precision: VocoderPrecision,
) -> Result<Box<dyn LoadedGraphs>, BackendError> {
    let info_of =
        |name: &str| manifest.graphs.get(name).ok_or_else(|| BackendError::Unsupported(format!("bundle.toml has no graph {name:?}")));
    let vocoder_key = manifest.vocoder_graph(form).ok_or_else(|| {
        BackendError::Unsupported(format!(
            "the bundle has no {form} vocoder graph ([vocoder].stream_graph is missing: re-export it with a current herald-export, or use synthesis.vocoder = \"windowed\")"
        ))
    })?;
    let talker_info = info_of(&manifest.talker.graph)?;
    let predictor_info = info_of(&manifest.code_predictor.graph)?;
    let vocoder_info = info_of(vocoder_key)?;
    let vocoder_sizes: Vec<Option<usize>> = match form {
        VocoderForm::Windowed => vec![None],
        VocoderForm::Stateful => vocoder::STREAM_PLAN_FRAMES.iter().map(|&n| Some(n)).collect(),
    };
    // The three graphs are independent: each is read, typed and optimized on its own
    // thread, so a board with more than one core opens the bundle in about the time of the
    // slowest graph rather than the sum (tract's optimizer is single-threaded).
    let int8 = manifest.int8_activations();
    // fp16: each frame count's fp16 plan, then its float32 plan for the gate (dropped after it)
    let fp16 = form == VocoderForm::Stateful
        && match precision {
            VocoderPrecision::Fp32 => false,
            VocoderPrecision::Fp16 => true,
            VocoderPrecision::Auto => fp16_arithmetic(),
        };
    let half: &[bool] = if fp16 { &[true, false] } else { &[false] };
    let (talker, predictor, vocoder_plans) = std::thread::scope(|s| {
        let spawn = |name: &str, graph: &'static str| {
            let (key, info) = if graph == "talker" {
                (&manifest.talker.graph, talker_info)
            } else {
                (&manifest.code_predictor.graph, predictor_info)
            };
            let load = if graph == "talker" { graph::load } else { graph::load_predictor };
            steps.then(|| std::thread::Builder::new().name(name.into()).spawn_scoped(s, move || load(dir, key, info, int8)))
        };
        let t = spawn("load-talker", "talker");
        let p = spawn("load-predictor", "code_predictor");
        let v = graph::load_plans(dir, vocoder_key, vocoder_info, &vocoder_sizes, false, false, half, None);
        type Handle<'s> = std::io::Result<std::thread::ScopedJoinHandle<'s, Result<graph::Graph, BackendError>>>;
        let finish = |h: Option<Handle<'_>>| match h {
            None => Ok(None),
            Some(Ok(h)) => {
                h.join().unwrap_or_else(|_| Err(BackendError::Unsupported("a graph loader thread panicked".into()))).map(Some)
            }
            Some(Err(e)) => Err(BackendError::Unsupported(format!("cannot start a graph loader thread: {e}"))),
        };
        (finish(t), finish(p), v)
    });
    let (talker, predictor) = (talker?, predictor?);
    let mut vocoder_plans = vocoder_plans?;
    let mut fp16_gate = None;
    if fp16 {
        let mut half_plans = Vec::with_capacity(vocoder_sizes.len());
        for (pair, &frames) in vocoder_plans.chunks(2).zip(&vocoder::STREAM_PLAN_FRAMES) {
            let spf = manifest.audio.samples_per_frame as usize;
            let gate = vocoder::fp16_gate(frames, &pair[1], &pair[0], vocoder_info, spf, manifest.vocoder.codebook_size)
                .map_err(|e| BackendError::Unsupported(format!("the half-precision vocoder gate could not run: {e}")))?;
            if !gate.passed() && precision == VocoderPrecision::Auto {
                log::warn!(
                    "the vocoder stays in float32: in half precision its {gate} against the float32 vocoder (runtime.vocoder_precision = \"auto\")"
                );
                half_plans.push(pair[1].clone());
                continue;
            }
            if !gate.passed() {
                return Err(BackendError::Unsupported(format!(
                    "the vocoder in half precision is refused for this bundle: {gate} against the float32 vocoder (set runtime.vocoder_precision = \"fp32\")"
                )));
            }
            log::info!("vocoder in half precision ({frames}-frame plan): {gate}");
            fp16_gate = Some(gate);
            half_plans.push(pair[0].clone());
        }
        vocoder_plans = half_plans;
    }
    let vocoder = match form {
        VocoderForm::Windowed => vocoder_plans.into_iter().map(|g| (0, g)).collect(),
        VocoderForm::Stateful => vocoder::STREAM_PLAN_FRAMES.iter().copied().zip(vocoder_plans).collect(),
    };
    Ok(Box::new(TractGraphs { manifest: manifest.clone(), talker, predictor, vocoder, vocoder_form: form, fp16_gate }))
}

/// A bundle's three graphs, optimized by tract; plans are shared, each session spawns its own
/// state.
#[derive(Debug)]
pub struct TractGraphs {
    manifest: Manifest,
    /// The step graphs (`None` when loaded by [`TractVocoderOnly`]).
    talker: Option<graph::Graph>,
    predictor: Option<graph::Graph>,
    /// The windowed graph (frames 0: symbolic), or the stream graph's concrete plans (frames
    /// per run, [`vocoder::STREAM_PLAN_FRAMES`]).
    vocoder: Vec<(usize, graph::Graph)>,
    vocoder_form: VocoderForm,
    /// What the half-precision gate measured, when the vocoder runs in fp16.
    fp16_gate: Option<vocoder::Fp16Gate>,
}

impl TractGraphs {
    /// What the half-precision gate measured at load ([`vocoder::fp16_gate`]), when the
    /// vocoder runs in fp16 ([`VocoderPrecision::Fp16`]); `None` for a float32 vocoder.
    pub fn fp16_gate(&self) -> Option<vocoder::Fp16Gate> {
        self.fp16_gate
    }
}

impl LoadedGraphs for TractGraphs {
    fn backend(&self) -> &'static str {
        "tract"
    }

    fn step_session(&self, spec: &StepSpec) -> Result<Box<dyn StepSession>, StepError> {
        let m = &self.manifest;
        let (graph, info) = match spec.role {
            StackRole::Talker => (&self.talker, &m.talker),
            StackRole::CodePredictor => (&self.predictor, &m.code_predictor),
        };
        let graph = graph.as_ref().ok_or_else(|| StepError::BadInput {
            stack: spec.role.key().to_owned(),
            message: "this tract instance loaded the vocoder only".into(),
        })?;
        let stack = stack::Stack::new(
            spec.role.key(),
            graph.clone(),
            info,
            spec.hidden_in,
            m.dtype(),
            spec.capacity,
            spec.max_seq,
            m.attention.mask_fill,
        )?;
        Ok(Box::new(stack))
    }

    fn vocoder_session(&self, max_window: usize) -> Result<Box<dyn VocoderSession>, VocoderError> {
        let m = &self.manifest;
        let spf = m.audio.samples_per_frame as usize;
        match self.vocoder_form {
            VocoderForm::Windowed => {
                let (_, g) = self.vocoder.first().ok_or_else(|| VocoderError("no vocoder graph loaded".into()))?;
                Ok(Box::new(vocoder::TractVocoder::new(g, max_window, spf)?))
            }
            VocoderForm::Stateful => {
                let info = m
                    .vocoder_graph(VocoderForm::Stateful)
                    .and_then(|k| m.graphs.get(k))
                    .ok_or_else(|| VocoderError("bundle.toml has no stream graph".into()))?;
                let (n, g) = self.vocoder.first().ok_or_else(|| VocoderError("no vocoder plan loaded".into()))?;
                Ok(Box::new(vocoder::TractStreamVocoder::new((*n, g), info, max_window, spf)?))
            }
        }
    }

    fn stage_compute(&self, stage: &str, cpus: &[usize], pin: PinThread) -> Result<Box<dyn StageCompute>, BackendError> {
        Ok(Box::new(compute::StageThreads::new(stage, cpus.len(), pin)?))
    }

    fn load_times(&self) -> LoadTimes {
        LoadTimes {
            talker: self.talker.as_ref().map_or(0.0, |g| g.load_seconds),
            code_predictor: self.predictor.as_ref().map_or(0.0, |g| g.load_seconds),
            vocoder: self.vocoder.iter().map(|(_, g)| g.load_seconds).sum(),
            from_cache: self.talker.as_ref().is_none_or(|g| g.cached)
                && self.predictor.as_ref().is_none_or(|g| g.cached)
                && self.vocoder.iter().all(|(_, g)| g.cached),
        }
    }
}
