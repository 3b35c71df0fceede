//! The graph cache: each graph's decluttered tract model, kept on disk as NNEF so that a second
//! start skips reading the ONNX protobuf, sanitizing, typing and decluttering.
//!
//! What a start costs without it (0.6B dimensions, fp32, one core of the build machine,
//! `RUST_LOG=backend_tract=debug`): the talker spends 3.4 s reading and parsing its 1.8 GB of
//! protobuf, 0.1 s typing, 0.9 s decluttering and 1.1 s optimizing. Optimizing (kernel selection,
//! weight packing) depends on the CPU and stays on the start path; everything before it is the
//! same on every start and is what this cache stores.
//!
//! An entry is a directory `<cache dir>/<graph>-<plan>-<key>/` holding `model/` (tract's NNEF
//! with its `tract_core`, `tract_onnx` and `herald` extensions; block-quantized weights stay in
//! their Q4_0 form) and `io.txt` (the ONNX input and output names in plan order). The key hashes
//! everything that could change what the entry holds: the cache format, this crate's version,
//! tract's version, the running executable (size and modification time, so a rebuilt herald
//! never reads an older herald's entries), the graph's name, manifest checksum, file sizes and
//! modification times, and the plan's fixed frame count. A stale entry is therefore never
//! found; a corrupt one (it fails to load, or its IO differs from the manifest's) is removed
//! with a warning and rebuilt from the ONNX file. Entries are written to a temporary directory
//! beside their final name and renamed into place, so a reader never sees half an entry and
//! two processes starting together both succeed. Entries carry no checksum of their contents
//! (hashing every weight on each start would cost what the cache saves): like the bundle
//! itself, the cache directory is trusted local state; deleting it is always safe.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use tract_nnef::internal::*;
use tract_onnx::WithOnnx;

use model::manifest::GraphInfo;

use crate::snake::Snake;

/// Bumped whenever the layout of an entry changes.
const CACHE_FORMAT: u32 = 1;
/// The tract release this crate is built against (Cargo.toml pins it).
const TRACT_VERSION: &str = "0.23.9";

static CACHE_DIR: RwLock<Option<PathBuf>> = RwLock::new(None);

/// Where graph caches live (`runtime.graph_cache_dir`); `None` turns the cache off (the
/// default: a library does not write to disk unless asked). The directory is created on the
/// first write.
pub fn set_graph_cache_dir(dir: Option<PathBuf>) {
    *CACHE_DIR.write().unwrap_or_else(|e| e.into_inner()) = dir;
}

/// The cache directory [`set_graph_cache_dir`] chose, if any.
pub fn graph_cache_dir() -> Option<PathBuf> {
    CACHE_DIR.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// tract's NNEF framework with every extension a herald graph uses after decluttering.
fn nnef() -> tract_nnef::framework::Nnef {
    tract_nnef::nnef().with_onnx().with_registry(herald_registry())
}

/// The `herald` NNEF extension: the fused SnakeBeta ([`Snake`]) as `herald_snake(x, a, inv_b)`,
/// and tract's exact GELU (the vocoder's, from ONNX `Erf`), which tract 0.23.9 cannot write
/// to NNEF itself, as `herald_gelu_exact(x)`.
fn herald_registry() -> Registry {
    let mut r = Registry::new("herald").with_doc("herald's own ops (the fused SnakeBeta activation, exact GELU)");
    r.register_unit_element_wise("herald_gelu_exact", &tract_nnef::tract_core::ops::nn::GeluExact {});
    r.register_dumper(|ast: &mut IntoAst, node: &TypedNode, _op: &Snake| {
        let inputs: TVec<Arc<RValue>> = node.inputs.iter().map(|i| ast.mapping[i].clone()).collect();
        Ok(Some(invocation("herald_snake", &inputs, &[])))
    });
    r.register_primitive(
        "herald_snake",
        &[TypeName::Scalar.tensor().named("x"), TypeName::Scalar.tensor().named("a"), TypeName::Scalar.tensor().named("inv_b")],
        &[("output", TypeName::Scalar.tensor())],
        |builder: &mut ModelBuilder, invocation: &ResolvedInvocation| {
            let x = invocation.named_arg_as(builder, "x")?;
            let a = invocation.named_arg_as(builder, "a")?;
            let inv_b = invocation.named_arg_as(builder, "inv_b")?;
            builder.wire(Snake, &[x, a, inv_b])
        },
    );
    r
}

/// One cache entry: where it is and what it is for.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    dir: PathBuf,
    /// The bundle directory (canonical) and `<graph>-<plan>`: recorded in the entry so that a
    /// later write can prune what it supersedes.
    bundle: PathBuf,
    slot: String,
}

