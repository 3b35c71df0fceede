//! herald's Q4_0 matrix products for the decode steps (moved here from
//! `backend_tract::q4gemv`, which wires them into tract as an op; issue 36).
//!
//! A decode step multiplies one activation row by every weight of the talker or the code
//! predictor: a matrix-vector product (GEMV) whose floor is the memory bandwidth. tract
//! 0.23.9 runs a Q4_0 weight through its general block-quant matmul (`fma_mmm_f32_32x1` on
//! x86, panels of 32 rows), which unpacks the nibbles through a byte-shuffling path and ran at
//! about 6.6 GB/s of int4 weights on the build machine: 20–28 % of the bandwidth floor
//! (docs/performance.md). These kernels are written for this shape:
//!
//! - the weights are kept in **groups** of four Q4_0 blocks (128 weights, one 64-byte cache
//!   line of nibbles) and **panels** of four rows, a panel one sequential stream of groups
//!   ([`Q4Weights`]), the f16 block scales in a separate array;
//! - AVX-512: a group is one 512-bit load of sixteen 32-bit lanes holding eight nibbles each;
//!   nibble `i` of every lane is `lane >> 4i`, looked up in a 16-entry table of `(q − 8) · d`
//!   (`vpermps` reads only the low four bits of each index, so no mask is needed; the table is
//!   multiplied by the block's scale once per block): per block and row two shifts, two
//!   permutations and two FMAs per activation row; the panel's stream prefetched
//!   512 bytes ahead;
//! - AVX2 + FMA + F16C: the same lanes in two 256-bit halves, nibbles masked and converted,
//!   the `− 8` taken out as `8 · Σ x` per block;
//! - elsewhere (and as the tests' reference): a plain loop, `Σ_b d_b Σ_j (q_j − 8) x_j`
//!   (`crate::portable::q4`).
//!
//! Up to [`MAX_X_ROWS`] activation rows share each pass over the weights (the code
//! predictor's two-position prefill costs little more than one step); longer inputs (the
//! talker's prompt prefill) take passes of four rows.
//!
//! These kernels keep the activations and the accumulation in f32, as tract's kernel and
//! onnxruntime's `MatMulNBits` with `accuracy_level` 0 do: the products differ from theirs by
//! summation order only.
//!
//! On a bundle whose fidelity gate measured int8 activations (`[quantization] activations =
//! "int8"`: the exporter writes `accuracy_level = 4`), a CPU with AVX-512 VNNI runs
//! [`Kernel::Avx512Vnni`] instead: each activation row is quantized per block of 32 to int8
//! (GGML's Q8_0, [`QGroup`]), the weights kept in [`Layout::BlockDwords`], and per group and
//! weight row two `vpdpbusd` sum sixteen lanes of four nibble × int8 products in integers, one
//! FMA scales them by `d_w · d_x`: about a third of the float kernel's instructions per weight
//! (docs/performance.md). It computes what onnxruntime computes with `accuracy_level = 4`, up
//! to summation order. Every int8 kernel computes each block's integer sum `Σ (w − 8) q`
//! exactly (the tests check it bit for bit against the portable reference); only the float
//! scaling and the order of the sum over blocks differ between them.

use std::ops::Range;

/// Weights per Q4_0 block (GGML's `QK4_0`).
pub const BLOCK_LEN: usize = 32;
/// Bytes per Q4_0 block: an f16 scale, then 16 bytes holding weight `j` in the low nibble of
/// byte `j` and weight `j + 16` in its high nibble (GGML's `block_q4_0`).
pub const BLOCK_BYTES: usize = 18;

/// Weights per group: four Q4_0 blocks, whose 64 bytes of nibbles fill one cache line.
pub const GROUP_LEN: usize = 4 * BLOCK_LEN;
/// Activation rows that share one pass over the weights (the kernels hold `4 × MAX_X_ROWS`
/// accumulators in registers).
pub const MAX_X_ROWS: usize = 4;

/// One group of one row: 64 bytes, 64-byte aligned. Byte `4l + h` is byte `l` of the group's
/// block `h` (GGML order: weight `l` of the block in the low nibble, weight `l + 16` in the
/// high one), so the 32-bit lane `l` holds in its nibble `i` the weight `16 i + l` of the
/// group.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub(crate) struct Group(pub(crate) [u8; 64]);

/// A Q4_0 weight `[n, k]` in the layout of herald's kernels: **panels** of four rows, each
/// panel one sequential stream of groups (group 0 of its rows 0–3, then group 1 of rows 0–3,
/// …), so that the kernel reads the weights strictly in order and one prefetch stream covers
/// them (a stream per row ran at 7.5 GB/s for rows of 3072 weights on the build machine, the
/// panel at 12.2–12.4 GB/s for every row length). The f16 block scales (bits) in runs of
/// sixteen blocks per row: per panel and run, rows 0–3 sixteen scales each.
///
/// Padding: `k` rounds up to whole runs of 512 weights and `n` to whole panels, with blocks of
/// scale 0 (weights exactly 0); at 0.6B dimensions (`k` of 1024, 2048 or 3072, `n` a
/// multiple of 4) there is none.
#[derive(Debug)]
pub struct Q4Weights {
    /// Output features (rows).
    pub(crate) n: usize,
    /// Input features (columns), a positive multiple of 32.
    pub(crate) k: usize,
    /// Groups per row, `⌈k / 128⌉`.
    pub(crate) groups: usize,
    /// `[⌈n / 4⌉ panels][groups][4 rows]`.
    nibbles: Vec<Group>,
    /// `[⌈n / 4⌉ panels][⌈groups / 4⌉ runs][4 rows][16 blocks]`.
    scales: Vec<u16>,
    /// The order of the bytes within a group ([`Layout`]).
    pub(crate) layout: Layout,
}

