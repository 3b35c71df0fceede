//! Packing Q4_0 weights for tract's block-quant matmul kernels at load time, fast.
//!
//! When tract optimizes a graph whose matmul weights are Q4_0 constants (an exporter's
//! `--dtype q4`, `com.microsoft.MatMulNBits`), it inserts an `OptSimpleMatMulPack` node in
//! front of each matmul and folds it into a constant: the weights are rearranged into the
//! kernel's panel layout once, at load. Tract 0.23.9 does that one nibble at a time through
//! a byte reader and writer and allocates a vector per block and row; at 0.6B dimensions that
//! was about 60 % of the talker's optimize time on the build machine (`perf`; 197 Q4_0 weight
//! tensors, 240 MB). [`optimize`] runs tract's own codegen passes with one more in
//! front, [`PackQ4_0`], which builds the same constant with [`pack_q4_0`]: byte for byte what
//! tract's `BaseQ4_0::pack` writes (checked against it in this module's tests), from whole
//! bytes. Anything it does not recognize (another block format, an odd panel height, weights
//! that are not constant) is left to tract's own folding.

use std::alloc::Layout;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tract_linalg::block_quant::{
    BlockQuant, BlockQuantStorage, PackedBlockQuantFact, PackedBlockQuantFormat, Q4_0, block_quant_slice,
};
use tract_linalg::mmm::{EagerPackedInput, MMMInputValue, PackedExoticFact, PackedMatrixStorage};
use tract_onnx::prelude::*;
use tract_onnx::tract_core::ops::konst::Const;
use tract_onnx::tract_core::ops::matmul::pack::OptSimpleMatMulPack;
use tract_onnx::tract_core::optim::{Optimizer, OptimizerSession, TypedPass};

use kernels::q4::{BLOCK_BYTES, BLOCK_LEN};

/// What [`optimize`] did to a graph's Q4_0 products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Q4Products {
    /// Products moved to herald's kernels ([`crate::q4gemv::Q4MatMul`]).
    pub herald: usize,
    /// Weights packed by [`pack_q4_0`] for tract's kernels.
    pub packed: usize,
    /// The kernel of herald's products (`None`: none moved, or tract's kernels chosen).
    pub kernel: Option<kernels::q4::Kernel>,
}

/// Optimize `model` for running like `TypedModel::optimize` (tract's codegen passes), with
/// [`crate::inplace::FoldReshapeInPlace`] first, so that reshapes of constant weights take
/// no copy, then [`crate::runtime_matmul::UseRuntimeMatMul`] for the attention's products of two
/// run-time operands (every graph, every dtype), then [`crate::q4gemv::UseQ4MatMul`] on the kernel [`crate::q4gemv::chosen`]
/// picks for `int8_activations` (the bundle's `[quantization] activations = "int8"`; when it picks one), so that Q4_0 products run on herald's kernels, and [`PackQ4_0`],
/// so that the Q4_0 weights left to tract are packed by [`pack_q4_0`]; after tract's passes,
/// [`crate::im2col::UsePanelIm2Col`], so that the vocoder's convolutions are laid out for their
/// products a panel row at a time.
///
/// # Errors
/// Whatever tract's optimizer returns.
pub(crate) fn optimize(model: &mut TypedModel, int8_activations: bool) -> TractResult<Q4Products> {
    optimize_with(model, crate::q4gemv::chosen(int8_activations))
}

