//! Opening a model bundle: the manifest and the tokenizer read from the directory, the tables
//! memory-mapped, the graphs loaded by a backend ([`model::backend::Backend`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use model::backend::{Backend, LoadedGraphs, VocoderForm};
use model::manifest::{Manifest, ManifestError};
use model::prompt::{PromptError, Prompter};
use tokenizers::Tokenizer;

use crate::error::EngineError;
use crate::tables::Tables;

/// Read, parse and validate `DIR/bundle.toml`, checking that every file it names exists inside
/// `DIR`.
///
/// # Errors
/// [`ManifestError::Io`] when the file cannot be read, [`ManifestError::Parse`] for TOML or
/// schema errors, [`ManifestError::Invalid`] for inconsistent or unsupported content or a file
/// that is not in the bundle.
pub fn read_manifest(dir: &Path) -> Result<Manifest, ManifestError> {
    let path = dir.join("bundle.toml");
    let text = std::fs::read_to_string(&path).map_err(|source| ManifestError::Io { path: path.clone(), source })?;
    let m = Manifest::parse(&text, &path)?;
    for file in m.files() {
        match std::fs::metadata(dir.join(file)) {
            Ok(m) if m.is_file() => {}
            Ok(_) => {
                return Err(ManifestError::Invalid { path, message: format!("names {file}, which is not a file in the bundle") });
            }
            Err(_) => return Err(ManifestError::Invalid { path, message: format!("names {file}, which is not in the bundle") }),
        }
    }
    Ok(m)
}

/// One file [`verify`] checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The file name inside the bundle.
    pub file: String,
    /// Its size, bytes.
    pub bytes: u64,
}

/// Check the SHA-256 of every file of the bundle in `dir` that `manifest` gives one for (the
/// tokenizer, each graph and each QNN context binary), reading each file once in 1 MiB blocks; then the tables, which
/// have no checksum in `bundle.toml`, as loading checks them (header, names, shapes, dtype and
/// a length that holds every table).
///
/// # Errors
/// [`ManifestError::Io`] naming a file that cannot be read; [`ManifestError::Invalid`] naming a
/// file whose SHA-256 differs from the manifest's (damaged, truncated or replaced), or tables
/// that are cut short or disagree with the manifest.
pub fn verify(dir: &Path, manifest: &Manifest) -> Result<Vec<Verified>, ManifestError> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut files: Vec<(&str, &str)> = vec![(manifest.tokenizer.file.as_str(), manifest.tokenizer.sha256.as_str())];
    files.extend(manifest.graphs.values().map(|g| (g.file.as_str(), g.sha256.as_str())));
    if let Some(q) = &manifest.qnn {
        files.extend(q.binaries.iter().map(|b| (b.file.as_str(), b.sha256.as_str())));
    }
    let mut out = Vec::with_capacity(files.len());
    let mut buf = vec![0u8; 1 << 20];
    for (file, want) in files {
        let path = dir.join(file);
        let io = |source| ManifestError::Io { path: path.clone(), source };
        let mut f = std::fs::File::open(&path).map_err(io)?;
        let mut hash = Sha256::new();
        let mut bytes = 0u64;
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io(e)),
            };
            hash.update(&buf[..n]);
            bytes += n as u64;
        }
        let got: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        if !got.eq_ignore_ascii_case(want.trim()) {
            return Err(ManifestError::Invalid {
                path,
                message: format!(
                    "SHA-256 is {got} ({bytes} bytes), bundle.toml says {want}: the file is damaged or was replaced; copy the bundle again"
                ),
            });
        }
        out.push(Verified { file: file.to_owned(), bytes });
    }
    // the tables: no checksum, but the same header, shape and length check as loading does
    let tables = crate::tables::Tables::open(dir, manifest).map_err(|e| match e {
        crate::tables::TablesError::Io { path, source } => ManifestError::Io { path, source },
        crate::tables::TablesError::Invalid { path, message } => ManifestError::Invalid { path, message },
    })?;
    out.push(Verified { file: manifest.tables.file.clone(), bytes: tables.mapped_bytes() as u64 });
    Ok(out)
}

