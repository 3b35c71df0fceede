//! The QNN C API as herald uses it, opened with `dlopen` at run time.
//!
//! Written from Qualcomm's public documentation (docs.qualcomm.com 80-63442-10 "API overview",
//! "Supported APIs", "Error codes"; 80-63442-50 "API version history") and the layouts measured
//! on QAIRT 2.51 (core API 2.40, HTP backend API 5.51, system API 1.15), recorded in
//! shared/reference/qnn.md §3. No Qualcomm header is used or copied: every struct below is a
//! byte layout with named offsets, read through bounds-checked helpers, so that a library whose
//! layout differs fails with a message instead of reading garbage.
//!
//! The two libraries:
//! - `libQnnSystem.so`: `QnnSystemInterface_getProviders` → a table whose functions create a
//!   system context and describe a context binary (graph names, each input's and output's
//!   name, shape, data type and quantization) without loading it.
//! - `libQnnHtp.so`: `QnnInterface_getProviders` → the HTP provider: backend, device, context
//!   from a binary, graph retrieval and execution, error messages.

use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::ptr;

use libloading::Library;

use crate::error::QnnError;

/// QNN's error handle: the code is the low 16 bits, 0 = success.
pub type ErrorHandle = u64;

/// Library file names, as the QNN SDK and onnxruntime-qnn ship them.
pub const SYSTEM_LIB: &str = "libQnnSystem.so";
/// The HTP backend library (on x86_64 it simulates the NPU; on a board it talks to the DSP).
pub const HTP_LIB: &str = "libQnnHtp.so";

/// The core API major this backend is written for (qnn.md §3: the provider whose core API
/// major is 2 is picked, as onnxruntime does).
pub const CORE_API_MAJOR: u32 = 2;
/// The oldest core API minor whose function table herald has verified (2.40, QAIRT 2.51:
/// qnn.md §3). Older tables may be shorter or ordered otherwise (some lacked `backendSetConfig`
/// at slot 2), and reading past one's end is undefined, so they are refused with the version.
pub const CORE_API_MIN_MINOR: u32 = 40;
/// The system API major this backend is written for.
pub const SYSTEM_API_MAJOR: u32 = 1;

/// A `{major, minor, patch}` version triple (`Qnn_Version_t`, 12 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Version {
    /// Incompatible changes.
    pub major: u32,
    /// Compatible additions.
    pub minor: u32,
    /// Fixes.
    pub patch: u32,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Read a `T` at `base + offset`.
///
/// # Safety
/// `base + offset` must point to readable memory holding a `T` (any alignment).
unsafe fn read<T: Copy>(base: *const u8, offset: usize) -> T {
    // SAFETY: the caller guarantees the bytes are readable; unaligned reads are allowed.
    unsafe { ptr::read_unaligned(base.add(offset).cast::<T>()) }
}

/// # Safety
/// `base + offset` must hold a `Qnn_Version_t`.
unsafe fn read_version(base: *const u8, offset: usize) -> Version {
    // SAFETY: forwarded.
    unsafe { Version { major: read(base, offset), minor: read(base, offset + 4), patch: read(base, offset + 8) } }
}

/// A NUL-terminated string owned by the library, copied; `None` for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
unsafe fn string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's guarantee.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `Qnn_DataType_t` values herald meets (docs "QnnTypes": the high byte is the family, the low
/// byte the bit width; FLOAT_16/32 and INT_64 seen in real binaries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    /// IEEE half precision (0x0216).
    F16,
    /// IEEE single precision (0x0232).
    F32,
    /// bfloat16 (0x0226).
    Bf16,
    /// Signed 32-bit integer (0x0032).
    I32,
    /// Signed 64-bit integer (0x0064).
    I64,
    /// Unsigned 16-bit fixed point, scale/offset quantized (0x0416).
    U16Fixed,
    /// Unsigned 8-bit fixed point (0x0408).
    U8Fixed,
    /// Anything else, with its raw value.
    Other(u32),
}

impl DataType {
    /// From the raw `Qnn_DataType_t`.
    pub fn from_raw(v: u32) -> Self {
        match v {
            0x0216 => DataType::F16,
            0x0232 => DataType::F32,
            0x0226 => DataType::Bf16,
            0x0032 => DataType::I32,
            0x0064 => DataType::I64,
            0x0416 => DataType::U16Fixed,
            0x0408 => DataType::U8Fixed,
            other => DataType::Other(other),
        }
    }

