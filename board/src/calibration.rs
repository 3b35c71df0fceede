//! Calibrated chunk schedules: derived from what this board measured, stored per hardware +
//! bundle fingerprint, and read back by `speak`.
//!
//! Schedule derivation (issue #7, after shared/reference/edge-design-notes.md §3), with
//! `ms_per_frame` the board's production time per 80 ms frame and `jitter` the worst lateness
//! of a chunk against steady production:
//!
//! - lead = jitter + max(0, ms_per_frame − 80) × steady: the audio that must be buffered before
//!   playback so that a board slower than real time does not run dry within one steady chunk;
//! - first chunk = ceil(lead / 80) frames, clamped to [1, steady];
//! - the ramp doubles from the first chunk until it reaches steady (e.g. 1, 2, 4, 8, 16, 25);
//! - safety margin = clamp(jitter + ms_per_frame, 20, 400) ms.
//!
//! Files: `<dir>/<fingerprint>.json`, pretty JSON, written atomically with
//! [`crate::fsutil::write_atomic`] (temporary file in the same directory, fsync, rename, fsync of
//! the directory), so a power cut leaves either the old file or the new one. The fingerprint is the first 16 hex digits of SHA-256 over the hardware
//! facts that set the speed (class, CPU model, flags, core counts, big cluster, RAM in 256 MiB
//! units) and the bundle's identity string.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use model::PlaybackMetrics;

use crate::probe::HardwareProfile;

/// One codec frame, ms: the 12 Hz family's 80 ms ([`model::frame::FRAME_SECONDS_12HZ`]); a
/// calibration is stored per bundle fingerprint, so it is only ever used with that family.
pub const FRAME_MS: f64 = model::frame::FRAME_SECONDS_12HZ * 1e3;
/// Version of the file format; other versions are ignored (with a warning).
pub const FORMAT_VERSION: u32 = 1;
/// The smallest jitter assumed, ms: a quiet warm-up can measure ~0, a device in use will not.
pub const MIN_JITTER_MS: f64 = 20.0;
/// Safety margin bounds, ms (edge-design-notes §3).
pub const MARGIN_MS: (f64, f64) = (20.0, 400.0);

/// Errors of storing a calibration; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    /// Creating the directory, writing, syncing or renaming failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The measurement cannot give a schedule (fewer than two chunks with audio, zero time).
    #[error("cannot derive a schedule: {0}")]
    Unmeasurable(String),
}

/// A chunk schedule and the numbers it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Chunk sizes in frames; the last (steady) repeats.
    pub ramp: Vec<usize>,
    /// The first chunk, frames.
    pub first_chunk: usize,
    /// The steady chunk, frames.
    pub steady: usize,
    /// Audio that must be buffered before playback, ms.
    pub lead_ms: f64,
    /// Safety margin, ms.
    pub safety_margin_ms: f64,
}

/// Derive the schedule from the production time per frame and the jitter (both ms).
///
/// `steady` is the steady chunk in frames (the last entry of the bundle's ramp, 25).
pub fn derive_schedule(ms_per_frame: f64, jitter_ms: f64, steady: usize) -> Schedule {
    let steady = steady.max(1);
    let lead_ms = jitter_ms + (ms_per_frame - FRAME_MS).max(0.0) * steady as f64;
    let first = ((lead_ms / FRAME_MS).ceil() as usize).clamp(1, steady);
    let mut ramp = vec![first];
    let mut n = first;
    while n < steady {
        n = (n * 2).min(steady);
        ramp.push(n);
    }
    let safety_margin_ms = (jitter_ms + ms_per_frame).clamp(MARGIN_MS.0, MARGIN_MS.1);
    Schedule { ramp, first_chunk: first, steady, lead_ms, safety_margin_ms }
}

