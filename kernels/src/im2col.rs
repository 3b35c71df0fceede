//! The im2col of herald's vocoder convolutions (moved here from `backend_tract::im2col`, which
//! wires it in place of tract's `Im2col` node; issue 36): a valid, stride-1, one-group 1-D
//! float32 convolution's input laid out as the `[k = channels · kernel, n]` right-hand side of
//! its matrix product, directly in a product kernel's panel layout (tract-linalg's
//! `PackedFormat`: panels of `r` output positions, each `[k][r]`, padded to `panel_len`
//! values), written a panel row at a time: for each panel, each input channel and each kernel
//! tap, one copy of `r` contiguous input values. Plain copies: the same code on every
//! architecture (the compiler picks the vector moves), so this is its own reference.

/// The shape of a valid, stride-1, one-group 1-D convolution whose input [`Conv1d::pack`] lays
/// out. Row `ci · kernel + j` of the packed matrix holds input channel `ci` shifted by
/// `j · dilation` positions (tract's order: channel outer, tap inner).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv1d {
    /// Input channels.
    pub channels: usize,
    /// Kernel length (taps), at least 1.
    pub kernel: usize,
    /// Spacing of the taps, in positions, at least 1.
    pub dilation: usize,
}

impl Conv1d {
    /// Rows of the packed matrix: `channels · kernel`.
    pub fn k(&self) -> usize {
        self.channels * self.kernel
    }

    /// The packed panels of `x` (`channels · t` float32 values, channel-major) for `n ≤ t −
    /// (kernel − 1) · dilation` output positions into `out`: `n.div_ceil(r)` panels of
    /// `panel_len ≥ k · r` values each, the columns past `n` of the last panel and the values
    /// past `k · r` of every panel zero.
    ///
    /// # Panics
    /// When `x` or `out` is shorter than that, or `r` or `kernel` is 0 (a caller's bug).
    pub fn pack(&self, x: &[f32], t: usize, n: usize, r: usize, panel_len: usize, out: &mut [f32]) {
        assert!(r > 0 && self.kernel > 0 && panel_len >= self.k() * r && out.len() >= n.div_ceil(r) * panel_len);
        assert!(n + (self.kernel - 1) * self.dilation <= t && x.len() >= self.channels * t);
        let out = &mut out[..n.div_ceil(r) * panel_len];
        match r {
            1 => self.fill::<1>(x, t, n, out, panel_len),
            2 => self.fill::<2>(x, t, n, out, panel_len),
            3 => self.fill::<3>(x, t, n, out, panel_len),
            4 => self.fill::<4>(x, t, n, out, panel_len),
            6 => self.fill::<6>(x, t, n, out, panel_len),
            8 => self.fill::<8>(x, t, n, out, panel_len),
            12 => self.fill::<12>(x, t, n, out, panel_len),
            16 => self.fill::<16>(x, t, n, out, panel_len),
            _ => self.fill_any(r, x, t, n, out, panel_len),
        }
    }

    /// [`Conv1d::pack`]'s copies for panels of `R` columns, known at compile time (tract's float32
    /// kernels on x86-64 take panels of 1 to 16 columns: a copy of a few values per row, which a
    /// general `memcpy` call would dominate).
    fn fill<const R: usize>(&self, x: &[f32], t: usize, n: usize, out: &mut [f32], panel_len: usize) {
        let k = self.k();
        let whole = n / R;
        for (p, panel) in out.chunks_exact_mut(panel_len).enumerate().take(whole) {
            let first = p * R;
            let (rows, tail) = panel.split_at_mut(k * R);
            let mut rows = rows.chunks_exact_mut(R);
            for ci in 0..self.channels {
                let row = &x[ci * t + first..];
                for (j, dst) in (0..self.kernel).zip(&mut rows) {
                    dst.copy_from_slice(&row[j * self.dilation..j * self.dilation + R]);
                }
            }
            tail.fill(0.0);
        }
        if whole * R < n {
            self.fill_any(R, x, t, n, &mut out[whole * panel_len..], panel_len);
        }
    }

    /// [`Conv1d::pack`]'s copies for any panel width `r`, for the last `out.len() / panel_len`
    /// panels of the `n.div_ceil(r)` (`out` starts at the first of them).
    fn fill_any(&self, r: usize, x: &[f32], t: usize, n: usize, out: &mut [f32], panel_len: usize) {
        let k = self.k();
        let first_panel = n.div_ceil(r) - out.len() / panel_len;
        for (p, panel) in out.chunks_exact_mut(panel_len).enumerate() {
            let first = (first_panel + p) * r;
            let cols = r.min(n - first);
            let (rows, tail) = panel.split_at_mut(k * r);
            for (row, dst) in rows.chunks_exact_mut(r).enumerate() {
                let (ci, j) = (row / self.kernel, row % self.kernel);
                let start = ci * t + first + j * self.dilation;
                dst[..cols].copy_from_slice(&x[start..start + cols]);
                dst[cols..].fill(0.0);
            }
            tail.fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every packed value against the definition, `out[p][row][col] = x[ci][p·r + col + j·dil]`
    /// (`row = ci · kernel + j`) or 0 past `n` and past `k · r`, for panel widths with a
    /// specialised copy (1–16), others (5, 7) and lengths that leave partial panels.
    #[test]
    fn packs_the_definition() {
        for &(channels, kernel, dilation) in &[(1usize, 1usize, 1usize), (3, 7, 1), (4, 7, 3), (2, 7, 9), (5, 3, 2)] {
            let conv = Conv1d { channels, kernel, dilation };
            let reach = (kernel - 1) * dilation;
            for t in [reach + 1, reach + 5, reach + 33] {
                let n = t - reach;
                let x: Vec<f32> = (0..channels * t).map(|i| i as f32 + 0.5).collect();
                for r in [1usize, 2, 3, 4, 5, 6, 7, 8, 12, 16] {
                    let panel_len = conv.k() * r + 3;
                    let mut out = vec![f32::NAN; n.div_ceil(r) * panel_len];
                    conv.pack(&x, t, n, r, panel_len, &mut out);
                    for (i, &v) in out.iter().enumerate() {
                        let (p, at) = (i / panel_len, i % panel_len);
                        let (row, col) = (at / r, at % r);
                        let want = if row >= conv.k() || p * r + col >= n {
                            0.0
                        } else {
                            let (ci, j) = (row / kernel, row % kernel);
                            x[ci * t + p * r + col + j * dilation]
                        };
                        assert_eq!(v, want, "channels {channels} kernel {kernel} dilation {dilation} t {t} r {r} [{i}]");
                    }
                }
            }
        }
    }
}
