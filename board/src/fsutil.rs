//! Atomic file replacement: one way, used for every file herald keeps.
//!
//! A file is written under a temporary name in its own directory (`tempfile`'s
//! [`NamedTempFile`]: a fresh name, created exclusively), fsynced, renamed over the target
//! ([`NamedTempFile::persist`]) and the directory fsynced, so a crash or power cut leaves
//! either the old file or the new one, never a torn one, and the rename itself is durable.
//! A failure before the rename removes the temporary file; the target is untouched.
//!
//! The new file gets the mode a plain `File::create` would give it (0o666 less the umask),
//! not `tempfile`'s private 0o600.
//!
//! A process killed outright (SIGKILL, a power cut) cannot remove its temporary file. The name
//! carries the writer's process id (`.<name>.<pid>-<random>.tmp`), and the next [`AtomicFile`]
//! for the same target removes every such file whose writer is gone, so no partial file stays
//! behind for long; the target itself is never partial.

use std::ffi::OsString;
use std::fs::{File, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

/// Replace `path` with `bytes` atomically (see the [module](self) docs). The directory must
/// exist.
///
/// # Errors
/// The I/O error of the step that failed (create, write, fsync, rename, directory fsync).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = AtomicFile::create(path)?;
    file.file_mut().write_all(bytes)?;
    file.commit()
}

/// A file being written that replaces its target only on [`commit`](Self::commit); dropped
/// without a commit, it is removed and the target is left as it was.
///
/// For writers that stream (a WAV file written chunk by chunk): write through
/// [`file_mut`](Self::file_mut), or open [`path`](Self::path) yourself (fsync at the commit
/// covers writes through any handle of the file).
///
/// A target that exists and is not a regular file (`/dev/null`, a FIFO, a terminal) cannot be
/// replaced by a rename, and is not a file worth keeping: it is written directly.
#[derive(Debug)]
pub struct AtomicFile {
    inner: Inner,
    target: PathBuf,
}

#[derive(Debug)]
enum Inner {
    /// The temporary file, renamed over the target at the commit.
    Temp(NamedTempFile),
    /// The target itself (not a regular file), opened for writing.
    Direct(File),
}

impl AtomicFile {
    /// Create the temporary file for `target`, named `.<name>.<pid>-<random>.tmp` in `target`'s
    /// directory (which must exist), after removing the temporary files of earlier writers of
    /// `target` that are no longer running ([`remove_stale`]); or open `target` itself when it
    /// exists and is not a regular file.
    ///
    /// # Errors
    /// `InvalidInput` when `target` has no file name, `IsADirectory` when it is a directory; the
    /// error of creating or opening the file.
    pub fn create(target: &Path) -> io::Result<Self> {
        // through a symbolic link: the file it points to is the one replaced (a dangling link
        // gets the file it names), the link stays
        let resolved = follow_links(target)?;
        let target = resolved.as_path();
        let existing = std::fs::metadata(target).ok();
        match &existing {
            Some(m) if m.is_dir() => {
                return Err(io::Error::new(io::ErrorKind::IsADirectory, format!("{}: is a directory", target.display())));
            }
            Some(m) if !m.is_file() => {
                let file = std::fs::OpenOptions::new().write(true).truncate(true).open(target)?;
                return Ok(Self { inner: Inner::Direct(file), target: target.to_owned() });
            }
            _ => {}
        }
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{}: no file name", target.display())))?;
        // named here, so the error speaks of the folder the caller gave, not of a temporary file
        let dir = parent_dir(target);
        if !dir.is_dir() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{}: no such directory", dir.display())));
        }
        let mut prefix = OsString::from(".");
        prefix.push(name);
        prefix.push(".");
        remove_stale(dir, &prefix);
        prefix.push(format!("{}-", std::process::id()));
        // a file replaced keeps its mode; a new one gets that of a plain File::create
        let mode = existing.filter(|m| m.is_file()).map_or(0o666, |m| m.permissions().mode() & 0o7777);
        let temp = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".tmp")
            .permissions(Permissions::from_mode(mode))
            .tempfile_in(dir)
            .map_err(without_temp_path)?;
        Ok(Self { inner: Inner::Temp(temp), target: target.to_owned() })
    }

    /// The path being written: the temporary file (it becomes the target's at the commit), or
    /// the target itself when it is written directly.
    pub fn path(&self) -> &Path {
        match &self.inner {
            Inner::Temp(t) => t.path(),
            Inner::Direct(_) => &self.target,
        }
    }

    /// The file that replaces the target.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The open file, to write to.
    pub fn file_mut(&mut self) -> &mut File {
        match &mut self.inner {
            Inner::Temp(t) => t.as_file_mut(),
            Inner::Direct(f) => f,
        }
    }

    /// Flush the data to disk, rename the file over the target and make the rename durable (for
    /// a target written directly: nothing more to do).
    ///
    /// # Errors
    /// The error of the fsync, the rename or the directory's fsync. After a failed fsync or
    /// rename the temporary file is removed; a failed directory fsync comes after the rename.
    pub fn commit(self) -> io::Result<()> {
        match self.inner {
            Inner::Temp(temp) => {
                temp.as_file().sync_all()?;
                temp.persist(&self.target).map_err(|e| e.error)?;
                sync_dir(parent_dir(&self.target))
            }
            Inner::Direct(_) => Ok(()),
        }
    }
}