    /// Bytes per element; `None` for a type herald does not handle.
    pub fn size(self) -> Option<usize> {
        match self {
            DataType::F16 | DataType::Bf16 | DataType::U16Fixed => Some(2),
            DataType::F32 | DataType::I32 => Some(4),
            DataType::I64 => Some(8),
            DataType::U8Fixed => Some(1),
            DataType::Other(_) => None,
        }
    }

    /// The bundle.toml spelling (`float16`, `float32`, `int64`, ...).
    pub fn name(self) -> String {
        match self {
            DataType::F16 => "float16".into(),
            DataType::F32 => "float32".into(),
            DataType::Bf16 => "bfloat16".into(),
            DataType::I32 => "int32".into(),
            DataType::I64 => "int64".into(),
            DataType::U16Fixed => "ufixed16".into(),
            DataType::U8Fixed => "ufixed8".into(),
            DataType::Other(v) => format!("qnn-type-0x{v:04x}"),
        }
    }
}

/// `Qnn_Tensor_t`: 144 bytes (qnn.md §3, stride checked): `version` u32 @0, the v1/v2 union
/// @8. Offsets below are inside the union.
pub const TENSOR_SIZE: usize = 144;
/// The v1 member of the union ends here (@8 + 104); v2's extra fields follow.
const T_V1_END: usize = 112;

/// One `Qnn_Tensor_t` as bytes, aligned as the struct (it holds pointers).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(8))]
pub struct RawTensor(pub [u8; TENSOR_SIZE]);
const T_UNION: usize = 8;
const T_ID: usize = 0;
const T_NAME: usize = 8;
const T_DATA_TYPE: usize = 24;
const T_QUANT: usize = 32;
const T_RANK: usize = 72;
const T_DIMS: usize = 80;
const T_MEM_TYPE: usize = 88;
const T_CLIENT_BUF: usize = 96;

/// Scale/offset encoding (`QNN_QUANTIZATION_ENCODING_SCALE_OFFSET`) with a defined encoding
/// (`QNN_DEFINITION_DEFINED` = 1): real = (q + offset) × scale.
const QUANT_DEFINED: u32 = 1;
const QUANT_SCALE_OFFSET: u32 = 0;

/// Per-tensor quantization of a fixed-point tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleOffset {
    /// Step between two codes.
    pub scale: f32,
    /// Added to the code before scaling (QNN's sign convention: negative zero point).
    pub offset: i32,
}

/// One input or output of a graph inside a context binary, copied out of the library's memory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The ONNX edge name.
    pub name: String,
    /// Element type.
    pub dtype: DataType,
    /// Dimensions, outermost first.
    pub dims: Vec<u32>,
    /// Scale/offset for fixed-point tensors.
    pub quant: Option<ScaleOffset>,
    /// The descriptor as the library gave it (144 bytes), reused for execution.
    pub(crate) raw: [u8; TENSOR_SIZE],
}

impl TensorInfo {
    /// Elements in the tensor.
    pub fn elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// # Safety
    /// `p` points to a `Qnn_Tensor_t` of version 1 or 2 whose name and dimensions are valid.
    unsafe fn read(p: *const u8) -> Result<Self, String> {
        // SAFETY: the caller guarantees 144 readable bytes at p and valid inner pointers.
        unsafe {
            let version: u32 = read(p, 0);
            if version != 1 && version != 2 {
                return Err(format!("tensor descriptor version {version} (herald reads 1 and 2)"));
            }
            let u = p.add(T_UNION);
            let name = string(read::<*const c_char>(u, T_NAME)).unwrap_or_default();
            let dtype = DataType::from_raw(read(u, T_DATA_TYPE));
            let rank: u32 = read(u, T_RANK);
            let dims_p: *const u32 = read(u, T_DIMS);
            if rank > 8 || (rank > 0 && dims_p.is_null()) {
                return Err(format!("tensor {name:?} has rank {rank}"));
            }
            let dims = (0..rank as usize).map(|i| ptr::read_unaligned(dims_p.add(i))).collect();
            let definition: u32 = read(u, T_QUANT);
            let encoding: u32 = read(u, T_QUANT + 4);
            if definition == QUANT_DEFINED && encoding != QUANT_SCALE_OFFSET {
                return Err(format!("tensor {name:?} uses quantization encoding {encoding} (herald reads scale/offset only)"));
            }
            let quant =
                (definition == QUANT_DEFINED).then(|| ScaleOffset { scale: read(u, T_QUANT + 8), offset: read(u, T_QUANT + 12) });
            let mut raw = [0u8; TENSOR_SIZE];
            ptr::copy_nonoverlapping(p, raw.as_mut_ptr(), TENSOR_SIZE);
            Ok(TensorInfo { name, dtype, dims, quant, raw })
        }
    }

