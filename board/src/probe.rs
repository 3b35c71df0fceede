//! Hardware probe: what board is this, how many (and which) CPUs, which ISA extensions, how much
//! RAM, and is there an NPU. Everything is read relative to an injectable root so tests can feed
//! recorded `/proc`, `/sys`, `/dev` and `/etc` trees (see `board/tests/fixtures/`).
//!
//! Classes, in decision order:
//! 1. `jetson`: `/etc/nv_tegra_release` exists, or `/proc/device-tree/compatible` contains `tegra`;
//! 2. `snapdragon_npu`: an aarch64 board with Qualcomm NPU evidence (`/dev/fastrpc-*`,
//!    `/dev/adsprpc-smd*`, `/dev/accel/accel*`, or `libQnnHtp.so` on the library path);
//! 3. `arm64_cpu`: any other aarch64 board (Raspberry Pi is flagged by `/proc/device-tree/model`);
//! 4. `x86_cpu`: everything else.
//!
//! `HERALD_HW_PROFILE=/path/profile.json` replaces the probe by a serialised profile
//! ([`probe_system`]); its `source` becomes `override:<path>`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A cluster whose maximum frequency is at least this percentage of the fastest one's counts
/// as big: the gold cores of a 1+3+4 Snapdragon (2.4 GHz next to a 2.7 GHz prime core, the same
/// Cortex-A78) are big; its 1.96 GHz A55s (72 %) are not.
pub const BIG_CLUSTER_PERCENT: u64 = 85;

/// Environment variable naming a JSON file that replaces the live probe.
pub const OVERRIDE_ENV: &str = "HERALD_HW_PROFILE";

/// Errors of the probe and the override loader; each names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A required file (`/proc/cpuinfo`, the override JSON) could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The override file is not a valid serialised [`HardwareProfile`].
    #[error("invalid hardware profile JSON in {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

/// Hardware class driving runtime decisions (threading, backends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HardwareClass {
    /// NVIDIA Jetson (Tegra SoC, unified memory).
    Jetson,
    /// Qualcomm Snapdragon board with a usable Hexagon NPU (FastRPC / QNN HTP).
    SnapdragonNpu,
    /// Any other 64-bit ARM board (Raspberry Pi, RK3588, ...): CPU only.
    #[default]
    Arm64Cpu,
    /// x86-64 machine: CPU only.
    X86Cpu,
}

impl HardwareClass {
    /// The serialised name (`jetson`, `snapdragon_npu`, `arm64_cpu`, `x86_cpu`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Jetson => "jetson",
            Self::SnapdragonNpu => "snapdragon_npu",
            Self::Arm64Cpu => "arm64_cpu",
            Self::X86Cpu => "x86_cpu",
        }
    }
}

impl std::fmt::Display for HardwareClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// CPUs sharing one maximum frequency.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Cluster {
    /// `cpuinfo_max_freq` in kHz.
    pub max_khz: u64,
    /// Logical CPU numbers, ascending.
    pub cpus: Vec<usize>,
}

/// What the probe found. Serialises to JSON; unknown keys are ignored and missing ones default
/// when loading an override.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HardwareProfile {
    /// `aarch64`, `x86_64`, ... (`unknown` when it cannot be told).
    pub arch: String,
    /// cpuinfo `model name` / `Hardware` / `cpu model`, else the device-tree model.
    pub cpu_model: String,
    /// `/proc/device-tree/model`, when present.
    pub device_tree_model: Option<String>,
    /// Normalised ISA flags, sorted (`neon`, `fp16_arith`, `dotprod`, `i8mm`, `bf16`, `sve`,
    /// `sve2`, `sme`; `avx2`, `avx512`, `avx512_bf16`, `avx512_vnni`, `fma`, `f16c`, `amx`, ...).
    pub cpu_flags: Vec<String>,
    /// Logical CPUs (`processor` lines).
    pub n_logical: usize,
    /// Physical cores: unique (package, core) pairs from sysfs topology.
    pub n_physical: usize,
    /// CPU clusters by maximum frequency, fastest first.
    pub clusters: Vec<Cluster>,
    /// NUMA nodes (at least 1).
    pub numa_nodes: usize,
    /// `MemTotal` in bytes.
    pub ram_total_bytes: u64,
    /// `MemAvailable` in bytes, lowered to [`Self::cgroup_memory_room_bytes`] when that is less.
    pub ram_available_bytes: u64,
    /// What this process's control group (cgroup v2, or v1's `memory` controller) still lets it
    /// use: the least of the limit − the usage (v2 `memory.max` − `memory.current`, v1
    /// `memory.limit_in_bytes` − `memory.usage_in_bytes`) over its group and the groups above
    /// it (a service's `MemoryMax=`, a container's limit), bytes; `None` when no group has a
    /// limit.
    pub cgroup_memory_room_bytes: Option<u64>,
    /// Number of `/sys/class/thermal/thermal_zone*` entries.
    pub thermal_zones: usize,
    /// NVIDIA Tegra (Jetson) board.
    pub is_jetson: bool,
    /// Raspberry Pi board.
    pub is_raspberry_pi: bool,
    /// NPU evidence found: device nodes and libraries, as absolute paths on the probed system.
    pub npu: Vec<String>,
    /// The decided class.
    pub class: HardwareClass,
    /// `probe`, or `override:<path>` when loaded from a file.
    pub source: String,
}

