//! How much CPU each encoder of [`service::encode`] and the time stretch of [`service::stretch`]
//! (HTTP `speed`) take per second of audio: encodes (stretches) 300 s of a speech-like synthetic
//! signal (a gliding harmonic tone with noise, 24 kHz mono) in 80 ms chunks, three times per
//! codec (speed), and prints the fastest run's process CPU time per second of audio in
//! (docs/performance.md). Run it on a release build:
//! `cargo run --release --example encode_bench`.

use std::time::Duration;

use board::audio::{AudioSink, NullSink, ShaperSettings};
use service::encode::Codec;
use service::stretch::StretchSink;

/// The process's user + system CPU time from /proc/self/stat (clock ticks of 10 ms, Linux's
/// USER_HZ of 100: a 300 s run of either codec takes over 40 ticks).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields 14 and 15 (utime, stime) in clock ticks; after the command name in parentheses
    // the tokens start at field 3 (the state)
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let ticks = tick(11) + tick(12);
    Duration::from_millis(ticks * 10)
}

fn main() {
    const RATE: u32 = 24_000;
    const SECONDS: usize = 300;
    let mut seed = 0x2545_f491_u32;
    let signal: Vec<i16> = (0..RATE as usize * SECONDS)
        .map(|i| {
            let t = i as f64 / f64::from(RATE);
            let f0 = 120.0 + 40.0 * (t * 1.3).sin();
            let tone: f64 = (1..=8).map(|h| (2.0 * std::f64::consts::PI * f0 * f64::from(h) * t).sin() / f64::from(h)).sum();
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let noise = f64::from(seed) / f64::from(u32::MAX) - 0.5;
            (6000.0 * tone + 2000.0 * noise) as i16
        })
        .collect();
    for codec in [Codec::Mp3, Codec::Flac, Codec::Opus] {
        let mut best = Duration::MAX;
        let mut bytes = 0;
        for _ in 0..3 {
            let Ok(mut enc) = codec.encoder(RATE) else {
                eprintln!("{}: the encoder cannot be made", codec.name());
                std::process::exit(1);
            };
            let mut out = Vec::new();
            let t0 = cpu_time();
            for chunk in signal.chunks(1920) {
                if let Err(e) = enc.encode(chunk, &mut out) {
                    eprintln!("{e}");
                    std::process::exit(1);
                }
            }
            if let Err(e) = enc.finish(&mut out) {
                eprintln!("{e}");
                std::process::exit(1);
            }
            best = best.min(cpu_time() - t0);
            bytes = out.len();
        }
        let per_s = best.as_secs_f64() * 1000.0 / SECONDS as f64;
        println!("{}: {per_s:.2} ms CPU per second of audio ({bytes} bytes for {SECONDS} s)", codec.name());
    }
    let floats: Vec<f32> = signal.iter().map(|&x| f32::from(x) / 32768.0).collect();
    for speed in [0.5f32, 0.8, 1.5, 2.0] {
        let mut best = Duration::MAX;
        for _ in 0..3 {
            let mut sink = StretchSink::new(NullSink::new(ShaperSettings::passthrough()), speed);
            let t0 = cpu_time();
            let run = sink.begin(RATE).and_then(|()| floats.chunks(1920).try_for_each(|c| sink.write(c))).and_then(|()| sink.finish());
            if let Err(e) = run {
                eprintln!("stretch: {e}");
                std::process::exit(1);
            }
            best = best.min(cpu_time() - t0);
        }
        let per_s = best.as_secs_f64() * 1000.0 / SECONDS as f64;
        println!("speed {speed}: {per_s:.2} ms CPU per second of audio in (WSOLA, service::stretch)");
    }
}