    /// A descriptor for execution: the library's own, with raw memory (`memType` 0), the client
    /// buffer set to `data`/`len`, and the name and dimensions pointing at the caller's copies
    /// (the library's die with the system context that described the binary).
    pub(crate) fn descriptor(&self, name: *const c_char, dims: *const u32, data: *mut c_void, len: u32) -> RawTensor {
        let mut d = self.raw;
        // a version-1 descriptor: v2's extra pointers (dynamic dimensions, sparse parameters)
        // would point into the system context, which is gone
        d[0..4].copy_from_slice(&1u32.to_ne_bytes());
        d[T_V1_END..].fill(0);
        let u = T_UNION;
        d[u + T_NAME..u + T_NAME + 8].copy_from_slice(&(name as usize as u64).to_ne_bytes());
        d[u + T_DIMS..u + T_DIMS + 8].copy_from_slice(&(dims as usize as u64).to_ne_bytes());
        d[u + T_MEM_TYPE..u + T_MEM_TYPE + 4].copy_from_slice(&0u32.to_ne_bytes());
        d[u + T_CLIENT_BUF..u + T_CLIENT_BUF + 8].copy_from_slice(&(data as usize as u64).to_ne_bytes());
        d[u + T_CLIENT_BUF + 8..u + T_CLIENT_BUF + 16].copy_from_slice(&(len as u64).to_ne_bytes());
        RawTensor(d)
    }

    /// The tensor id the backend knows this tensor by.
    pub fn id(&self) -> u32 {
        let at = T_UNION + T_ID;
        u32::from_ne_bytes([self.raw[at], self.raw[at + 1], self.raw[at + 2], self.raw[at + 3]])
    }
}

/// One graph of a context binary.
#[derive(Debug, Clone)]
pub struct GraphInfo {
    /// The graph's name (what `graphRetrieve` takes).
    pub name: String,
    /// Inputs in execution order.
    pub inputs: Vec<TensorInfo>,
    /// Outputs in execution order.
    pub outputs: Vec<TensorInfo>,
}

/// What the system API says about a context binary.
#[derive(Debug, Clone)]
pub struct BinaryInfo {
    /// The backend id the binary is for (6 = HTP).
    pub backend_id: u32,
    /// The SDK build that wrote it (e.g. `v2.51.0.260929181845`).
    pub build_id: String,
    /// The core API version it was written with.
    pub core_api: Version,
    /// The backend API version it was written with.
    pub backend_api: Version,
    /// The SoC model the binary was compiled for (binary info version 3 only).
    pub soc_model: Option<u32>,
    /// Its graphs.
    pub graphs: Vec<GraphInfo>,
}

/// `QnnSystemContext_BinaryInfo_t`, version 3 (measured on QAIRT 2.51; versions 1 and 2 place
/// the graph list elsewhere and are refused):
/// `version` @0, the union @8; inside it `backendId` @0, `buildId` @8, core API version @16,
/// backend API version @28, the context tensors' count @72, the graphs' count @88 and their
/// array @96. A graph-info entry (`QnnSystemContext_GraphInfo_t`, versions 1–3) is `version`
/// @0 and, @8, name @0, input count @8, inputs @16, output count @24, outputs @32; entries are
/// 88 bytes apart (version 3, the size of the union's largest member).
const BI_UNION: usize = 8;
const BI_BACKEND_ID: usize = 0;
const BI_BUILD_ID: usize = 8;
const BI_CORE_API: usize = 16;
const BI_BACKEND_API: usize = 28;
const BI_NUM_GRAPHS: usize = 88;
const BI_GRAPHS: usize = 96;
/// Version 3 only: the SoC model the binary targets (43 seen for SM8550/v73, 57 for SM8650/v75
/// and 69 for SM8750/v79 binaries, matching the `soc_model` they were compiled with).
const BI_V3_SOC_MODEL: usize = 128;
const GI_STRIDE: usize = 88;
const GI_UNION: usize = 8;

/// The function table of `QnnSystemInterface_t` starts @32 (`backendId` @0, `providerName` @8,
/// `systemApiVersion` @16).
const SYS_TABLE: usize = 32;
const SYS_CONTEXT_CREATE: usize = 0;
const SYS_CONTEXT_GET_BINARY_INFO: usize = 1;
const SYS_CONTEXT_FREE: usize = 3;

