//! AlsaSink through the real alsa-lib, without sound hardware.
//!
//! The test process points `ALSA_CONFIG_PATH` at its own asound.conf (in a temp dir) before
//! the first ALSA call, so only the PCMs defined there exist:
//!
//! - `herald_null`: alsa-lib's `file` plugin over `null`. `null` accepts any parameters and
//!   consumes instantly; `file` records every frame the slave accepted (raw, as written).
//! - `herald_plug48`: `file` over `plug` over a 2-binding `multi` over `null`, with the plug
//!   slave at `rate 48000; channels unchanged`. `multi` has exactly 2 client channels, so mono is
//!   refused; with herald's default "no alsa-lib resampling" (`SND_PCM_HW_PARAMS_NORESAMPLE`)
//!   plug links the rate to its slave, so only 48 kHz is offered — the situation of `default` →
//!   plug → dmix at 48 kHz on a real board.
//! - `herald_fixed48` / `herald_u8`: `file` over `heraldclk`, an ioplug test plugin compiled from
//!   C at test time (below), constrained like a `hw:` codec: S16_LE, 2 channels, 48000 Hz only
//!   (or U8 only).
//! - `herald_clock`: `file` over `heraldclk` in real-time mode: its hardware pointer advances
//!   with CLOCK_MONOTONIC at the granted rate and reports an underrun (-EPIPE, exactly like a
//!   driver) when it passes the frames the application wrote. `null` never underruns (its
//!   pointer jumps to the application pointer), so this is how xruns are provoked.
//! - `herald_frozen`: `heraldclk` whose pointer never moves (a codec whose clock stopped), with
//!   the exclusive lock, so a leaked handle would show as EBUSY.
//! - `herald_busy`: `heraldclk` that takes an exclusive `flock` at open and fails the open with
//!   -EBUSY while another handle holds it — what `hw:` does for a second opener.
//! - `herald_fault`: `heraldclk` in real-time mode with a fault file (`<dir>/fault`) the test
//!   writes while a stream runs: `unplug` (every call fails with -ENODEV, as a card that was
//!   pulled out), `freeze` (the clock stops), `busy` (opens fail with -EBUSY).
//!
//! All ALSA work runs under one mutex (alsa-lib's global config and the env var are shared).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

#[path = "support/alsa_plugin.rs"]
mod alsa_plugin;

use board::audio::{
    AlsaSettings, AlsaSink, AudioSink, SampleFormat, ShaperSettings, SinkError, SinkErrorKind, SinkStats, WavSink,
    list_playback_devices,
};

struct Env {
    dir: PathBuf,
}

static ENV: OnceLock<Env> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

/// Serialise the test and make sure the ALSA configuration is in place.
fn env() -> (MutexGuard<'static, ()>, &'static Env) {
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    (guard, ENV.get_or_init(setup))
}

