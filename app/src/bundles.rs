//! Installed bundles (issue 41): `herald bundle install ARCHIVE`, `list`, `remove NAME` and
//! `use NAME` (the `default` link, [`use_bundle`]), in `model.bundles_dir`.
//!
//! The archive is what `tools/export/export pack` writes (docs/bundle.md, "Bundle archives"): a
//! ustar file whose first member is the index [`INDEX_NAME`] (the files, their sizes and SHA-256,
//! the bundle's `format_version`, a fingerprint), then the bundle's regular files in the index's
//! order. [`install`] reads it once, front to back, and refuses it with nothing left behind when
//! anything disagrees:
//!
//! - the index is read and checked first ([`Index::check`]): a bundle of another
//!   `format_version` or archive version is refused before a byte of it is written;
//! - every member must be the next file of the index (name, size), a regular file (no links,
//!   devices or directories: nothing in the archive decides where a file lands but the index's
//!   checked relative paths), and hash to the index's SHA-256; nothing may follow the last;
//! - the unpacked `bundle.toml` must parse as a manifest this herald reads and name only files
//!   the archive held.
//!
//! The files land in a hidden staging folder in `model.bundles_dir`
//! (`.NAME.partial-PID`), each synced, and the folder is renamed to `NAME` only when all is
//! checked (refused when `NAME` exists): a kill, a full disk or a bad byte leaves no bundle
//! half-installed, and the next install removes a dead process's staging folder.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The index's member name, always the archive's first.
pub const INDEX_NAME: &str = "herald-bundle.json";
/// The largest index accepted, bytes (a bundle's is a few KiB; tools/export/herald_export/pack.py
/// writes at most this much).
pub const INDEX_MAX: u64 = 1 << 20;
/// The archive layout this herald reads (docs/bundle.md, "Bundle archives").
pub const ARCHIVE_VERSION: u32 = 1;

/// The index of a bundle archive (`herald-bundle.json`; docs/bundle.md).
#[derive(Debug, Clone, Deserialize)]
pub struct Index {
    /// The archive layout, [`ARCHIVE_VERSION`].
    pub archive_version: u32,
    /// The bundle's name: the folder it is installed as.
    pub name: String,
    /// `bundle.toml`'s `format_version`.
    pub format_version: u32,
    /// The herald versions that load the bundle.
    pub herald: HeraldVersions,
    /// `bundle.toml`'s `[model]` facts (type, size, dtype, weights, source), for listings.
    #[serde(default)]
    pub model: BTreeMap<String, serde_json::Value>,
    /// The files, in archive order.
    pub files: Vec<IndexFile>,
    /// The files' sizes summed, bytes.
    pub bytes: u64,
    /// SHA-256 (hex) over `PATH NUL SIZE NUL SHA256 LF` of each file in order.
    pub fingerprint: String,
}

/// The herald versions an archive's bundle loads in.
#[derive(Debug, Clone, Deserialize)]
pub struct HeraldVersions {
    /// The first herald version that loads the bundle's `format_version`.
    pub min: String,
}

/// One file of an [`Index`].
#[derive(Debug, Clone, Deserialize)]
pub struct IndexFile {
    /// Relative path inside the bundle, `/`-separated.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// SHA-256, lower-case hex.
    pub sha256: String,
}