/// The function table of `QnnInterface_t` starts @40 (`backendId` @0, `providerName` @8,
/// `apiVersion` @16: core then backend version, 24 bytes), slots as measured (qnn.md §3).
const CORE_TABLE: usize = 40;
const CORE_BACKEND_CREATE: usize = 1;
const CORE_GET_BUILD_ID: usize = 4;
const CORE_BACKEND_FREE: usize = 8;
const CORE_CONTEXT_CREATE_FROM_BINARY: usize = 13;
const CORE_CONTEXT_FREE: usize = 14;
const CORE_GRAPH_RETRIEVE: usize = 20;
const CORE_GRAPH_EXECUTE: usize = 21;
const CORE_DEVICE_CREATE: usize = 40;
const CORE_DEVICE_FREE: usize = 43;
const CORE_ERROR_GET_MESSAGE: usize = 48;

type GetProviders = unsafe extern "C" fn(*mut *const *const u8, *mut u32) -> ErrorHandle;
type SysContextCreate = unsafe extern "C" fn(*mut *mut c_void) -> ErrorHandle;
type SysGetBinaryInfo = unsafe extern "C" fn(*mut c_void, *mut c_void, u64, *mut *const u8, *mut u64) -> ErrorHandle;
type SysContextFree = unsafe extern "C" fn(*mut c_void) -> ErrorHandle;
type BackendCreate = unsafe extern "C" fn(*mut c_void, *const *const c_void, *mut *mut c_void) -> ErrorHandle;
type HandleFree = unsafe extern "C" fn(*mut c_void) -> ErrorHandle;
type GetBuildId = unsafe extern "C" fn(*mut *const c_char) -> ErrorHandle;
type DeviceCreate = unsafe extern "C" fn(*mut c_void, *const *const c_void, *mut *mut c_void) -> ErrorHandle;
type ContextCreateFromBinary = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *const *const c_void,
    *const c_void,
    u64,
    *mut *mut c_void,
    *mut c_void,
) -> ErrorHandle;
type ContextFree = unsafe extern "C" fn(*mut c_void, *mut c_void) -> ErrorHandle;
type GraphRetrieve = unsafe extern "C" fn(*mut c_void, *const c_char, *mut *mut c_void) -> ErrorHandle;
type GraphExecute = unsafe extern "C" fn(*mut c_void, *const u8, u32, *mut u8, u32, *mut c_void, *mut c_void) -> ErrorHandle;
type ErrorGetMessage = unsafe extern "C" fn(ErrorHandle, *mut *const c_char) -> ErrorHandle;

/// The low 16 bits of an error handle: the code.
pub fn code(e: ErrorHandle) -> u32 {
    (e & 0xffff) as u32
}

/// Which API component an error code belongs to (docs "Error codes": ranges by component).
pub fn component(code: u32) -> &'static str {
    match code {
        1000..=1999 => "common",
        2000..=2999 => "property",
        3000..=3999 => "op package",
        4000..=4999 => "backend",
        5000..=5999 => "context",
        6000..=6999 => "graph",
        7000..=7999 => "tensor",
        8000..=8999 => "memory",
        9000..=9999 => "signal",
        10000..=10999 => "log",
        11000..=11999 => "profile",
        14000..=14999 => "device",
        30000..=49999 => "system",
        60000..=60999 => "interface",
        _ => "unknown",
    }
}

/// Where to look for the QNN libraries: `dir` if given, else the board's standard locations
/// (the vendor BSP's `/usr/lib`, Debian-style multiarch, `/usr/local/lib`, Android-style
/// vendor folders), then `LD_LIBRARY_PATH`.
pub fn search_dirs(dir: Option<&Path>) -> Vec<PathBuf> {
    if let Some(d) = dir {
        return vec![d.to_owned()];
    }
    let mut v: Vec<PathBuf> =
        ["/usr/lib", "/usr/lib64", "/usr/lib/aarch64-linux-gnu", "/usr/local/lib", "/vendor/lib64", "/odm/lib64"]
            .iter()
            .map(PathBuf::from)
            .collect();
    if let Some(lp) = std::env::var_os("LD_LIBRARY_PATH") {
        v.extend(std::env::split_paths(&lp).filter(|p| !p.as_os_str().is_empty()));
    }
    v
}

/// The first directory of `dirs` holding both libraries.
pub fn find_libs(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter().find(|d| d.join(SYSTEM_LIB).is_file() && d.join(HTP_LIB).is_file()).cloned()
}

