//! Hardware probe against recorded board snapshots (`tests/fixtures/<board>/`), plus the
//! override file and the typed errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use board::probe::{Cluster, HardwareClass, HardwareProfile, ProbeError, load_override, probe};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn cl(max_khz: u64, cpus: &[usize]) -> Cluster {
    Cluster { max_khz, cpus: cpus.to_vec() }
}

const ARM_FLAGS: &[&str] = &["dotprod", "fp16_arith", "neon"];

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("herald-probe-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn jetson_orin_nano() {
    let p = probe(&fixture("jetson-orin-nano")).unwrap();
    assert_eq!(p.class, HardwareClass::Jetson);
    assert_eq!(p.arch, "aarch64");
    assert!(p.is_jetson && !p.is_raspberry_pi);
    assert_eq!(p.cpu_model, "NVIDIA Jetson Orin Nano Developer Kit");
    assert_eq!((p.n_logical, p.n_physical), (6, 6));
    assert_eq!(p.clusters, vec![cl(1_510_400, &[0, 1, 2, 3, 4, 5])]);
    assert_eq!(p.cpu_flags, ARM_FLAGS);
    assert_eq!(p.ram_total_bytes, 7_802_016 * 1024);
    assert_eq!(p.ram_available_bytes, 5_916_332 * 1024);
    assert_eq!((p.thermal_zones, p.numa_nodes), (9, 1));
    assert!(p.npu.is_empty());
    assert_eq!(p.source, "probe");
    // n = 6 → round(4) = 4 talker CPUs, 2 vocoder CPUs.
    assert_eq!(p.thread_split(), (vec![0, 1, 2, 3], vec![4, 5]));
}

#[test]
fn rpi5() {
    let p = probe(&fixture("rpi5")).unwrap();
    assert_eq!(p.class, HardwareClass::Arm64Cpu);
    assert_eq!(p.arch, "aarch64");
    assert!(p.is_raspberry_pi && !p.is_jetson);
    assert_eq!(p.device_tree_model.as_deref(), Some("Raspberry Pi 5 Model B Rev 1.0"));
    // No `Hardware`/`model name` line in Pi 5 cpuinfo: the model comes from the device tree.
    assert_eq!(p.cpu_model, "Raspberry Pi 5 Model B Rev 1.0");
    assert_eq!((p.n_logical, p.n_physical), (4, 4));
    assert_eq!(p.clusters, vec![cl(2_400_000, &[0, 1, 2, 3])]);
    assert_eq!(p.cpu_flags, ARM_FLAGS);
    assert_eq!(p.ram_total_bytes, 8_245_968 * 1024);
    assert_eq!(p.ram_available_bytes, 7_519_340 * 1024);
    assert_eq!(p.thermal_zones, 1);
    assert!(p.npu.is_empty());
    // n = 4 → round(2.67) = 3.
    assert_eq!(p.thread_split(), (vec![0, 1, 2], vec![3]));
}

#[test]
fn rb3gen2_is_snapdragon_npu() {
    let p = probe(&fixture("rb3gen2")).unwrap();
    assert_eq!(p.class, HardwareClass::SnapdragonNpu);
    assert_eq!(p.arch, "aarch64");
    assert!(!p.is_jetson && !p.is_raspberry_pi);
    assert_eq!(p.cpu_model, "Qualcomm Technologies, Inc. Robotics RB3gen2");
    assert_eq!((p.n_logical, p.n_physical), (8, 8));
    assert_eq!(p.clusters, vec![cl(2_707_200, &[7]), cl(2_400_000, &[4, 5, 6]), cl(1_958_400, &[0, 1, 2, 3]),]);
    assert_eq!(p.cpu_flags, ARM_FLAGS);
    assert_eq!(p.ram_total_bytes, 5_863_296 * 1024);
    assert_eq!(p.ram_available_bytes, 3_920_684 * 1024);
    assert_eq!(p.thermal_zones, 8);
    assert_eq!(p.npu, vec!["/dev/fastrpc-adsp", "/dev/fastrpc-cdsp", "/usr/lib/libQnnHtp.so"]);
    // The big cluster is the single prime core (cpu7): it serves both stages.
    // prime (2.71 GHz) and gold (2.40 GHz, 89 %) are big; the 1.96 GHz silver cluster is not
    assert_eq!(p.big_cpus(), vec![7, 4, 5, 6]);
    assert_eq!(p.thread_split(), (vec![7, 4, 5], vec![6]));
}