impl Default for HardwareProfile {
    fn default() -> Self {
        Self {
            arch: "unknown".into(),
            cpu_model: "unknown".into(),
            device_tree_model: None,
            cpu_flags: Vec::new(),
            n_logical: 1,
            n_physical: 1,
            clusters: Vec::new(),
            numa_nodes: 1,
            ram_total_bytes: 0,
            ram_available_bytes: 0,
            cgroup_memory_room_bytes: None,
            thermal_zones: 0,
            is_jetson: false,
            is_raspberry_pi: false,
            npu: Vec::new(),
            class: HardwareClass::default(),
            source: "probe".into(),
        }
    }
}

impl HardwareProfile {
    /// True when every given (normalised) flag is present.
    pub fn has(&self, flags: &[&str]) -> bool {
        flags.iter().all(|f| self.cpu_flags.iter().any(|c| c == f))
    }

    /// The big cores: the fastest cluster and every cluster within [`BIG_CLUSTER_PERCENT`] of
    /// its maximum frequency, fastest first (a 1+3+4 Snapdragon gives prime + gold: 7, 4, 5,
    /// 6); duplicates dropped. Without clusters: `0..n_logical`.
    pub fn big_cpus(&self) -> Vec<usize> {
        let Some(top) = self.clusters.first().filter(|c| !c.cpus.is_empty()) else {
            return (0..self.n_logical.max(1)).collect();
        };
        let mut out: Vec<usize> = Vec::new();
        for c in self.clusters.iter().filter(|c| c.max_khz.saturating_mul(100) >= top.max_khz.saturating_mul(BIG_CLUSTER_PERCENT)) {
            for &cpu in &c.cpus {
                if !out.contains(&cpu) {
                    out.push(cpu);
                }
            }
        }
        out
    }

    /// Split the big cluster between the talker (first) and vocoder (second) stages: the talker
    /// gets `max(1, round(n·2/3))` CPUs, capped at `n−1` when `n > 1`, the vocoder the rest. A
    /// single big CPU goes to both.
    pub fn thread_split(&self) -> (Vec<usize>, Vec<usize>) {
        let big = self.big_cpus();
        let n = big.len();
        if n <= 1 {
            return (big.clone(), big);
        }
        // round(2n/3): the fraction is 0, 1/3 or 2/3, so this never hits a tie.
        let n0 = ((2 * n + 1) / 3).max(1).min(n - 1);
        (big[..n0].to_vec(), big[n0..].to_vec())
    }

    /// Serialise to pretty JSON.
    pub fn to_json(&self) -> String {
        // A plain struct of strings/numbers/vecs cannot fail to serialise.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// One-line human description.
    pub fn describe(&self) -> String {
        let gib = self.ram_total_bytes as f64 / (1u64 << 30) as f64;
        let cgroup = self
            .cgroup_memory_room_bytes
            .map(|b| format!(" cgroup_room={:.1}GiB", b as f64 / (1u64 << 30) as f64))
            .unwrap_or_default();
        format!(
            "class={} arch={} cpu=\"{}\" logical={} physical={} big={} flags=[{}] ram={gib:.1}GiB{cgroup} npu=[{}] source={}",
            self.class,
            self.arch,
            self.cpu_model,
            self.n_logical,
            self.n_physical,
            self.big_cpus().len(),
            self.cpu_flags.join(","),
            self.npu.join(","),
            self.source
        )
    }
}

/// Read an optional text file: any failure (absent, unreadable) is `None`.
fn read_opt(path: &Path) -> Option<String> {
    match fs::read_to_string(path) {
        Ok(s) => Some(s),
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::debug!("probe: skipping {}: {e}", path.display());
            }
            None
        }
    }
}

