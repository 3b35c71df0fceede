//! `herald bundle install | list | remove` (issue 41) end to end: an archive that
//! `tools/export/export pack` writes installs into `model.bundles_dir` and speaks exactly like
//! the bundle it was packed from; every damaged, cut, altered or hostile archive is refused with
//! one line naming what is wrong, and leaves nothing in `model.bundles_dir`.
//!
//! The hostile archives are written here byte by byte ([`ustar`], POSIX ustar headers per the
//! POSIX `pax` specification), so that the test, not a tar library, decides what they hold.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

mod common;

use common::{assert_one_error_line, bundle, repo, stderr};

fn herald(args: &[&str], dir: &Path) -> Output {
    common::run(args, &[("HERALD_MODEL_BUNDLES_DIR", dir.to_str().unwrap())], None)
}

/// The tiny bundle packed by the exporter, once per test binary.
fn packed() -> PathBuf {
    static ONCE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bundle-archive").join("tiny-0.6b.tar");
        let st = Command::new(repo().join("tools/export/export"))
            .args(["pack", "--quiet", "--bundle"])
            .arg(bundle())
            .arg("--out")
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success(), "export pack failed");
        out
    })
    .clone()
}

/// What a bundles_dir holds, hidden entries included (a staging folder left behind shows).
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