/// Open a QNN library for the rest of the process (`RTLD_NODELETE`): the HTP library keeps
/// threads of its own after `backendFree`, and unmapping its code under them crashed the test
/// process (SIGSEGV) when a second load followed a first one's drop. A later open of the same
/// file finds it loaded.
fn open(path: &Path) -> Result<Library, QnnError> {
    let _setup = setup_lock();
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
    // SAFETY: loading a shared library runs its initializers. The QNN libraries are the vendor's
    // runtime, named by configuration; herald trusts them as it trusts the C library.
    unsafe { libloading::os::unix::Library::open(Some(path), flags) }
        .map(Library::from)
        .map_err(|e| QnnError::Library { path: path.to_owned(), message: e.to_string() })
}

/// Function pointers read out of a provider's inline table.
///
/// # Safety
/// `table` points to at least `slot + 1` pointers.
unsafe fn slot<F: Copy>(table: *const u8, slot: usize) -> Option<F> {
    // SAFETY: forwarded; a NULL slot is reported as None.
    unsafe {
        let p: *const c_void = read(table, slot * std::mem::size_of::<usize>());
        if p.is_null() { None } else { Some(std::mem::transmute_copy::<*const c_void, F>(&p)) }
    }
}

/// The non-NULL provider pointers `symbol` (a `…_getProviders` function) lists.
fn providers(lib: &Library, symbol: &str) -> Result<Vec<*const u8>, String> {
    let name = format!("{symbol}\0");
    // SAFETY: both getProviders functions have this documented signature.
    let get: GetProviders = *unsafe { lib.get::<GetProviders>(name.as_bytes()) }.map_err(|e| e.to_string())?;
    let mut list: *const *const u8 = ptr::null();
    let mut n = 0u32;
    // SAFETY: out-pointers to our locals.
    let e = unsafe { get(&mut list, &mut n) };
    if code(e) != 0 || list.is_null() || n == 0 {
        return Err(format!("{symbol} returned {} with {n} providers", code(e)));
    }
    // SAFETY: the library returned `n` provider pointers, which live as long as it is loaded.
    Ok((0..n as usize).map(|i| unsafe { *list.add(i) }).filter(|p| !p.is_null()).collect())
}

/// `libQnnSystem.so`: describes context binaries.
pub struct System {
    _lib: Library,
    /// The system API version the provider reports.
    pub version: Version,
    create: SysContextCreate,
    info: SysGetBinaryInfo,
    free: SysContextFree,
}

impl std::fmt::Debug for System {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("System").field("version", &self.version).finish_non_exhaustive()
    }
}

impl System {
    /// Open `dir/libQnnSystem.so` and pick its provider (system API major 1).
    ///
    /// # Errors
    /// [`QnnError::Library`] when it cannot be opened or has no provider;
    /// [`QnnError::ApiVersion`] for another major.
    pub fn open(dir: &Path) -> Result<Self, QnnError> {
        let path = dir.join(SYSTEM_LIB);
        let lib = open(&path)?;
        let lib_err = |message: String| QnnError::Library { path: path.clone(), message };
        // SAFETY: the symbol's type is the documented `QnnSystemInterface_getProviders`.
        let mut seen = Vec::new();
        for p in providers(&lib, "QnnSystemInterface_getProviders").map_err(lib_err)? {
            // SAFETY: a provider is a QnnSystemInterface_t (version @16, table @32).
            let version = unsafe { read_version(p, 16) };
            seen.push(version);
            if version.major != SYSTEM_API_MAJOR {
                continue;
            }
            let t = p.wrapping_add(SYS_TABLE);
            // SAFETY: the table holds at least SYS_CONTEXT_FREE + 1 slots in system API 1.x.
            let (create, info, free) =
                unsafe { (slot(t, SYS_CONTEXT_CREATE), slot(t, SYS_CONTEXT_GET_BINARY_INFO), slot(t, SYS_CONTEXT_FREE)) };
            return match (create, info, free) {
                (Some(create), Some(info), Some(free)) => Ok(System { _lib: lib, version, create, info, free }),
                _ => Err(lib_err("the system provider lacks the context functions".into())),
            };
        }
        Err(QnnError::ApiVersion {
            path,
            found: seen.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", "),
            wanted: format!("{SYSTEM_API_MAJOR}.x"),
        })
    }

    /// Describe a context binary.
    ///
    /// # Errors
    /// [`QnnError::Api`] when the library rejects the bytes (a truncated or corrupted binary:
    /// code 30002 on QAIRT 2.51); [`QnnError::Layout`] when what it returns does not look like
    /// the layout this file knows.
    pub fn describe(&self, bytes: &[u8]) -> Result<BinaryInfo, QnnError> {
        let _setup = setup_lock();
        let mut ctx: *mut c_void = ptr::null_mut();
        // SAFETY: out-pointer to a local.
        let e = unsafe { (self.create)(&mut ctx) };
        if code(e) != 0 {
            return Err(QnnError::api("systemContextCreate", e, None));
        }
        // The library may keep pointers into the buffer it reads, and some versions write to
        // it: hand it a private copy that lives as long as the system context.
        let mut copy = bytes.to_vec();
        let mut info: *const u8 = ptr::null();
        let mut size = 0u64;
        // SAFETY: the buffer and out-pointers are valid for the call.
        let e = unsafe { (self.info)(ctx, copy.as_mut_ptr().cast(), copy.len() as u64, &mut info, &mut size) };
        let result = if code(e) != 0 {
            Err(QnnError::api("systemContextGetBinaryInfo", e, None))
        } else if info.is_null() {
            Err(QnnError::Layout("systemContextGetBinaryInfo returned no description".into()))
        } else {
            // SAFETY: the library returned a binary-info struct that lives until the free below.
            unsafe { parse_binary_info(info) }
        };
        // SAFETY: the context came from create and is freed once.
        unsafe { (self.free)(ctx) };
        drop(copy);
        result
    }
}