/// Errors of the bundle commands; each names the archive, folder or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The archive is not a bundle archive, or its content disagrees with its index (damaged,
    /// cut short, altered, or holding what a bundle archive must not).
    #[error("{archive}: {problem}")]
    Archive {
        /// The archive.
        archive: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A well-formed archive of a bundle this herald cannot load.
    #[error("{archive}: {problem}")]
    Incompatible {
        /// The archive.
        archive: PathBuf,
        /// Why, and what to do.
        problem: String,
    },
    /// A bundle of that name is installed already.
    #[error("a bundle named {name:?} is installed already ({dir}); remove it first: herald bundle remove {name}")]
    Exists {
        /// The bundle's name.
        name: String,
        /// Its folder.
        dir: PathBuf,
    },
    /// No installed bundle of that name.
    #[error("no bundle named {name:?} in {dir} (herald bundle list shows the installed ones)")]
    Missing {
        /// The name asked for.
        name: String,
        /// `model.bundles_dir`.
        dir: PathBuf,
    },
    /// A name that cannot be a bundle's.
    #[error("{name:?} is not a bundle name: {why}")]
    BadName {
        /// The name given.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// `bundles_dir/default` is a folder, not the link [`use_bundle`] manages.
    #[error("{path} is a folder, not a link herald manages; move it to a name of its own (it is then listed and usable)")]
    NotALink {
        /// `bundles_dir/default`.
        path: PathBuf,
    },
    /// The bundle asked to be removed is the configured one.
    #[error("{name:?} is model.bundle ({path}), the bundle herald speaks with; set model.bundle to another one first")]
    InUse {
        /// The bundle's name.
        name: String,
        /// The configured path.
        path: PathBuf,
    },
    /// Reading the archive or writing the bundle failed (a full disk among others).
    #[error("{path}: cannot {op}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The operating system's reason.
        source: io::Error,
    },
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(io::Error) -> BundleError {
    let path = path.to_owned();
    move |source| BundleError::Io { path, op, source }
}

fn bad(archive: &Path, problem: impl Into<String>) -> BundleError {
    BundleError::Archive { archive: archive.to_owned(), problem: problem.into() }
}

/// A failed read of `what` in the archive: the system's (an I/O error, [`BundleError::Io`]) or
/// the archive's (cut short, not tar: [`BundleError::Archive`]).
fn read_err<'a>(archive: &'a Path, what: &'a str) -> impl FnOnce(io::Error) -> BundleError + 'a {
    move |e| {
        if e.raw_os_error().is_some() {
            BundleError::Io { path: archive.to_owned(), op: "read", source: e }
        } else {
            bad(archive, format!("{what}: cannot read: {e}"))
        }
    }
}

/// Whether `name` can be a bundle's folder name: 1 to 100 bytes of ASCII letters, digits, `.`,
/// `_` and `-`, not starting with `.` (the staging folders' prefix).
///
/// # Errors
/// [`BundleError::BadName`] saying what is wrong.
pub fn check_name(name: &str) -> Result<(), BundleError> {
    let why = if name.is_empty() || name.len() > 100 {
        Some("it must be 1 to 100 characters")
    } else if name.starts_with('.') {
        Some("it must not start with '.'")
    } else if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
        Some("only ASCII letters, digits, '.', '_' and '-' are allowed")
    } else {
        None
    };
    match why {
        Some(why) => Err(BundleError::BadName { name: name.to_owned(), why }),
        None => Ok(()),
    }
}

/// Whether `path` is a safe relative path inside a bundle: `/`-separated components, none empty,
/// `.` or `..`, no NUL or backslash, at most 255 bytes.
fn safe_relative(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= 255
        && !path.contains(['\0', '\\'])
        && path.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// SHA-256 (hex) over `PATH NUL SIZE NUL SHA256 LF` of each file, in order.
pub fn fingerprint(files: &[IndexFile]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(format!("{}\0{}\0{}\n", f.path, f.size, f.sha256).as_bytes());
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Index {
    /// Check what can be checked before unpacking: the archive and bundle format versions this
    /// herald reads, the name, every path (relative, inside the bundle, each once, `bundle.toml`
    /// among them), the hashes' form, the total and the fingerprint.
    ///
    /// # Errors
    /// [`BundleError::Incompatible`] for another archive or bundle format version;
    /// [`BundleError::Archive`] for anything else wrong, naming it.
    pub fn check(&self, archive: &Path) -> Result<(), BundleError> {
        let incompatible = |problem: String| BundleError::Incompatible { archive: archive.to_owned(), problem };
        if self.archive_version != ARCHIVE_VERSION {
            return Err(incompatible(format!(
                "archive_version {} is not one this herald reads ({ARCHIVE_VERSION}); install a newer herald",
                self.archive_version
            )));
        }
        let reads = model::manifest::FORMAT_VERSION;
        if self.format_version != reads {
            return Err(incompatible(format!(
                "the bundle's format_version is {}, this herald {} reads {reads} (the bundle needs herald {} or later; \
                 or re-export it with this herald's exporter)",
                self.format_version,
                env!("CARGO_PKG_VERSION"),
                self.herald.min
            )));
        }
        check_name(&self.name).map_err(|e| bad(archive, format!("{INDEX_NAME}: {e}")))?;
        let mut seen = HashSet::new();
        for f in &self.files {
            if !safe_relative(&f.path) || f.path == INDEX_NAME {
                return Err(bad(archive, format!("{INDEX_NAME}: {:?} is not a path inside a bundle", f.path)));
            }
            if !seen.insert(f.path.as_str()) {
                return Err(bad(archive, format!("{INDEX_NAME}: {} is listed twice", f.path)));
            }
            if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return Err(bad(archive, format!("{INDEX_NAME}: {}: {:?} is not a SHA-256", f.path, f.sha256)));
            }
        }
        // a directory and a file under it cannot both be files
        for f in &self.files {
            let mut prefix = f.path.as_str();
            while let Some((parent, _)) = prefix.rsplit_once('/') {
                if seen.contains(parent) {
                    return Err(bad(archive, format!("{INDEX_NAME}: {parent} is a file and a folder")));
                }
                prefix = parent;
            }
        }
        if !seen.contains("bundle.toml") {
            return Err(bad(archive, format!("{INDEX_NAME}: no bundle.toml among the files: not a herald bundle")));
        }
        let total = self.files.iter().try_fold(0u64, |t, f| t.checked_add(f.size));
        if total != Some(self.bytes) {
            return Err(bad(archive, format!("{INDEX_NAME}: bytes {} is not the files' sizes summed", self.bytes)));
        }
        if fingerprint(&self.files) != self.fingerprint {
            return Err(bad(archive, format!("{INDEX_NAME}: the fingerprint does not match the files listed")));
        }
        Ok(())
    }
}

/// What [`install`] installed.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The bundle's name.
    pub name: String,
    /// Its folder, `model.bundles_dir/NAME`.
    pub dir: PathBuf,
    /// The index's `model` facts: `type size weights` (`?` for one missing).
    pub model: String,
    /// Files written.
    pub files: usize,
    /// Bytes written.
    pub bytes: u64,
    /// The index's fingerprint.
    pub fingerprint: String,
}