/// A POSIX ustar archive of `(name, type flag, link name, data)` members, ended by two zero
/// blocks. Header fields (POSIX.1-2008 `pax`, "ustar Interchange Format"): name 0..100, mode
/// 100, uid 108, gid 116, size 124 (11 octal digits), mtime 136, checksum 148 (the header's byte
/// sum with the field as spaces), type flag 156, link name 157..257, magic "ustar\0" 257,
/// version "00" 263.
fn ustar(members: &[(&str, u8, &str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(name, flag, link, data) in members {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..108].copy_from_slice(b"0000644\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        h[124..136].copy_from_slice(format!("{:011o}\0", data.len()).as_bytes());
        h[136..148].copy_from_slice(b"00000000000\0");
        h[148..156].copy_from_slice(b"        ");
        h[156] = flag;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    out
}

fn sha(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

/// An index (docs/bundle.md "Bundle archives") of `files`, its fingerprint computed here.
fn index(name: &str, format_version: u32, files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut fp = Sha256::new();
    let list: Vec<serde_json::Value> = files
        .iter()
        .map(|(p, d)| {
            fp.update(format!("{p}\0{}\0{}\n", d.len(), sha(d)).as_bytes());
            serde_json::json!({"path": p, "size": d.len(), "sha256": sha(d)})
        })
        .collect();
    let fingerprint: String = fp.finalize().iter().map(|b| format!("{b:02x}")).collect();
    serde_json::to_vec(&serde_json::json!({
        "archive_version": 1, "name": name, "format_version": format_version, "herald": {"min": "0.1.0"},
        "model": {"type": "custom_voice"}, "files": list,
        "bytes": files.iter().map(|(_, d)| d.len()).sum::<usize>(), "fingerprint": fingerprint,
    }))
    .unwrap()
}

#[test]
fn an_installed_archive_speaks_like_its_bundle_and_is_listed_and_removed() {
    let d = common::tmp("bundle", "install");
    let dir = d.join("bundles");
    let o = herald(&["bundle", "list"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("no bundles in"));
    let o = herald(&["bundle", "install", packed().to_str().unwrap()], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(said.starts_with("installed tiny-0.6b (custom_voice 0b6 fp32; 7 files, "), "{said}");
    assert_eq!(entries(&dir), ["tiny-0.6b"]);
    // file for file the bundle it was packed from
    for e in std::fs::read_dir(bundle()).unwrap() {
        let e = e.unwrap();
        let got = std::fs::read(dir.join("tiny-0.6b").join(e.file_name())).unwrap();
        assert!(got == std::fs::read(e.path()).unwrap(), "{:?} differs", e.file_name());
    }
    // and it speaks the same samples
    let installed = dir.join("tiny-0.6b");
    let raw = |b: &Path| {
        let o = herald(&["speak", "Installed.", "--bundle", b.to_str().unwrap(), "--seed", "3", "--raw"], &dir);
        assert!(o.status.success(), "{}", stderr(&o));
        o.stdout
    };
    assert!(raw(&installed) == raw(&bundle()), "the installed bundle speaks other samples");
    let o = herald(&["bundle", "list"], &dir);
    let listed = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(listed.contains("tiny-0.6b") && listed.contains("custom_voice 0b6 fp32"), "{listed}");
    assert!(!listed.starts_with('*'), "not model.bundle: {listed}");

    // installed already: refused, the installed one untouched
    let o = herald(&["bundle", "install", packed().to_str().unwrap()], &dir);
    assert_one_error_line(&o, 2, "a bundle named \"tiny-0.6b\" is installed already");
    // the configured bundle is neither removed nor unmarked
    let o = common::run(
        &["bundle", "remove", "tiny-0.6b"],
        &[("HERALD_MODEL_BUNDLES_DIR", dir.to_str().unwrap()), ("HERALD_MODEL_BUNDLE", installed.to_str().unwrap())],
        None,
    );
    assert_one_error_line(&o, 2, "is model.bundle");
    let o = common::run(
        &["bundle", "list"],
        &[("HERALD_MODEL_BUNDLES_DIR", dir.to_str().unwrap()), ("HERALD_MODEL_BUNDLE", installed.to_str().unwrap())],
        None,
    );
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("* tiny-0.6b"), "{}", String::from_utf8_lossy(&o.stdout));
    let o = herald(&["bundle", "remove", "tiny-0.6b"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(entries(&dir), Vec::<String>::new());
    let o = herald(&["bundle", "remove", "tiny-0.6b"], &dir);
    assert_one_error_line(&o, 2, "no bundle named \"tiny-0.6b\"");
    let o = herald(&["bundle", "remove", "../etc"], &dir);
    assert_one_error_line(&o, 2, "is not a bundle name");
    // a bundle that is a link to a folder elsewhere: listed; removing it removes the link only
    std::os::unix::fs::symlink(bundle(), dir.join("linked")).unwrap();
    let o = herald(&["bundle", "list"], &dir);
    assert!(String::from_utf8_lossy(&o.stdout).contains("linked"), "{}", String::from_utf8_lossy(&o.stdout));
    let o = herald(&["bundle", "remove", "linked"], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(entries(&dir), Vec::<String>::new());
    assert!(bundle().join("bundle.toml").is_file(), "the link's target was removed");

    // use: bundles_dir/default, the default model.bundle, links to it, and herald speaks with it
    // without --bundle; list marks it and does not show the link; it cannot be removed
    let o = herald(&["bundle", "install", packed().to_str().unwrap()], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    let link = dir.join("default");
    let env = [("HERALD_MODEL_BUNDLES_DIR", dir.to_str().unwrap()), ("HERALD_MODEL_BUNDLE", link.to_str().unwrap())];
    let o = common::run(&["bundle", "use", "tiny-0.6b"], &env, None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("now links to"), "{}", String::from_utf8_lossy(&o.stdout));
    assert_eq!(std::fs::read_link(&link).unwrap(), PathBuf::from("tiny-0.6b"));
    let o = common::run(&["speak", "Installed.", "--seed", "3", "--raw"], &env, None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(o.stdout == raw(&bundle()), "the bundle in use speaks other samples");
    let o = common::run(&["bundle", "list"], &env, None);
    let listed = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.starts_with("* tiny-0.6b"), "{listed}");
    let o = common::run(&["bundle", "remove", "tiny-0.6b"], &env, None);
    assert_one_error_line(&o, 2, "is model.bundle");
    let o = common::run(&["bundle", "use", "nothing"], &env, None);
    assert_one_error_line(&o, 2, "no bundle named \"nothing\"");
    let o = common::run(&["bundle", "use", "default"], &env, None);
    assert_one_error_line(&o, 2, "it is the link `herald bundle use` sets");
    // with model.bundle set elsewhere, use says that setting wins
    let o = herald(&["bundle", "use", "tiny-0.6b"], &dir);
    assert!(String::from_utf8_lossy(&o.stdout).contains("note: model.bundle is"), "{}", String::from_utf8_lossy(&o.stdout));
    // a real folder named default (an image's own bundle) is not replaced
    let other = d.join("other");
    std::fs::create_dir_all(other.join("default")).unwrap();
    std::os::unix::fs::symlink(bundle(), other.join("tiny")).unwrap();
    let o = herald(&["bundle", "use", "tiny"], &other);
    assert_one_error_line(&o, 2, "is a folder, not a link herald manages");
}

#[test]
fn damaged_cut_altered_and_hostile_archives_are_refused_leaving_nothing() {
    let d = common::tmp("bundle", "faults");
    let dir = d.join("bundles");
    let good = std::fs::read(packed()).unwrap();
    let refused = |name: &str, bytes: &[u8], code: i32, needle: &str| {
        let a = d.join(name);
        std::fs::write(&a, bytes).unwrap();
        let o = herald(&["bundle", "install", a.to_str().unwrap()], &dir);
        assert_one_error_line(&o, code, needle);
        assert_eq!(entries(&dir), Vec::<String>::new(), "{name} left something behind");
    };
    // the index's size, from the first header (11 octal digits at 124)
    let index_len = usize::from_str_radix(std::str::from_utf8(&good[124..135]).unwrap(), 8).unwrap();
    let second = 512 + index_len.div_ceil(512) * 512;
    assert_eq!(&good[second..second + 11], b"bundle.toml");

    // one byte of bundle.toml's data flipped
    let mut b = good.clone();
    b[second + 512 + 40] ^= 0x20;
    refused("flipped.tar", &b, 4, "bundle.toml: its SHA-256 is");
    // cut in the middle of a file
    refused("cut.tar", &good[..good.len() / 2], 4, "cut.tar: ");
    // cut after the index: the files are missing
    refused("index-only.tar", &good[..second], 4, "cut short");
    // a file after those the index lists (before the end-of-archive blocks), and bytes after
    // those blocks (which tar readers skip: hidden data)
    let members_end = (good.iter().rposition(|&b| b != 0).unwrap() + 1).div_ceil(512) * 512;
    let mut b = good[..members_end].to_vec();
    b.extend_from_slice(&ustar(&[("extra.bin", b'0', "", b"more")]));
    refused("extra.tar", &b, 4, "holds \"extra.bin\" after the files its index lists");
    let mut b = good.clone();
    b.extend_from_slice(&ustar(&[("hidden.bin", b'0', "", b"more")]));
    refused("trailing.tar", &b, 4, "data after the end of the archive");
    // not an archive at all, and an empty file
    refused("noise.tar", &[0x5a; 3000], 4, "not a");
    refused("empty.tar", b"", 4, "not a herald bundle archive");
    // a bundle of another format version: refused from the index, before anything is written
    let mut b = good.clone();
    let at = b.windows(19).position(|w| w == b"\"format_version\": 1").unwrap();
    b[at + 18] = b'2';
    refused("v2.tar", &b, 4, "the bundle's format_version is 2, this herald");

    // hostile paths, each behind an index whose fingerprint is right
    let toml = std::fs::read(bundle().join("bundle.toml")).unwrap();
    let evil: &[u8] = b"owned";
    for (label, path) in [("dotdot", "../escaped"), ("absolute", "/tmp/escaped"), ("nested", "graphs/../../escaped")] {
        let files: Vec<(&str, &[u8])> = vec![("bundle.toml", &toml), (path, evil)];
        let idx = index("hostile", 1, &files);
        let a = ustar(&[("herald-bundle.json", b'0', "", &idx), ("bundle.toml", b'0', "", &toml), (path, b'0', "", evil)]);
        refused(&format!("{label}.tar"), &a, 4, "is not a path inside a bundle");
    }
    assert!(!d.join("escaped").exists() && !Path::new("/tmp/escaped").exists());
    // a symlink member where the index lists a file
    let files: Vec<(&str, &[u8])> = vec![("bundle.toml", &toml), ("tokenizer.json", evil)];
    let idx = index("linked", 1, &files);
    let a = ustar(&[
        ("herald-bundle.json", b'0', "", &idx),
        ("bundle.toml", b'0', "", &toml),
        ("tokenizer.json", b'2', "/etc/passwd", b""),
    ]);
    refused("symlink.tar", &a, 4, "tokenizer.json is not a regular file");
    // the index's first, out of order: another name where it lists one
    let idx = index("swapped", 1, &files);
    let a = ustar(&[("herald-bundle.json", b'0', "", &idx), ("tokenizer.json", b'0', "", evil), ("bundle.toml", b'0', "", &toml)]);
    refused("swapped.tar", &a, 4, "member 1 is \"tokenizer.json\" where the index lists bundle.toml");
    // a well-formed archive whose bundle.toml names files it does not hold
    let idx = index("partial", 1, &files);
    let a = ustar(&[("herald-bundle.json", b'0', "", &idx), ("bundle.toml", b'0', "", &toml), ("tokenizer.json", b'0', "", evil)]);
    refused("partial.tar", &a, 4, "bundle.toml names");
    // an index that lies about its fingerprint, and a name that is a path
    let mut idx: serde_json::Value = serde_json::from_slice(&index("x", 1, &files)).unwrap();
    idx["fingerprint"] = serde_json::json!("0".repeat(64));
    let a = ustar(&[("herald-bundle.json", b'0', "", &serde_json::to_vec(&idx).unwrap())]);
    refused("fingerprint.tar", &a, 4, "the fingerprint does not match");
    let idx = index("../up", 1, &files);
    refused("name.tar", &ustar(&[("herald-bundle.json", b'0', "", &idx)]), 4, "is not a bundle name");
    // tar extension records (pax, GNU long names) are refused as members, never applied: a pax
    // `size` would make the index read gigabytes, a long name rename the next member
    let idx = index("pax", 1, &files);
    let a = ustar(&[("PaxHeader", b'x', "", b"19 size=4000000000\n"), ("herald-bundle.json", b'0', "", &idx)]);
    refused("pax.tar", &a, 4, "its first member is \"PaxHeader\", not herald-bundle.json");
    let a = ustar(&[
        ("herald-bundle.json", b'0', "", &idx),
        ("bundle.toml", b'0', "", &toml),
        ("././@LongLink", b'L', "", b"tokenizer.json\0"),
        ("tokenizer.json", b'0', "", evil),
    ]);
    refused("longname.tar", &a, 4, "member 2 is \"././@LongLink\" where the index lists tokenizer.json");
    // a hard link, and a member of another size than the index says
    let a = ustar(&[
        ("herald-bundle.json", b'0', "", &idx),
        ("bundle.toml", b'0', "", &toml),
        ("tokenizer.json", b'1', "bundle.toml", b""),
    ]);
    refused("hardlink.tar", &a, 4, "tokenizer.json is not a regular file");
    let a =
        ustar(&[("herald-bundle.json", b'0', "", &idx), ("bundle.toml", b'0', "", &toml), ("tokenizer.json", b'0', "", b"owned!")]);
    refused("size.tar", &a, 4, "tokenizer.json is 6 bytes in the archive and 5 in its index");
    // an index over the limit, a path twice, a file that is also a folder, the index as a file
    refused(
        "huge-index.tar",
        &ustar(&[("herald-bundle.json", b'0', "", &vec![b' '; (1 << 20) + 1])]),
        4,
        "over the 1048576-byte limit",
    );
    for (label, list, needle) in [
        ("twice", vec!["bundle.toml", "bundle.toml"], "bundle.toml is listed twice"),
        ("file-and-folder", vec!["bundle.toml", "a", "a/b"], "a is a file and a folder"),
        ("index-as-file", vec!["bundle.toml", "herald-bundle.json"], "\"herald-bundle.json\" is not a path inside a bundle"),
    ] {
        let files: Vec<(&str, &[u8])> = list.iter().map(|p| (*p, evil)).collect();
        let idx = index(label, 1, &files);
        refused(&format!("{label}.tar"), &ustar(&[("herald-bundle.json", b'0', "", &idx)]), 4, needle);
    }
    // consistent with its index, but a file bundle.toml records another SHA-256 for (altered
    // after the export): what model.verify would refuse at every start is refused here
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(bundle())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    files.sort();
    files.iter_mut().find(|(n, _)| n == "tokenizer.json").unwrap().1.push(b' ');
    let listed: Vec<(&str, &[u8])> = files.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
    let idx = index("altered", 1, &listed);
    let mut members: Vec<(&str, u8, &str, &[u8])> = vec![("herald-bundle.json", b'0', "", &idx)];
    members.extend(listed.iter().map(|(n, d)| (*n, b'0', "", *d)));
    refused("altered.tar", &ustar(&members), 4, "tokenizer.json: its SHA-256 is not the one bundle.toml records");

    // a missing archive is bad input
    let o = herald(&["bundle", "install", d.join("nowhere.tar").to_str().unwrap()], &dir);
    assert_one_error_line(&o, 2, "nowhere.tar: cannot open");

    // a staging folder left by a killed install is removed by the next one
    std::fs::create_dir_all(dir.join(".tiny-0.6b.partial-999999999/sub")).unwrap();
    let o = herald(&["bundle", "install", packed().to_str().unwrap()], &dir);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(entries(&dir), ["tiny-0.6b"]);
}
