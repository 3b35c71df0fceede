//! File I/O of `herald sanitize`: read, sanitize, copy external data, write atomically.

use std::collections::BTreeSet;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path};

use prost::Message;
use tract_onnx::pb;

use super::proto::*;
use super::{SanitizeError, SanitizeReport};

/// Reads the ONNX model at `input`, sanitizes it and writes it to `output` atomically (a
/// temporary file in the output's directory, fsync, rename).
///
/// External-data files (initializers with `data_location == EXTERNAL`) are never modified. When
/// `output` lives in another directory than `input`, each one is copied next to the output (under
/// the same relative location) unless an identical file is already there; a different file of the
/// same name is an error. `input == output` sanitizes in place.
pub fn sanitize_file(input: &Path, output: &Path) -> Result<SanitizeReport, SanitizeError> {
    let bytes = fs::read(input).map_err(|source| SanitizeError::Read { path: input.to_path_buf(), source })?;
    let mut model = decode_model(input, &bytes)?;
    let report = super::sanitize(&mut model);

    let write_err = |source| SanitizeError::Write { path: output.to_path_buf(), source };
    if output.is_dir() {
        return Err(write_err(io::Error::new(io::ErrorKind::IsADirectory, "the output is a directory")));
    }
    // The output is replaced by a rename: only ever replace a regular file, never a device node,
    // a FIFO or a symlink (renaming over /dev/full would destroy the node).
    if let Ok(meta) = fs::symlink_metadata(output)
        && !meta.file_type().is_file()
    {
        return Err(write_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the output exists and is not a regular file (a device, FIFO or symlink); choose another path",
        )));
    }
    let out_dir = parent_dir(output);
    let out_dir_canon = out_dir.canonicalize().map_err(write_err)?;
    let in_dir = parent_dir(input);
    let in_dir_canon = in_dir.canonicalize().map_err(|source| SanitizeError::Read { path: input.to_path_buf(), source })?;

    // External data stays where it is when the output sits next to the input; otherwise it is
    // copied (never rewritten) so the relative locations resolve from the output's directory.
    if let Some(graph) = &model.graph
        && in_dir_canon != out_dir_canon
    {
        let mut locations = BTreeSet::new();
        collect_external_locations(graph, &mut locations);
        for location in &locations {
            check_location(input, location)?;
        }
        for location in &locations {
            copy_external(input, &in_dir_canon, &out_dir_canon, location)?;
        }
    }

    write_atomic(output, &model.encode_to_vec()).map_err(write_err)?;
    log::info!("{}: {report}", output.display());
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// Graph rewrites
// ---------------------------------------------------------------------------------------------

pub(super) fn decode_model(path: &Path, bytes: &[u8]) -> Result<pb::ModelProto, SanitizeError> {
    let not_onnx = |reason: String| SanitizeError::NotOnnx { path: path.to_path_buf(), reason };
    let model = pb::ModelProto::decode(bytes).map_err(|e| not_onnx(format!("protobuf decoding failed: {e}")))?;
    if model.ir_version <= 0 {
        return Err(not_onnx("no IR version".to_string()));
    }
    if model.graph.is_none() {
        return Err(not_onnx("no graph".to_string()));
    }
    Ok(model)
}

/// The directory holding `path` (`.` for a bare file name).
pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Every external-data `location` the graph (and its subgraphs) refers to.
pub(super) fn collect_external_locations(graph: &pb::GraphProto, out: &mut BTreeSet<String>) {
    let mut tensors: Vec<&pb::TensorProto> = graph.initializer.iter().collect();
    for sparse in &graph.sparse_initializer {
        tensors.extend(sparse.values.iter().chain(&sparse.indices));
    }
    for node in &graph.node {
        for attr in &node.attribute {
            tensors.extend(attr.t.iter().chain(&attr.tensors));
            for sparse in attr.sparse_tensor.iter().chain(&attr.sparse_tensors) {
                tensors.extend(sparse.values.iter().chain(&sparse.indices));
            }
            for g in attr.g.iter().chain(&attr.graphs) {
                collect_external_locations(g, out);
            }
        }
    }
    for t in tensors.into_iter().filter(|t| is_external(t)) {
        if let Some(loc) = t.external_data.iter().find(|e| e.key == "location") {
            out.insert(loc.value.clone());
        }
    }
}