/// The order of the 64 bytes of a group (four blocks of one row), set by the kernel family that
/// reads them ([`Kernel::layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// For the float32-activation kernels: byte `4l + h` is byte `l` of block `h`, so the
    /// 32-bit lane `l` holds in its nibble `i` the weight `16 i + l` of the group.
    Interleaved,
    /// For the int8-activation kernels: byte `16j + 4h + t` is byte `4j + t` of block `h`, so
    /// the 32-bit lane `4j + h` holds four consecutive bytes of block `h` (its weights
    /// `4j .. 4j + 4` in the low nibbles, `16 + 4j .. 16 + 4j + 4` in the high ones): a
    /// `vpdpbusd` of the lane sums within one block, and the block scales repeat every four
    /// lanes.
    BlockDwords,
}

impl Layout {
    /// Where byte `l` of block `h` lies in a group.
    pub(crate) fn position(self, h: usize, l: usize) -> usize {
        match self {
            Layout::Interleaved => 4 * l + h,
            Layout::BlockDwords => 16 * (l / 4) + 4 * h + l % 4,
        }
    }
}

impl Q4Weights {
    /// From GGML Q4_0 blocks (`n` rows of `k / 32` blocks of 18 bytes, rows one after the
    /// other) in `layout`, or `None` when `k` is not a positive multiple of 32 or the length
    /// does not match.
    pub fn from_q4_0(blocks: &[u8], n: usize, k: usize, layout: Layout) -> Option<Q4Weights> {
        if n == 0 || k == 0 || !k.is_multiple_of(BLOCK_LEN) || blocks.len() != n * k / BLOCK_LEN * BLOCK_BYTES {
            return None;
        }
        let (groups, panels) = (k.div_ceil(GROUP_LEN), n.div_ceil(4));
        let runs = groups.div_ceil(4);
        let mut nibbles = vec![Group([0; 64]); panels * groups * 4];
        let mut scales = vec![0u16; panels * runs * 64];
        for (b, block) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
            let (r, c) = (b / (k / BLOCK_LEN), b % (k / BLOCK_LEN));
            let (p, i) = (r / 4, r % 4);
            scales[((p * runs + c / 16) * 4 + i) * 16 + c % 16] = u16::from_le_bytes([block[0], block[1]]);
            let (group, h) = (&mut nibbles[(p * groups + c / 4) * 4 + i], c % 4);
            for (l, &byte) in block[2..].iter().enumerate() {
                group.0[layout.position(h, l)] = byte;
            }
        }
        Some(Q4Weights { n, k, groups, nibbles, scales, layout })
    }

    /// Bytes held: the nibbles and the f16 scales (0.5625 bytes per weight without padding).
    pub fn bytes(&self) -> usize {
        self.nibbles.len() * 64 + 2 * self.scales.len()
    }

    /// Output features (rows), `n`.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns), `k`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The byte order of the groups ([`Layout`]).
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Columns the kernels read per activation row: `k` rounded up to a whole group.
    pub(crate) fn padded_k(&self) -> usize {
        self.groups * GROUP_LEN
    }

    /// Panels of four rows (the last may hold padding rows).
    pub(crate) fn panels(&self) -> usize {
        self.n.div_ceil(4)
    }

    /// Runs of sixteen blocks per row.
    pub(crate) fn runs(&self) -> usize {
        self.groups.div_ceil(4)
    }

    /// Panel `p`'s groups, `[groups][4 rows]`.
    pub(crate) fn panel_groups(&self, p: usize) -> &[Group] {
        &self.nibbles[p * self.groups * 4..][..self.groups * 4]
    }

    /// Panel `p`'s scales, `[runs][4 rows][16 blocks]`.
    pub(crate) fn panel_scales(&self, p: usize) -> &[u16] {
        &self.scales[p * self.runs() * 64..][..self.runs() * 64]
    }
}

/// `$kernel::<M>(args)` with the const `M` (activation rows per pass, 1 to [`MAX_X_ROWS`])
/// that the run-time row count `$m` names: the kernels are instantiated for each.
macro_rules! by_rows {
    ($m:expr, $($kernel:ident)::+ ($($arg:expr),* $(,)?)) => {
        match $m {
            1 => $($kernel)::+::<1>($($arg),*),
            2 => $($kernel)::+::<2>($($arg),*),
            3 => $($kernel)::+::<3>($($arg),*),
            _ => $($kernel)::+::<4>($($arg),*),
        }
    };
}