/// Removes the staging folder unless disarmed.
struct Staging(Option<PathBuf>);

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_dir_all(p);
        }
    }
}

/// Remove the staging folders (`.NAME.partial-PID`) of processes no longer running.
fn remove_stale(bundles_dir: &Path) {
    // without /proc no process can be told dead: leave them
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(rd) = fs::read_dir(bundles_dir) else { return };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().filter(|n| n.starts_with('.')).and_then(|n| n.rsplit_once(".partial-")).map(|(_, p)| p) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            log::info!("removing {}, left by an install that did not finish", e.path().display());
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// The next member of the archive, or `None` at its end.
fn next_member<'a, R: Read>(entries: &mut tar::Entries<'a, R>, archive: &Path) -> Result<Option<tar::Entry<'a, R>>, BundleError> {
    match entries.next() {
        None => Ok(None),
        Some(Ok(e)) => Ok(Some(e)),
        Some(Err(e)) if e.raw_os_error().is_some() => Err(BundleError::Io { path: archive.to_owned(), op: "read", source: e }),
        Some(Err(e)) => Err(bad(archive, format!("not a readable tar archive: {e}"))),
    }
}

/// Read `archive`'s index (its first member) and check it ([`Index::check`]).
///
/// # Errors
/// [`BundleError`] naming what is wrong: not a tar archive, no index first, an index over
/// [`INDEX_MAX`] or not valid JSON, or one [`Index::check`] refuses.
pub fn read_index<'a, R: Read>(entries: &mut tar::Entries<'a, R>, archive: &Path) -> Result<Index, BundleError> {
    let not_ours = |what: String| bad(archive, format!("not a herald bundle archive ({what}; tools/export/export pack writes them)"));
    let Some(mut first) = next_member(entries, archive)? else {
        return Err(not_ours("it is empty".into()));
    };
    let name = String::from_utf8_lossy(&first.path_bytes()).into_owned();
    if name != INDEX_NAME || !first.header().entry_type().is_file() {
        return Err(not_ours(format!("its first member is {name:?}, not {INDEX_NAME}")));
    }
    let size = first.size();
    if size > INDEX_MAX {
        return Err(bad(archive, format!("{INDEX_NAME} is {size} bytes, over the {INDEX_MAX}-byte limit")));
    }
    let mut text = Vec::new();
    (&mut first).take(INDEX_MAX).read_to_end(&mut text).map_err(read_err(archive, INDEX_NAME))?;
    let index: Index = serde_json::from_slice(&text).map_err(|e| bad(archive, format!("{INDEX_NAME}: {e}")))?;
    index.check(archive)?;
    Ok(index)
}