/// The chunk timeline a schedule gives on a board that produces one frame every
/// `ms_per_frame` after a prefill of `prefill_ms`, with a vocoder on its own thread that takes
/// `vocoder_ms(w)` for a window of `w` frames: chunk `i` of `n_i` frames (frames up to `F_i`)
/// has the window `min(left_context, F_(i-1)) + n_i` and is ready at
/// `max(prefill + F_i × ms_per_frame, ready_(i-1)) + vocoder_ms(window_i)`. Returns
/// `(arrival s, frames)` for `frames` frames in all, the form of `Report::chunk_times`.
pub fn simulate(
    ramp: &[usize],
    ms_per_frame: f64,
    prefill_ms: f64,
    vocoder_ms: &dyn Fn(usize) -> f64,
    left_context: usize,
    frames: usize,
) -> Vec<(f64, usize)> {
    let steady = ramp.last().copied().unwrap_or(1).max(1);
    let mut out = Vec::new();
    let (mut done, mut ready) = (0usize, 0.0f64);
    let mut i = 0;
    while done < frames {
        let n = ramp.get(i).copied().unwrap_or(steady).max(1).min(frames - done);
        let window = done.min(left_context) + n;
        done += n;
        ready = (prefill_ms + done as f64 * ms_per_frame).max(ready) + vocoder_ms(window);
        out.push((ready / 1e3, n));
        i += 1;
    }
    out
}

/// The vocoder cost of a window of `n` frames, interpolated linearly between the measured sizes
/// (and extrapolated from the two nearest at the ends); 0 with no measurements.
pub fn vocoder_cost_ms(measured: &BTreeMap<usize, f64>, n: usize) -> f64 {
    if let Some(&ms) = measured.get(&n) {
        return ms;
    }
    let below = measured.range(..n).next_back();
    let above = measured.range(n..).next();
    let ((x0, y0), (x1, y1)) = match (below, above) {
        (Some(a), Some(b)) => (a, b),
        (Some(a), None) => match measured.range(..*a.0).next_back() {
            Some(b) => (b, a),
            None => return *a.1,
        },
        (None, Some(b)) => match measured.range(*b.0 + 1..).next() {
            Some(c) => (b, c),
            None => return *b.1,
        },
        (None, None) => return 0.0,
    };
    let t = (n as f64 - *x0 as f64) / (*x1 as f64 - *x0 as f64);
    (y0 + t * (y1 - y0)).max(0.0)
}

/// The formula's schedule ([`derive_schedule`]), checked against a simulation of this board
/// ([`simulate`] over `frames` frames, every chunk after the first `jitter_ms` late): where it
/// would stall, the first chunk grows (and the ramp doubles from there) until the simulated
/// playback, started at the first audio, never waits — or the first chunk is `steady`.
///
/// Why: the formula's lead covers one steady chunk on a board slower than real time. A doubling
/// ramp also stalls on boards faster than real time but slower than 40 ms per frame: each
/// chunk takes twice as long to produce as the previous one lasts. The simulation catches that.
/// On a board slower than real time no finite lead avoids a stall in a long utterance; the
/// check then stops at the formula.
pub fn derive_checked_schedule(m: &Measured, steady: usize, left_context: usize, frames: usize) -> Schedule {
    let mut s = derive_schedule(m.ms_per_frame, m.jitter_ms, steady);
    if m.ms_per_frame > FRAME_MS {
        return s;
    }
    let voc = |n: usize| vocoder_cost_ms(&m.vocoder_ms, n);
    let stalls = |ramp: &[usize]| {
        let mpf = if m.decode_ms_per_frame > 0.0 { m.decode_ms_per_frame } else { m.ms_per_frame };
        let mut t = simulate(ramp, mpf, m.prefill_ms, &voc, left_context, frames);
        for c in t.iter_mut().skip(1) {
            c.0 += m.jitter_ms / 1e3;
        }
        let pm = PlaybackMetrics::from_chunks(&t, FRAME_MS / 1e3).playback_start;
        pm > t[0].0 + 1e-9
    };
    while stalls(&s.ramp) && s.first_chunk < s.steady {
        let first = s.first_chunk + 1;
        let mut ramp = vec![first];
        let mut n = first;
        while n < s.steady {
            n = (n * 2).min(s.steady);
            ramp.push(n);
        }
        s.ramp = ramp;
        s.first_chunk = first;
        s.lead_ms = s.lead_ms.max((first - 1) as f64 * FRAME_MS);
    }
    s
}