/// Which kernel a product runs on, and with it the numerics of the activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, any CPU; float32 activations.
    Portable,
    /// AVX2 + FMA + F16C (x86-64); float32 activations.
    Avx2,
    /// AVX-512F (x86-64); float32 activations.
    Avx512,
    /// Plain Rust, any CPU; int8 activations ([`QGroup`]): the reference of [`Kernel::Avx512Vnni`].
    PortableInt8,
    /// AVX-512F + BW + VNNI (x86-64); int8 activations ([`QGroup`]), `vpdpbusd` products.
    Avx512Vnni,
    /// AVX2 + FMA + F16C + AVX-VNNI (x86-64 without AVX-512: Alder Lake-N and later); int8
    /// activations ([`QGroup`]), 256-bit `vpdpbusd` products.
    AvxVnni,
    /// NEON (aarch64, every core); float32 activations: the fallback where there is no
    /// `sdot` (Cortex-A53, A72: the Pi 3 and 4).
    Neon,
    /// NEON + dot product (`asimddp`, aarch64; Cortex-A55, A76, A78 and later); int8
    /// activations ([`QGroup`]), `sdot` products.
    NeonDot,
}

impl Kernel {
    /// The widest float32-activation kernel this CPU runs.
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Kernel::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Kernel::Neon;
            }
        }
        Kernel::Portable
    }

    /// The int8-activation kernel this CPU runs, `None` without AVX-512 VNNI (x86-64) or the
    /// dot-product instructions (aarch64).
    pub fn detect_int8() -> Option<Kernel> {
        #[cfg(target_arch = "x86_64")]
        {
            if Kernel::detect() == Kernel::Avx512
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Some(Kernel::Avx512Vnni);
            }
            if Kernel::AvxVnni.runs_here() {
                return Some(Kernel::AvxVnni);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if Kernel::detect() == Kernel::Neon && std::arch::is_aarch64_feature_detected!("dotprod") {
                return Some(Kernel::NeonDot);
            }
        }
        None
    }

    /// Every kernel this CPU runs: the portable ones, then the vector kernels whose features
    /// it has (what the tests hold to the references).
    pub fn available() -> Vec<Kernel> {
        let mut v = vec![Kernel::Portable, Kernel::PortableInt8];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                v.push(Kernel::Avx2);
            }
            if Kernel::detect() == Kernel::Avx512 {
                v.push(Kernel::Avx512);
            }
            if Kernel::detect_int8() == Some(Kernel::Avx512Vnni) && Kernel::AvxVnni.runs_here() {
                v.push(Kernel::AvxVnni);
            }
        }
        if Kernel::detect() == Kernel::Neon {
            v.push(Kernel::Neon);
        }
        v.extend(Kernel::detect_int8());
        v
    }

    /// Whether this CPU has the features the kernel needs ([`Kernel::available`] holds it).
    pub fn runs_here(self) -> bool {
        match self {
            Kernel::Portable | Kernel::PortableInt8 => true,
            Kernel::Avx512 | Kernel::Neon => Kernel::detect() == self,
            Kernel::Avx2 => Kernel::detect() == Kernel::Avx512 || Kernel::detect() == self,
            Kernel::Avx512Vnni | Kernel::NeonDot => Kernel::detect_int8() == Some(self),
            Kernel::AvxVnni => {
                #[cfg(target_arch = "x86_64")]
                {
                    Kernel::Avx2.runs_here() && std::arch::is_x86_feature_detected!("avxvnni")
                }
                #[cfg(not(target_arch = "x86_64"))]
                {
                    false
                }
            }
        }
    }

    /// Whether the kernel quantizes the activations to int8 (per block of 32, [`QGroup`]).
    pub fn int8(self) -> bool {
        matches!(self, Kernel::PortableInt8 | Kernel::Avx512Vnni | Kernel::AvxVnni | Kernel::NeonDot)
    }

    /// The byte order of the weights this kernel reads.
    pub fn layout(self) -> Layout {
        if self.int8() { Layout::BlockDwords } else { Layout::Interleaved }
    }

    /// `y[m][r] = Σ_c w[r][c] · x[m][c]` for every weight row `r < n` of the `panels` (four
    /// rows each) and `m` activation rows `x` (row `m` at `x[m * w.padded_k()..]`, zero past
    /// `k`) into `y` (row `m` at `y[m * y_stride..]`, column `r`).
    ///
    /// # Safety
    /// `y` writable at `m * y_stride + r` for those rows and columns, and no other thread
    /// touching them while this runs.
    unsafe fn gemm(self, m: usize, w: &Q4Weights, x: &[f32], y: *mut f32, y_stride: usize, panels: Range<usize>) {
        assert!((1..=MAX_X_ROWS).contains(&m) && x.len() >= m * w.padded_k() && y_stride >= w.n);
        assert!(panels.end <= w.panels() && self.runs_here() && !self.int8());
        // SAFETY (every arm): `runs_here` was asserted (the kernel's CPU features), the asserts
        // above bound every read of x; the writes to y are the caller's contract.
        unsafe {
            match self {
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512 => by_rows!(m, crate::x86_64::q4::gemm_avx512(w, x, y, y_stride, panels)),
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx2 => by_rows!(m, crate::x86_64::q4::gemm_avx2(w, x, y, y_stride, panels)),
                #[cfg(target_arch = "aarch64")]
                Kernel::Neon => by_rows!(m, crate::aarch64::q4::gemm_neon(w, x, y, y_stride, panels)),
                _ => by_rows!(m, crate::portable::q4::gemm_portable(w, x, y, y_stride, panels)),
            }
        }
    }

    /// As [`Kernel::gemm`] with the `m` activation rows quantized ([`quantize_row`]): row `i`
    /// is `xq[i * w.groups..][..w.groups]`.
    ///
    /// # Safety
    /// As [`Kernel::gemm`].
    unsafe fn gemm_int8(self, m: usize, w: &Q4Weights, xq: &[QGroup], y: *mut f32, y_stride: usize, panels: Range<usize>) {
        assert!((1..=MAX_X_ROWS).contains(&m) && xq.len() >= m * w.groups && w.layout == Layout::BlockDwords);
        assert!(y_stride >= w.n && panels.end <= w.panels() && self.runs_here() && self.int8());
        // SAFETY (every arm): as in `gemm`.
        unsafe {
            match self {
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Vnni => by_rows!(m, crate::x86_64::q4::gemm_vnni(w, xq, y, y_stride, panels)),
                #[cfg(target_arch = "x86_64")]
                Kernel::AvxVnni => by_rows!(m, crate::x86_64::q4::gemm_avxvnni(w, xq, y, y_stride, panels)),
                #[cfg(target_arch = "aarch64")]
                Kernel::NeonDot => by_rows!(m, crate::aarch64::q4::gemm_sdot(w, xq, y, y_stride, panels)),
                _ => by_rows!(m, crate::portable::q4::gemm_portable_int8(w, xq, y, y_stride, panels)),
            }
        }
    }
}

