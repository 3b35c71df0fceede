//! Talker decode-step cost against the filled KV length, and the bytes the host copies.
//!
//!     cargo run --release -p herald-engine --example kv_cost -- BUNDLE [STEPS]
//!
//! Runs one long sequence of one-position steps (random inputs) and prints, per band of
//! positions, the median step time, the cache slots attended and the bytes copied per step.

use backend_tract::Tract;
use std::sync::Arc;
use std::time::Instant;

use engine::Bundle;
use engine::EngineSettings;
use model::backend::{StackRole, StepSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: kv_cost BUNDLE [STEPS]")?;
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let b = Arc::new(Bundle::open(std::path::Path::new(&dir), &Tract)?);
    let m = &b.manifest;
    let h = m.talker.hidden as usize;
    let cap = EngineSettings::default().kv_capacity.max(steps + 1);
    let mut st = b.graphs.step_session(&StepSpec { role: StackRole::Talker, capacity: cap, max_seq: 1, hidden_in: h })?;
    let x: Vec<f32> = (0..h).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
    let mut band: Vec<f64> = Vec::new();
    let mut copied = 0usize;
    let mut regrown = 0usize;
    println!("{:>10} {:>14} {:>8} {:>16} {:>16}", "positions", "median ms/step", "slots", "copied B/step", "regrown B/step");
    for p in 0..steps {
        let t = Instant::now();
        st.step(&x, 1, None)?;
        band.push(t.elapsed().as_secs_f64() * 1e3);
        let s = st.last_stats();
        copied += s.bytes_copied;
        regrown += s.bytes_regrown;
        if (p + 1).is_power_of_two() && p >= 15 {
            let n = band.len();
            let med = model::stats::median(&mut band);
            println!("{:>4}..{:<5} {:>14.3} {:>8} {:>16} {:>16}", p + 1 - n, p + 1, med, s.slots, copied / n, regrown / n);
            band.clear();
            copied = 0;
            regrown = 0;
        }
    }
    Ok(())
}