/// Load `dir/<tokenizer.file>` and build the prompter over it ([`Prompter::with_tokenizer`]).
///
/// # Errors
/// [`PromptError::TokenizerLoad`] (names the file), or [`Prompter::with_tokenizer`]'s errors.
pub fn read_prompter(dir: &Path, manifest: &Manifest) -> Result<Prompter, PromptError> {
    let path = dir.join(&manifest.tokenizer.file);
    let tokenizer = Tokenizer::from_file(&path).map_err(|source| PromptError::TokenizerLoad { path, source })?;
    Prompter::with_tokenizer(tokenizer, manifest)
}

/// The last prompter [`shared_prompter`] built, with the identity of the files it came from.
type PrompterMemo = Option<(Vec<(PathBuf, u64, Option<std::time::SystemTime>)>, Arc<Prompter>)>;
static PROMPTER_MEMO: std::sync::Mutex<PrompterMemo> = std::sync::Mutex::new(None);

/// [`read_prompter`], remembered: the last prompter built is returned again while the
/// tokenizer file and `bundle.toml` are unchanged (path, size, modification time). Building
/// the tokenizer (151k tokens and merges) takes about 0.5 s on a small board, and a command
/// checks its text against the tokenizer while the bundle opens: with this, it is built once
/// per start, by whichever thread asks first (the other waits for it).
///
/// # Errors
/// As [`read_prompter`].
pub fn shared_prompter(dir: &Path, manifest: &Manifest) -> Result<Arc<Prompter>, PromptError> {
    let id: Vec<_> = [dir.join(&manifest.tokenizer.file), dir.join("bundle.toml")]
        .into_iter()
        .map(|p| {
            let md = std::fs::metadata(&p).ok();
            let p = std::fs::canonicalize(&p).unwrap_or(p);
            (p, md.as_ref().map_or(0, |m| m.len()), md.and_then(|m| m.modified().ok()))
        })
        .collect();
    // the lock is held while building, so two threads asking at once (a command checking its
    // text while the bundle loads on another thread) build it once: the second one waits
    let mut memo = PROMPTER_MEMO.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((key, p)) = memo.as_ref()
        && *key == id
    {
        return Ok(p.clone());
    }
    let p = Arc::new(read_prompter(dir, manifest)?);
    *memo = Some((id, p.clone()));
    Ok(p)
}

/// A loaded bundle: manifest, tables, tokenizer and optimized graphs. Load once, share.
#[derive(Debug)]
pub struct Bundle {
    /// Bundle directory.
    pub dir: PathBuf,
    /// The manifest.
    pub manifest: Manifest,
    /// Memory-mapped embedding tables.
    pub tables: Arc<Tables>,
    /// Tokenizer and prompt layout.
    pub prompter: Arc<Prompter>,
    /// The three graphs, loaded by a backend.
    pub graphs: Box<dyn LoadedGraphs>,
    /// The vocoder form the graphs were loaded with.
    pub vocoder_form: VocoderForm,
    /// Seconds from open to ready.
    pub load_seconds: f64,
}

impl Bundle {
    /// Open and validate a bundle directory and load its graphs with `backend`, the vocoder in
    /// the bundle's default form ([`Manifest::default_vocoder_form`]: stateful when it has a
    /// stream graph).
    ///
    /// # Errors
    /// Any [`EngineError`] of the loading stages, naming the file at fault.
    pub fn open(dir: &Path, backend: &dyn Backend) -> Result<Self, EngineError> {
        Self::open_with(dir, backend, None)
    }