/// Install the bundle archive at `archive` into `bundles_dir` (created when missing) as
/// `bundles_dir/NAME`; `progress(done, total)` is called as bytes are written.
///
/// # Errors
/// [`BundleError::Exists`] when `NAME` is installed; [`BundleError::Archive`] /
/// [`BundleError::Incompatible`] for an archive refused (module doc); [`BundleError::Io`] for a
/// read or write that failed. Nothing is left in `bundles_dir` then.
pub fn install(archive: &Path, bundles_dir: &Path, mut progress: impl FnMut(u64, u64)) -> Result<Installed, BundleError> {
    let file = File::open(archive).map_err(io_err(archive, "open"))?;
    if file.metadata().map_err(io_err(archive, "read"))?.is_dir() {
        return Err(bad(archive, "is a folder; bundle install takes the archive that tools/export/export pack writes"));
    }
    let mut tar = tar::Archive::new(BufReader::with_capacity(1 << 20, file));
    // raw: pax and GNU long-name records come back as members of their own (and are refused:
    // herald's archives have none), never silently renaming or resizing the next member
    let mut entries = tar.entries().map_err(|e| bad(archive, format!("not a readable tar archive: {e}")))?.raw(true);
    let index = read_index(&mut entries, archive)?;
    let target = bundles_dir.join(&index.name);
    if target.symlink_metadata().is_ok() {
        return Err(BundleError::Exists { name: index.name, dir: target });
    }
    fs::create_dir_all(bundles_dir).map_err(io_err(bundles_dir, "create"))?;
    remove_stale(bundles_dir);
    if let Ok(st) = nix::sys::statvfs::statvfs(bundles_dir) {
        let free = st.blocks_available().saturating_mul(st.fragment_size());
        if free < index.bytes {
            return Err(BundleError::Io {
                path: bundles_dir.to_owned(),
                op: "install",
                source: io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!("the bundle needs {:.1} MB, {:.1} MB are free", index.bytes as f64 / 1e6, free as f64 / 1e6),
                ),
            });
        }
    }
    let staging = bundles_dir.join(format!(".{}.partial-{}", index.name, std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir(&staging).map_err(io_err(&staging, "create"))?;
    let mut guard = Staging(Some(staging.clone()));

    let mut done = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (i, want) in index.files.iter().enumerate() {
        let Some(mut member) = next_member(&mut entries, archive)? else {
            return Err(bad(
                archive,
                format!("ends after {i} of the {} files its index lists ({} is missing): cut short?", index.files.len(), want.path),
            ));
        };
        let name = String::from_utf8_lossy(&member.path_bytes()).into_owned();
        if name != want.path {
            return Err(bad(archive, format!("member {} is {name:?} where the index lists {}", i + 1, want.path)));
        }
        if !member.header().entry_type().is_file() {
            return Err(bad(archive, format!("{name} is not a regular file (a link, a folder or a device)")));
        }
        let size = member.size();
        if size != want.size {
            return Err(bad(archive, format!("{name} is {size} bytes in the archive and {} in its index", want.size)));
        }
        let path = staging.join(&want.path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io_err(parent, "create"))?;
        }
        let mut out = fs::OpenOptions::new().write(true).create_new(true).open(&path).map_err(io_err(&path, "create"))?;
        let mut hash = Sha256::new();
        let mut got = 0u64;
        loop {
            let n = member.read(&mut buf).map_err(read_err(archive, &name))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io_err(&path, "write"))?;
            got += n as u64;
            done += n as u64;
            progress(done, index.bytes);
        }
        if got != want.size {
            return Err(bad(archive, format!("{name}: {got} of its {} bytes: the archive is cut short", want.size)));
        }
        let sha = hex(&hash.finalize());
        if sha != want.sha256 {
            return Err(bad(archive, format!("{name}: its SHA-256 is {sha}, its index says {}: the archive is damaged", want.sha256)));
        }
        out.sync_all().map_err(io_err(&path, "sync"))?;
    }
    if let Some(extra) = next_member(&mut entries, archive)? {
        let name = String::from_utf8_lossy(&extra.path_bytes()).into_owned();
        return Err(bad(archive, format!("holds {name:?} after the files its index lists")));
    }
    // after the end-of-archive blocks only the zeros that pad the last record (tar readers skip
    // whatever follows: nothing may hide there)
    let mut rest = tar.into_inner();
    loop {
        let n = rest.read(&mut buf).map_err(io_err(archive, "read"))?;
        if n == 0 {
            break;
        }
        if buf[..n].iter().any(|&b| b != 0) {
            return Err(bad(archive, "holds data after the end of the archive"));
        }
    }
    // the bundle itself: a manifest this herald reads, naming only files the archive held
    let manifest_path = staging.join("bundle.toml");
    let text = fs::read_to_string(&manifest_path).map_err(io_err(&manifest_path, "read"))?;
    let manifest = model::manifest::Manifest::parse(&text, Path::new("bundle.toml"))
        .map_err(|e| bad(archive, format!("its bundle is not one this herald loads: {e}")))?;
    let listed: HashSet<&str> = index.files.iter().map(|f| f.path.as_str()).collect();
    if let Some(missing) = manifest.files().into_iter().find(|f| !listed.contains(f)) {
        return Err(bad(archive, format!("bundle.toml names {missing}, which the archive does not hold")));
    }
    // the hashes bundle.toml records (what `model.verify` checks at load) agree with the index's
    let hashes: BTreeMap<&str, &str> = index.files.iter().map(|f| (f.path.as_str(), f.sha256.as_str())).collect();
    let mut recorded = vec![(manifest.tokenizer.file.as_str(), manifest.tokenizer.sha256.as_str())];
    recorded.extend(manifest.graphs.values().map(|g| (g.file.as_str(), g.sha256.as_str())));
    if let Some(q) = &manifest.qnn {
        recorded.extend(q.binaries.iter().map(|b| (b.file.as_str(), b.sha256.as_str())));
    }
    if let Some((file, _)) = recorded.iter().find(|(f, h)| hashes.get(f).is_some_and(|got| !got.eq_ignore_ascii_case(h))) {
        return Err(bad(archive, format!("{file}: its SHA-256 is not the one bundle.toml records: the bundle was altered")));
    }
    sync_dirs(&staging)?;
    // NOREPLACE: an install of the same name that finished meanwhile is not overwritten (a
    // file system without it, EINVAL: checked just before a plain rename instead)
    let exists = || BundleError::Exists { name: index.name.clone(), dir: target.clone() };
    let into_place = |e: io::Error| BundleError::Io { path: target.clone(), op: "rename into place", source: e };
    match nix::fcntl::renameat2(None, &staging, None, &target, nix::fcntl::RenameFlags::RENAME_NOREPLACE) {
        Ok(()) => {}
        Err(nix::errno::Errno::EEXIST | nix::errno::Errno::ENOTEMPTY) => return Err(exists()),
        Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS) => {
            // rename(2) would replace an empty folder of that name: checked just before
            if target.symlink_metadata().is_ok() {
                return Err(exists());
            }
            let taken = [nix::errno::Errno::EEXIST, nix::errno::Errno::ENOTEMPTY].map(|e| e as i32);
            fs::rename(&staging, &target)
                .map_err(|e| if e.raw_os_error().is_some_and(|c| taken.contains(&c)) { exists() } else { into_place(e) })?;
        }
        Err(e) => return Err(into_place(io::Error::from(e))),
    }
    guard.0 = None;
    // installed: a failed sync of the folder's entry now is a warning, not a failed install
    if let Err(e) = File::open(bundles_dir).and_then(|d| d.sync_all()) {
        log::warn!("{}: cannot sync: {e} (the bundle is installed)", bundles_dir.display());
    }
    let fact = |k: &str| index.model.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_owned();
    let model = format!("{} {} {}", fact("type"), fact("size"), fact("weights"));
    Ok(Installed {
        name: index.name,
        dir: target,
        model,
        files: index.files.len(),
        bytes: index.bytes,
        fingerprint: index.fingerprint,
    })
}

