//! The stateful vocoder on context binaries (`runtime.qnn_vocoder = "npu"`, docs/backend.md).
//!
//! The exporter compiles the bundle's stream vocoder graph (docs/bundle.md "Stateful vocoder")
//! at a few fixed frame counts per execution (`export qnn --vocoder`, e.g. 2 and 1). A chunk of
//! `n` frames runs as executions of the largest count that fits the rest, so a 1-frame binary
//! makes every `n` possible. The state (`state.*` inputs, `next.*` outputs) lives on the host in
//! the binaries' own element types and is carried from one execution to the next; every buffer
//! is allocated when the session is made, so a steady chunk allocates nothing.

use std::sync::Arc;

use model::backend::{VocoderError, VocoderForm, VocoderSession};
use model::frame::Frame;

use crate::ffi::{DataType, RawTensor};
use crate::session::Buf;
use crate::{Runtime, Tier};

/// The buffers of one binary: every input and output, and their descriptors.
struct Run {
    tier: Arc<Tier>,
    frames: usize,
    inputs: Vec<Buf>,
    outputs: Vec<Buf>,
    in_desc: Vec<RawTensor>,
    out_desc: Vec<RawTensor>,
}

/// A stateful vocoder session on the NPU.
pub struct QnnVocoder {
    runtime: Arc<Runtime>,
    /// One per binary, most frames first.
    runs: Vec<Run>,
    /// Index of `codes` among the inputs, of `wav` among the outputs (the same in every binary).
    codes: usize,
    wav: usize,
    /// Per state: its input index and its `next.*` output index.
    state_io: Vec<(usize, usize)>,
    /// The state carried between executions, in the binaries' element types, one per state.
    state: Vec<Vec<u8>>,
    /// The state before the current chunk, to undo a failed one.
    before: Vec<Vec<u8>>,
    max_chunk: usize,
    samples_per_frame: usize,
    codebook_size: u32,
}

impl std::fmt::Debug for QnnVocoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QnnVocoder")
            .field("frames", &self.runs.iter().map(|r| r.frames).collect::<Vec<_>>())
            .field("max_chunk", &self.max_chunk)
            .finish_non_exhaustive()
    }
}

fn err(m: String) -> VocoderError {
    VocoderError(format!("qnn vocoder: {m}"))
}

impl QnnVocoder {
    /// A session over `tiers` (the vocoder binaries, `slots` = frames per execution, already
    /// checked against the stream graph's declaration in bundle.toml), for chunks of at most
    /// `max_chunk` frames of `samples_per_frame` samples each; codes must be below
    /// `codebook_size`.
    ///
    /// # Errors
    /// [`VocoderError`] when there is no 1-frame binary, the binaries disagree on their inputs,
    /// outputs or state shapes, a `state.*` input has no `next.*` output of the same type and
    /// size, `codes` is not an integer tensor of `[1, codebooks, frames]`, or `wav` does not hold
    /// frames × samples_per_frame floats.
    pub(crate) fn new(
        runtime: Arc<Runtime>,
        tiers: &[Arc<Tier>],
        max_chunk: usize,
        samples_per_frame: usize,
        codebook_size: u32,
    ) -> Result<Self, VocoderError> {
        let mut tiers: Vec<Arc<Tier>> = tiers.to_vec();
        tiers.sort_by_key(|t| std::cmp::Reverse(t.slots));
        if tiers.last().is_none_or(|t| t.slots != 1) {
            return Err(err("no 1-frame binary: a chunk of any length needs one (export qnn --vocoder-frames ...,1)".into()));
        }
        let first = tiers[0].clone();
        let names = |v: &[crate::ffi::TensorInfo]| v.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
        let input = |n: &str| first.info.inputs.iter().position(|t| t.name == n);
        let output = |n: &str| first.info.outputs.iter().position(|t| t.name == n);
        let codes = input("codes").ok_or_else(|| err(format!("{} has no input codes", first.file)))?;
        let wav = output("wav").ok_or_else(|| err(format!("{} has no output wav", first.file)))?;
        let mut state_io = Vec::new();
        for (i, t) in first.info.inputs.iter().enumerate() {
            if i == codes {
                continue;
            }
            let Some(rest) = t.name.strip_prefix("state.") else {
                return Err(err(format!("{} has the input {}, neither codes nor a state.*", first.file, t.name)));
            };
            let o = output(&format!("next.{rest}")).ok_or_else(|| err(format!("{} has no output next.{rest}", first.file)))?;
            let n = &first.info.outputs[o];
            if n.dtype != t.dtype || n.dims != t.dims || n.quant != t.quant {
                return Err(err(format!("next.{rest} is not stored as {} is ({:?} vs {:?})", t.name, n.dims, t.dims)));
            }
            state_io.push((i, o));
        }
        if state_io.is_empty() {
            return Err(err(format!("{} carries no state: not a stateful vocoder binary", first.file)));
        }
        let mut runs = Vec::with_capacity(tiers.len());
        for t in &tiers {
            if names(&t.info.inputs) != names(&first.info.inputs) || names(&t.info.outputs) != names(&first.info.outputs) {
                return Err(err(format!("{} has its inputs or outputs in another order than {}", t.file, first.file)));
            }
            let frames = t.slots;
            let c = &t.info.inputs[codes];
            if !matches!(c.dtype, DataType::I64 | DataType::I32) || c.dims.len() != 3 || c.dims[0] != 1 || c.dims[2] as usize != frames
            {
                return Err(err(format!(
                    "{}: codes is {} {:?}, expected int [1, codebooks, {frames}]",
                    t.file,
                    c.dtype.name(),
                    c.dims
                )));
            }
            let w = &t.info.outputs[wav];
            if w.elements() != frames * samples_per_frame || !matches!(w.dtype, DataType::F32 | DataType::F16) {
                return Err(err(format!(
                    "{}: wav is {} {:?}, expected {} float samples",
                    t.file,
                    w.dtype.name(),
                    w.dims,
                    frames * samples_per_frame
                )));
            }
            for &(i, o) in &state_io {
                let (a, b) = (&t.info.inputs[i], &first.info.inputs[i]);
                let n = &t.info.outputs[o];
                if a.dims != b.dims || a.dtype != b.dtype || n.dims != a.dims || n.dtype != a.dtype || n.quant != a.quant {
                    return Err(err(format!("{}: the state {} differs from {}'s", t.file, a.name, first.file)));
                }
            }
            let mut inputs = t.info.inputs.iter().map(Buf::new).collect::<Result<Vec<_>, _>>().map_err(err)?;
            let mut outputs = t.info.outputs.iter().map(Buf::new).collect::<Result<Vec<_>, _>>().map_err(err)?;
            // descriptors point into the buffers; the Vecs never reallocate after this
            let in_desc = inputs.iter_mut().map(Buf::descriptor).collect();
            let out_desc = outputs.iter_mut().map(Buf::descriptor).collect();
            runs.push(Run { tier: t.clone(), frames, inputs, outputs, in_desc, out_desc });
        }
        let state: Vec<Vec<u8>> = state_io.iter().map(|&(i, _)| vec![0u8; runs[0].inputs[i].bytes]).collect();
        Ok(QnnVocoder {
            runtime,
            before: state.clone(),
            state,
            runs,
            codes,
            wav,
            state_io,
            max_chunk,
            samples_per_frame,
            codebook_size,
        })
    }