#[test]
fn rk3588_big_little() {
    let p = probe(&fixture("rk3588")).unwrap();
    assert_eq!(p.class, HardwareClass::Arm64Cpu);
    assert_eq!(p.cpu_model, "Radxa ROCK 5B");
    assert_eq!((p.n_logical, p.n_physical), (8, 8));
    assert_eq!(p.clusters, vec![cl(2_256_000, &[4, 5, 6, 7]), cl(1_800_000, &[0, 1, 2, 3])]);
    assert_eq!(p.cpu_flags, ARM_FLAGS);
    assert_eq!(p.ram_total_bytes, 16_183_024 * 1024);
    assert_eq!(p.thermal_zones, 7);
    assert!(p.npu.is_empty());
    assert_eq!(p.big_cpus(), vec![4, 5, 6, 7]);
    assert_eq!(p.thread_split(), (vec![4, 5, 6], vec![7]));
}

#[test]
fn x86_two_core_avx2() {
    let p = probe(&fixture("x86")).unwrap();
    assert_eq!(p.class, HardwareClass::X86Cpu);
    assert_eq!(p.arch, "x86_64");
    assert_eq!(p.cpu_model, "AMD Athlon Silver 3050U with Radeon Graphics");
    assert_eq!((p.n_logical, p.n_physical), (2, 2));
    assert_eq!(p.clusters, vec![cl(3_200_000, &[0, 1])]);
    assert_eq!(p.cpu_flags, ["avx2", "f16c", "fma"]);
    assert!(p.has(&["avx2", "fma"]) && !p.has(&["avx512"]));
    assert_eq!(p.ram_total_bytes, 7_987_412 * 1024);
    assert_eq!(p.ram_available_bytes, 5_123_980 * 1024);
    assert_eq!((p.numa_nodes, p.thermal_zones), (1, 1));
    // n = 2 → round(1.33) = 1.
    assert_eq!(p.thread_split(), (vec![0], vec![1]));
}

#[test]
fn thread_split_without_clusters_uses_all_cpus() {
    let p = HardwareProfile { n_logical: 3, ..HardwareProfile::default() };
    assert_eq!(p.big_cpus(), vec![0, 1, 2]);
    assert_eq!(p.thread_split(), (vec![0, 1], vec![2]));
}