/// [`optimize`] with herald's Q4_0 products on `kernel`, or left to tract when `None`.
pub(crate) fn optimize_with(model: &mut TypedModel, kernel: Option<kernels::q4::Kernel>) -> TractResult<Q4Products> {
    let packed = Arc::new(AtomicUsize::new(0));
    let herald = Arc::new(AtomicUsize::new(0));
    let mut passes = Optimizer::codegen().passes;
    passes.insert(0, Box::new(PackQ4_0 { packed: packed.clone() }));
    if let Some(kernel) = kernel {
        passes.insert(0, Box::new(crate::q4gemv::UseQ4MatMul { kernel, replaced: herald.clone() }));
    }
    let runtime = crate::runtime_matmul::UseRuntimeMatMul::default();
    let attention = runtime.replaced.clone();
    passes.insert(0, Box::new(runtime));
    passes.insert(0, Box::new(crate::inplace::FoldReshapeInPlace));
    let im2col = crate::im2col::UsePanelIm2Col::default();
    let convolutions = im2col.replaced.clone();
    passes.push(Box::new(im2col));
    let optimizer = Optimizer { passes, steps: None };
    model.optimize_with_session(&mut optimizer.session())?;
    log::debug!("{} products of two run-time operands on herald's loops", attention.load(Ordering::Relaxed));
    log::debug!("{} convolutions packed by herald's im2col", convolutions.load(Ordering::Relaxed));
    let herald = herald.load(Ordering::Relaxed);
    Ok(Q4Products { herald, packed: packed.load(Ordering::Relaxed), kernel: kernel.filter(|_| herald > 0) })
}

/// An optimizer pass: replaces every `OptSimpleMatMulPack` of a constant Q4_0 tensor with the
/// constant it would fold into, packed by [`pack_q4_0`].
#[derive(Clone, Debug, Default)]
pub(crate) struct PackQ4_0 {
    /// Tensors packed so far (shared by the clones tract's optimizer session makes).
    packed: Arc<AtomicUsize>,
}

impl TypedPass for PackQ4_0 {
    fn reset(&mut self) -> TractResult<()> {
        Ok(())
    }

    fn next(&mut self, _session: &mut OptimizerSession, model: &TypedModel) -> TractResult<Option<TypedModelPatch>> {
        for node in &model.nodes {
            if !node.op_is::<OptSimpleMatMulPack>() || node.inputs.len() != 1 {
                continue;
            }
            let input = node.inputs[0];
            let fact = model.outlet_fact(input)?;
            // like tract's constant folding: only a constant that nothing else reads
            let Some(weights) = fact.konst.as_ref() else { continue };
            if model.node(input.node).outputs[input.slot].successors.len() != 1 {
                continue;
            }
            let out_fact = model.outlet_fact(OutletId::new(node.id, 0))?;
            let Some(packed_fact) = out_fact.exotic_fact.as_ref().and_then(|f| f.downcast_ref::<PackedBlockQuantFact>()) else {
                continue;
            };
            let Some(value) = pack_tensor(weights, &packed_fact.format)? else { continue };
            let mut patch = TypedModelPatch::default();
            let konst = Const::new_with_opt_exotic_fact(value.into_arc_tensor(), out_fact.exotic_fact.clone())?;
            let wire = patch.wire_node(&node.name, konst, &[])?[0];
            patch.shunt_outside(model, OutletId::new(node.id, 0), wire)?;
            self.packed.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(patch));
        }
        Ok(None)
    }
}

/// What `OptSimpleMatMulPack` evaluates to for `weights` (`[.., m, k]`, Q4_0 block storage),
/// or `None` when [`pack_q4_0`] does not handle the format (tract then folds it itself).
fn pack_tensor(weights: &Tensor, format: &PackedBlockQuantFormat) -> TractResult<Option<Tensor>> {
    let q4_0: &dyn BlockQuant = &Q4_0;
    if *format.bq != *q4_0 {
        return Ok(None);
    }
    let Ok(storage) = weights.try_storage_as::<BlockQuantStorage>() else { return Ok(None) };
    if *storage.format() != *q4_0 || weights.rank() < 2 {
        return Ok(None);
    }
    let rank = weights.rank();
    let leading = &weights.shape()[..rank - 2];
    let (m, k) = (weights.shape()[rank - 2], weights.shape()[rank - 1]);
    let groups: usize = leading.iter().product();
    let mut values: TVec<Box<dyn MMMInputValue>> = tvec!();
    for g in 0..groups {
        let slice = block_quant_slice(storage.value(), &Q4_0, m, k, g);
        let Some(packed) = pack_q4_0(slice, k, format.r, format.zip, format.scales_at_end) else { return Ok(None) };
        values.push(Box::new(EagerPackedInput {
            fact: PackedExoticFact { format: Box::new(format.clone()), mn: packed.m.to_dim(), k },
            packed: Arc::new(packed.blob),
            panel_bytes: packed.panel_bytes,
            mn: packed.m,
        }));
    }
    Ok(Some(PackedMatrixStorage::new_batched(leading, values).into_tensor(weights.datum_type())))
}