/// One group (128 values, four blocks of 32) of an activation row quantized to int8 per block
/// of 32, as GGML's Q8_0 and onnxruntime's `MatMulNBits` with `accuracy_level = 4` do: per
/// block `d = max |x| / 127`, `q = round_half_even(x / d)` (computed as `x · (1 / d)`, 0 when
/// `d` is 0), in the order of [`Layout::BlockDwords`] so that one `vpdpbusd` pairs each lane
/// of weights with its activations. 256 bytes, 64-byte aligned.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct QGroup {
    /// Byte `16j + 4h + t`: `q` of value `4j + t` of block `h` (the low nibbles' partners).
    pub(crate) lo: [i8; 64],
    /// Byte `16j + 4h + t`: `q` of value `16 + 4j + t` of block `h` (the high nibbles').
    pub(crate) hi: [i8; 64],
    /// Lane `4j + h`: `−8 ·` the sum of the lane's eight `q` (the weights' offset of 8,
    /// `Σ (w − 8) q = Σ w q − 8 Σ q`, started from here).
    pub(crate) corr: [i32; 16],
    /// Lane `4j + h`: block `h`'s scale `d`.
    pub(crate) d: [f32; 16],
}

impl QGroup {
    /// All zeros (what [`quantize_row`] writes past `k`).
    pub const ZERO: QGroup = QGroup { lo: [0; 64], hi: [0; 64], corr: [0; 16], d: [0.0; 16] };
}

/// Quantizes one activation row `x` (`k` values, zero past `k` up to `out.len()` groups of 128)
/// into `out` ([`QGroup`]).
pub fn quantize_row(x: &[f32], out: &mut [QGroup]) {
    for (g, qg) in out.iter_mut().enumerate() {
        *qg = QGroup::ZERO;
        for h in 0..4 {
            let start = (g * 4 + h) * BLOCK_LEN;
            let xb: [f32; BLOCK_LEN] = std::array::from_fn(|i| x.get(start + i).copied().unwrap_or(0.0));
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            // NaN (a NaN activation) casts to 0; |x · inv| ≤ 127 up to rounding
            let q: [i8; BLOCK_LEN] = std::array::from_fn(|i| (xb[i] * inv).round_ties_even().clamp(-127.0, 127.0) as i8);
            for j in 0..4 {
                let mut sum = 0i32;
                for t in 0..4 {
                    let (lo, hi) = (q[4 * j + t], q[16 + 4 * j + t]);
                    qg.lo[16 * j + 4 * h + t] = lo;
                    qg.hi[16 * j + 4 * h + t] = hi;
                    sum += i32::from(lo) + i32::from(hi);
                }
                qg.corr[4 * j + h] = -8 * sum;
                qg.d[4 * j + h] = d;
            }
        }
    }
}

/// Runs the parts of one product, on several threads where it has them: what a caller hands
/// [`Kernel::product_split`]. The kernels start no threads of their own; `backend_tract` gives
/// them the decode stage's thread pool (issue 36, item 3).
pub trait Split: Sync {
    /// How many threads may work on one product at once (1: the calling thread alone).
    fn threads(&self) -> usize;

    /// Calls `part(i)` once for every `i < parts`, on any of its threads, and returns when all
    /// have returned.
    fn run(&self, parts: usize, part: &(dyn Fn(usize) + Sync));
}

/// No split: the whole product on the calling thread.
#[derive(Clone, Copy, Debug, Default)]
pub struct Serial;

impl Split for Serial {
    fn threads(&self) -> usize {
        1
    }

    fn run(&self, parts: usize, part: &(dyn Fn(usize) + Sync)) {
        (0..parts).for_each(part);
    }
}