#[test]
fn override_round_trip() {
    let probed = probe(&fixture("rb3gen2")).unwrap();
    let dir = temp_dir("override");
    let path = dir.join("profile.json");
    // Unknown keys are ignored on load.
    let mut json: serde_json::Value = serde_json::from_str(&probed.to_json()).unwrap();
    json["some_future_field"] = serde_json::json!({"x": 1});
    std::fs::write(&path, json.to_string()).unwrap();

    let loaded = load_override(&path).unwrap();
    assert_eq!(loaded.source, format!("override:{}", path.display()));
    assert_eq!(loaded.class, HardwareClass::SnapdragonNpu);
    assert_eq!(HardwareProfile { source: "probe".into(), ..loaded }, probed);

    // A partial profile fills the rest with defaults.
    std::fs::write(&path, r#"{"class":"x86_cpu","n_logical":4}"#).unwrap();
    let partial = load_override(&path).unwrap();
    assert_eq!(partial.class, HardwareClass::X86Cpu);
    assert_eq!(partial.thread_split(), (vec![0, 1, 2], vec![3]));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_cpuinfo_is_a_typed_error() {
    let dir = temp_dir("empty-root");
    let err = probe(&dir).unwrap_err();
    match &err {
        ProbeError::Read { path, .. } => assert_eq!(path, &dir.join("proc/cpuinfo")),
        other => panic!("unexpected error {other:?}"),
    }
    assert!(err.to_string().contains("proc/cpuinfo"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn malformed_override_names_the_file() {
    let dir = temp_dir("bad-json");
    let path = dir.join("bad.json");
    std::fs::write(&path, "{ \"class\": \"jetson\", ").unwrap();
    let err = load_override(&path).unwrap_err();
    assert!(matches!(err, ProbeError::Json { .. }), "{err:?}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    // An absent override file is a read error naming it.
    let missing = dir.join("absent.json");
    let err = load_override(&missing).unwrap_err();
    assert!(matches!(err, ProbeError::Read { .. }), "{err:?}");
    assert!(err.to_string().contains("absent.json"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn live_probe_does_not_fail() {
    if !Path::new("/proc/cpuinfo").exists() {
        return;
    }
    let p = probe(Path::new("/")).unwrap();
    assert_eq!(p.arch, std::env::consts::ARCH);
    assert!(p.n_logical >= 1 && p.n_physical >= 1);
    assert!(!p.thread_split().0.is_empty());
}

/// Copy the directory tree `from` into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn a_cgroup_memory_limit_lowers_the_available_memory() {
    let root = temp_dir("cgroup");
    let _ = std::fs::remove_dir_all(&root);
    copy_tree(&fixture("rpi5"), &root);
    let free = probe(&root).unwrap().ram_available_bytes;
    assert!(free > 1 << 30, "the fixture has more than 1 GiB free");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(root.join("proc/self/cgroup"), "0::/system.slice/herald.service\n").unwrap();
    let group = root.join("sys/fs/cgroup/system.slice/herald.service");
    std::fs::create_dir_all(&group).unwrap();
    // no limit anywhere: MemAvailable stands
    std::fs::write(group.join("memory.max"), "max\n").unwrap();
    let p = probe(&root).unwrap();
    assert_eq!((p.ram_available_bytes, p.cgroup_memory_room_bytes), (free, None));
    // MemoryMax=512M on the service, 100 MiB in use: 412 MiB left
    std::fs::write(group.join("memory.max"), "536870912\n").unwrap();
    std::fs::write(group.join("memory.current"), "104857600\n").unwrap();
    let p = probe(&root).unwrap();
    assert_eq!(p.cgroup_memory_room_bytes, Some(412 << 20));
    assert_eq!(p.ram_available_bytes, 412 << 20);
    // ... of which 50 MiB inactive file cache, which the kernel reclaims first: 462 MiB
    std::fs::write(group.join("memory.stat"), "anon 54525952\nfile 52428800\nactive_file 0\ninactive_file 52428800\n").unwrap();
    assert_eq!(probe(&root).unwrap().ram_available_bytes, 462 << 20);
    std::fs::remove_file(group.join("memory.stat")).unwrap();
    // a tighter limit on the slice above wins
    std::fs::write(root.join("sys/fs/cgroup/system.slice/memory.max"), "209715200\n").unwrap();
    std::fs::write(root.join("sys/fs/cgroup/system.slice/memory.current"), "0\n").unwrap();
    assert_eq!(probe(&root).unwrap().ram_available_bytes, 200 << 20);

    // cgroup v1 (older Jetson L4T, many containers): the memory controller's own line and
    // hierarchy; "unlimited" is the largest page-aligned i64; a hybrid host's v2 tree sits
    // under sys/fs/cgroup/unified with no memory files
    std::fs::remove_dir_all(root.join("sys/fs/cgroup")).unwrap();
    std::fs::write(root.join("proc/self/cgroup"), "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n").unwrap();
    let v1 = root.join("sys/fs/cgroup/memory/docker/abc");
    std::fs::create_dir_all(&v1).unwrap();
    std::fs::create_dir_all(root.join("sys/fs/cgroup/unified/docker/abc")).unwrap();
    std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
    std::fs::write(v1.join("memory.usage_in_bytes"), "104857600\n").unwrap();
    assert_eq!(probe(&root).unwrap().cgroup_memory_room_bytes, None);
    std::fs::write(v1.join("memory.limit_in_bytes"), "314572800\n").unwrap();
    assert_eq!(probe(&root).unwrap().ram_available_bytes, 200 << 20);
    // inactive file cache (reclaimable) is not counted as used
    std::fs::write(v1.join("memory.stat"), "cache 73400320\ntotal_inactive_file 52428800\ntotal_active_file 1\n").unwrap();
    assert_eq!(probe(&root).unwrap().ram_available_bytes, 250 << 20);
    std::fs::remove_file(v1.join("memory.stat")).unwrap();
    // a container that sees its own group as the mount's root (the path is not there)
    std::fs::remove_dir_all(root.join("sys/fs/cgroup/memory/docker")).unwrap();
    std::fs::write(root.join("sys/fs/cgroup/memory/memory.limit_in_bytes"), "157286400\n").unwrap();
    std::fs::write(root.join("sys/fs/cgroup/memory/memory.usage_in_bytes"), "52428800\n").unwrap();
    assert_eq!(probe(&root).unwrap().ram_available_bytes, 100 << 20);
    std::fs::remove_dir_all(&root).unwrap();
}