/// Remove the files `<prefix><pid>-<anything>.tmp` in `dir` whose process `pid` is not running
/// (no `/proc/<pid>`): temporary files of writers that were killed before they could commit or
/// clean up. Failures are ignored (logged at debug): they cost a leftover file, never the write.
pub fn remove_stale(dir: &Path, prefix: &std::ffi::OsStr) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let prefix = prefix.to_string_lossy();
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name.strip_prefix(prefix.as_ref()).filter(|_| name.ends_with(".tmp")) else { continue };
        let Some(pid) = rest.split_once('-').and_then(|(p, _)| p.parse::<u32>().ok()) else { continue };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => log::info!("removed {}, left by a writer (process {pid}) that did not finish", e.path().display()),
            Err(err) => log::debug!("cannot remove {}: {err}", e.path().display()),
        }
    }
}

/// Remove the temporary files this process is writing for `target` (`.<name>.<own pid>-*.tmp`
/// in its directory, symbolic links followed as [`AtomicFile::create`] does) and return their
/// paths: for a process about to exit at once, without the drop that would remove them
/// (`herald speak --out` on a second SIGINT). Files it cannot remove are left out of the list.
pub fn remove_own_temps(target: &Path) -> Vec<PathBuf> {
    let Ok(resolved) = follow_links(target) else { return Vec::new() };
    let Some(name) = resolved.file_name() else { return Vec::new() };
    let mut prefix = OsString::from(".");
    prefix.push(name);
    prefix.push(format!(".{}-", std::process::id()));
    let prefix = prefix.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir(parent_dir(&resolved)) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with(&prefix) && n.ends_with(".tmp")
        })
        .filter_map(|e| std::fs::remove_file(e.path()).ok().map(|()| e.path()))
        .collect()
}

/// fsync a directory, so that a rename or a creation in it survives a power cut.
///
/// # Errors
/// The error of opening or syncing it.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// `e` without the temporary file's path that `tempfile` appends (`… at path "/x/.out.wav.…tmp"`):
/// the caller names the target, and the user asked for `out.wav`.
fn without_temp_path(e: io::Error) -> io::Error {
    let text = e.to_string();
    match text.find(" at path ") {
        Some(i) => io::Error::new(e.kind(), text[..i].to_owned()),
        None => e,
    }
}

/// `path` with symbolic links followed (at most 40, as the kernel does): the file a write
/// through the link would change; for a dangling link, the path it names.
fn follow_links(path: &Path) -> io::Result<PathBuf> {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let link = std::fs::read_link(&p)?;
                p = if link.is_absolute() { link } else { parent_dir(&p).join(link) };
            }
            _ => return Ok(p),
        }
    }
    Err(io::Error::other(format!("{}: too many levels of symbolic links", path.display())))
}