    /// [`Bundle::open`] with the vocoder in `form` (`None`: the bundle's default).
    ///
    /// # Errors
    /// As [`Bundle::open`]; [`EngineError::Config`] when `form` is stateful and the bundle has
    /// no stream graph.
    pub fn open_with(dir: &Path, backend: &dyn Backend, form: Option<VocoderForm>) -> Result<Self, EngineError> {
        let t0 = Instant::now();
        let manifest = read_manifest(dir)?;
        let vocoder_form = form.unwrap_or_else(|| manifest.default_vocoder_form());
        if manifest.vocoder_graph(vocoder_form).is_none() {
            return Err(EngineError::Config(format!(
                "synthesis.vocoder = \"{vocoder_form}\", but {} has no stream graph ([vocoder].stream_graph): re-export the bundle with a current herald-export, or set synthesis.vocoder = \"windowed\"",
                dir.join("bundle.toml").display()
            )));
        }
        let tables = Arc::new(Tables::open(dir, &manifest)?);
        for (key, stack) in [("talker", &manifest.talker), ("code_predictor", &manifest.code_predictor)] {
            check_caches(dir, &manifest, key, stack)?;
        }
        // The tokenizer (a 151k-entry vocabulary and its merges, ~0.5 s to build) loads on its
        // own thread while the backend loads the graphs; its error, if any, is reported first.
        let (prompter, graphs) = std::thread::scope(|s| {
            let prompter = std::thread::Builder::new()
                .name("load-tokenizer".into())
                .spawn_scoped(s, || shared_prompter(dir, &manifest).map_err(|e| EngineError::Bundle(e.to_string())));
            let graphs = backend.load(dir, &manifest, vocoder_form);
            let prompter = match prompter {
                Ok(h) => h.join().unwrap_or_else(|_| Err(EngineError::Bundle("the tokenizer loader panicked".into()))),
                Err(_) => shared_prompter(dir, &manifest).map_err(|e| EngineError::Bundle(e.to_string())),
            };
            (prompter, graphs)
        });
        let prompter = prompter?;
        let graphs = graphs?;
        let load_seconds = t0.elapsed().as_secs_f64();
        let times = graphs.load_times();
        log::info!(
            "bundle {}: {} {} {} weights loaded by {} in {:.2} s{} (talker {:.2} s, predictor {:.2} s, {} vocoder {:.2} s; graphs load in parallel)",
            dir.display(),
            manifest.model.family,
            manifest.model.size,
            manifest.weights(),
            graphs.backend(),
            load_seconds,
            if times.from_cache { " from its graph cache" } else { "" },
            times.talker,
            times.code_predictor,
            vocoder_form,
            times.vocoder
        );
        Ok(Bundle { dir: dir.to_owned(), manifest, tables, prompter, graphs, vocoder_form, load_seconds })
    }
}

/// Every layer's declared cache inputs must match the manifest's cache kind: a `full` layer takes
/// `[1, past, KV, head_dim]`, a `sliding` one `[1, window - 1, KV, head_dim]`. Checked before any
/// buffer is sized from the manifest, so an absurd window is an error, not an allocation.
fn check_caches(dir: &Path, m: &Manifest, key: &str, stack: &model::manifest::StackInfo) -> Result<(), EngineError> {
    use model::manifest::{CacheKind, Dim};
    let file = dir.join("bundle.toml");
    let g = m
        .graphs
        .get(&stack.graph)
        .ok_or_else(|| EngineError::Bundle(format!("{}: {key}.graph {:?} is not in [graphs]", file.display(), stack.graph)))?;
    for (i, kind) in stack.cache.iter().enumerate() {
        for kv in ["k", "v"] {
            let name = format!("{kv}_cache_{i}");
            let spec = g.inputs.iter().find(|t| t.name == name).ok_or_else(|| {
                EngineError::Bundle(format!("{}: graph {} has no input {name} for {key}.cache[{i}]", file.display(), stack.graph))
            })?;
            let rows_ok = match (kind, spec.shape.get(1)) {
                (CacheKind::Full, Some(Dim::Symbol(_))) => true,
                (CacheKind::Sliding { window }, Some(Dim::Fixed(r))) => u64::from(*window) == r + 1,
                _ => false,
            };
            let tail =
                spec.shape.get(2..) == Some(&[Dim::Fixed(u64::from(stack.kv_heads)), Dim::Fixed(u64::from(stack.head_dim))][..]);
            if !rows_ok || !tail || spec.shape.len() != 4 {
                return Err(EngineError::Bundle(format!(
                    "{}: {key}.cache[{i}] is {kind:?} with {} kv heads x {}, but graph input {name} has shape {:?}",
                    file.display(),
                    stack.kv_heads,
                    stack.head_dim,
                    spec.shape
                )));
            }
        }
    }
    Ok(())
}