fn read_num(path: &Path) -> Option<u64> {
    read_opt(path)?.trim().parse().ok()
}

/// Entry names of a directory (empty when absent).
fn dir_names(path: &Path) -> Vec<String> {
    let Ok(rd) = fs::read_dir(path) else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).collect();
    v.sort();
    v
}

/// `name` is `prefix` followed by only digits (at least one).
fn numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix).is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
}

fn normalise_flag(raw: &str) -> Option<&'static str> {
    Some(match raw {
        // ARM `Features`
        "asimd" => "neon",
        "asimdhp" => "fp16_arith",
        "asimddp" => "dotprod",
        "i8mm" => "i8mm",
        "bf16" => "bf16",
        "sve" => "sve",
        "sve2" => "sve2",
        "sme" => "sme",
        // x86 `flags`
        "avx2" => "avx2",
        "avx512f" => "avx512",
        "avx512_bf16" => "avx512_bf16",
        "avx512_vnni" => "avx512_vnni",
        "amx_tile" => "amx",
        "amx_bf16" => "amx_bf16",
        "amx_int8" => "amx_int8",
        "fma" => "fma",
        "f16c" => "f16c",
        _ => return None,
    })
}

struct CpuInfo {
    n_processors: usize,
    model: Option<String>,
    flags: BTreeSet<&'static str>,
    arm_arch_line: bool,
}

fn parse_cpuinfo(text: &str) -> CpuInfo {
    let mut n_processors = 0;
    let mut model: Option<(usize, String)> = None; // (priority, value)
    let mut flags = BTreeSet::new();
    let mut arm_arch_line = false;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim(), v.trim());
        match k {
            "processor" => n_processors += 1,
            "model name" | "Hardware" | "cpu model" => {
                let prio = match k {
                    "model name" => 0,
                    "Hardware" => 1,
                    _ => 2,
                };
                if !v.is_empty() && model.as_ref().is_none_or(|(p, _)| prio < *p) {
                    model = Some((prio, v.to_string()));
                }
            }
            "Features" | "flags" => {
                flags.extend(v.split_whitespace().filter_map(normalise_flag));
            }
            "CPU architecture" if v == "8" || v.starts_with("AArch64") => arm_arch_line = true,
            _ => {}
        }
    }
    CpuInfo { n_processors, model: model.map(|(_, m)| m), flags, arm_arch_line }
}

fn parse_meminfo(text: &str) -> (u64, u64) {
    let mut total = 0;
    let mut avail = 0;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        let kb: u64 = v.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
        match k.trim() {
            "MemTotal" => total = kb * 1024,
            "MemAvailable" => avail = kb * 1024,
            _ => {}
        }
    }
    (total, avail)
}

/// What this process's control groups still let it use, bytes: the least, over its memory
/// cgroup and every group above it, of the limit minus the usage (0 when a group is at or over
/// its limit); `None` when no group has a limit.
///
/// Groups are named by `root/proc/self/cgroup`: the cgroup v2 line (`0::/path`) is looked up
/// under `sys/fs/cgroup` (unified) and `sys/fs/cgroup/unified` (hybrid), with `memory.max` and
/// `memory.current`; a cgroup v1 `memory` controller line (`N:memory:/path`, as on older
/// Jetson L4T and in many containers) under `sys/fs/cgroup/memory`, with
/// `memory.limit_in_bytes` and `memory.usage_in_bytes`. A path that is not there (a container
/// that sees its own group as the mount's root) is walked up to the mount's root.
fn cgroup_memory_room(root: &Path) -> Option<u64> {
    let own = read_opt(&root.join("proc/self/cgroup"))?;
    let mut room: Option<u64> = None;
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        let found = if controllers.is_empty() {
            ["sys/fs/cgroup", "sys/fs/cgroup/unified"]
                .iter()
                .filter_map(|base| group_room(&root.join(base), path, ["memory.max", "memory.current", "inactive_file"]))
                .min()
        } else if controllers.split(',').any(|c| c == "memory") {
            group_room(
                &root.join("sys/fs/cgroup/memory"),
                path,
                ["memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"],
            )
        } else {
            None
        };
        if let Some(here) = found {
            room = Some(room.map_or(here, |r| r.min(here)));
        }
    }
    room
}

/// A cgroup v1 limit at or above this is "no limit" (the kernel shows unlimited as the largest
/// page-aligned `i64`, 9223372036854771712).
const CGROUP_V1_UNLIMITED: u64 = 1 << 62;