/// Q4_0 weights in a kernel's panel layout ([`pack_q4_0`]).
pub(crate) struct PackedQ4_0 {
    /// The panels, `panel_bytes` each, 128-byte aligned.
    pub blob: Blob,
    /// Bytes per panel of `r` rows: `r * k / 32 * 18`.
    pub panel_bytes: usize,
    /// Rows (the matmul's M).
    pub m: usize,
}

/// Rearrange `input` (`m` rows of `k` weights as GGML Q4_0 blocks, rows one after the other)
/// into the panel layout of a kernel `r` rows tall, as tract-linalg 0.23.9's `BaseQ4_0::pack`
/// does: panels of `r` rows (the last padded with copies of its first row); in each panel,
/// for every block of 32 columns, the `r` row scales (f16, row order) and then, for each of
/// the 32 columns in order, one nibble per row in the kernel's `zip` order, two per byte, low
/// nibble first; the scales come after the nibbles instead when `scales_at_end`.
///
/// Returns `None` when this routine does not cover the case (`r` odd or 0, `k` not a positive
/// multiple of 32, `zip` not dividing `r / 2`, `input` not whole rows, no rows): the caller
/// then leaves it to tract.
pub(crate) fn pack_q4_0(input: &[u8], k: usize, r: usize, zip: usize, scales_at_end: bool) -> Option<PackedQ4_0> {
    // tract's zipped order is a permutation only when r is a multiple of 2 * zip
    if r == 0 || !r.is_multiple_of(2) || k == 0 || !k.is_multiple_of(BLOCK_LEN) || zip >= r || (zip > 0 && !r.is_multiple_of(2 * zip))
    {
        return None;
    }
    let blocks = k / BLOCK_LEN;
    let row_bytes = blocks * BLOCK_BYTES;
    if input.is_empty() || !input.len().is_multiple_of(row_bytes) {
        return None;
    }
    let m = input.len() / row_bytes;
    let panels = m.div_ceil(r);
    let panel_bytes = row_bytes * r;
    let order = zipped_order(r, zip);
    let layout = Layout::from_size_align(panel_bytes * panels, 128).ok()?;
    // SAFETY: the layout has a non-zero size (m, k, r > 0); every byte is written below before
    // the blob is read (each panel's block columns tile its `panel_bytes` exactly).
    let mut blob = unsafe { Blob::for_layout(layout) };
    let out: &mut [u8] = &mut blob;
    let nibble_bytes = BLOCK_LEN * r / 2;
    let mut rows: Vec<&[u8]> = Vec::with_capacity(r);
    for p in 0..panels {
        rows.clear();
        let first = p * r;
        for i in 0..r {
            let row = if first + i < m { first + i } else { first };
            rows.push(&input[row * row_bytes..][..row_bytes]);
        }
        // a pair of rows at a time, all their blocks: two sequential input streams, the writes
        // land in the panel (18 bytes x r per block column, a few tens of KB: L1/L2). Walking
        // the blocks outermost instead read one block from each of the r rows in turn (r
        // streams at once), which left the packing waiting on memory.
        let half = r / 2;
        for (j, pair) in order.chunks_exact(2).enumerate() {
            let (lo, hi) = (rows[pair[0]], rows[pair[1]]);
            for b in 0..blocks {
                let col = &mut out[p * panel_bytes + b * BLOCK_BYTES * r..][..BLOCK_BYTES * r];
                let (scales, nibbles) = if scales_at_end {
                    let (n, s) = col.split_at_mut(nibble_bytes);
                    (s, n)
                } else {
                    col.split_at_mut(2 * r)
                };
                // the scales stay in row order
                scales[2 * pair[0]..2 * pair[0] + 2].copy_from_slice(&lo[b * BLOCK_BYTES..][..2]);
                scales[2 * pair[1]..2 * pair[1] + 2].copy_from_slice(&hi[b * BLOCK_BYTES..][..2]);
                // column `pos` of the block holds, in byte `j`, the nibbles of the `j`-th pair
                // of rows in zipped order; a row's 16 bytes hold columns 0..16 in their low
                // nibbles and 16..32 in their high ones, so one pass over the pair fills byte
                // `j` of all 32 columns
                let lo_row = &lo[b * BLOCK_BYTES + 2..][..BLOCK_LEN / 2];
                let hi_row = &hi[b * BLOCK_BYTES + 2..][..BLOCK_LEN / 2];
                for (t, (&x, &y)) in lo_row.iter().zip(hi_row).enumerate() {
                    nibbles[t * half + j] = (x & 0x0F) | (y << 4);
                    nibbles[(t + BLOCK_LEN / 2) * half + j] = (x >> 4) | (y & 0xF0);
                }
            }
        }
    }
    Some(PackedQ4_0 { blob, panel_bytes, m })
}

