//! herald's QNN backend: the talker and the code predictor as HTP context binaries on a
//! Qualcomm NPU, behind [`model::backend`]'s traits.
//!
//! The QNN libraries (`libQnnHtp.so`, `libQnnSystem.so`) are opened with `dlopen` when a bundle
//! is loaded ([`ffi`]); herald has no link dependency on them and never ships them (on a board
//! they come from the vendor's BSP; on an x86_64 build machine the PyPI `onnxruntime-qnn` wheel
//! carries a build of `libQnnHtp.so` that simulates the NPU, which the tests use). Each binary
//! is described through the system API and checked against `bundle.toml` (graph name, every
//! input's and output's name, shape and element type, the SoC it was compiled for) before a
//! context is made from it. Steps run on [`session::QnnStack`]. The vocoder stays on the CPU by
//! default: [`Qnn`] hands it to another backend (tract), as the edge design measured it better
//! off the NPU; with [`Qnn::npu_vocoder`] it runs from the bundle's vocoder binaries instead
//! ([`vocoder::QnnVocoder`], stateful only).

pub mod error;
pub mod ffi;
pub mod session;
pub mod vocoder;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use model::backend::{
    Backend, BackendError, LoadTimes, LoadedGraphs, PinThread, StackRole, StageCompute, StepError, StepSession, StepSpec,
    VocoderError, VocoderForm, VocoderSession,
};
use model::manifest::{Dim, GraphInfo as ManifestGraph, Manifest, QnnBinary};

pub use error::QnnError;
use ffi::{BinaryInfo, DataType, GraphInfo, Handle, Htp, System};

/// The backend's name in messages.
pub const QNN: &str = "qnn";

/// The HTP architecture of the SoC models herald knows (Qualcomm's `Qnn_SocModel_t` ids as
/// public Qualcomm code lists them, e.g. pytorch/executorch's `qc_schema.py`: 43 SM8550, 57
/// SM8650, 69 SM8750, 93 QCM6490/QCS6490): what a binary's recorded SoC says about its
/// architecture, for messages.
pub const SOC_ARCH: &[(u32, &str)] = &[(36, "v69"), (42, "v69"), (43, "v73"), (52, "v73"), (57, "v75"), (69, "v79"), (93, "v68")];

/// The architecture of SoC model `soc`, if herald knows it.
pub fn soc_arch(soc: u32) -> Option<&'static str> {
    SOC_ARCH.iter().find(|(s, _)| *s == soc).map(|(_, a)| *a)
}

/// Where the QNN libraries were found and what they report (for `herald probe`/`info`).
#[derive(Debug, Clone)]
pub struct LibInfo {
    /// The directory holding both libraries.
    pub dir: PathBuf,
    /// The HTP provider's name.
    pub provider: String,
    /// Core API version.
    pub core_api: ffi::Version,
    /// HTP backend API version.
    pub backend_api: ffi::Version,
    /// System API version.
    pub system_api: ffi::Version,
    /// The HTP library's build id.
    pub build_id: Option<String>,
}

/// Open both libraries in the first of `dirs` that holds them.
///
/// # Errors
/// [`QnnError::Library`] naming the directories searched when none holds both, or the library
/// that failed to open; [`QnnError::ApiVersion`] for an API major herald does not speak.
pub fn open_libs(dirs: &[PathBuf]) -> Result<(PathBuf, System, Htp), QnnError> {
    let dir = ffi::find_libs(dirs).ok_or_else(|| QnnError::Library {
        path: PathBuf::from(ffi::HTP_LIB),
        message: format!(
            "not found with {} in {} (set runtime.qnn_lib_dir to the folder of the board's QNN runtime)",
            ffi::SYSTEM_LIB,
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    })?;
    let system = System::open(&dir)?;
    let htp = Htp::open(&dir)?;
    Ok((dir, system, htp))
}

/// Describe the libraries in `dirs` without loading a bundle.
///
/// # Errors
/// As [`open_libs`].
pub fn lib_info(dirs: &[PathBuf]) -> Result<LibInfo, QnnError> {
    let (dir, system, htp) = open_libs(dirs)?;
    Ok(LibInfo {
        dir,
        provider: htp.provider.clone(),
        core_api: htp.core_api,
        backend_api: htp.backend_api,
        system_api: system.version,
        build_id: htp.build_id(),
    })
}

/// The QNN backend: step graphs from context binaries, the vocoder from `vocoder`.
pub struct Qnn {
    /// Directories searched for the libraries ([`ffi::search_dirs`]).
    pub lib_dirs: Vec<PathBuf>,
    /// The HTP architecture to run (`None`: the bundle's only one).
    pub arch: Option<String>,
    /// The backend that loads and runs the vocoder graph (tract) unless `npu_vocoder`.
    pub vocoder: Arc<dyn Backend>,
    /// Run the vocoder from the bundle's vocoder context binaries (`stack = "vocoder"`) instead
    /// of `vocoder`: a load fails when the bundle has none for the architecture, or when the
    /// vocoder form asked for is not stateful.
    pub npu_vocoder: bool,
}

impl std::fmt::Debug for Qnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qnn")
            .field("lib_dirs", &self.lib_dirs)
            .field("arch", &self.arch)
            .field("npu_vocoder", &self.npu_vocoder)
            .finish_non_exhaustive()
    }
}