/// The fewest panels (four weight rows each) one part of a split product gets: 32 panels, 128
/// rows, 72 KB of Q4_0 weights at `k` = 1024, about 6.5 µs at the build machine's 11 GB/s, so
/// that handing a part to another thread (a few µs) stays small beside its work. The decode's
/// products at 0.6B (`n` of 1024 to 3072 rows, the codebook heads 2048) split 8 to 24 ways at
/// most; the tiny test bundles' products are not split.
pub const MIN_SPLIT_PANELS: usize = 32;

/// The output pointer of a split product, handed to the parts; each part writes only the rows
/// of its own panels.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: the parts write disjoint elements through it (their own panels' rows), and
// `product_split` holds the `&mut` it came from until every part has returned.
unsafe impl Sync for Out {}
// SAFETY: as above.
unsafe impl Send for Out {}

impl Out {
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

impl Kernel {
    /// `y = x · Wᵀ` for f32 `x` of `rows × k` (row-major) into `y` of `rows × n`: passes of up
    /// to [`MAX_X_ROWS`] activation rows over the weights, on the calling thread
    /// ([`Kernel::product_split`] with [`Serial`]).
    ///
    /// # Panics
    /// As [`Kernel::product_split`].
    pub fn product(self, w: &Q4Weights, x: &[f32], y: &mut [f32]) {
        self.product_split(w, x, y, &Serial);
    }