/// The entry for graph `name` (`info`: its file, checksum and IO in the bundle's manifest) of
/// the bundle `bundle`, plan `frames` (`None`: symbolic), when a cache directory is set.
pub(crate) fn entry(bundle: &Path, name: &str, info: &GraphInfo, frames: Option<usize>) -> Option<Entry> {
    let root = graph_cache_dir()?;
    let file = info.file.as_str();
    let mut h = DefaultHasher::new();
    (CACHE_FORMAT, env!("CARGO_PKG_VERSION"), TRACT_VERSION, name, &info.sha256, frames).hash(&mut h);
    // the IO the manifest declares (names, dtypes, shapes): the ONNX path checks the file
    // against it, so an edited manifest must miss the cache and meet that check
    format!("{:?} {:?}", info.inputs, info.outputs).hash(&mut h);
    let stamp = |p: &Path, h: &mut DefaultHasher| match std::fs::metadata(p) {
        Ok(md) => (true, md.len(), md.modified().ok()).hash(h),
        Err(_) => false.hash(h),
    };
    if let Ok(exe) = std::env::current_exe() {
        stamp(&exe, &mut h);
    }
    let path = bundle.join(file);
    stamp(&path, &mut h);
    stamp(&bundle.join(format!("{file}.data")), &mut h);
    // the bundle's location too: two copies of one bundle get separate entries, so deleting
    // one bundle never leaves entries the other relies on half-known
    let bundle = std::fs::canonicalize(bundle).unwrap_or_else(|_| bundle.to_owned());
    bundle.hash(&mut h);
    let plan = frames.map_or_else(|| "sym".to_string(), |n| format!("f{n}"));
    let safe: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    let slot = format!("{safe}-{plan}");
    Some(Entry { dir: root.join(format!("{slot}-{:016x}", h.finish())), bundle, slot })
}

impl Entry {
    /// The cached decluttered model and its ONNX IO names, or `None` when there is no entry.
    /// A corrupt entry is removed (with a warning) and reads as `None`.
    pub(crate) fn read(&self, info: &GraphInfo) -> Option<(TypedModel, Vec<String>, Vec<String>)> {
        if !self.dir.is_dir() {
            return None;
        }
        match self.try_read(info) {
            Ok(v) => Some(v),
            Err(e) => {
                log::warn!("graph cache {}: unusable, rebuilding it from the ONNX file: {e:#}", self.dir.display());
                let _ = std::fs::remove_dir_all(&self.dir);
                None
            }
        }
    }

    fn try_read(&self, info: &GraphInfo) -> TractResult<(TypedModel, Vec<String>, Vec<String>)> {
        let io_path = self.dir.join("io.txt");
        let io = std::fs::read_to_string(&io_path).with_context(|| format!("reading {}", io_path.display()))?;
        let mut lines = io.lines();
        let mut names = |what: &str| -> TractResult<Vec<String>> {
            let l = lines.next().with_context(|| format!("io.txt has no {what} line"))?;
            let l = l.strip_prefix(what).and_then(|l| l.strip_prefix('\t')).with_context(|| format!("io.txt: no {what} line"))?;
            Ok(if l.is_empty() { vec![] } else { l.split('\t').map(str::to_owned).collect() })
        };
        let (ins, outs) = (names("inputs")?, names("outputs")?);
        // the names in plan order must be the manifest's, in its order (the ONNX path checked
        // the file against them when it wrote the entry)
        let want = |specs: &[model::manifest::TensorSpec]| specs.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        ensure!(
            ins == want(&info.inputs) && outs == want(&info.outputs),
            "io.txt names inputs {ins:?} and outputs {outs:?}, the manifest declares {:?} and {:?}",
            want(&info.inputs),
            want(&info.outputs)
        );
        let model_dir = self.dir.join("model");
        let model = nnef()
            .model_for_path(&model_dir)
            .and_then(|m| m.into_decluttered())
            .with_context(|| format!("loading {}", model_dir.display()))?;
        ensure!(
            model.inputs.len() == ins.len() && model.outputs.len() == outs.len(),
            "the cached model has {} inputs and {} outputs, the manifest declares {} and {}",
            model.inputs.len(),
            model.outputs.len(),
            ins.len(),
            outs.len()
        );
        Ok((model, ins, outs))
    }

