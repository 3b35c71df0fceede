//! The FIFO line reader (`service::fifo::LineSplitter`): any bytes, cut into reads at any
//! places, give the lines of a plain model: one per newline, numbered from 1, the bytes before
//! it (a `\r` at the end taken off), or "too long" with their count when they are more than the
//! limit (the `\r` counted).

#![no_main]

use libfuzzer_sys::fuzz_target;
use service::fifo::{Line, LineSplitter};

fuzz_target!(|data: &[u8]| {
    // the first byte picks the line limit (small, so that over-long lines are common), the
    // second where the reads are cut
    let [limit, cut, bytes @ ..] = data else { return };
    let max = usize::from(*limit % 64) + 1;
    let step = usize::from(*cut % 16) + 1;
    let mut lines = Vec::new();
    let mut s = LineSplitter::new(max);
    for chunk in bytes.chunks(step) {
        s.push(chunk, &mut lines);
    }
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(&[][..], |p| &bytes[..p]);
    let want: Vec<Line> = if bytes.contains(&b'\n') {
        complete
            .split(|&b| b == b'\n')
            .enumerate()
            .map(|(i, seg)| {
                let n = i as u64 + 1;
                if seg.len() > max {
                    Line::TooLong(n, seg.len())
                } else {
                    Line::Text(n, seg.strip_suffix(b"\r").unwrap_or(seg).to_vec())
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    assert_eq!(lines, want);
});