fn setup() -> Env {
    // Remove what earlier (finished) runs left behind; the directory is named after the pid.
    if let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("herald-alsa-")
                && !Path::new("/proc").join(pid).exists()
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    let dir = std::env::temp_dir().join(format!("herald-alsa-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let plugin = alsa_plugin::build(&dir);
    let d = dir.display();
    let conf = format!(
        r#"
{plugin}
pcm.herald_null {{
    type file
    slave.pcm {{ type null }}
    file "{d}/null.raw"
    format "raw"
    hint {{ show on; description "herald test: file plugin over null" }}
}}
pcm.herald_plug48 {{
    type file
    file "{d}/plug48.raw"
    format "raw"
    slave.pcm {{
        type plug
        slave {{
            pcm {{
                type multi
                slaves.a {{ pcm {{ type null }} channels 2 }}
                bindings.0 {{ slave a; channel 0 }}
                bindings.1 {{ slave a; channel 1 }}
            }}
            rate 48000
            channels unchanged
            format unchanged
        }}
    }}
    hint {{ show on; description "herald test: plug over a 48 kHz stereo slave" }}
}}
pcm.herald_fixed48 {{
    type file
    file "{d}/fixed48.raw"
    format "raw"
    slave.pcm {{ type heraldclk; rate 48000; channels 2; format "S16_LE" }}
}}
pcm.herald_u8 {{
    type heraldclk
    format "U8"
}}
pcm.herald_clock {{
    type file
    file "{d}/clock.raw"
    format "raw"
    slave.pcm {{ type heraldclk; realtime true }}
}}
pcm.herald_frozen {{
    type heraldclk
    frozen true
    lock "{d}/frozen.lock"
}}
pcm.herald_busy {{
    type heraldclk
    lock "{d}/busy.lock"
}}
pcm.herald_fault {{
    type heraldclk
    realtime true
    fault "{d}/fault"
}}
"#
    );
    let conf_path = dir.join("asound.conf");
    std::fs::write(&conf_path, conf).unwrap();
    // SAFETY: every test in this binary takes SERIAL before touching ALSA or the environment,
    // and this runs (once, under SERIAL) before the first ALSA call; no other thread reads the
    // environment meanwhile.
    unsafe { std::env::set_var("ALSA_CONFIG_PATH", &conf_path) };
    Env { dir }
}

/// Deterministic test signal at 24 kHz: two sine sweeps (200 → 4000 Hz and back) with silence
/// gaps between and around them.
fn signal() -> Vec<f32> {
    let rate = 24000.0f64;
    let mut x = vec![0.0f32; 600];
    for (f0, f1, secs) in [(200.0f64, 4000.0f64, 0.25f64), (4000.0, 300.0, 0.2)] {
        let n = (secs * rate) as usize;
        let mut phase = 0.0f64;
        for i in 0..n {
            let f = f0 + (f1 - f0) * i as f64 / n as f64;
            phase += std::f64::consts::TAU * f / rate;
            x.push((0.7 * phase.sin()) as f32);
        }
        x.extend(std::iter::repeat_n(0.0, 1201));
    }
    x
}

/// Odd chunk sizes, cycled.
const CHUNKS: [usize; 7] = [1, 7, 333, 1001, 17, 2049, 480];

fn shaper() -> ShaperSettings {
    ShaperSettings { gain: 0.9, lead_silence_ms: 10, trail_silence_ms: 15, fade_ms: 5 }
}

/// Play `x` in odd chunks; sleep `stall` after the chunks whose index is in `stall_after`.
fn play(sink: &mut dyn AudioSink, x: &[f32], stall_after: &[usize], stall: Duration) -> SinkStats {
    sink.begin(24000).unwrap();
    let mut rest = x;
    let mut k = 0;
    while !rest.is_empty() {
        let n = CHUNKS[k % CHUNKS.len()].min(rest.len());
        sink.write(&rest[..n]).unwrap();
        rest = &rest[n..];
        if stall_after.contains(&k) {
            std::thread::sleep(stall);
        }
        k += 1;
    }
    sink.finish().unwrap()
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);
impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The WavSink rendering of `x` (same chunks, same shaper): the samples after the header.
fn wav_reference(x: &[f32]) -> Vec<i16> {
    let buf = Shared::default();
    let mut sink = WavSink::stream(buf.clone(), "memory", shaper());
    play(&mut sink, x, &[], Duration::ZERO);
    sink.close().unwrap();
    let bytes = buf.0.lock().unwrap().clone();
    assert_eq!(&bytes[..4], b"RIFF");
    s16(&bytes[44..])
}

fn s16(b: &[u8]) -> Vec<i16> {
    b.chunks_exact(2).map(|c| i16::from_le_bytes([c[0], c[1]])).collect()
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("capture {name}: {e}"))
}

fn sink(device: &str) -> AlsaSink {
    AlsaSink::new(AlsaSettings { device: device.into(), ..AlsaSettings::default() }, shaper())
}

#[test]
fn a_capture_through_file_over_null_equals_the_wav_output() {
    let (_g, env) = env();
    let x = signal();
    let reference = wav_reference(&x);
    let mut s = sink("herald_null");
    for round in 0..2 {
        let stats = play(&mut s, &x, &[], Duration::ZERO);
        eprintln!("herald_null granted (round {round}): {stats:?}");
        assert_eq!((stats.device_rate, stats.channels, stats.format), (24000, 1, SampleFormat::S16));
        assert!(!stats.resampled);
        assert_eq!(stats.input_samples, x.len() as u64);
        assert_eq!(stats.frames_written, reference.len() as u64);
        assert_eq!(stats.xruns, 0);
        assert_eq!((stats.period_frames, stats.buffer_frames), (480, 1920));
        let captured = s16(&read(&env.dir, "null.raw"));
        assert_eq!(captured.len(), reference.len());
        assert!(captured == reference, "ALSA capture differs from the WAV output");
    }

    // Float output: the same samples before quantisation.
    let mut f =
        AlsaSink::new(AlsaSettings { device: "herald_null".into(), format: SampleFormat::F32, ..AlsaSettings::default() }, shaper());
    let stats = play(&mut f, &x, &[], Duration::ZERO);
    eprintln!("herald_null granted with FLOAT_LE preferred: {stats:?}");
    assert_eq!(stats.format, SampleFormat::F32);
    let floats: Vec<i16> = read(&env.dir, "null.raw")
        .chunks_exact(4)
        .map(|c| board::pcm::f32_to_s16(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    assert!(floats == reference, "float capture differs from the WAV output");
}

#[test]
fn b_underruns_are_recovered_without_dropping_or_repeating_samples() {
    let (_g, env) = env();
    let x = signal();
    let reference = wav_reference(&x);
    let mut s = sink("herald_clock");
    // Buffer = 4 × 20 ms = 80 ms; stall 250 ms twice.
    let t = Instant::now();
    let stats = play(&mut s, &x, &[3, 8], Duration::from_millis(250));
    let took = t.elapsed();
    eprintln!("herald_clock granted: {stats:?}, took {took:?}");
    assert_eq!((stats.device_rate, stats.channels), (24000, 1));
    assert!(stats.xruns >= 2, "expected an underrun per stall, got {}", stats.xruns);
    // Real time: the audio's duration plus each stall minus the buffer that played during it.
    let audio_ms = reference.len() as u64 * 1000 / 24000;
    let buffer_ms = u64::from(stats.buffer_frames) * 1000 / 24000;
    assert!(took >= Duration::from_millis(audio_ms + 2 * (250 - buffer_ms)), "{took:?}: not real time");
    let captured = s16(&read(&env.dir, "clock.raw"));
    assert_eq!(captured.len(), reference.len(), "frames dropped or duplicated");
    assert!(captured == reference, "capture differs from the WAV output after xrun recovery");
    assert_eq!(stats.frames_written, reference.len() as u64);
}

/// Left/right identical, and the 2x-upsampled left channel lines up with the 24 kHz reference.
fn check_48k_stereo(captured: &[i16], reference: &[i16], name: &str) {
    assert_eq!(captured.len(), 2 * 2 * reference.len(), "{name}: 2 channels × round(n × 48000/24000) frames");
    let left: Vec<f64> = captured.chunks_exact(2).map(|f| f64::from(f[0])).collect();
    assert!(captured.chunks_exact(2).all(|f| f[0] == f[1]), "{name}: channels differ");
    let (mut err, mut sig) = (0.0f64, 0.0f64);
    for (i, &r) in reference.iter().enumerate() {
        let d = left[2 * i] - f64::from(r);
        err += d * d;
        sig += f64::from(r) * f64::from(r);
    }
    let rel = (err / sig).sqrt();
    eprintln!("{name}: relative RMS error of the even 48 kHz samples vs the 24 kHz reference: {rel:.5}");
    assert!(rel < 0.01, "{name}: resampled output misaligned or distorted ({rel})");
}

#[test]
fn c_48k_stereo_devices_get_resampled_and_upmixed_audio() {
    let (_g, env) = env();
    let x = signal();
    let reference = wav_reference(&x);
    for (device, file) in [("herald_plug48", "plug48.raw"), ("herald_fixed48", "fixed48.raw")] {
        let mut s = sink(device);
        let stats = play(&mut s, &x, &[], Duration::ZERO);
        eprintln!("{device} granted: {stats:?}");
        assert_eq!((stats.device_rate, stats.channels, stats.format), (48000, 2, SampleFormat::S16));
        assert!(stats.resampled);
        assert_eq!(stats.frames_written, 2 * reference.len() as u64);
        assert_eq!((stats.period_frames, stats.buffer_frames), (960, 3840));
        check_48k_stereo(&s16(&read(&env.dir, file)), &reference, device);
    }

    // With alsa-lib resampling allowed, plug converts the rate itself (channels stay linked).
    let mut s =
        AlsaSink::new(AlsaSettings { device: "herald_plug48".into(), alsa_resample: true, ..AlsaSettings::default() }, shaper());
    let stats = play(&mut s, &x, &[], Duration::ZERO);
    eprintln!("herald_plug48 with alsa_resample granted: {stats:?}");
    assert_eq!((stats.device_rate, stats.channels), (24000, 2));
    assert!(!stats.resampled);
    let captured = s16(&read(&env.dir, "plug48.raw"));
    let left: Vec<i16> = captured.chunks_exact(2).map(|f| f[0]).collect();
    assert!(left == reference);
}

#[test]
fn d_busy_and_missing_devices_give_typed_errors() {
    let (_g, _env) = env();
    let retrying = |device: &str, delay_ms: u64| {
        AlsaSink::new(
            AlsaSettings {
                device: device.into(),
                busy_retries: 3,
                busy_retry_delay: Duration::from_millis(delay_ms),
                ..AlsaSettings::default()
            },
            shaper(),
        )
    };
    let quick = |device: &str| retrying(device, 50);

    let t = Instant::now();
    let err = retrying("herald_no_such_pcm", 1000).begin(24000).unwrap_err();
    eprintln!("missing: {err}");
    assert!(matches!(err, SinkError::NotFound { .. }), "{err:?}");
    assert_eq!(err.kind(), SinkErrorKind::NotFound);
    assert!(err.to_string().contains("herald_no_such_pcm"));
    assert!(t.elapsed() < Duration::from_millis(900), "a missing device is not retried");

    let mut holder = quick("herald_busy");
    holder.begin(24000).unwrap();
    let mut second = quick("herald_busy");
    let t = Instant::now();
    let err = second.begin(24000).unwrap_err();
    let took = t.elapsed();
    eprintln!("busy: {err} (after {took:?})");
    assert!(matches!(err, SinkError::Busy { attempts: 4, .. }), "{err:?}");
    assert_eq!(err.kind(), SinkErrorKind::Busy);
    assert!(err.to_string().contains("herald_busy"));
    assert!(took >= Duration::from_millis(150) && took < Duration::from_secs(2), "bounded retry: {took:?}");

    // finish closes the handle: the device is free for the next utterance / process.
    holder.write(&[0.1; 480]).unwrap();
    holder.finish().unwrap();
    second.begin(24000).unwrap();
    // ...and begin failing leaves nothing open: the holder can take it back after abort.
    second.abort();
    holder.begin(24000).unwrap();
    holder.abort();

    let err = quick("herald_u8").begin(24000).unwrap_err();
    eprintln!("unsupported: {err}");
    assert!(matches!(err, SinkError::Unsupported { .. }), "{err:?}");
    assert_eq!(err.kind(), SinkErrorKind::Unsupported);
}

#[test]
fn e_device_list_comes_from_the_hints() {
    let (_g, _env) = env();
    let list = list_playback_devices().unwrap();
    eprintln!("devices: {list:?}");
    let null = list.iter().find(|d| d.name == "herald_null").expect("herald_null listed");
    assert_eq!(null.description, "herald test: file plugin over null");
}

#[test]
fn f_a_device_that_stops_consuming_fails_with_stalled_and_is_released() {
    let (_g, _env) = env();
    let mut s = AlsaSink::new(
        AlsaSettings { device: "herald_frozen".into(), stall_timeout: Duration::from_millis(300), ..AlsaSettings::default() },
        shaper(),
    );
    s.begin(24000).unwrap();
    let t = Instant::now();
    // 1 s of audio into an 80 ms buffer that never drains.
    let err = s.write(&[0.1; 24000]).unwrap_err();
    eprintln!("frozen: {err} (after {:?})", t.elapsed());
    assert!(matches!(err, SinkError::Stalled { .. }), "{err:?}");
    assert_eq!(err.kind(), SinkErrorKind::Device);
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(3));
    // The failed utterance released the device; a new one opens it again.
    assert!(matches!(s.write(&[0.0]), Err(SinkError::Config(_))));
    s.begin(24000).unwrap();
    s.abort();
}

#[test]
fn g_a_device_that_goes_away_fails_the_utterance_and_the_next_one_opens_it_again() {
    let (_g, env) = env();
    let fault = env.dir.join("fault");
    let set = |word: &str| std::fs::write(&fault, word).unwrap();
    let mut s = AlsaSink::new(
        AlsaSettings {
            device: "herald_fault".into(),
            stall_timeout: Duration::from_millis(400),
            busy_retries: 1,
            busy_retry_delay: Duration::from_millis(50),
            ..AlsaSettings::default()
        },
        shaper(),
    );
    // gone before the utterance: not found, at once (no retries)
    set("unplug");
    let err = s.begin(24000).unwrap_err();
    eprintln!("unplugged at open: {err}");
    assert!(matches!(err, SinkError::NotFound { .. }), "{err:?}");
    // busy at open: the bounded retries, then Busy
    set("busy");
    let err = s.begin(24000).unwrap_err();
    assert!(matches!(err, SinkError::Busy { attempts: 2, .. }), "{err:?}");

    // pulled out mid-stream: the write fails with a device error within the stall limit
    set("");
    s.begin(24000).unwrap();
    s.write(&[0.1; 4800]).unwrap();
    set("unplug");
    let t = Instant::now();
    let err = s.write(&[0.1; 24000]).unwrap_err();
    eprintln!("unplugged mid-stream: {err} (after {:?})", t.elapsed());
    assert!(matches!(err, SinkError::Gone { .. }), "{err:?}");
    assert_eq!(err.kind(), SinkErrorKind::Device);
    assert!(err.to_string().contains("'herald_fault' went away"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    // the failed utterance released the device; plugged back in, the next utterance plays
    assert!(matches!(s.write(&[0.0]), Err(SinkError::Config(_))));
    set("");
    s.begin(24000).unwrap();
    s.write(&[0.1; 2400]).unwrap();
    let stats = s.finish().unwrap();
    assert!(stats.input_samples == 2400 && stats.frames_written >= 2400, "{stats:?}");

    // how many frames an utterance of 4800 samples hands the device (with the shaper's silences)
    s.begin(24000).unwrap();
    s.write(&[0.1; 4800]).unwrap();
    let total = s.finish().unwrap().frames_written;
    // pulled out after the last write, while the buffer drains: Gone, not a silent success
    s.begin(24000).unwrap();
    s.write(&[0.1; 4800]).unwrap();
    set(&format!("unplug after {total}"));
    let t = Instant::now();
    let err = s.finish().unwrap_err();
    eprintln!("unplugged while draining: {err} (after {:?})", t.elapsed());
    assert!(matches!(err, SinkError::Gone { .. }), "{err:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    set("");
    // the clock stops while the last buffer drains: bounded (buffer + stall limit), a
    // warning, the rest dropped; the utterance counts as played and the device is released
    s.begin(24000).unwrap();
    s.write(&[0.1; 4800]).unwrap();
    set(&format!("freeze after {total}"));
    let t = Instant::now();
    let stats = s.finish().unwrap();
    eprintln!("frozen while draining: {stats:?} (after {:?})", t.elapsed());
    assert!(t.elapsed() >= Duration::from_millis(400) && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    set("");
    s.begin(24000).unwrap();
    s.abort();

    // the clock stops mid-stream: Stalled after the limit, and the device is released
    s.begin(24000).unwrap();
    s.write(&[0.1; 2400]).unwrap();
    set("freeze");
    let t = Instant::now();
    let err = s.write(&[0.1; 24000]).unwrap_err();
    eprintln!("frozen mid-stream: {err} (after {:?})", t.elapsed());
    assert!(matches!(err, SinkError::Stalled { .. }), "{err:?}");
    assert!(t.elapsed() >= Duration::from_millis(400) && t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    set("");
    s.begin(24000).unwrap();
    s.write(&[0.1; 2400]).unwrap();
    s.finish().unwrap();
}