/// The least `limit − usage` over the group `path` under the hierarchy mounted at `base` and
/// the groups above it; `None` when none has a limit (v2 `max`, a v1 "unlimited", no file).
/// `files` names the limit file, the usage file and the `memory.stat` key of the inactive
/// file cache, which the kernel reclaims before it counts as out of memory (the bundle's
/// pages just read, say), so it is not counted as used: the working set Kubernetes and
/// systemd-oomd watch.
fn group_room(base: &Path, path: &str, files: [&str; 3]) -> Option<u64> {
    let [limit_file, usage_file, inactive_key] = files;
    let mut room: Option<u64> = None;
    let mut group = Path::new(path.trim().trim_start_matches('/'));
    loop {
        let dir = base.join(group);
        let limit = read_opt(&dir.join(limit_file)).and_then(|m| m.trim().parse::<u64>().ok()).filter(|&l| l < CGROUP_V1_UNLIMITED);
        if let Some(limit) = limit {
            let inactive = read_opt(&dir.join("memory.stat"))
                .and_then(|stat| {
                    stat.lines().find_map(|l| l.strip_prefix(inactive_key)?.strip_prefix(' ')?.trim().parse::<u64>().ok())
                })
                .unwrap_or(0);
            let usage = read_num(&dir.join(usage_file)).unwrap_or(0).saturating_sub(inactive);
            let here = limit.saturating_sub(usage);
            room = Some(room.map_or(here, |r| r.min(here)));
        }
        match group.parent() {
            Some(p) if group != Path::new("") => group = p,
            _ => break,
        }
    }
    room
}

/// Device-tree strings are NUL-terminated (and `compatible` is a NUL-separated list).
fn dt_string(raw: &str) -> String {
    raw.trim_end_matches(['\0', '\n', ' ']).replace('\0', ",")
}

/// Directories searched for QNN libraries (relative to the root), plus `LD_LIBRARY_PATH` on a
/// live probe.
const LIB_DIRS: &[&str] =
    &["usr/lib", "usr/lib64", "usr/lib/aarch64-linux-gnu", "usr/local/lib", "lib", "lib64", "vendor/lib64", "odm/lib64"];

fn npu_evidence(root: &Path, live: bool) -> Vec<String> {
    let mut ev = Vec::new();
    for name in dir_names(&root.join("dev")) {
        if name.starts_with("fastrpc-") || name.starts_with("adsprpc-smd") {
            ev.push(format!("/dev/{name}"));
        }
    }
    for name in dir_names(&root.join("dev/accel")) {
        if numbered(&name, "accel") {
            ev.push(format!("/dev/accel/{name}"));
        }
    }
    let mut dirs: Vec<(PathBuf, String)> = LIB_DIRS.iter().map(|d| (root.join(d), format!("/{d}"))).collect();
    if live && let Some(lp) = std::env::var_os("LD_LIBRARY_PATH") {
        for d in std::env::split_paths(&lp) {
            if !d.as_os_str().is_empty() {
                let shown = d.display().to_string();
                dirs.push((d, shown));
            }
        }
    }
    let mut seen = BTreeSet::new();
    for (dir, shown) in dirs {
        let lib = dir.join("libQnnHtp.so");
        if lib.exists() {
            let s = format!("{}/libQnnHtp.so", shown.trim_end_matches('/'));
            if seen.insert(s.clone()) {
                ev.push(s);
            }
        }
    }
    ev
}

fn infer_arch(flags: &BTreeSet<&'static str>, arm_arch_line: bool) -> String {
    const ARM: &[&str] = &["neon", "dotprod", "sve", "i8mm", "fp16_arith"];
    const X86: &[&str] = &["avx2", "avx512", "amx", "fma", "f16c"];
    if arm_arch_line || flags.iter().any(|f| ARM.contains(f)) {
        "aarch64".into()
    } else if flags.iter().any(|f| X86.contains(f)) {
        "x86_64".into()
    } else {
        "unknown".into()
    }
}