    /// Store `model` (decluttered) with its ONNX IO names. Failures are logged, never fatal:
    /// the graph loaded anyway, only the next start stays slow.
    pub(crate) fn write(&self, model: &TypedModel, inputs: &[String], outputs: &[String]) {
        if let Err(e) = self.try_write(model, inputs, outputs) {
            // an op tract cannot write to NNEF is a fact of the graph, not a fault to repeat
            // as a warning on every start
            let msg = format!("{e:#}");
            // one warning per start is enough for a directory that cannot be written
            static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if msg.contains("No serializer found") {
                log::info!("graph cache {}: this graph cannot be cached ({msg}); it is parsed on every start", self.dir.display());
            } else if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!("graph cache {}: not written ({msg}); the next start parses the ONNX files again", self.dir.display());
            } else {
                log::debug!("graph cache {}: not written ({msg})", self.dir.display());
            }
        }
    }

    fn try_write(&self, model: &TypedModel, inputs: &[String], outputs: &[String]) -> TractResult<()> {
        let root = self.dir.parent().context("cache entry has no parent directory")?;
        std::fs::create_dir_all(root).with_context(|| format!("creating {}", root.display()))?;
        let name = self.dir.file_name().context("cache entry has no name")?.to_string_lossy().into_owned();
        let tmp = tempfile::Builder::new().prefix(&format!(".{name}.")).tempdir_in(root)?;
        nnef().write_to_dir(model, tmp.path().join("model"))?;
        let mut io = std::fs::File::create(tmp.path().join("io.txt"))?;
        writeln!(io, "inputs\t{}", inputs.join("\t"))?;
        writeln!(io, "outputs\t{}", outputs.join("\t"))?;
        writeln!(io, "bundle\t{}", self.bundle.display())?;
        writeln!(io, "slot\t{}", self.slot)?;
        io.sync_all()?;
        drop(io);
        let tmp = tmp.keep();
        // something that is not an entry directory in the way (a stray file): replace it
        if self.dir.exists() && !self.dir.is_dir() {
            std::fs::remove_file(&self.dir).with_context(|| format!("removing {}", self.dir.display()))?;
        }
        if let Err(e) = std::fs::rename(&tmp, &self.dir) {
            let _ = std::fs::remove_dir_all(&tmp);
            // another process wrote the same entry first: theirs is as good as ours
            if !self.dir.is_dir() {
                return Err(e.into());
            }
        }
        log::debug!("graph cache {}: written", self.dir.display());
        self.prune(root);
        Ok(())
    }

    /// Remove the entries this one supersedes (same bundle, graph and plan: the bundle or
    /// herald changed) and those whose bundle directory no longer exists, so the cache holds
    /// about one copy of each bundle in use.
    fn prune(&self, root: &Path) {
        let Ok(list) = std::fs::read_dir(root) else { return };
        for e in list.flatten() {
            let dir = e.path();
            if dir == self.dir || !dir.is_dir() {
                continue;
            }
            // a temporary entry is renamed within seconds; one an hour old was left by a
            // process that was killed while writing
            if e.file_name().to_string_lossy().starts_with('.') {
                let old = e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
                if old.is_some_and(|age| age > std::time::Duration::from_secs(3600)) {
                    log::debug!("graph cache {}: removed (left by an interrupted write)", dir.display());
                    let _ = std::fs::remove_dir_all(&dir);
                }
                continue;
            }
            let Ok(io) = std::fs::read_to_string(dir.join("io.txt")) else { continue };
            let field = |k: &str| io.lines().find_map(|l| l.strip_prefix(k).and_then(|l| l.strip_prefix('\t'))).map(str::to_owned);
            let (Some(bundle), Some(slot)) = (field("bundle"), field("slot")) else { continue };
            let gone = !Path::new(&bundle).is_dir();
            if gone || (Path::new(&bundle) == self.bundle && slot == self.slot) {
                log::debug!("graph cache {}: removed (superseded or its bundle is gone)", dir.display());
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}