/// # Safety
/// `p` is a `QnnSystemContext_BinaryInfo_t` the system library returned, still alive.
unsafe fn parse_binary_info(p: *const u8) -> Result<BinaryInfo, QnnError> {
    // SAFETY: the caller guarantees the struct; every pointer read is checked before use.
    unsafe {
        let version: u32 = read(p, 0);
        if version != 3 {
            return Err(QnnError::Layout(format!(
                "the system library describes binaries in layout version {version}; herald reads version 3 (QAIRT 2.51, system API 1.15): use a QNN runtime of that generation or newer"
            )));
        }
        let u = p.add(BI_UNION);
        let backend_id: u32 = read(u, BI_BACKEND_ID);
        let build_id = string(read(u, BI_BUILD_ID)).unwrap_or_default();
        let core_api = read_version(u, BI_CORE_API);
        let backend_api = read_version(u, BI_BACKEND_API);
        let n: u32 = read(u, BI_NUM_GRAPHS);
        let graphs_p: *const u8 = read(u, BI_GRAPHS);
        if n == 0 || n > 256 || graphs_p.is_null() {
            return Err(QnnError::Layout(format!("binary info lists {n} graphs")));
        }
        let mut graphs = Vec::with_capacity(n as usize);
        for g in 0..n as usize {
            let gp = graphs_p.add(g * GI_STRIDE);
            let gv: u32 = read(gp, 0);
            if !(1..=3).contains(&gv) {
                return Err(QnnError::Layout(format!("graph info version {gv} (herald reads 1 to 3)")));
            }
            let gu = gp.add(GI_UNION);
            let name = string(read(gu, 0)).ok_or_else(|| QnnError::Layout("a graph without a name".into()))?;
            let mut io = [Vec::new(), Vec::new()];
            for (k, list) in io.iter_mut().enumerate() {
                let count: u32 = read(gu, 8 + 16 * k);
                let tp: *const u8 = read(gu, 16 + 16 * k);
                if count > 4096 || (count > 0 && tp.is_null()) {
                    return Err(QnnError::Layout(format!("graph {name} lists {count} tensors")));
                }
                for t in 0..count as usize {
                    list.push(TensorInfo::read(tp.add(t * TENSOR_SIZE)).map_err(QnnError::Layout)?);
                }
            }
            let [inputs, outputs] = io;
            graphs.push(GraphInfo { name, inputs, outputs });
        }
        let soc_model = (version == 3).then(|| read::<u32>(u, BI_V3_SOC_MODEL));
        Ok(BinaryInfo { backend_id, build_id, core_api, backend_api, soc_model, graphs })
    }
}

/// `libQnnHtp.so`'s provider: the calls herald makes.
pub struct Htp {
    _lib: Library,
    /// The HTP provider's name (`HTP_QTI_AISW`).
    pub provider: String,
    /// Core API version.
    pub core_api: Version,
    /// HTP backend API version.
    pub backend_api: Version,
    backend_create: BackendCreate,
    backend_free: HandleFree,
    get_build_id: Option<GetBuildId>,
    device_create: Option<DeviceCreate>,
    device_free: Option<HandleFree>,
    context_create_from_binary: ContextCreateFromBinary,
    context_free: ContextFree,
    graph_retrieve: GraphRetrieve,
    graph_execute: GraphExecute,
    error_get_message: Option<ErrorGetMessage>,
}

impl std::fmt::Debug for Htp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Htp").field("provider", &self.provider).field("core_api", &self.core_api).finish_non_exhaustive()
    }
}

