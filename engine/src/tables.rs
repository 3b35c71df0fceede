//! Host-side embedding tables (`tables.safetensors`), memory-mapped.
//!
//! The file holds `text_embedding` [text vocab, H] (already text-projected), `codec_embedding`
//! [codec vocab, H] and `cp_embedding` [15, 2048, H] in float32 or float16 (docs/bundle.md,
//! "Tables"). Nothing is copied at open: a lookup widens one row to float32 and adds it into
//! the caller's buffer, so only the rows a prompt touches become resident.
//!
//! A mapped file that is truncated while it is mapped (a bundle rewritten in place under a
//! running herald) makes the next read of a page past its new end raise SIGBUS, which would
//! kill the process without a word. [`exit_on_truncation`] lets a program turn that into one
//! line naming the file and an exit code of its choice; every open [`Tables`] registers its
//! mapping for it.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use model::manifest::{Manifest, TableRef};

/// Why the tables cannot be used; names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum TablesError {
    /// The file could not be opened or mapped.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The table file.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file or disagrees with the manifest.
    #[error("{path}: {message}")]
    Invalid {
        /// The table file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Storage type of the tables (the bundle dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Storage {
    F32,
    F16,
}

#[derive(Debug, Clone, Copy)]
struct Table {
    /// Byte offset of the first element in the mapped file.
    offset: usize,
    /// Number of rows (for cp_embedding: 15 x 2048 rows, table-major).
    rows: usize,
}

/// The three embedding tables of a bundle, memory-mapped.
#[derive(Debug)]
pub struct Tables {
    map: Mmap,
    storage: Storage,
    hidden: usize,
    text: Table,
    codec: Table,
    cp: Table,
    cp_codes: usize,
    /// The mapping's entry in the SIGBUS registry, removed on drop.
    _guard: truncation::Registered,
}

/// Which embedding a lookup reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embedding {
    /// T(id): projected text embedding of a text token id.
    Text(u32),
    /// C(id): the talker's codec embedding of a codec id (0..3071).
    Codec(u32),
    /// E_{k+1}(code): the code predictor's input embedding of codebook `k + 1`, k in 0..15.
    Residual {
        /// Table index k (codebook k + 1).
        table: usize,
        /// Code 0..2047.
        code: u32,
    },
}

/// An id outside its table.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("embedding {which:?} is outside its table")]
pub struct OutOfRange {
    /// The lookup that failed.
    pub which: Embedding,
}

