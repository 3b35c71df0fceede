//! A QEMU TCG plugin that counts the guest instructions a run executes: every translated block
//! gets an execution callback that adds its instruction count to one atomic counter (a callback,
//! not QEMU's inline add, because user-mode emulation runs the guest's threads as parallel
//! vCPUs and the inline add is not atomic). At exit the total is written to the file named by
//! the plugin argument `out=PATH` (or to standard error).
//!
//! The declarations below are written from QEMU's public plugin API documentation
//! (docs/devel/tcg-plugins.rst, "API"), version 1 as QEMU 7.2 (Debian 12's qemu-user) loads it:
//! `qemu_plugin_version`, `qemu_plugin_install`, `qemu_plugin_register_vcpu_tb_trans_cb`,
//! `qemu_plugin_tb_n_insns`, `qemu_plugin_register_vcpu_tb_exec_cb` and
//! `qemu_plugin_register_atexit_cb`. QEMU resolves the imported functions from its own binary
//! when it loads the plugin.
//!
//! Usage: `qemu-aarch64 -plugin target/release/libherald_qemu_insns.so,out=FILE ...`.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The plugin API version this plugin was written against (QEMU's `QEMU_PLUGIN_VERSION` in 7.2).
#[unsafe(no_mangle)]
pub static qemu_plugin_version: c_int = 1;

/// QEMU's opaque translated block.
#[repr(C)]
pub struct QemuPluginTb {
    _opaque: [u8; 0],
}

type TbTransCb = extern "C" fn(id: u64, tb: *mut QemuPluginTb);
type VcpuUdataCb = extern "C" fn(vcpu_index: c_uint, userdata: *mut c_void);
type UdataCb = extern "C" fn(id: u64, userdata: *mut c_void);

unsafe extern "C" {
    fn qemu_plugin_register_vcpu_tb_trans_cb(id: u64, cb: TbTransCb);
    fn qemu_plugin_tb_n_insns(tb: *const QemuPluginTb) -> usize;
    /// `flags` 0: `QEMU_PLUGIN_CB_NO_REGS`.
    fn qemu_plugin_register_vcpu_tb_exec_cb(tb: *mut QemuPluginTb, cb: VcpuUdataCb, flags: c_int, userdata: *mut c_void);
    fn qemu_plugin_register_atexit_cb(id: u64, cb: UdataCb, userdata: *mut c_void);
}

/// Guest instructions executed so far, all vCPUs.
static EXECUTED: AtomicU64 = AtomicU64::new(0);
/// Where the total goes (`out=PATH`).
static OUT: OnceLock<Option<String>> = OnceLock::new();

extern "C" fn on_exec(_vcpu: c_uint, userdata: *mut c_void) {
    EXECUTED.fetch_add(userdata as u64, Ordering::Relaxed);
}

extern "C" fn on_translate(_id: u64, tb: *mut QemuPluginTb) {
    // SAFETY: `tb` is the block QEMU is translating, valid during this callback.
    unsafe {
        let n = qemu_plugin_tb_n_insns(tb);
        qemu_plugin_register_vcpu_tb_exec_cb(tb, on_exec, 0, n as *mut c_void);
    }
}

extern "C" fn on_exit(_id: u64, _userdata: *mut c_void) {
    let line = format!("guest_instructions {}\n", EXECUTED.load(Ordering::Relaxed));
    match OUT.get().and_then(Option::as_ref) {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &line) {
                eprintln!("qemu-insns: cannot write {path}: {e}");
            }
        }
        None => eprint!("qemu-insns: {line}"),
    }
}

/// Called by QEMU when it loads the plugin; `argv` holds the `name=value` arguments.
///
/// # Safety
/// QEMU passes `argc` valid C strings in `argv`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn qemu_plugin_install(id: u64, _info: *const c_void, argc: c_int, argv: *const *const c_char) -> c_int {
    let mut out = None;
    for i in 0..usize::try_from(argc).unwrap_or(0) {
        // SAFETY: QEMU's contract above.
        let arg = unsafe { std::ffi::CStr::from_ptr(*argv.add(i)) }.to_string_lossy().into_owned();
        match arg.strip_prefix("out=") {
            Some(path) => out = Some(path.to_string()),
            None => {
                eprintln!("qemu-insns: unknown argument {arg:?} (only out=PATH)");
                return -1;
            }
        }
    }
    let _ = OUT.set(out);
    // SAFETY: registering callbacks with the id QEMU gave this plugin.
    unsafe {
        qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
        qemu_plugin_register_atexit_cb(id, on_exit, std::ptr::null_mut());
    }
    0
}