/// Sync `dir` and every folder under it (their entries: the files' names).
fn sync_dirs(dir: &Path) -> Result<(), BundleError> {
    for e in fs::read_dir(dir).map_err(io_err(dir, "read"))?.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            sync_dirs(&e.path())?;
        }
    }
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir, "sync"))
}

/// One installed bundle, as [`list`] finds it.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Its folder name.
    pub name: String,
    /// Its folder.
    pub dir: PathBuf,
    /// `bundle.toml`'s `[model]` `type`, `size` and `weights` (`?` where missing or unreadable).
    pub model: String,
    /// The files' sizes summed, bytes.
    pub bytes: u64,
}

/// The bundles in `bundles_dir`: each folder (or link to one) holding a `bundle.toml`, by name;
/// hidden entries (staging folders) and the [`DEFAULT_LINK`] link are skipped. A missing `bundles_dir` has none.
///
/// # Errors
/// [`BundleError::Io`] when `bundles_dir` exists but cannot be read.
pub fn list(bundles_dir: &Path) -> Result<Vec<Listed>, BundleError> {
    let rd = match fs::read_dir(bundles_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(BundleError::Io { path: bundles_dir.to_owned(), op: "read", source: e }),
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_owned) else { continue };
        let dir = e.path();
        let is_link = e.file_type().is_ok_and(|t| t.is_symlink());
        if name.starts_with('.') || (name == DEFAULT_LINK && is_link) || !dir.join("bundle.toml").is_file() {
            continue;
        }
        let model = fs::read_to_string(dir.join("bundle.toml"))
            .ok()
            .and_then(|t| t.parse::<toml::Table>().ok())
            .and_then(|t| t.get("model").and_then(|m| m.as_table()).cloned())
            .map_or_else(
                || "?".to_owned(),
                |m| {
                    let get = |k: &str| m.get(k).and_then(|v| v.as_str()).unwrap_or("?").to_owned();
                    format!("{} {} {}", get("type"), get("size"), get("weights"))
                },
            );
        out.push(Listed { bytes: dir_bytes(&dir), name, dir, model });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir).map_or(0, |rd| {
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                _ => 0,
            })
            .sum()
    })
}