/// Production rate from a chunk timeline of `(arrival s, frames)`: the frames after the first
/// chunk divided by the time between the first and the last arrival, frames per second
/// (edge-design-notes §3). `None` with fewer than two chunks or no elapsed time.
pub fn rate_from_chunks(chunks: &[(f64, usize)]) -> Option<f64> {
    let (first, rest) = chunks.split_first()?;
    let last = rest.last()?;
    let frames: usize = rest.iter().map(|c| c.1).sum();
    let wall = last.0 - first.0;
    (wall > 0.0 && frames > 0).then(|| frames as f64 / wall)
}

/// Jitter: the worst lateness of a measured chunk against the model of the board, ms (≥ 0):
/// `max_i (measured_i − modelled_i)` over chunks present in both timelines (arrival seconds),
/// where the model is [`simulate`] with the measured decode time per frame, prefill and vocoder
/// cost per window. What the model explains (production, vocoder windows) is not jitter; what
/// is left (scheduling, caches, other processes) is.
pub fn lateness_ms(measured: &[(f64, usize)], modelled: &[(f64, usize)]) -> f64 {
    measured.iter().zip(modelled).map(|(m, s)| (m.0 - s.0) * 1e3).fold(0.0, f64::max)
}

/// What calibration measured on this board.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// Warm-up utterances measured (after the discarded first one).
    pub utterances: usize,
    /// Frames produced per wall second by the whole pipeline (decode and vocoder together).
    pub rate_frames_per_s: f64,
    /// 1000 / rate, ms.
    pub ms_per_frame: f64,
    /// Real-time factor of production, ms_per_frame / 80.
    pub rtf: f64,
    /// Decode time per frame (talker + code predictor + sampling, from the step statistics),
    /// ms: the production side of the model [`simulate`] runs.
    pub decode_ms_per_frame: f64,
    /// Worst chunk lateness against the board's model ([`lateness_ms`]), ms, at least
    /// [`MIN_JITTER_MS`].
    pub jitter_ms: f64,
    /// Median prefill (prompt) time, ms.
    pub prefill_ms: f64,
    /// Median vocoder time per window length (frames of left context + chunk → ms).
    pub vocoder_ms: BTreeMap<usize, f64>,
    /// Median time to first audio with the default ramp, ms.
    pub ttfa_default_ms: f64,
    /// Frames per text token of the utterances that ended by themselves (the playback start
    /// policy's length prediction, `model::start`); absent in older files and when no
    /// utterance ended by itself.
    #[serde(default)]
    pub frames_per_token: Option<f64>,
    /// How the numbers were measured: `calibrate` (the command) or `automatic` (the first
    /// utterances of a board without a calibration, docs/board.md).
    #[serde(default)]
    pub source: Option<String>,
}

/// A stored calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// The fingerprint this file is for (also its file name).
    pub fingerprint: String,
    /// herald's version that wrote it.
    pub herald: String,
    /// Seconds since the Unix epoch when it was written.
    pub created_unix: u64,
    /// The probe's one-line description of the board.
    pub hardware: String,
    /// The bundle's identity string ([`fingerprint`]'s second input).
    pub bundle: String,
    /// Measured while `HERALD_HW_PROFILE` described another board: the numbers are this
    /// machine's, filed under that board's fingerprint (tests, demonstrations). A live probe
    /// ignores such a file.
    #[serde(default)]
    pub profile_override: bool,
    /// The measurements.
    pub measured: Measured,
    /// The formula's schedule ([`derive_schedule`]).
    pub formula: Schedule,
    /// The schedule `speak` uses: the formula's, checked against a simulation of this board
    /// ([`derive_checked_schedule`]).
    pub schedule: Schedule,
}

/// The speed-relevant hardware facts, in a fixed order, for the fingerprint.
#[derive(Serialize)]
struct HardwareKey<'a> {
    class: &'a str,
    arch: &'a str,
    cpu_model: &'a str,
    flags: Vec<&'a str>,
    n_logical: usize,
    n_physical: usize,
    big: Vec<usize>,
    ram_256mib: u64,
}