impl Tables {
    /// Map `dir/<tables.file>` and check it against the manifest's names, shapes and dtype.
    ///
    /// # Errors
    /// [`TablesError::Io`] when the file cannot be mapped, [`TablesError::Invalid`] when the
    /// header is malformed, a tensor is missing, or a shape or dtype differs from the manifest.
    pub fn open(dir: &Path, m: &Manifest) -> Result<Self, TablesError> {
        let path = dir.join(&m.tables.file);
        let file = File::open(&path).map_err(|source| TablesError::Io { path: path.clone(), source })?;
        // SAFETY: the bundle is read-only for herald's lifetime; a concurrent writer would be an
        // operator error (re-exports rename a new directory into place rather than rewrite).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| TablesError::Io { path: path.clone(), source })?;
        let invalid = |message: String| TablesError::Invalid { path: path.clone(), message };
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| match e {
            safetensors::SafeTensorError::MetadataIncompleteBuffer => invalid(format!(
                "{} bytes, fewer than its header describes: the file is truncated (a copy that stopped part-way?)",
                map.len()
            )),
            e => invalid(format!("not a safetensors file: {e}")),
        })?;
        let data_start = 8 + header_len;
        let storage = match m.tables.dtype.as_str() {
            "float32" => Storage::F32,
            "float16" => Storage::F16,
            other => return Err(invalid(format!("tables.dtype {other:?} is not float32 or float16"))),
        };
        let want_dtype = match storage {
            Storage::F32 => safetensors::Dtype::F32,
            Storage::F16 => safetensors::Dtype::F16,
        };
        let find = |r: &TableRef| -> Result<Table, TablesError> {
            let info = meta.info(&r.name).ok_or_else(|| invalid(format!("tensor {:?} is missing", r.name)))?;
            let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
            if shape != r.shape {
                return Err(invalid(format!("tensor {:?} has shape {:?}, bundle.toml says {:?}", r.name, shape, r.shape)));
            }
            if info.dtype != want_dtype {
                return Err(invalid(format!("tensor {:?} is {:?}, bundle.toml says {}", r.name, info.dtype, m.tables.dtype)));
            }
            let rows = info.shape[..info.shape.len() - 1].iter().product();
            Ok(Table { offset: data_start + info.data_offsets.0, rows })
        };
        let text = find(&m.tables.text_embedding)?;
        let codec = find(&m.tables.codec_embedding)?;
        let cp = find(&m.tables.cp_embedding)?;
        let hidden = m.talker.hidden as usize;
        let cp_codes = m.audio.codebook_size as usize;
        let elem = if storage == Storage::F32 { 4 } else { 2 };
        for t in [text, codec, cp] {
            if t.offset + t.rows * hidden * elem > map.len() {
                return Err(invalid("a table extends past the end of the file (truncated?)".into()));
            }
        }
        let guard = truncation::register(&map, &path);
        Ok(Tables { map, storage, hidden, text, codec, cp, cp_codes, _guard: guard })
    }

    /// Length of the mapped file, bytes.
    pub fn mapped_bytes(&self) -> usize {
        self.map.len()
    }

    /// Hidden size H of every row.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// `out[i] += row[i]` for the row `which` (widened to float32).
    ///
    /// `out` must have length H; a different length or an id outside the table is an error and
    /// leaves `out` untouched.
    ///
    /// # Errors
    /// [`OutOfRange`] for an id outside its table or a wrong `out` length.
    pub fn add(&self, which: Embedding, out: &mut [f32]) -> Result<(), OutOfRange> {
        let (table, row) = match which {
            Embedding::Text(id) => (self.text, id as usize),
            Embedding::Codec(id) => (self.codec, id as usize),
            Embedding::Residual { table, code } => {
                if code as usize >= self.cp_codes {
                    return Err(OutOfRange { which });
                }
                (self.cp, table * self.cp_codes + code as usize)
            }
        };
        if row >= table.rows || out.len() != self.hidden {
            return Err(OutOfRange { which });
        }
        let h = self.hidden;
        match self.storage {
            Storage::F32 => {
                let start = table.offset + row * h * 4;
                let bytes = &self.map[start..start + h * 4];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Storage::F16 => {
                let start = table.offset + row * h * 2;
                let bytes = &self.map[start..start + h * 2];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o += half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
        Ok(())
    }
}

/// After this call, a SIGBUS raised by reading a [`Tables`] mapping whose file was truncated
/// under it ends the process with `code` and one line on standard error naming the file
/// (`error: <path>: the file was cut short while herald had it mapped …`), instead of the
/// signal's default (killed, core dumped, no message). A SIGBUS at any other address goes to
/// the handler that was there before (the Rust runtime's, or the default). Meant for the
/// binary's `main`, once; later calls only change the code.
///
/// # Errors
/// The OS error when the handler cannot be installed (the process then keeps the default).
pub fn exit_on_truncation(code: i32) -> std::io::Result<()> {
    truncation::install(code)
}

/// The SIGBUS registry behind [`exit_on_truncation`]: a fixed table of mapped ranges with their
/// messages, read by the signal handler without locks or allocation.
mod truncation {
    use std::path::Path;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicUsize, Ordering};

    use memmap2::Mmap;

    /// Mappings watched at once; more are simply not watched (a process maps one bundle's
    /// tables, tests a few).
    const SLOTS: usize = 32;

    struct Slot {
        start: AtomicUsize,
        /// 0: free.
        len: AtomicUsize,
        msg: AtomicPtr<u8>,
        msg_len: AtomicUsize,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const FREE: Slot = Slot {
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        msg: AtomicPtr::new(std::ptr::null_mut()),
        msg_len: AtomicUsize::new(0),
    };
    static TABLE: [Slot; SLOTS] = [FREE; SLOTS];
    /// Serialises registration (the handler only reads).
    static WRITERS: Mutex<()> = Mutex::new(());
    /// The exit code; -1 until [`install`].
    static CODE: AtomicI32 = AtomicI32::new(-1);
    /// Whether the handler is installed (serialises [`install`]).
    static INSTALLED: Mutex<bool> = Mutex::new(false);
    /// The disposition before ours (handler and flags), to pass other SIGBUSes on to.
    static PREVIOUS_ACTION: AtomicUsize = AtomicUsize::new(0);
    static PREVIOUS_FLAGS: AtomicI32 = AtomicI32::new(0);

    /// A registered mapping; its slot is freed on drop.
    #[derive(Debug)]
    pub(super) struct Registered(Option<usize>);

    impl Drop for Registered {
        fn drop(&mut self) {
            if let Some(i) = self.0 {
                let _w = WRITERS.lock().unwrap_or_else(|e| e.into_inner());
                TABLE[i].len.store(0, Ordering::Release);
                // the message stays allocated (a few hundred bytes): a handler running on another
                // thread may still hold its pointer
            }
        }
    }

    /// Watch `map` (the mapping of `path`).
    pub(super) fn register(map: &Mmap, path: &Path) -> Registered {
        if map.is_empty() {
            return Registered(None);
        }
        let _w = WRITERS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = TABLE.iter().position(|s| s.len.load(Ordering::Acquire) == 0) else {
            log::debug!("{}: not watched for truncation ({SLOTS} mappings already are)", path.display());
            return Registered(None);
        };
        let text = format!(
            "error: {}: the file was cut short while herald had it mapped (a bundle rewritten in place?); \
             install a new bundle under another name and rename it into place, then restart herald\n",
            path.display()
        );
        let msg: &'static mut [u8] = Box::leak(text.into_bytes().into_boxed_slice());
        let slot = &TABLE[i];
        slot.msg_len.store(msg.len(), Ordering::Relaxed);
        slot.msg.store(msg.as_mut_ptr(), Ordering::Relaxed);
        slot.start.store(map.as_ptr() as usize, Ordering::Relaxed);
        slot.len.store(map.len(), Ordering::Release);
        Registered(Some(i))
    }

    pub(super) fn install(code: i32) -> std::io::Result<()> {
        let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
        CODE.store(code, Ordering::Release);
        if *installed {
            return Ok(());
        }
        // SAFETY: a zeroed sigaction is a valid empty one; sigemptyset and sigaction get valid
        // pointers to locals; the handler is async-signal-safe (atomics, write(2), _exit(2)).
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            ours.sa_sigaction = on_sigbus as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
            ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut ours.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &ours, &mut old) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            PREVIOUS_ACTION.store(old.sa_sigaction, Ordering::Release);
            PREVIOUS_FLAGS.store(old.sa_flags, Ordering::Release);
        }
        *installed = true;
        Ok(())
    }

    extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
        let addr = unsafe { (*info).si_addr() } as usize;
        for slot in &TABLE {
            let len = slot.len.load(Ordering::Acquire);
            let start = slot.start.load(Ordering::Relaxed);
            if len != 0 && addr >= start && addr - start < len {
                let msg = slot.msg.load(Ordering::Relaxed);
                let n = slot.msg_len.load(Ordering::Relaxed);
                // SAFETY: msg points to n leaked bytes; write(2) and _exit(2) are
                // async-signal-safe.
                unsafe {
                    libc::write(2, msg.cast(), n);
                    libc::_exit(CODE.load(Ordering::Acquire));
                }
            }
        }
        // not one of ours: what was there before
        let action = PREVIOUS_ACTION.load(Ordering::Acquire);
        let flags = PREVIOUS_FLAGS.load(Ordering::Acquire);
        if action != libc::SIG_DFL && action != libc::SIG_IGN && flags & libc::SA_SIGINFO != 0 {
            // SAFETY: the previous handler was installed with SA_SIGINFO, so this is its type.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(action) };
            f(sig, info, ctx);
            return;
        }
        if action != libc::SIG_DFL && action != libc::SIG_IGN {
            // SAFETY: a plain handler installed without SA_SIGINFO.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(action) };
            f(sig);
            return;
        }
        // the default (an ignored SIGBUS from a fault is the default too): restore it and
        // return, so the faulting access repeats and kills the process as it would have
        // without us
        // SAFETY: a zeroed sigaction with SIG_DFL is valid.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        }
    }
}