/// The binaries of `manifest` that `arch` selects (`None`: the only arch it has).
///
/// # Errors
/// [`BackendError::Unsupported`] when the bundle has no `[qnn]` section, no binaries for the
/// requested arch, or several arches and none was requested.
pub fn select<'m>(manifest: &'m Manifest, arch: Option<&str>) -> Result<(String, Vec<&'m QnnBinary>), BackendError> {
    let Some(q) = &manifest.qnn else {
        return Err(BackendError::Unsupported(
            "the bundle has no QNN context binaries ([qnn] in bundle.toml): make them with `tools/export/export qnn --bundle DIR --arch v73`".into(),
        ));
    };
    let arches = manifest.qnn_arches();
    let arch = match arch {
        Some(a) if arches.contains(&a) => a.to_owned(),
        Some(a) => {
            return Err(BackendError::Unsupported(format!(
                "the bundle has no QNN context binaries for {a} (it has {}): export them with `tools/export/export qnn --arch {a}`",
                arches.join(", ")
            )));
        }
        None if arches.len() == 1 => arches[0].to_owned(),
        None => {
            return Err(BackendError::Unsupported(format!(
                "the bundle has QNN context binaries for {}: set runtime.qnn_arch to this board's",
                arches.join(", ")
            )));
        }
    };
    let bins = q.binaries.iter().filter(|b| b.arch == arch).collect();
    Ok((arch, bins))
}

/// The vocoder binaries of `manifest` for `arch` (`stack = "vocoder"`), fewest frames first.
///
/// # Errors
/// [`BackendError::Unsupported`] naming the export command when there are none.
pub fn vocoder_binaries<'m>(manifest: &'m Manifest, arch: &str) -> Result<Vec<&'m QnnBinary>, BackendError> {
    let mut v: Vec<&QnnBinary> =
        manifest.qnn.iter().flat_map(|q| q.binaries.iter()).filter(|b| b.arch == arch && b.stack == VOCODER).collect();
    if v.is_empty() {
        return Err(BackendError::Unsupported(format!(
            "runtime.qnn_vocoder = \"npu\" but the bundle has no {arch} vocoder context binaries: export them with `tools/export/export qnn --arch {arch} --vocoder`"
        )));
    }
    v.sort_by_key(|b| b.frames);
    Ok(v)
}

/// The `stack` of vocoder binaries in bundle.toml.
pub const VOCODER: &str = "vocoder";

/// The loaded libraries, backend, device and contexts; freed in order when the last graph or
/// session goes.
pub struct Runtime {
    htp: Htp,
    backend: Handle,
    device: Option<Handle>,
    contexts: Mutex<Vec<Handle>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("htp", &self.htp).finish_non_exhaustive()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let contexts = std::mem::take(&mut *self.contexts.lock().unwrap_or_else(|e| e.into_inner()));
        for c in contexts {
            // SAFETY: every context came from context_from_binary and no graph of it is used
            // any more (sessions hold this Runtime alive).
            unsafe { self.htp.free_context(c) };
        }
        // SAFETY: the backend and device came from create_backend; their contexts are freed.
        unsafe { self.htp.free_backend(self.backend, self.device) };
    }
}