    /// One execution of run `r` over `frames` (exactly its frame count): samples into `out`,
    /// the state advanced.
    fn execute(&mut self, r: usize, frames: &[Frame], out: &mut [f32]) -> Result<(), VocoderError> {
        let run = &mut self.runs[r];
        let n = run.frames;
        {
            let c = &mut run.inputs[self.codes];
            let wide = c.info.dtype == DataType::I64;
            let b = c.as_bytes_mut();
            for (f, frame) in frames.iter().enumerate() {
                for (q, &code) in frame.iter().enumerate() {
                    let k = q * n + f;
                    if wide {
                        b[k * 8..k * 8 + 8].copy_from_slice(&i64::from(code).to_ne_bytes());
                    } else {
                        b[k * 4..k * 4 + 4].copy_from_slice(&(code as i32).to_ne_bytes());
                    }
                }
            }
        }
        for (s, &(i, _)) in self.state.iter().zip(&self.state_io) {
            run.inputs[i].as_bytes_mut().copy_from_slice(s);
        }
        {
            let _guard = run.tier.lock.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the descriptors point at this run's buffers, sized from the binary's own
            // tensor info; the graph belongs to `self.runtime`, alive while this session is; the
            // tier's lock keeps other sessions off this graph during the call.
            unsafe { self.runtime.htp.execute(run.tier.graph, &run.in_desc, &mut run.out_desc) }
                .map_err(|e| err(format!("{}: {e}", run.tier.file)))?;
        }
        let w = &run.outputs[self.wav];
        if !w.all_finite() {
            return Err(err(format!("{}: wav holds non-finite values", run.tier.file)));
        }
        for &(_, o) in &self.state_io {
            if !run.outputs[o].all_finite() {
                return Err(err(format!("{}: {} holds non-finite values", run.tier.file, run.outputs[o].info.name)));
            }
        }
        w.read_f32(0, out);
        for (s, &(_, o)) in self.state.iter_mut().zip(&self.state_io) {
            s.copy_from_slice(run.outputs[o].as_bytes());
        }
        Ok(())
    }
}

impl VocoderSession for QnnVocoder {
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        let spf = self.samples_per_frame;
        if n == 0 || window.len() != n || n > self.max_chunk || out.len() != n * spf {
            return Err(err(format!(
                "bad chunk for the stateful vocoder: {} frames given, chunk {n} (at most {}), output {} samples",
                window.len(),
                self.max_chunk,
                out.len()
            )));
        }
        if let Some(c) = window.iter().flatten().find(|&&c| c >= self.codebook_size) {
            return Err(err(format!("code {c} is outside the codebook of {}", self.codebook_size)));
        }
        for (b, s) in self.before.iter_mut().zip(&self.state) {
            b.copy_from_slice(s);
        }
        let mut done = 0;
        while done < n {
            // the runs are sorted by frames, most first; the last one has 1
            let r = self.runs.iter().position(|r| r.frames <= n - done).unwrap_or(self.runs.len() - 1);
            let k = self.runs[r].frames;
            if let Err(e) = self.execute(r, &window[done..done + k], &mut out[done * spf..(done + k) * spf]) {
                for (s, b) in self.state.iter_mut().zip(&self.before) {
                    s.copy_from_slice(b);
                }
                return Err(e);
            }
            done += k;
        }
        Ok(())
    }

    fn reset(&mut self) {
        for s in &mut self.state {
            s.fill(0);
        }
    }

    fn form(&self) -> VocoderForm {
        VocoderForm::Stateful
    }
}