    /// `y = x · Wᵀ` as [`Kernel::product`], each pass's weight rows split into up to
    /// `split.threads()` parts of consecutive panels (at least [`MIN_SPLIT_PANELS`] each) that
    /// `split` runs, possibly at once. Every output element is computed by the same code in
    /// the same order whatever the split: the result is bit for bit the serial one.
    ///
    /// When `k` is not a multiple of 128 (tiny bundles only) each pass copies its rows into a
    /// zero-padded buffer. An int8 kernel quantizes each pass's rows ([`quantize_row`]) once,
    /// on the calling thread, into a buffer of that thread kept between calls (a decode step
    /// allocates nothing once warm).
    ///
    /// # Panics
    /// When the kernel does not run on this CPU ([`Kernel::runs_here`]), `w` is not in its
    /// [`Kernel::layout`], or `x` and `y` are not whole rows of `k` and `n` values with as many
    /// rows each (a caller's bug: `backend_tract` checks the shapes before).
    pub fn product_split(self, w: &Q4Weights, x: &[f32], y: &mut [f32], split: &dyn Split) {
        let (n, k, kp) = (w.n, w.k, w.padded_k());
        assert!(self.runs_here(), "the {self:?} kernel needs CPU features this CPU lacks");
        assert!(w.layout == self.layout(), "{self:?} reads weights in {:?}, not {:?}", self.layout(), w.layout);
        assert!(
            x.len().is_multiple_of(k) && y.len() == x.len() / k * n,
            "x of {} values and y of {} for W [{n}, {k}]",
            x.len(),
            y.len()
        );
        let panels = w.panels();
        let parts = split.threads().min(panels / MIN_SPLIT_PANELS).max(1);
        let range = move |i: usize| panels * i / parts..panels * (i + 1) / parts;
        if self.int8() {
            thread_local! {
                static QUANTIZED: std::cell::RefCell<Vec<QGroup>> = const { std::cell::RefCell::new(Vec::new()) };
            }
            QUANTIZED.with_borrow_mut(|xq| {
                for (xs, ys) in x.chunks(MAX_X_ROWS * k).zip(y.chunks_mut(MAX_X_ROWS * n)) {
                    let m = xs.len() / k;
                    if xq.len() < m * w.groups {
                        xq.resize(m * w.groups, QGroup::ZERO);
                    }
                    for (row, out) in xs.chunks_exact(k).zip(xq.chunks_exact_mut(w.groups)) {
                        quantize_row(row, out);
                    }
                    let (xq, out) = (&xq[..m * w.groups], Out(ys.as_mut_ptr()));
                    // SAFETY: `ys` holds m rows of n; each part writes its own panels' rows.
                    let part = |i: usize| unsafe { self.gemm_int8(m, w, xq, out.ptr(), n, range(i)) };
                    if parts == 1 { part(0) } else { split.run(parts, &part) }
                }
            });
            return;
        }
        let mut padded = Vec::new();
        for (xs, ys) in x.chunks(MAX_X_ROWS * k).zip(y.chunks_mut(MAX_X_ROWS * n)) {
            let m = xs.len() / k;
            let xs = if kp == k {
                xs
            } else {
                padded.clear();
                padded.resize(m * kp, 0f32);
                for (src, dst) in xs.chunks_exact(k).zip(padded.chunks_exact_mut(kp)) {
                    dst[..k].copy_from_slice(src);
                }
                &padded[..]
            };
            let out = Out(ys.as_mut_ptr());
            // SAFETY: as above.
            let part = |i: usize| unsafe { self.gemm(m, w, xs, out.ptr(), n, range(i)) };
            if parts == 1 { part(0) } else { split.run(parts, &part) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A xorshift64 sequence from `seed` (made odd, so never all zeros): deterministic test data.
    fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
        let mut s = seed | 1;
        std::iter::repeat_with(move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        })
    }

    /// Q4_0 blocks for `n × k` weights: random nibbles, scales from `scale(random)` (f32, stored
    /// as f16).
    fn blocks(n: usize, k: usize, seed: u64, scale: impl Fn(u64) -> f32) -> Vec<u8> {
        let mut rng = xorshift(seed);
        let mut out = Vec::new();
        for _ in 0..n * k / BLOCK_LEN {
            let r = rng.next().unwrap_or(0);
            out.extend_from_slice(&half::f16::from_f32(scale(r)).to_bits().to_le_bytes());
            for _ in 0..16 {
                out.push(rng.next().unwrap_or(0) as u8);
            }
        }
        out
    }

    /// Scales in ±[0.01, 0.1).
    fn small_scale(r: u64) -> f32 {
        (0.01 + (r % 1000) as f32 / 1000.0 * 0.09) * if r & (1 << 20) != 0 { -1.0 } else { 1.0 }
    }

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        xorshift(seed).take(n).map(|s| (s % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// The weights as GGML defines Q4_0 (`ggml-quants.c`, `dequantize_row_q4_0`): byte `j` of a
    /// block holds weight `j` in its low nibble and `j + 16` in its high one, each `(q − 8) · d`.
    fn dequantize(bytes: &[u8]) -> Vec<f64> {
        let mut w = Vec::new();
        for b in bytes.chunks_exact(BLOCK_BYTES) {
            let d = f64::from(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
            let q = &b[2..];
            w.extend(q.iter().map(|&v| (f64::from(v & 0x0F) - 8.0) * d));
            w.extend(q.iter().map(|&v| (f64::from(v >> 4) - 8.0) * d));
        }
        w
    }

    /// `y = x · Wᵀ` in f64 from [`dequantize`].
    fn reference(bytes: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f64> {
        let w = dequantize(bytes);
        let mut y = Vec::new();
        for xs in x.chunks_exact(k) {
            y.extend((0..n).map(|r| (0..k).map(|c| w[r * k + c] * f64::from(xs[c])).sum::<f64>()));
        }
        y
    }

    /// Q8_0 of `x` (rows of `k`) as GGML defines it, written out here independently of
    /// [`quantize_row`]: per block of 32, `d = max |x| / 127` and `q = round_half_even(x / d)`;
    /// returns `q · d` per value (what an int8 kernel multiplies the weights by).
    fn q8_0(x: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for b in x.chunks(32) {
            let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            out.extend(b.iter().map(|v| if d == 0.0 { 0.0 } else { (v * (1.0 / d)).round_ties_even() * d }));
        }
        out
    }

    /// A [`Split`] on `threads` scoped OS threads, each taking every `threads`-th part, that
    /// records which parts ran (each exactly once, or the test fails).
    struct Threads {
        threads: usize,
        ran: std::sync::Mutex<Vec<usize>>,
    }

    impl Split for Threads {
        fn threads(&self) -> usize {
            self.threads
        }

        fn run(&self, parts: usize, part: &(dyn Fn(usize) + Sync)) {
            std::thread::scope(|s| {
                for t in 0..self.threads.min(parts) {
                    s.spawn(move || {
                        for i in (t..parts).step_by(self.threads) {
                            part(i);
                            self.ran.lock().unwrap().push(i);
                        }
                    });
                }
            });
        }
    }

    /// A product split over threads is bit for bit the serial one, for every kernel, on row
    /// counts that split into uneven parts with a partial last panel (4·97 + 3 rows: 98 panels
    /// in 2 or 3 parts) and on one too small to split (4·31 rows: one part, the split never
    /// asked), for one activation row and several passes (1, 3, 6 rows); every part runs once.
    #[test]
    fn a_split_product_is_the_serial_one() {
        for &(n, k, threads, parts) in &[(4 * 97 + 3, 256usize, 2usize, 2usize), (4 * 97 + 3, 160, 3, 3), (4 * 31, 128, 4, 1)] {
            let bytes = blocks(n, k, (n + k) as u64, small_scale);
            for kernel in Kernel::available() {
                let w = Q4Weights::from_q4_0(&bytes, n, k, kernel.layout()).unwrap();
                for rows in [1usize, 3, 6] {
                    let x = floats(rows * k, (rows + n) as u64);
                    let mut serial = vec![f32::NAN; rows * n];
                    kernel.product(&w, &x, &mut serial);
                    let split = Threads { threads, ran: Default::default() };
                    let mut y = vec![f32::NAN; rows * n];
                    kernel.product_split(&w, &x, &mut y, &split);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&y), bits(&serial), "{kernel:?}, n {n}, k {k}, {rows} rows, {threads} threads");
                    let mut ran = split.ran.into_inner().unwrap();
                    ran.sort_unstable();
                    let passes = rows.div_ceil(MAX_X_ROWS);
                    let want: Vec<usize> =
                        if parts == 1 { vec![] } else { (0..parts).flat_map(|i| std::iter::repeat_n(i, passes)).collect() };
                    assert_eq!(ran, want, "{kernel:?}: parts run per pass");
                }
            }
        }
    }

    /// Every kernel this CPU runs, one activation row and several, against the Q4_0
    /// definition in f64 ([`reference`]): within float32 rounding of the sum, `1e-5 · Σ |w x|`
    /// (the bound the x86 kernels met since they were written; a sum of 3072 terms in f32
    /// with a different order stays far inside it), for weight-row counts that leave partial
    /// panels of four rows, block counts that leave partial groups of four blocks (a padded last
    /// group) and of sixteen (a partial run of scales), and activation-row counts of every pass
    /// width (1–4) and of several passes (5, 17). The int8 kernels are held to the same bound
    /// against the product of the weights with Q8_0 of x ([`q8_0`]); that product itself stays
    /// within 1 % of Σ |w x| of the float one (the Q8_0 rounding, at most d/2 per value).
    #[test]
    fn every_kernel_matches_the_q4_0_definition() {
        for &(n, k) in &[(1usize, 32usize), (5, 64), (3, 96), (37, 544), (64, 1024), (19, 3072)] {
            let bytes = blocks(n, k, (n * 31 + k) as u64, small_scale);
            for layout in [Layout::Interleaved, Layout::BlockDwords] {
                let w = Q4Weights::from_q4_0(&bytes, n, k, layout).unwrap();
                // whole groups of 64 nibble bytes and four scales per row
                assert_eq!(w.bytes(), n.div_ceil(4) * 4 * (k.div_ceil(128) * 64 + k.div_ceil(512) * 32));
                if k % 512 == 0 && n % 4 == 0 {
                    assert_eq!(w.bytes(), bytes.len(), "no padding when k is a multiple of 512 and n of 4");
                }
            }
            for rows in [1usize, 2, 3, 4, 5, 17] {
                let x = floats(rows * k, (rows * 7 + k) as u64);
                let xq = q8_0(&x);
                let want = reference(&bytes, n, k, &x);
                let want_q8 = reference(&bytes, n, k, &xq);
                // the scale of the rounding error: Σ |w x| ≤ 8 · 0.1 · Σ |x| per row
                let abs: Vec<f64> = x.chunks(k).map(|r| r.iter().map(|v| f64::from(v.abs())).sum::<f64>() * 0.8).collect();
                for (i, (a, b)) in want_q8.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 0.01 * abs[i / n], "Q8_0 of x moves [{i}] from {b} to {a}");
                }
                for kernel in Kernel::available() {
                    let w = Q4Weights::from_q4_0(&bytes, n, k, kernel.layout()).unwrap();
                    let mut y = vec![f32::NAN; rows * n];
                    kernel.product(&w, &x, &mut y);
                    let want = if kernel.int8() { &want_q8 } else { &want };
                    for (i, (a, b)) in y.iter().zip(want).enumerate() {
                        let tol = abs[i / n] * 1e-5 + 1e-6;
                        assert!((f64::from(*a) - b).abs() <= tol, "{kernel:?} n={n} k={k} rows={rows} [{i}]: {a} vs {b} (tol {tol})");
                    }
                }
            }
        }
    }

    /// The int8 kernels' integer products bit for bit. With every weight scale a power of two
    /// (½, 1, 2) and every activation block `e · z` for integers `z` in [−127, 127], one of them
    /// ±127, and `e` ∈ {½, 1, 2} (so Q8_0 gives `d = e` and `q = z` exactly, as
    /// [`quantizes_as_q8_0`] checks), every term `d_w d_x Σ (w − 8) q` is a multiple of ¼ below
    /// 2²⁴ · ¼ in magnitude (`k ≤ 1024`: at most 32 blocks of ≤ 4 · 32 · 8 · 127), so every
    /// float sum of them is exact in any order: each kernel must return exactly the sum of the
    /// exact integer block products, computed here in i64. A block of zeros (`d = 0`) is in
    /// every row. Sizes as in [`every_kernel_matches_the_q4_0_definition`] (odd rows, partial
    /// groups and runs, passes of 1–4 rows and more).
    #[test]
    fn int8_kernels_are_exact_on_the_integers() {
        let pow2 = |r: u64| [0.5f32, 1.0, 2.0][(r % 3) as usize] * if r & (1 << 20) != 0 { -1.0 } else { 1.0 };
        let int8: Vec<Kernel> = Kernel::available().into_iter().filter(|k| k.int8()).collect();
        assert!(int8.contains(&Kernel::PortableInt8));
        for &(n, k) in &[(1usize, 32usize), (5, 64), (7, 160), (37, 544), (64, 1024), (6, 1024)] {
            let bytes = blocks(n, k, (n * 17 + k) as u64, pow2);
            for rows in [1usize, 2, 3, 4, 6, 9] {
                let mut rng = xorshift((rows * 5 + k) as u64);
                let mut z = vec![0i64; rows * k];
                let mut e = vec![0f64; rows * k / BLOCK_LEN];
                for (b, (zb, eb)) in z.chunks_exact_mut(BLOCK_LEN).zip(e.iter_mut()).enumerate() {
                    if b % 11 == 3 {
                        continue; // a block of zeros
                    }
                    for v in zb.iter_mut() {
                        *v = (rng.next().unwrap_or(0) % 255) as i64 - 127;
                    }
                    let r = rng.next().unwrap_or(0);
                    zb[(r % 32) as usize] = if r & 64 != 0 { 127 } else { -127 };
                    *eb = [0.5, 1.0, 2.0][(r >> 8) as usize % 3];
                }
                let x: Vec<f32> = z.iter().enumerate().map(|(i, &v)| (v as f64 * e[i / BLOCK_LEN]) as f32).collect();
                // Σ_b d_w d_x Σ (w − 8) z, each block's integer exact in i64
                let want: Vec<f64> = (0..rows * n)
                    .map(|o| {
                        let (m, r) = (o / n, o % n);
                        (0..k / BLOCK_LEN)
                            .map(|b| {
                                let blk = &bytes[(r * k / BLOCK_LEN + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                                let dw = f64::from(half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32());
                                let xb = &z[m * k + b * BLOCK_LEN..][..BLOCK_LEN];
                                let t: i64 = (0..16)
                                    .map(|j| {
                                        (i64::from(blk[2 + j] & 0x0F) - 8) * xb[j] + (i64::from(blk[2 + j] >> 4) - 8) * xb[j + 16]
                                    })
                                    .sum();
                                t as f64 * dw * e[m * k / BLOCK_LEN + b]
                            })
                            .sum()
                    })
                    .collect();
                for &kernel in &int8 {
                    let w = Q4Weights::from_q4_0(&bytes, n, k, kernel.layout()).unwrap();
                    let mut y = vec![f32::NAN; rows * n];
                    kernel.product(&w, &x, &mut y);
                    for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                        assert_eq!(f64::from(*a), *b, "{kernel:?} n={n} k={k} rows={rows} [{i}]");
                    }
                }
            }
        }
    }

    /// [`quantize_row`] against the definition: every value's `q` and its block's `d` where
    /// [`Layout::BlockDwords`] puts them, the lanes' `−8 Σ q`, zeros past `k`; a block of zeros
    /// has `d = 0`, a half rounds to even, the extremes are ±127.
    #[test]
    #[allow(clippy::needless_range_loop)] // g, h, l, j index the layout's positions together
    fn quantizes_as_q8_0() {
        let k = 160; // one whole group and a padded one
        let mut x = floats(k, 3);
        x[32..64].fill(0.0); // block 1: zeros
        // block 2: max 127 so d = 1; 2.5 rounds to 2, -3.5 to -4
        x[64] = 127.0;
        x[65] = 2.5;
        x[66] = -3.5;
        let mut out = vec![QGroup::ZERO; 2];
        quantize_row(&x, &mut out);
        for g in 0..2 {
            for h in 0..4 {
                let start = (g * 4 + h) * 32;
                let block: Vec<f32> = (0..32).map(|i| x.get(start + i).copied().unwrap_or(0.0)).collect();
                let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                for l in 0..32 {
                    let want = if d == 0.0 { 0 } else { (block[l] / d).round_ties_even() as i8 };
                    let at = 16 * ((l % 16) / 4) + 4 * h + l % 4;
                    let got = if l < 16 { out[g].lo[at] } else { out[g].hi[at] };
                    assert!((i32::from(got) - i32::from(want)).abs() <= 1, "group {g} block {h} value {l}: {got} vs {want}");
                    if d == 0.0 || (block[l] / d).fract().abs() != 0.5 {
                        // away from ties x · (1/d) and x / d round alike here
                        assert_eq!(got, want, "group {g} block {h} value {l}");
                    }
                }
                for j in 0..4 {
                    assert_eq!(out[g].d[4 * j + h], d);
                    let lane: i32 =
                        (0..4).map(|t| i32::from(out[g].lo[16 * j + 4 * h + t]) + i32::from(out[g].hi[16 * j + 4 * h + t])).sum();
                    assert_eq!(out[g].corr[4 * j + h], -8 * lane);
                }
            }
        }
        assert_eq!(out[0].d[1], 0.0, "a block of zeros");
        // values 0, 1, 2 of block 2 at bytes 8, 9, 10 (j = 0, h = 2)
        assert_eq!((out[0].lo[8], out[0].lo[9], out[0].lo[10], out[0].d[2]), (127, 2, -4, 1.0), "127, 2.5 and -3.5 with d = 1");
        assert!(out[1].d[1..4].iter().all(|&d| d == 0.0), "the padding past k");
    }

    #[test]
    fn rejects_what_it_does_not_cover() {
        for layout in [Layout::Interleaved, Layout::BlockDwords] {
            assert!(Q4Weights::from_q4_0(&[0; 18], 1, 48, layout).is_none(), "k not a multiple of 32");
            assert!(Q4Weights::from_q4_0(&[0; 17], 1, 32, layout).is_none(), "partial block");
            assert!(Q4Weights::from_q4_0(&[], 0, 32, layout).is_none(), "no rows");
        }
    }

    /// The kernels the dispatcher finds on this CPU, against `HERALD_TEST_EXPECT_Q4_KERNELS`
    /// (their `Debug` names, comma-separated) where a CI step sets it: the emulated runs
    /// (scripts/test, `qemu-aarch64 -cpu cortex-a53 / cortex-a76 / max`) check that the CPU
    /// model really changed which kernels ran. Without the variable it checks only that the
    /// widest kernels are among those available.
    #[test]
    fn dispatch_finds_the_expected_kernels() {
        let got: Vec<String> = Kernel::available().iter().map(|k| format!("{k:?}")).collect();
        assert!(Kernel::available().contains(&Kernel::detect()));
        assert!(Kernel::detect_int8().is_none_or(|k| k.int8() && Kernel::available().contains(&k)));
        assert!(Kernel::available().iter().all(|k| k.runs_here()));
        if let Ok(want) = std::env::var("HERALD_TEST_EXPECT_Q4_KERNELS") {
            assert_eq!(got.join(","), want, "the kernels this (emulated) CPU runs");
        }
    }
}