/// One binary of a stack, ready to execute.
pub struct Tier {
    /// The static `past` size (a vocoder binary: frames per execution).
    pub slots: usize,
    /// The graph handle inside its context.
    graph: Handle,
    /// The binary's graph description (tensor descriptors used for execution).
    info: GraphInfo,
    /// One execution at a time per graph.
    lock: Mutex<()>,
    /// The binary's file name (messages).
    pub file: String,
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier").field("slots", &self.slots).field("file", &self.file).finish_non_exhaustive()
    }
}

/// Check a binary's graph against the manifest's graph, at the binary's static sizes (a step
/// graph's `seq` and `past`; the vocoder's `frames` and `samples` = frames × `samples_per_frame`).
fn check_io(
    path: &Path,
    bin: &QnnBinary,
    info: &BinaryInfo,
    spec: &ManifestGraph,
    samples_per_frame: u32,
) -> Result<GraphInfo, BackendError> {
    let mismatch = |message: String| BackendError::Mismatch { path: path.to_owned(), message };
    if let (Some(soc), Some(want)) = (info.soc_model, Some(bin.soc_model))
        && soc != want
    {
        let built = soc_arch(soc).map_or(format!("SoC model {soc}"), |a| format!("{a} (SoC model {soc})"));
        return Err(mismatch(format!(
            "the binary was compiled for {built}, bundle.toml lists it for {} (SoC model {want}): re-export it with `tools/export/export qnn --arch {}`",
            bin.arch, bin.arch
        )));
    }
    let graph = info.graphs.iter().find(|g| g.name == bin.graph).ok_or_else(|| {
        mismatch(format!(
            "has no graph {:?} (it has {})",
            bin.graph,
            info.graphs.iter().map(|g| g.name.as_str()).collect::<Vec<_>>().join(", ")
        ))
    })?;
    for (kind, want, got) in [("input", &spec.inputs, &graph.inputs), ("output", &spec.outputs, &graph.outputs)] {
        let names = |v: &mut dyn Iterator<Item = &str>| v.collect::<Vec<_>>().join(", ");
        if want.len() != got.len() {
            return Err(mismatch(format!(
                "{kind}s are [{}], bundle.toml declares [{}]",
                names(&mut got.iter().map(|t| t.name.as_str())),
                names(&mut want.iter().map(|t| t.name.as_str()))
            )));
        }
        for (i, w) in want.iter().enumerate() {
            let Some(g) = got.iter().find(|t| t.name == w.name) else {
                return Err(mismatch(format!("has no {kind} {} that bundle.toml declares", w.name)));
            };
            if got[i].name != w.name {
                return Err(mismatch(format!("{kind} {i} is {}, bundle.toml declares {} there", got[i].name, w.name)));
            }
            let dims: Vec<u32> = w
                .shape
                .iter()
                .map(|d| match d {
                    Dim::Fixed(n) => *n as u32,
                    Dim::Symbol(s) if s == "seq" && bin.stack != VOCODER => bin.positions,
                    Dim::Symbol(s) if s == "past" && bin.stack != VOCODER => bin.slots,
                    Dim::Symbol(s) if s == "frames" && bin.stack == VOCODER => bin.frames,
                    Dim::Symbol(s) if s == "samples" && bin.stack == VOCODER => bin.frames.saturating_mul(samples_per_frame),
                    Dim::Symbol(_) => 0,
                })
                .collect();
            if g.dims != dims {
                let at = if bin.stack == VOCODER {
                    format!("{} frames", bin.frames)
                } else {
                    format!("{} slots and {} positions", bin.slots, bin.positions)
                };
                return Err(mismatch(format!("{kind} {} has shape {:?}, bundle.toml implies {:?} at {at}", w.name, g.dims, dims)));
            }
            let ok = match w.dtype.as_str() {
                "float32" | "float16" => matches!(g.dtype, DataType::F32 | DataType::F16 | DataType::U16Fixed | DataType::U8Fixed),
                "int64" | "int32" => matches!(g.dtype, DataType::I64 | DataType::I32),
                _ => false,
            };
            if !ok {
                return Err(mismatch(format!("{kind} {} is {}, bundle.toml declares {}", w.name, g.dtype.name(), w.dtype)));
            }
            if matches!(g.dtype, DataType::U16Fixed | DataType::U8Fixed) && g.quant.is_none() {
                return Err(mismatch(format!("{kind} {} is {} without a scale and offset", w.name, g.dtype.name())));
            }
        }
    }
    // a cache and its new entries must share an element type: the output is copied into the input
    for t in &graph.outputs {
        let Some(layer) = t.name.strip_prefix("k_new_").or_else(|| t.name.strip_prefix("v_new_")) else { continue };
        let cache = format!("{}_cache_{layer}", &t.name[..1]);
        if let Some(c) = graph.inputs.iter().find(|i| i.name == cache)
            && (c.dtype != t.dtype || c.quant != t.quant)
        {
            return Err(mismatch(format!(
                "{} is {} {:?} but {cache} is {} {:?}: the new entries must be stored as they come",
                t.name,
                t.dtype.name(),
                t.quant,
                c.dtype.name(),
                c.quant
            )));
        }
    }
    if bin.stack != VOCODER && bin.positions != 1 {
        return Err(mismatch(format!("has {} positions per execution; herald runs binaries of 1", bin.positions)));
    }
    Ok(graph.clone())
}

