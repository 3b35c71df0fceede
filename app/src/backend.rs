//! Which backend runs the talker, the code predictor and the vocoder (`runtime.backend`,
//! `runtime.qnn_vocoder`, docs/backend.md).

use std::path::PathBuf;
use std::sync::Arc;

use board::probe::HardwareClass;
use model::backend::Backend;
use model::manifest::Manifest;

use crate::config::{BackendChoice, Config, QnnVocoder, VocoderPrecision};
use crate::exit::{self, Failure, fail};

/// The backend chosen for a bundle, and why.
pub struct Chosen {
    /// The backend that loads the bundle.
    pub backend: Box<dyn Backend>,
    /// The backend that loads the bundle when `backend` fails to (`runtime.backend = "auto"`
    /// chose `qnn`: tract); `None` when a failure must stop herald.
    pub fallback: Option<Box<dyn Backend>>,
    /// One line for the log: which backend runs which stage, and why.
    pub why: String,
}

/// The folders searched for the QNN libraries: `runtime.qnn_lib_dir`, else the standard ones.
pub fn qnn_lib_dirs(cfg: &Config) -> Vec<PathBuf> {
    backend_qnn::ffi::search_dirs(cfg.runtime.qnn_lib_dir.as_deref())
}

/// The tract backend with `runtime.vocoder_precision`; `steps` false loads the vocoder only
/// (beside the qnn backend).
pub fn tract_with(cfg: &Config, steps: bool) -> backend_tract::TractWith {
    let vocoder = match cfg.runtime.vocoder_precision {
        VocoderPrecision::Fp32 => backend_tract::VocoderPrecision::Fp32,
        VocoderPrecision::Fp16 => backend_tract::VocoderPrecision::Fp16,
        VocoderPrecision::Auto => backend_tract::VocoderPrecision::Auto,
    };
    backend_tract::TractWith { steps, vocoder }
}

fn qnn(cfg: &Config, arch: String) -> Box<dyn Backend> {
    Box::new(backend_qnn::Qnn {
        lib_dirs: qnn_lib_dirs(cfg),
        arch: Some(arch),
        vocoder: Arc::new(tract_with(cfg, false)),
        npu_vocoder: cfg.runtime.qnn_vocoder == QnnVocoder::Npu,
    })
}

/// Where the vocoder runs under the qnn backend, for the log line.
fn vocoder_place(cfg: &Config, arch: &str) -> String {
    match cfg.runtime.qnn_vocoder {
        QnnVocoder::Cpu => "vocoder on the CPU (tract)".into(),
        QnnVocoder::Npu => format!("vocoder on the NPU ({arch} vocoder binaries, runtime.qnn_vocoder = \"npu\")"),
    }
}

/// Choose the backend for `manifest`'s bundle on a board of `class`.
///
/// `qnn` is checked here, before anything is loaded: the bundle must have binaries for
/// `runtime.qnn_arch` (or exactly one arch), vocoder binaries too with `runtime.qnn_vocoder =
/// "npu"`, and the libraries must open with a QNN API herald speaks. `auto` takes `qnn` only on
/// a `snapdragon_npu` board where all of that holds, else `tract` with the reason in
/// [`Chosen::why`]; when it takes `qnn`, tract is the [`Chosen::fallback`] for a load that fails
/// later (a backend or context the runtime cannot create, a binary that does not match).
///
/// # Errors
/// `runtime.backend = "qnn"` with a bundle lacking the binaries (or the vocoder binaries that
/// `qnn_vocoder = "npu"` needs), or libraries that are missing or speak another API: exit 4
/// with one line.
pub fn choose(cfg: &Config, manifest: &Manifest, class: HardwareClass) -> Result<Chosen, Failure> {
    let tract = |why: String| Chosen { backend: Box::new(tract_with(cfg, true)), fallback: None, why };
    let arch = cfg.runtime.qnn_arch.as_deref();
    let npu_vocoder = cfg.runtime.qnn_vocoder == QnnVocoder::Npu;
    match cfg.runtime.backend {
        BackendChoice::Tract => Ok(tract("backend tract (runtime.backend = \"tract\"): every stage on the CPU".into())),
        BackendChoice::Qnn => {
            let (arch, _) = backend_qnn::select(manifest, arch).map_err(|e| fail(exit::BUNDLE, e))?;
            if npu_vocoder {
                backend_qnn::vocoder_binaries(manifest, &arch).map_err(|e| fail(exit::BUNDLE, e))?;
            }
            let libs = backend_qnn::lib_info(&qnn_lib_dirs(cfg))
                .map_err(|e| fail(exit::BUNDLE, anyhow::Error::new(e).context("runtime.backend = \"qnn\"")))?;
            let why = format!(
                "backend qnn (runtime.backend = \"qnn\"): talker and code predictor on the NPU ({arch} binaries, {} core API {} from {}), {}",
                libs.provider,
                libs.core_api,
                libs.dir.display(),
                vocoder_place(cfg, &arch)
            );
            Ok(Chosen { backend: qnn(cfg, arch), fallback: None, why })
        }
        BackendChoice::Auto => {
            if class != HardwareClass::SnapdragonNpu {
                return Ok(tract(format!(
                    "backend tract (runtime.backend = \"auto\" on a {} board): every stage on the CPU",
                    class.as_str()
                )));
            }
            let arch = match backend_qnn::select(manifest, arch) {
                Ok((a, _)) => a,
                Err(e) => return Ok(tract(format!("backend tract, not qnn (every stage on the CPU): {e}"))),
            };
            if npu_vocoder && let Err(e) = backend_qnn::vocoder_binaries(manifest, &arch) {
                return Ok(tract(format!("backend tract, not qnn (every stage on the CPU): {e}")));
            }
            match backend_qnn::lib_info(&qnn_lib_dirs(cfg)) {
                Ok(libs) => {
                    let why = format!(
                        "backend qnn (runtime.backend = \"auto\" on a snapdragon_npu board): talker and code predictor on the NPU ({arch} binaries, {} from {}), {}",
                        libs.provider,
                        libs.dir.display(),
                        vocoder_place(cfg, &arch)
                    );
                    Ok(Chosen { backend: qnn(cfg, arch), fallback: Some(Box::new(tract_with(cfg, true))), why })
                }
                Err(e) => Ok(tract(format!("backend tract, not qnn (every stage on the CPU): the QNN runtime does not load: {e}"))),
            }
        }
    }
}
