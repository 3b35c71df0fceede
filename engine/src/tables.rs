//! Host-side embedding tables (`tables.safetensors`), memory-mapped.
//!
//! The file holds `text_embedding` [text vocab, H] (already text-projected), `codec_embedding`
//! [codec vocab, H] and `cp_embedding` [15, 2048, H] in float32 or float16 (docs/bundle.md,
//! "Tables"). Nothing is copied at open: a lookup widens one row to float32 and adds it into
//! the caller's buffer, so only the rows a prompt touches become resident.

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
        let (header_len, meta) =
            safetensors::SafeTensors::read_metadata(&map).map_err(|e| invalid(format!("not a safetensors file: {e}")))?;
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
        Ok(Tables { map, storage, hidden, text, codec, cp, cp_codes })
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