/// First 16 hex digits of SHA-256 over the speed-relevant hardware facts and `bundle_id`
/// (which the caller derives from the bundle's manifest and file sizes).
pub fn fingerprint(hw: &HardwareProfile, bundle_id: &str) -> String {
    let mut flags: Vec<&str> = hw.cpu_flags.iter().map(String::as_str).collect();
    flags.sort_unstable();
    let key = HardwareKey {
        class: hw.class.as_str(),
        arch: &hw.arch,
        cpu_model: &hw.cpu_model,
        flags,
        n_logical: hw.n_logical,
        n_physical: hw.n_physical,
        big: hw.big_cpus(),
        ram_256mib: hw.ram_total_bytes >> 28,
    };
    let mut h = Sha256::new();
    h.update(serde_json::to_string(&key).unwrap_or_default().as_bytes());
    h.update([0u8]);
    h.update(bundle_id.as_bytes());
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The file of `fingerprint` in `dir`.
pub fn path_for(dir: &Path, fingerprint: &str) -> PathBuf {
    dir.join(format!("{fingerprint}.json"))
}

/// Write `cal` to `<dir>/<fingerprint>.json` atomically; creates `dir`. Returns the path.
///
/// # Errors
/// [`CalibrationError::Write`] naming the path that failed; no partial file is left.
pub fn store(dir: &Path, cal: &Calibration) -> Result<PathBuf, CalibrationError> {
    let werr = |path: &Path| {
        let path = path.to_owned();
        move |source| CalibrationError::Write { path, source }
    };
    fs::create_dir_all(dir).map_err(werr(dir))?;
    let path = path_for(dir, &cal.fingerprint);
    let text = serde_json::to_string_pretty(cal).unwrap_or_default() + "\n";
    crate::fsutil::write_atomic(&path, text.as_bytes()).map_err(werr(&path))?;
    Ok(path)
}

/// What [`load`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// A valid calibration for this fingerprint.
    Found(Box<Calibration>, PathBuf),
    /// No file (or no directory): use the defaults.
    Missing(PathBuf),
    /// A file that cannot be used (corrupt, another version, another fingerprint, a bad
    /// schedule); the reason names the file. Log it once and use the defaults.
    Ignored(String),
}