/// The directory of `path`; `.` for a bare file name.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("herald-fsutil-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }

    #[test]
    fn own_temporaries_are_removed_and_named_others_left() {
        let dir = scratch("own");
        let target = dir.join("out.wav");
        let file = AtomicFile::create(&target).unwrap();
        let temp = file.path().to_path_buf();
        // another writer's temporary file, and a file that merely looks alike
        let other = dir.join(".out.wav.1-abc.tmp");
        fs::write(&other, b"x").unwrap();
        fs::write(dir.join("out.wav.tmp"), b"x").unwrap();
        assert_eq!(remove_own_temps(&target), vec![temp.clone()]);
        assert!(!temp.exists() && other.exists() && !target.exists());
        assert!(remove_own_temps(&target).is_empty());
        drop(file);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_replaces_and_leaves_no_temporary_file() {
        let dir = scratch("write");
        let path = dir.join("a.json");
        write_atomic(&path, b"one").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"one");
        write_atomic(&path, b"two, longer").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two, longer");
        assert_eq!(names(&dir), ["a.json"]);
        // the mode of a plain File::create, not 0o600
        fs::write(dir.join("plain"), b"").unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), mode(&dir.join("plain")));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_link_is_written_through_and_a_replaced_file_keeps_its_mode() {
        let dir = scratch("links");
        let real = dir.join("real.wav");
        fs::write(&real, b"old").unwrap();
        fs::set_permissions(&real, Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink("real.wav", dir.join("link.wav")).unwrap();
        write_atomic(&dir.join("link.wav"), b"new").unwrap();
        assert!(fs::symlink_metadata(dir.join("link.wav")).unwrap().file_type().is_symlink(), "the link stays");
        assert_eq!(fs::read(&real).unwrap(), b"new");
        assert_eq!(fs::metadata(&real).unwrap().permissions().mode() & 0o7777, 0o640);
        // a dangling link: the file it names is created
        std::os::unix::fs::symlink("sub/made.wav", dir.join("dangling.wav")).unwrap();
        fs::create_dir(dir.join("sub")).unwrap();
        write_atomic(&dir.join("dangling.wav"), b"made").unwrap();
        assert_eq!(fs::read(dir.join("sub/made.wav")).unwrap(), b"made");
        assert_eq!(names(&dir), ["dangling.wav", "link.wav", "real.wav", "sub"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_uncommitted_file_is_removed_and_the_target_kept() {
        let dir = scratch("drop");
        let path = dir.join("out.wav");
        fs::write(&path, b"old").unwrap();
        let mut f = AtomicFile::create(&path).unwrap();
        f.file_mut().write_all(b"half").unwrap();
        let temp = f.path().to_owned();
        assert_eq!(temp.parent(), Some(dir.as_path()));
        assert!(temp.file_name().unwrap().to_string_lossy().starts_with(".out.wav."));
        assert_eq!(f.target(), path);
        drop(f);
        assert!(!temp.exists());
        assert_eq!(names(&dir), ["out.wav"]);
        assert_eq!(fs::read(&path).unwrap(), b"old");
        // written by path through another handle, then committed
        let f = AtomicFile::create(&path).unwrap();
        fs::write(f.path(), b"new").unwrap();
        f.commit().unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(names(&dir), ["out.wav"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn temporary_files_of_writers_that_are_gone_are_removed() {
        let dir = scratch("stale");
        let path = dir.join("out.wav");
        // pid 4194305 is above the kernel's pid_max: never running; this process is
        let dead = dir.join(".out.wav.4194305-abc123.tmp");
        let alive = dir.join(format!(".out.wav.{}-def456.tmp", std::process::id()));
        let other = dir.join(".other.wav.4194305-abc123.tmp");
        for p in [&dead, &alive, &other] {
            fs::write(p, b"partial").unwrap();
        }
        let f = AtomicFile::create(&path).unwrap();
        let own = f.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(own.starts_with(&format!(".out.wav.{}-", std::process::id())) && own.ends_with(".tmp"), "{own}");
        assert!(!dead.exists(), "a dead writer's file is removed");
        assert!(alive.exists() && other.exists(), "a live writer's file and other targets' files stay");
        f.commit().unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failures_name_nothing_new_on_disk() {
        let dir = scratch("fail");
        let e = write_atomic(&dir.join("missing/x.json"), b"x").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        // a directory in the way: the rename fails and the temporary file goes
        fs::create_dir(dir.join("taken")).unwrap();
        assert!(write_atomic(&dir.join("taken"), b"x").is_err());
        assert_eq!(names(&dir), ["taken"]);
        assert_eq!(AtomicFile::create(Path::new("/")).unwrap_err().kind(), io::ErrorKind::IsADirectory);
        assert_eq!(AtomicFile::create(Path::new("")).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        // not a regular file: written in place, never renamed over
        write_atomic(Path::new("/dev/null"), b"x").unwrap();
        assert!(Path::new("/dev/null").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