/// The rows of a panel in the order their nibbles are written, for kernels that zip `zip`
/// lanes (tract-linalg's convention: slot `i` holds row `i / 2z * 2z + i % 2 * z + i % 2z / 2`,
/// e.g. `[0, 4, 1, 5, 2, 6, 3, 7]` for r = 8, z = 4); `zip == 0` keeps rows in order.
fn zipped_order(r: usize, zip: usize) -> Vec<usize> {
    (0..r).map(|i| if zip == 0 { i } else { i / (2 * zip) * 2 * zip + (i % 2) * zip + (i % (2 * zip)) / 2 }).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic bytes (xorshift), any value: the packing moves bytes and nibbles without
    /// reading them as numbers.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        crate::xorshift(seed).take(n).map(|s| s as u8).collect()
    }

    /// Byte for byte what tract's own `BaseQ4_0::pack` writes, across panel heights, zips,
    /// scale placements and row counts that leave a partial last panel.
    #[test]
    fn matches_tracts_pack() {
        for &(r, zip, at_end) in
            &[(32, 0, false), (64, 0, false), (16, 8, true), (8, 4, false), (4, 0, true), (2, 0, false), (48, 8, false)]
        {
            for &m in &[1usize, r - 1, r, 3 * r + 5] {
                for &k in &[32usize, 96] {
                    let input = bytes(m * k / BLOCK_LEN * BLOCK_BYTES, (r * 1000 + m * 10 + k) as u64);
                    let ours = pack_q4_0(&input, k, r, zip, at_end).expect("covered case");
                    let theirs = Q4_0.pack(&input, k, r, zip, at_end).unwrap();
                    assert_eq!(ours.m, theirs.mn, "r={r} zip={zip} m={m} k={k}");
                    assert_eq!(ours.panel_bytes, theirs.panel_bytes, "r={r} zip={zip} m={m} k={k}");
                    assert_eq!(&ours.blob[..], &theirs.packed[..], "r={r} zip={zip} at_end={at_end} m={m} k={k}");
                }
            }
        }
    }

    /// Weights with leading (group) dimensions `[2, 3, m, k]`: every group packed as tract's own
    /// `prepare_tensor` packs it, byte for byte.
    #[test]
    fn grouped_weights_match_tracts() {
        let (m, k) = (40, 64);
        let shape = [2usize, 3, m, k];
        let groups = 6;
        let input = bytes(groups * m * k / BLOCK_LEN * BLOCK_BYTES, 9);
        let storage = BlockQuantStorage::new(Box::new(Q4_0), groups * m, k, Arc::new(Blob::from_bytes(&input).unwrap())).unwrap();
        let weights = storage.into_tensor_with_shape(f32::datum_type(), &shape);
        let format = PackedBlockQuantFormat::new(&Q4_0, 32, 16, false);
        let ours = pack_tensor(&weights, &format).unwrap().expect("covered case");
        let theirs = tract_linalg::mmm::MMMInputFormat::prepare_tensor(&format, &weights, 3, 2).unwrap();
        let values = |t: &Tensor| -> Vec<Vec<u8>> {
            let s = t.try_storage_as::<PackedMatrixStorage>().unwrap();
            assert_eq!(s.batch_shape(), &shape[..2]);
            s.values().iter().map(|v| v.downcast_ref::<EagerPackedInput>().unwrap().packed.to_vec()).collect()
        };
        let (a, b) = (values(&ours), values(&theirs));
        assert_eq!(a.len(), groups);
        assert!(a == b, "grouped packing differs from tract's");
    }

    #[test]
    fn leaves_uncovered_cases_to_tract() {
        let input = bytes(4 * BLOCK_BYTES, 3);
        assert!(pack_q4_0(&input, 32, 3, 0, false).is_none(), "odd panel height");
        assert!(pack_q4_0(&input, 32, 6, 2, false).is_none(), "zip not dividing r / 2");
        assert!(pack_q4_0(&input, 48, 4, 0, false).is_none(), "k not a multiple of 32");
        assert!(pack_q4_0(&input[..17], 32, 4, 0, false).is_none(), "partial row");
        assert!(pack_q4_0(&[], 32, 4, 0, false).is_none(), "no rows");
    }

    /// A Q4_0 matmul as tract-onnx builds one for `MatMulNBits` (bits 4, block 32): `x [1, s, k]`
    /// against a constant Q4_0 weight `[1, m, k]`, through an `EinSum`.
    pub(crate) fn q4_matmul(m: usize, k: usize, s: usize) -> TypedModel {
        use tract_linalg::block_quant::BlockQuantFact;
        use tract_onnx::tract_core::ops::einsum::EinSum;
        let w: Vec<f32> = bytes(m * k, 11).iter().map(|b| (*b as f32 - 128.0) / 64.0).collect();
        let blob = Q4_0.quant_f32(&w).unwrap();
        let storage = BlockQuantStorage::new(Box::new(Q4_0), m, k, Arc::new(blob)).unwrap();
        let mut model = TypedModel::default();
        let x = model.add_source("x", f32::fact([1, s, k])).unwrap();
        let konst = Const::new_with_exotic_fact(
            Arc::new(storage.into_tensor_with_shape(f32::datum_type(), &[1, m, k])),
            Box::new(BlockQuantFact::new(Box::new(Q4_0), tvec!(1, m, k))),
        )
        .unwrap();
        let wq = model.wire_node("w", konst, &[]).unwrap()[0];
        let axes = tract_onnx::tract_core::axes::AxesMapping::from_strs(&["abk", "gnk"], &["abn"]).unwrap();
        let y = model.wire_node("y", EinSum::new(axes, f32::datum_type()), &[x, wq]).unwrap()[0];
        model.select_output_outlets(&[y]).unwrap();
        model.into_decluttered().unwrap()
    }

    /// In a whole optimize with tract's kernels, the pass replaces tract's own packing (one weight packed here) and
    /// the plan computes bit for bit what tract's own packing gives, for one row and for a
    /// prefill-sized batch (different kernels).
    #[test]
    fn optimized_plan_matches_tracts() {
        let (m, k) = (96, 128);
        for s in [1usize, 7] {
            let mut ours = q4_matmul(m, k, s);
            assert_eq!(optimize_with(&mut ours, None).unwrap().packed, 1, "the pass packed the weight");
            let mut theirs = q4_matmul(m, k, s);
            theirs.optimize().unwrap();
            let x: Vec<f32> = bytes(s * k, 5).iter().map(|b| *b as f32 / 255.0 - 0.5).collect();
            let x = Tensor::from_shape(&[1, s, k], &x).unwrap();
            let run = |model: TypedModel| {
                model.into_runnable().unwrap().run(tvec!(x.clone().into_tvalue())).unwrap().remove(0).into_tensor()
            };
            let vals = |t: &Tensor| t.try_as_plain_ram().unwrap().as_slice::<f32>().unwrap().to_vec();
            let (a, b) = (run(ours), run(theirs));
            assert_eq!(a.shape(), &[1, s, m]);
            assert_eq!(vals(&a), vals(&b), "s = {s}");
            assert!(vals(&a).iter().any(|v| *v != 0.0), "a non-trivial product");
        }
    }
}