/// The largest calibration file read, bytes (a real one is about 1 KiB).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Read a regular file of at most [`MAX_FILE_BYTES`]. Opened non-blocking, so that a FIFO in its
/// place cannot hang the caller; anything but a regular file is an error.
fn read_small_regular(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let md = f.metadata()?;
    if !md.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if md.len() > MAX_FILE_BYTES {
        return Err(std::io::Error::other(format!("{} bytes, more than a calibration file ({MAX_FILE_BYTES} at most)", md.len())));
    }
    let mut text = String::new();
    f.take(MAX_FILE_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// Read the calibration of `fingerprint` from `dir`, checking that it is well-formed, of this
/// format version, for this fingerprint, and has a usable ramp (1..=32 entries of 1..=256
/// frames) ending at `steady` (any ending when `steady` is 0). `live`: the hardware profile
/// comes from the probe, so a file measured under a profile override does not apply.
pub fn load(dir: &Path, fingerprint: &str, steady: usize, live: bool) -> Lookup {
    let path = path_for(dir, fingerprint);
    let text = match read_small_regular(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Missing(path),
        Err(e) => return Lookup::Ignored(format!("{}: {e}", path.display())),
    };
    let cal: Calibration = match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => return Lookup::Ignored(format!("{}: not a calibration file ({e})", path.display())),
    };
    if cal.version != FORMAT_VERSION {
        return Lookup::Ignored(format!("{}: format version {} (this herald reads {FORMAT_VERSION})", path.display(), cal.version));
    }
    if cal.fingerprint != fingerprint {
        return Lookup::Ignored(format!(
            "{}: written for fingerprint {}, not this board and bundle ({fingerprint})",
            path.display(),
            cal.fingerprint
        ));
    }
    if live && cal.profile_override {
        return Lookup::Ignored(format!("{}: measured on another machine under HERALD_HW_PROFILE, not on this board", path.display()));
    }
    let r = &cal.schedule.ramp;
    if r.is_empty() || r.contains(&0) || r.len() > 32 || r.iter().any(|&n| n > 256) {
        let shown: Vec<usize> = r.iter().copied().take(8).collect();
        let more = if r.len() > 8 { format!(" … ({} entries)", r.len()) } else { String::new() };
        return Lookup::Ignored(format!("{}: unusable ramp {shown:?}{more}", path.display()));
    }
    if steady > 0 && r.last() != Some(&steady) {
        return Lookup::Ignored(format!(
            "{}: ramp {r:?} does not end at the bundle's steady chunk of {steady} frames",
            path.display()
        ));
    }
    Lookup::Found(Box::new(cal), path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_examples_of_the_reference_design() {
        // 150 frames/s: 6.7 ms per frame, jitter 40 -> lead 40 -> first 1, ramp 1..25
        let s = derive_schedule(1000.0 / 150.0, 40.0, 25);
        assert_eq!(s.first_chunk, 1);
        assert_eq!(s.ramp, vec![1, 2, 4, 8, 16, 25]);
        assert!((s.safety_margin_ms - (40.0 + 1000.0 / 150.0)).abs() < 1e-9);
        // 10 frames/s: 100 ms per frame -> lead = 40 + 20 x 25 = 540 -> ceil(6.75) = 7,
        // margin 140, ramp 7, 14, 25 (edge-design-notes §3)
        let s = derive_schedule(100.0, 40.0, 25);
        assert!((s.lead_ms - 540.0).abs() < 1e-9);
        assert_eq!(s.first_chunk, 7);
        assert_eq!(s.ramp, vec![7, 14, 25]);
        assert!((s.safety_margin_ms - 140.0).abs() < 1e-9);
    }

    #[test]
    fn clamps() {
        // very slow board: the first chunk is clamped to steady, the margin to 400
        let s = derive_schedule(400.0, 100.0, 25);
        assert_eq!(s.ramp, vec![25]);
        assert_eq!(s.safety_margin_ms, 400.0);
        // very fast, no jitter: margin floor 20
        let s = derive_schedule(1.0, 0.0, 25);
        assert_eq!(s.first_chunk, 1);
        assert_eq!(s.safety_margin_ms, 20.0);
        // exactly 80 ms per frame: only the jitter leads; 81 ms of jitter needs 2 frames
        assert_eq!(derive_schedule(80.0, 81.0, 25).first_chunk, 2);
    }

    #[test]
    fn simulated_timeline_by_hand() {
        // 50 ms/frame, prefill 100 ms, vocoder 10 ms + 1 ms per window frame, left context 8;
        // ramp 2, 4 then 4s.
        // chunk 0: frames 1-2 done at 100 + 100 = 200, window 2 -> +12 -> 212 ms
        // chunk 1: frames 3-6 done at 400, window 2 + 4 -> +16 -> 416
        // chunk 2: frames 7-10 done at 600, window min(8, 6) + 4 = 10 -> +20 -> 620
        // chunk 3: frames 11-12 done at 700, window min(8, 10) + 2 = 10 -> +20 -> 720
        let voc = |w: usize| 10.0 + w as f64;
        let t = simulate(&[2, 4], 50.0, 100.0, &voc, 8, 12);
        let want = [(0.212, 2), (0.416, 4), (0.620, 4), (0.720, 2)];
        assert_eq!(t.len(), want.len());
        for (a, b) in t.iter().zip(want) {
            assert!((a.0 - b.0).abs() < 1e-9 && a.1 == b.1, "{t:?}");
        }
        // a vocoder slower than production delays every later chunk behind it
        let slow = |_n: usize| 300.0;
        let t = simulate(&[2], 50.0, 0.0, &slow, 72, 6);
        assert_eq!(t.iter().map(|c| (c.0 * 1e3).round() as i64).collect::<Vec<_>>(), [400, 700, 1000]);
    }

    #[test]
    fn vocoder_cost_interpolates() {
        let m = BTreeMap::from([(1, 10.0), (4, 16.0), (25, 58.0)]);
        assert_eq!(vocoder_cost_ms(&m, 4), 16.0);
        assert!((vocoder_cost_ms(&m, 2) - 12.0).abs() < 1e-9);
        assert!((vocoder_cost_ms(&m, 11) - 30.0).abs() < 1e-9);
        // beyond the ends: the nearest segment's slope (2 ms per frame)
        assert!((vocoder_cost_ms(&m, 30) - 68.0).abs() < 1e-9);
        assert_eq!(vocoder_cost_ms(&BTreeMap::new(), 3), 0.0);
    }

    fn measured(ms_per_frame: f64, jitter: f64) -> Measured {
        Measured {
            utterances: 1,
            rate_frames_per_s: 1e3 / ms_per_frame,
            ms_per_frame,
            rtf: ms_per_frame / 80.0,
            decode_ms_per_frame: ms_per_frame,
            jitter_ms: jitter,
            prefill_ms: 20.0,
            vocoder_ms: BTreeMap::from([(1, 2.0), (25, 10.0)]),
            ttfa_default_ms: 0.0,
            frames_per_token: None,
            source: None,
        }
    }

    #[test]
    fn checked_schedule_keeps_the_formula_on_a_fast_board() {
        // 5 ms/frame: the formula's 1-frame start never stalls
        let m = measured(5.0, 20.0);
        assert_eq!(derive_checked_schedule(&m, 25, 72, 300), derive_schedule(5.0, 20.0, 25));
    }

    #[test]
    fn checked_schedule_grows_the_first_chunk_where_doubling_outruns_playback() {
        // 70 ms/frame: the formula says lead = jitter only, first chunk 1; but chunk 2 (2
        // frames) is ready 140 ms after chunk 1, which lasts 80 ms: a stall.
        let m = measured(70.0, 20.0);
        let formula = derive_schedule(70.0, 20.0, 25);
        assert_eq!(formula.first_chunk, 1);
        let voc = |n: usize| vocoder_cost_ms(&m.vocoder_ms, n);
        let late = |ramp: &[usize]| {
            let mut t = simulate(ramp, 70.0, 20.0, &voc, 72, 300);
            for c in t.iter_mut().skip(1) {
                c.0 += 0.020;
            }
            PlaybackMetrics::from_chunks(&t, 0.08).playback_start - t[0].0
        };
        assert!(late(&formula.ramp) > 0.0);
        let checked = derive_checked_schedule(&m, 25, 72, 300);
        assert!(checked.first_chunk > 1);
        assert!(late(&checked.ramp) <= 1e-9, "{checked:?}");
        // and it is the smallest first chunk that does not stall
        let mut smaller = vec![checked.first_chunk - 1];
        while *smaller.last().unwrap() < 25 {
            let n = (smaller.last().unwrap() * 2).min(25);
            smaller.push(n);
        }
        assert!(late(&smaller) > 0.0);
        assert_eq!(*checked.ramp.last().unwrap(), 25);
    }

    #[test]
    fn checked_schedule_on_a_board_slower_than_real_time_is_the_formula() {
        let m = measured(100.0, 40.0);
        assert_eq!(derive_checked_schedule(&m, 25, 72, 300).ramp, vec![7, 14, 25]);
    }

    #[test]
    fn rate_and_jitter_from_a_timeline() {
        // first chunk 2 frames at 0.1 s, then 4 frames at 0.3, 8 at 0.7: 12 frames in 0.6 s
        let t = [(0.1, 2), (0.3, 4), (0.7, 8)];
        let r = rate_from_chunks(&t).unwrap();
        assert!((r - 20.0).abs() < 1e-9);
        // against a model: the worst lateness, never negative
        assert!((lateness_ms(&t, &[(0.1, 2), (0.25, 4), (0.72, 8)]) - 50.0).abs() < 1e-9);
        assert_eq!(lateness_ms(&t, &[(0.2, 2), (0.4, 4), (0.8, 8)]), 0.0);
        assert_eq!(rate_from_chunks(&[(0.1, 2)]), None);
    }

    fn sample(fp: &str) -> Calibration {
        Calibration {
            version: FORMAT_VERSION,
            fingerprint: fp.into(),
            herald: "test".into(),
            created_unix: 1,
            hardware: "hw".into(),
            bundle: "b".into(),
            profile_override: false,
            measured: Measured {
                utterances: 2,
                rate_frames_per_s: 20.0,
                ms_per_frame: 50.0,
                rtf: 0.625,
                decode_ms_per_frame: 40.0,
                jitter_ms: 20.0,
                prefill_ms: 5.0,
                vocoder_ms: BTreeMap::from([(1, 3.0), (25, 30.0)]),
                ttfa_default_ms: 120.0,
                frames_per_token: None,
                source: None,
            },
            formula: derive_schedule(50.0, 20.0, 25),
            schedule: derive_schedule(50.0, 20.0, 25),
        }
    }

    #[test]
    fn store_then_load_round_trips_and_leaves_no_temp_file() {
        let dir = std::env::temp_dir().join(format!("herald-cal-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let sub = dir.join("a/b");
        let cal = sample("0123456789abcdef");
        let path = store(&sub, &cal).unwrap();
        assert_eq!(path, sub.join("0123456789abcdef.json"));
        assert_eq!(fs::read_dir(&sub).unwrap().count(), 1);
        match load(&sub, "0123456789abcdef", 25, true) {
            Lookup::Found(c, p) => {
                assert_eq!(*c, cal);
                assert_eq!(p, path);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(load(&sub, "ffffffffffffffff", 25, true), Lookup::Missing(_)));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn corrupt_foreign_and_odd_files_are_ignored_with_a_reason() {
        let dir = std::env::temp_dir().join(format!("herald-cal-bad-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let fp = "00000000000000aa";
        let write = |text: &str| fs::write(path_for(&dir, fp), text).unwrap();
        let reason = |steady| match load(&dir, fp, steady, true) {
            Lookup::Ignored(r) => r,
            other => panic!("{other:?}"),
        };
        write("{ not json");
        assert!(reason(25).contains("not a calibration file"));
        // foreign: a valid file copied from another board
        write(&serde_json::to_string(&sample("00000000000000bb")).unwrap());
        assert!(reason(25).contains("written for fingerprint 00000000000000bb"));
        let mut c = sample(fp);
        c.version = 99;
        write(&serde_json::to_string(&c).unwrap());
        assert!(reason(25).contains("format version 99"));
        let mut c = sample(fp);
        c.schedule.ramp = vec![2, 0, 25];
        write(&serde_json::to_string(&c).unwrap());
        assert!(reason(25).contains("unusable ramp"));
        // a bundle whose steady chunk differs
        write(&serde_json::to_string(&sample(fp)).unwrap());
        assert!(reason(30).contains("steady chunk of 30"));
        assert!(matches!(load(&dir, fp, 25, true), Lookup::Found(..)));
        // measured under HERALD_HW_PROFILE: fine for another override run, not for the board
        let mut c = sample(fp);
        c.profile_override = true;
        write(&serde_json::to_string(&c).unwrap());
        assert!(reason(25).contains("HERALD_HW_PROFILE"));
        assert!(matches!(load(&dir, fp, 25, false), Lookup::Found(..)));
        // a 1000-entry ramp is reported briefly
        let mut c = sample(fp);
        c.schedule.ramp = vec![1; 1000];
        write(&serde_json::to_string(&c).unwrap());
        let r = reason(25);
        assert!(r.contains("(1000 entries)") && r.len() < 200, "{r}");
        // not a regular file: a FIFO does not hang, a directory and a huge file are refused
        let path = path_for(&dir, fp);
        fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(reason(25).contains("not a regular file"));
        fs::remove_file(&path).unwrap();
        fs::create_dir(&path).unwrap();
        assert!(reason(25).contains("not a regular file"));
        fs::remove_dir(&path).unwrap();
        fs::write(&path, vec![b' '; (MAX_FILE_BYTES + 1) as usize]).unwrap();
        assert!(reason(25).contains("more than a calibration file"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fingerprint_is_16_hex_stable_and_sensitive() {
        let hw = HardwareProfile { cpu_model: "Cortex-A76".into(), n_logical: 4, ..HardwareProfile::default() };
        let a = fingerprint(&hw, "bundle-1");
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(a, fingerprint(&hw.clone(), "bundle-1"));
        assert_ne!(a, fingerprint(&hw, "bundle-2"));
        let mut other = hw.clone();
        other.n_logical = 8;
        assert_ne!(a, fingerprint(&other, "bundle-1"));
        // RAM within the same 256 MiB step and the available memory do not change it
        let mut same = hw.clone();
        same.ram_available_bytes = 12345;
        assert_eq!(a, fingerprint(&same, "bundle-1"));
    }
}