impl Backend for Qnn {
    fn name(&self) -> &'static str {
        QNN
    }

    fn load(&self, dir: &Path, manifest: &Manifest, form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        let (arch, bins) = select(manifest, self.arch.as_deref())?;
        if self.npu_vocoder {
            vocoder_binaries(manifest, &arch)?;
            if form != VocoderForm::Stateful {
                return Err(BackendError::Unsupported(format!(
                    "runtime.qnn_vocoder = \"npu\" runs the stateful vocoder only, not the {form} one (set synthesis.vocoder = \"stateful\" or \"auto\")"
                )));
            }
        }
        let lib_err = |e: QnnError| BackendError::Unsupported(format!("QNN runtime: {e}"));
        let (lib_dir, system, htp) = open_libs(&self.lib_dirs).map_err(lib_err)?;
        log::info!(
            "qnn: {} (core API {}, HTP API {}) from {}, {arch} binaries",
            htp.provider,
            htp.core_api,
            htp.backend_api,
            lib_dir.display()
        );
        let (backend, device) = htp.create_backend().map_err(|e| {
            BackendError::Unsupported(format!(
                "QNN runtime: {e} (on a board: is the DSP side, libQnnHtpV<arch>Skel.so, reachable through ADSP_LIBRARY_PATH?)"
            ))
        })?;
        let runtime = Arc::new(Runtime { htp, backend, device, contexts: Mutex::new(Vec::new()) });
        let mut stacks: [Vec<Arc<Tier>>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        let mut seconds = [0.0f64; 3];
        for bin in bins {
            let t0 = Instant::now();
            let (k, graph_name) = match bin.stack.as_str() {
                "talker" => (0, &manifest.talker.graph),
                "code_predictor" => (1, &manifest.code_predictor.graph),
                VOCODER if self.npu_vocoder => match &manifest.vocoder.stream_graph {
                    Some(g) => (2, g),
                    None => return Err(BackendError::Unsupported("bundle.toml lists vocoder binaries but no stream graph".into())),
                },
                // vocoder binaries stay unloaded while tract runs the vocoder
                _ => continue,
            };
            let path = dir.join(&bin.file);
            let bytes = std::fs::read(&path).map_err(|e| BackendError::Load { path: path.clone(), message: e.to_string() })?;
            let info = system.describe(&bytes).map_err(|e| BackendError::Load {
                path: path.clone(),
                message: format!("not a QNN context binary this runtime reads: {e}"),
            })?;
            let spec = manifest
                .graphs
                .get(graph_name)
                .ok_or_else(|| BackendError::Unsupported(format!("bundle.toml has no graph {graph_name:?}")))?;
            let ginfo = check_io(&path, bin, &info, spec, manifest.audio.samples_per_frame)?;
            let ctx = runtime.htp.context_from_binary(runtime.backend, runtime.device, &bytes).map_err(|e| BackendError::Runtime {
                path: path.clone(),
                backend: QNN,
                message: e.to_string(),
            })?;
            runtime.contexts.lock().unwrap_or_else(|e| e.into_inner()).push(ctx);
            let graph = runtime.htp.graph(ctx, &bin.graph).map_err(|e| BackendError::Runtime {
                path: path.clone(),
                backend: QNN,
                message: e.to_string(),
            })?;
            stacks[k].push(Arc::new(Tier {
                slots: if k == 2 { bin.frames as usize } else { bin.slots as usize },
                graph,
                info: ginfo,
                lock: Mutex::new(()),
                file: bin.file.clone(),
            }));
            seconds[k] += t0.elapsed().as_secs_f64();
        }
        for (k, key) in ["talker", "code_predictor"].iter().enumerate() {
            if stacks[k].is_empty() {
                return Err(BackendError::Unsupported(format!("the bundle has no {arch} context binary for the {key}")));
            }
            stacks[k].sort_by_key(|t| t.slots);
        }
        let [talker, predictor, vocoder_tiers] = stacks;
        let t0 = Instant::now();
        let vocoder = if self.npu_vocoder { None } else { Some(self.vocoder.load(dir, manifest, form)?) };
        let vocoder_seconds = if self.npu_vocoder { seconds[2] } else { t0.elapsed().as_secs_f64() };
        Ok(Box::new(QnnGraphs {
            manifest: manifest.clone(),
            arch,
            runtime,
            talker,
            predictor,
            times: LoadTimes { talker: seconds[0], code_predictor: seconds[1], vocoder: vocoder_seconds, from_cache: false },
            vocoder,
            vocoder_tiers,
        }))
    }
}