/// External-data locations must be relative paths inside the model's directory (as tract and the
/// ONNX checker require).
pub(super) fn check_location(model: &Path, location: &str) -> Result<(), SanitizeError> {
    let p = Path::new(location);
    let ok = !location.is_empty()
        && p.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && p.components().any(|c| matches!(c, Component::Normal(_)));
    if ok {
        Ok(())
    } else {
        Err(SanitizeError::ExternalLocation {
            model: model.to_path_buf(),
            location: location.to_string(),
            reason: "not a relative path inside the model's directory".to_string(),
        })
    }
}

/// Copies the external-data file `location` from `in_dir` to `out_dir`, unless an identical file
/// is already there.
pub(super) fn copy_external(model: &Path, in_dir: &Path, out_dir: &Path, location: &str) -> Result<(), SanitizeError> {
    let from = in_dir.join(location);
    let to = out_dir.join(location);
    let read_err = |source| SanitizeError::ExternalRead { model: model.to_path_buf(), path: from.clone(), source };
    let canon = from.canonicalize().map_err(read_err)?;
    if !canon.starts_with(in_dir) {
        return Err(SanitizeError::ExternalLocation {
            model: model.to_path_buf(),
            location: location.to_string(),
            reason: format!("resolves outside the model's directory (to {})", canon.display()),
        });
    }
    if !canon.is_file() {
        return Err(read_err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file")));
    }
    if to.exists() {
        let same =
            same_contents(&canon, &to).map_err(|source| SanitizeError::ExternalCopy { from: from.clone(), to: to.clone(), source })?;
        return if same { Ok(()) } else { Err(SanitizeError::ExternalConflict { path: to, original: from }) };
    }
    let copy_err = |source| SanitizeError::ExternalCopy { from: from.clone(), to: to.clone(), source };
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent).map_err(copy_err)?;
    }
    copy_atomic(&canon, &to).map_err(copy_err)
}

/// Byte-for-byte comparison of two files.
pub(super) fn same_contents(a: &Path, b: &Path) -> io::Result<bool> {
    let (fa, fb) = (fs::File::open(a)?, fs::File::open(b)?);
    if fa.metadata()?.len() != fb.metadata()?.len() {
        return Ok(false);
    }
    let (mut ra, mut rb) = (io::BufReader::new(fa), io::BufReader::new(fb));
    let (mut ba, mut bb) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let na = read_full(&mut ra, &mut ba)?;
        let nb = read_full(&mut rb, &mut bb)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or the end of the file; returns the number of bytes read.
pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Replace `path` with what `fill` writes, through `tempfile`'s [`tempfile::NamedTempFile`] in
/// the same directory: fsync, rename over `path`, fsync of the directory (the temporary file is
/// removed when anything fails). The same steps as `board::fsutil::AtomicFile`, which this crate
/// cannot depend on (the tract backend knows nothing of the device side).
fn replace_atomic(path: &Path, fill: impl FnOnce(&mut fs::File) -> io::Result<()>) -> io::Result<()> {
    // the mode a plain File::create gives (0o666 less the umask), not tempfile's 0o600
    let mut tmp = tempfile::Builder::new().permissions(fs::Permissions::from_mode(0o666)).tempfile_in(parent_dir(path))?;
    fill(tmp.as_file_mut())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(parent_dir(path));
    Ok(())
}

/// Writes `bytes` to `path` atomically ([`replace_atomic`]).
pub(super) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace_atomic(path, |f| f.write_all(bytes))
}

/// Copies `from` to `to` atomically ([`replace_atomic`]).
pub(super) fn copy_atomic(from: &Path, to: &Path) -> io::Result<()> {
    let mut src = fs::File::open(from)?;
    replace_atomic(to, |dst| io::copy(&mut src, dst).map(drop))
}

/// Best-effort fsync of a directory, so a rename into it is durable.
pub(super) fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}