impl Htp {
    /// Open `dir/libQnnHtp.so` and pick the provider whose core API major is
    /// [`CORE_API_MAJOR`] and minor at least [`CORE_API_MIN_MINOR`].
    ///
    /// # Errors
    /// [`QnnError::Library`] when it cannot be opened or lacks a function herald calls;
    /// [`QnnError::ApiVersion`] when no provider has a core API herald knows.
    pub fn open(dir: &Path) -> Result<Self, QnnError> {
        let path = dir.join(HTP_LIB);
        let lib = open(&path)?;
        let lib_err = |message: String| QnnError::Library { path: path.clone(), message };
        // SAFETY: the symbol's type is the documented `QnnInterface_getProviders`.
        let mut seen = Vec::new();
        for p in providers(&lib, "QnnInterface_getProviders").map_err(lib_err)? {
            // SAFETY: a provider is a QnnInterface_t (name @8, versions @16 and @28, table @40).
            let (name, core_api, backend_api) =
                unsafe { (string(read(p, 8)).unwrap_or_default(), read_version(p, 16), read_version(p, 28)) };
            seen.push(core_api);
            if core_api.major != CORE_API_MAJOR || core_api.minor < CORE_API_MIN_MINOR {
                continue;
            }
            let t = p.wrapping_add(CORE_TABLE);
            let missing = |what: &str| lib_err(format!("provider {name} has no {what}"));
            // SAFETY: core API 2.14+ tables hold at least 49 slots (errorGetMessage is 48).
            unsafe {
                return Ok(Htp {
                    backend_create: slot(t, CORE_BACKEND_CREATE).ok_or_else(|| missing("backendCreate"))?,
                    backend_free: slot(t, CORE_BACKEND_FREE).ok_or_else(|| missing("backendFree"))?,
                    get_build_id: slot(t, CORE_GET_BUILD_ID),
                    device_create: slot(t, CORE_DEVICE_CREATE),
                    device_free: slot(t, CORE_DEVICE_FREE),
                    context_create_from_binary: slot(t, CORE_CONTEXT_CREATE_FROM_BINARY)
                        .ok_or_else(|| missing("contextCreateFromBinary"))?,
                    context_free: slot(t, CORE_CONTEXT_FREE).ok_or_else(|| missing("contextFree"))?,
                    graph_retrieve: slot(t, CORE_GRAPH_RETRIEVE).ok_or_else(|| missing("graphRetrieve"))?,
                    graph_execute: slot(t, CORE_GRAPH_EXECUTE).ok_or_else(|| missing("graphExecute"))?,
                    error_get_message: slot(t, CORE_ERROR_GET_MESSAGE),
                    provider: name,
                    core_api,
                    backend_api,
                    _lib: lib,
                });
            }
        }
        Err(QnnError::ApiVersion {
            path,
            found: seen.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", "),
            wanted: format!("{CORE_API_MAJOR}.{CORE_API_MIN_MINOR}+"),
        })
    }

    /// The library's message for an error handle, if it has one.
    pub fn message(&self, e: ErrorHandle) -> Option<String> {
        let f = self.error_get_message?;
        let mut m: *const c_char = ptr::null();
        // SAFETY: out-pointer to a local; the string is the library's, copied at once.
        let r = unsafe { f(e, &mut m) };
        if code(r) != 0 {
            return None;
        }
        // SAFETY: NULL or a NUL-terminated string owned by the library.
        unsafe { string(m) }.filter(|s| !s.is_empty())
    }

    /// The library's build id (e.g. `v2.51.0...`).
    pub fn build_id(&self) -> Option<String> {
        let f = self.get_build_id?;
        let mut m: *const c_char = ptr::null();
        // SAFETY: out-pointer to a local.
        if code(unsafe { f(&mut m) }) != 0 {
            return None;
        }
        // SAFETY: NULL or a NUL-terminated string owned by the library.
        unsafe { string(m) }
    }

    fn check(&self, call: &'static str, e: ErrorHandle) -> Result<(), QnnError> {
        if code(e) == 0 { Ok(()) } else { Err(QnnError::api(call, e, self.message(e))) }
    }

    /// `backendCreate(NULL logger, NULL config)` then `deviceCreate` (when the provider has it).
    ///
    /// # Errors
    /// [`QnnError::Api`] with the library's message.
    pub fn create_backend(&self) -> Result<(Handle, Option<Handle>), QnnError> {
        let _setup = setup_lock();
        let mut be: *mut c_void = ptr::null_mut();
        // SAFETY: NULL logger and config are documented defaults; out-pointer to a local.
        self.check("backendCreate", unsafe { (self.backend_create)(ptr::null_mut(), ptr::null(), &mut be) })?;
        let mut dev: *mut c_void = ptr::null_mut();
        let device = match self.device_create {
            // SAFETY: as above.
            Some(f) => match self.check("deviceCreate", unsafe { f(ptr::null_mut(), ptr::null(), &mut dev) }) {
                Ok(()) => Some(Handle(dev)),
                Err(e) => {
                    // SAFETY: the backend handle came from backendCreate.
                    unsafe { (self.backend_free)(be) };
                    return Err(e);
                }
            },
            None => None,
        };
        Ok((Handle(be), device))
    }

    /// Free what [`Htp::create_backend`] made.
    ///
    /// # Safety
    /// The handles came from [`Htp::create_backend`], every context made on them is freed, and
    /// they are not used again.
    pub unsafe fn free_backend(&self, backend: Handle, device: Option<Handle>) {
        let _setup = setup_lock();
        if let (Some(d), Some(f)) = (device, self.device_free) {
            // SAFETY: forwarded.
            unsafe { f(d.0) };
        }
        // SAFETY: forwarded.
        unsafe { (self.backend_free)(backend.0) };
    }

    /// `contextCreateFromBinary` on a copy of `bytes`.
    ///
    /// # Errors
    /// [`QnnError::Api`] (e.g. a binary for another HTP architecture, or damaged).
    pub fn context_from_binary(&self, backend: Handle, device: Option<Handle>, bytes: &[u8]) -> Result<Handle, QnnError> {
        let _setup = setup_lock();
        let mut ctx: *mut c_void = ptr::null_mut();
        let dev = device.map_or(ptr::null_mut(), |d| d.0);
        // SAFETY: valid handles, a buffer valid for the call, out-pointer to a local.
        let e = unsafe {
            (self.context_create_from_binary)(
                backend.0,
                dev,
                ptr::null(),
                bytes.as_ptr().cast(),
                bytes.len() as u64,
                &mut ctx,
                ptr::null_mut(),
            )
        };
        self.check("contextCreateFromBinary", e)?;
        Ok(Handle(ctx))
    }

    /// # Safety
    /// `ctx` came from [`Htp::context_from_binary`] and is not used again.
    pub unsafe fn free_context(&self, ctx: Handle) {
        let _setup = setup_lock();
        // SAFETY: forwarded.
        unsafe { (self.context_free)(ctx.0, ptr::null_mut()) };
    }

    /// `graphRetrieve(ctx, name)`.
    ///
    /// # Errors
    /// [`QnnError::Api`] when the context has no such graph.
    pub fn graph(&self, ctx: Handle, name: &str) -> Result<Handle, QnnError> {
        let c = std::ffi::CString::new(name).map_err(|_| QnnError::Layout(format!("graph name {name:?} holds a NUL")))?;
        let mut g: *mut c_void = ptr::null_mut();
        // SAFETY: a live context, a NUL-terminated name, out-pointer to a local.
        self.check("graphRetrieve", unsafe { (self.graph_retrieve)(ctx.0, c.as_ptr(), &mut g) })?;
        Ok(Handle(g))
    }

    /// `graphExecute(graph, inputs, outputs)` with descriptors from [`TensorInfo::descriptor`].
    ///
    /// # Safety
    /// `graph` is live; every descriptor's client buffer and dimensions pointer are valid for
    /// the call and sized as the descriptor says; nothing else runs this graph concurrently.
    ///
    /// # Errors
    /// [`QnnError::Api`] with the library's message.
    pub unsafe fn execute(&self, graph: Handle, inputs: &[RawTensor], outputs: &mut [RawTensor]) -> Result<(), QnnError> {
        // SAFETY: forwarded; the arrays are contiguous Qnn_Tensor_t's (144 bytes each).
        let e = unsafe {
            (self.graph_execute)(
                graph.0,
                inputs.as_ptr().cast(),
                inputs.len() as u32,
                outputs.as_mut_ptr().cast(),
                outputs.len() as u32,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        self.check("graphExecute", e)
    }
}

/// Held around the calls that create or free QNN objects: two bundles loading at once (tests,
/// a reload while serving) never enter the vendor library's setup paths concurrently. Not on
/// the step path.
static SETUP: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup_lock() -> std::sync::MutexGuard<'static, ()> {
    SETUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// An opaque QNN handle (backend, device, context or graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle(*mut c_void);

// SAFETY: QNN handles are opaque tokens the library accepts from any thread; herald serializes
// the calls that need it (one execution of a graph at a time, behind a Mutex).
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}