/// The name of the link in `model.bundles_dir` that [`use_bundle`] points at a bundle: the last
/// component of the default `model.bundle` (`/usr/share/herald/bundles/default`).
pub const DEFAULT_LINK: &str = "default";

/// Point `bundles_dir/default` (the default `model.bundle`) at the installed bundle `name`: a
/// relative symbolic link, replaced in one rename (a reader sees the old bundle or the new one).
/// A running `herald serve` keeps the bundle it loaded until it is restarted.
///
/// # Errors
/// [`BundleError::BadName`] (also for `default` itself), [`BundleError::Missing`],
/// [`BundleError::NotALink`] when `default` is a real folder, [`BundleError::Io`].
pub fn use_bundle(bundles_dir: &Path, name: &str) -> Result<PathBuf, BundleError> {
    check_name(name)?;
    if name == DEFAULT_LINK {
        return Err(BundleError::BadName { name: name.to_owned(), why: "it is the link `herald bundle use` sets" });
    }
    let dir = bundles_dir.join(name);
    if !dir.join("bundle.toml").is_file() {
        return Err(BundleError::Missing { name: name.to_owned(), dir: bundles_dir.to_owned() });
    }
    let link = bundles_dir.join(DEFAULT_LINK);
    if link.symlink_metadata().is_ok_and(|m| !m.file_type().is_symlink()) {
        return Err(BundleError::NotALink { path: link });
    }
    let tmp = bundles_dir.join(format!(".{DEFAULT_LINK}.link-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(name, &tmp).map_err(io_err(&tmp, "create"))?;
    if let Err(e) = fs::rename(&tmp, &link) {
        let _ = fs::remove_file(&tmp);
        return Err(BundleError::Io { path: link, op: "replace", source: e });
    }
    if let Err(e) = File::open(bundles_dir).and_then(|d| d.sync_all()) {
        log::warn!("{}: cannot sync: {e}", bundles_dir.display());
    }
    Ok(dir)
}

/// Remove the installed bundle `name` from `bundles_dir`; refused for the bundle `configured`
/// (`model.bundle`) resolves to.
///
/// # Errors
/// [`BundleError::BadName`], [`BundleError::Missing`] (no such bundle), [`BundleError::InUse`],
/// [`BundleError::Io`] when it cannot be removed.
pub fn remove(bundles_dir: &Path, name: &str, configured: &Path) -> Result<PathBuf, BundleError> {
    check_name(name)?;
    let dir = bundles_dir.join(name);
    if !dir.join("bundle.toml").is_file() {
        return Err(BundleError::Missing { name: name.to_owned(), dir: bundles_dir.to_owned() });
    }
    let same = |a: &Path, b: &Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y);
    if same(&dir, configured) {
        return Err(BundleError::InUse { name: name.to_owned(), path: configured.to_owned() });
    }
    // out of sight first (one rename), then deleted: a kill midway leaves a hidden folder, not
    // a half bundle under its name; the next install clears it
    let doomed = bundles_dir.join(format!(".{name}.partial-{}", std::process::id()));
    if dir.symlink_metadata().is_ok_and(|m| m.file_type().is_symlink()) {
        fs::remove_file(&dir).map_err(io_err(&dir, "remove"))?;
        return Ok(dir);
    }
    fs::rename(&dir, &doomed).map_err(io_err(&dir, "remove"))?;
    fs::remove_dir_all(&doomed).map_err(io_err(&doomed, "remove"))?;
    Ok(dir)
}