/// Probe the system mounted at `root` (`/` on a live system). Only `proc/cpuinfo` is required;
/// any other missing file leaves its value at the default.
pub fn probe(root: &Path) -> Result<HardwareProfile, ProbeError> {
    let cpuinfo_path = root.join("proc/cpuinfo");
    let cpuinfo_text = fs::read_to_string(&cpuinfo_path).map_err(|source| ProbeError::Read { path: cpuinfo_path.clone(), source })?;
    let info = parse_cpuinfo(&cpuinfo_text);
    let live = root == Path::new("/");

    let cpu_dir = root.join("sys/devices/system/cpu");
    let n_logical = if info.n_processors > 0 {
        info.n_processors
    } else {
        let n = dir_names(&cpu_dir).iter().filter(|n| numbered(n, "cpu")).count();
        if n > 0 {
            n
        } else if live {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            1
        }
    };

    // Physical cores and clusters from sysfs.
    let mut cores = BTreeSet::new();
    let mut by_freq: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for cpu in 0..n_logical {
        let d = cpu_dir.join(format!("cpu{cpu}"));
        let pkg = read_num(&d.join("topology/physical_package_id"));
        let core = read_num(&d.join("topology/core_id"));
        if let (Some(p), Some(c)) = (pkg, core) {
            cores.insert((p, c));
        }
        if let Some(khz) = read_num(&d.join("cpufreq/cpuinfo_max_freq")) {
            by_freq.entry(khz).or_default().push(cpu);
        }
    }
    let n_physical = if cores.is_empty() { n_logical } else { cores.len() };
    let clusters: Vec<Cluster> = by_freq.into_iter().rev().map(|(max_khz, cpus)| Cluster { max_khz, cpus }).collect();

    let numa_nodes = dir_names(&root.join("sys/devices/system/node")).iter().filter(|n| numbered(n, "node")).count().max(1);
    let (ram_total_bytes, mem_available) = read_opt(&root.join("proc/meminfo")).map(|t| parse_meminfo(&t)).unwrap_or((0, 0));
    let cgroup_memory_room_bytes = cgroup_memory_room(root);
    let ram_available_bytes = match cgroup_memory_room_bytes {
        Some(room) if mem_available == 0 || room < mem_available => room,
        _ => mem_available,
    };
    let thermal_zones = dir_names(&root.join("sys/class/thermal")).iter().filter(|n| numbered(n, "thermal_zone")).count();

    let device_tree_model = read_opt(&root.join("proc/device-tree/model")).map(|s| dt_string(&s)).filter(|s| !s.is_empty());
    let compatible = read_opt(&root.join("proc/device-tree/compatible")).map(|s| dt_string(&s)).unwrap_or_default();
    let is_jetson = root.join("etc/nv_tegra_release").exists() || compatible.to_lowercase().contains("tegra");
    let is_raspberry_pi = device_tree_model.as_deref().is_some_and(|m| m.starts_with("Raspberry Pi"));

    let arch = if live { std::env::consts::ARCH.to_string() } else { infer_arch(&info.flags, info.arm_arch_line) };
    let npu = npu_evidence(root, live);

    let class = if is_jetson {
        HardwareClass::Jetson
    } else if arch == "aarch64" && !npu.is_empty() {
        HardwareClass::SnapdragonNpu
    } else if arch == "aarch64" {
        HardwareClass::Arm64Cpu
    } else {
        HardwareClass::X86Cpu
    };

    let cpu_model = info.model.or_else(|| device_tree_model.clone()).unwrap_or_else(|| "unknown".into());

    Ok(HardwareProfile {
        arch,
        cpu_model,
        device_tree_model,
        cpu_flags: info.flags.into_iter().map(String::from).collect(),
        n_logical,
        n_physical,
        clusters,
        numa_nodes,
        ram_total_bytes,
        ram_available_bytes,
        cgroup_memory_room_bytes,
        thermal_zones,
        is_jetson,
        is_raspberry_pi,
        npu,
        class,
        source: "probe".into(),
    })
}

/// Load a serialised profile; `source` becomes `override:<path>`.
pub fn load_override(path: impl AsRef<Path>) -> Result<HardwareProfile, ProbeError> {
    let path = path.as_ref();
    let text = fs::read_to_string(path).map_err(|source| ProbeError::Read { path: path.to_path_buf(), source })?;
    let mut p: HardwareProfile =
        serde_json::from_str(&text).map_err(|source| ProbeError::Json { path: path.to_path_buf(), source })?;
    p.source = format!("override:{}", path.display());
    Ok(p)
}

/// The live profile: the file named by `HERALD_HW_PROFILE` when set (non-empty), else
/// [`probe`] of `/`.
pub fn probe_system() -> Result<HardwareProfile, ProbeError> {
    match std::env::var_os(OVERRIDE_ENV) {
        Some(p) if !p.is_empty() => load_override(PathBuf::from(p)),
        _ => probe(Path::new("/")),
    }
}