/// A bundle's context binaries, loaded; the vocoder on the other backend, or from its own
/// binaries on the NPU.
pub struct QnnGraphs {
    manifest: Manifest,
    arch: String,
    runtime: Arc<Runtime>,
    talker: Vec<Arc<Tier>>,
    predictor: Vec<Arc<Tier>>,
    /// The other backend's vocoder (`None`: the vocoder runs from `vocoder_tiers`).
    vocoder: Option<Box<dyn LoadedGraphs>>,
    /// The vocoder binaries, fewest frames first (empty unless the NPU runs the vocoder).
    vocoder_tiers: Vec<Arc<Tier>>,
    times: LoadTimes,
}

impl std::fmt::Debug for QnnGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QnnGraphs")
            .field("arch", &self.arch)
            .field("talker", &self.talker)
            .field("predictor", &self.predictor)
            .field("vocoder_tiers", &self.vocoder_tiers)
            .finish_non_exhaustive()
    }
}

impl QnnGraphs {
    /// The HTP architecture running.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Whether the vocoder runs on the NPU.
    pub fn npu_vocoder(&self) -> bool {
        self.vocoder.is_none()
    }
}

impl LoadedGraphs for QnnGraphs {
    fn backend(&self) -> &'static str {
        QNN
    }

    fn step_session(&self, spec: &StepSpec) -> Result<Box<dyn StepSession>, StepError> {
        let m = &self.manifest;
        let (tiers, info) = match spec.role {
            StackRole::Talker => (&self.talker, &m.talker),
            StackRole::CodePredictor => (&self.predictor, &m.code_predictor),
        };
        Ok(Box::new(session::QnnStack::new(
            spec.role.key(),
            self.runtime.clone(),
            tiers.clone(),
            info,
            spec.hidden_in,
            spec.capacity,
            spec.max_seq,
            m.attention.mask_fill,
        )?))
    }

    fn vocoder_session(&self, max_window: usize) -> Result<Box<dyn VocoderSession>, VocoderError> {
        match &self.vocoder {
            Some(v) => v.vocoder_session(max_window),
            None => Ok(Box::new(vocoder::QnnVocoder::new(
                self.runtime.clone(),
                &self.vocoder_tiers,
                max_window,
                self.manifest.audio.samples_per_frame as usize,
                self.manifest.vocoder.codebook_size,
            )?)),
        }
    }

    fn stage_compute(&self, stage: &str, cpus: &[usize], pin: PinThread) -> Result<Box<dyn StageCompute>, BackendError> {
        match &self.vocoder {
            Some(v) => v.stage_compute(stage, cpus, pin),
            // every stage runs on the NPU: its own thread only calls the graphs
            None => Ok(Box::new(Inline)),
        }
    }

    fn load_times(&self) -> LoadTimes {
        self.times
    }
}

/// A stage whose work the NPU does: `f` runs on the stage's own thread.
struct Inline;

impl StageCompute for Inline {
    fn run(&self, f: &mut dyn FnMut()) {
        f();
    }
}
