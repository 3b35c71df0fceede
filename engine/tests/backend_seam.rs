//! The backend seam exercised by a second implementation: a recorder that wraps the tract
//! backend and writes down every step and vocoder call (inputs and outputs), and a replay
//! backend that answers the same calls from that tape without any graph. The engine run on the
//! replay must ask for exactly the recorded inputs, in order, and produce bit-identical PCM: so
//! the decode loop, the vocoder driver and the pipeline depend on nothing but the traits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use backend_tract::Tract;
use engine::{Engine, EngineError, EngineSettings, Request};
use model::backend::{
    Backend, BackendError, KvStats, LoadTimes, LoadedGraphs, PinThread, StageCompute, StepError, StepOutput, StepSession, StepSpec,
    VocoderError, VocoderForm, VocoderSession,
};
use model::frame::Frame;
use model::manifest::Manifest;

/// One step call: what went in and what came out.
#[derive(Debug, Clone)]
struct Step {
    x: Vec<f32>,
    positions: usize,
    head: Option<usize>,
    logits: Vec<f32>,
    hidden: Option<Vec<f32>>,
}

/// One vocoder call.
#[derive(Debug, Clone)]
struct Voc {
    window: Vec<Frame>,
    n: usize,
    out: Vec<f32>,
}

/// Every call, per stack (`talker`, `code_predictor`) and for the vocoder, in call order.
#[derive(Debug, Default)]
struct Tape {
    steps: Mutex<HashMap<&'static str, VecDeque<Step>>>,
    vocoder: Mutex<VecDeque<Voc>>,
    /// The vocoder form the recording was made with.
    form: Mutex<Option<VocoderForm>>,
}

impl Tape {
    fn len(&self) -> (usize, usize) {
        let steps = self.steps.lock().unwrap().values().map(VecDeque::len).sum();
        (steps, self.vocoder.lock().unwrap().len())
    }
}

// ---- the recorder: tract underneath, every call written to the tape

struct Recorder(Arc<Tape>);

impl Backend for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }
    fn load(&self, dir: &Path, manifest: &Manifest, form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        *self.0.form.lock().unwrap() = Some(form);
        Ok(Box::new(RecGraphs { inner: Tract.load(dir, manifest, form)?, tape: self.0.clone() }))
    }
}

#[derive(Debug)]
struct RecGraphs {
    inner: Box<dyn LoadedGraphs>,
    tape: Arc<Tape>,
}

impl LoadedGraphs for RecGraphs {
    fn backend(&self) -> &'static str {
        "recorder"
    }
    fn step_session(&self, spec: &StepSpec) -> Result<Box<dyn StepSession>, StepError> {
        Ok(Box::new(RecStep { inner: self.inner.step_session(spec)?, role: spec.role.key(), tape: self.tape.clone() }))
    }
    fn vocoder_session(&self, max_window: usize) -> Result<Box<dyn VocoderSession>, VocoderError> {
        Ok(Box::new(RecVoc { inner: self.inner.vocoder_session(max_window)?, tape: self.tape.clone() }))
    }
    fn stage_compute(&self, stage: &str, cpus: &[usize], pin: PinThread) -> Result<Box<dyn StageCompute>, BackendError> {
        self.inner.stage_compute(stage, cpus, pin)
    }
    fn load_times(&self) -> LoadTimes {
        self.inner.load_times()
    }
}

struct RecStep {
    inner: Box<dyn StepSession>,
    role: &'static str,
    tape: Arc<Tape>,
}

impl StepSession for RecStep {
    fn position(&self) -> usize {
        self.inner.position()
    }
    fn clear(&mut self) {
        self.inner.clear()
    }
    fn step(&mut self, x: &[f32], positions: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
        let out = self.inner.step(x, positions, head)?;
        let rec = Step { x: x.to_vec(), positions, head, logits: out.logits.to_vec(), hidden: out.hidden.map(<[f32]>::to_vec) };
        self.tape.steps.lock().unwrap().entry(self.role).or_default().push_back(rec);
        Ok(out)
    }
    fn last_stats(&self) -> KvStats {
        self.inner.last_stats()
    }
}

struct RecVoc {
    inner: Box<dyn VocoderSession>,
    tape: Arc<Tape>,
}

impl VocoderSession for RecVoc {
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        self.inner.decode(window, n, out)?;
        self.tape.vocoder.lock().unwrap().push_back(Voc { window: window.to_vec(), n, out: out.to_vec() });
        Ok(())
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn form(&self) -> VocoderForm {
        self.inner.form()
    }
}

// ---- the replay: no graph at all, answers from the tape and checks every input

struct Replay(Arc<Tape>);

impl Backend for Replay {
    fn name(&self) -> &'static str {
        "replay"
    }
    fn load(&self, _dir: &Path, _manifest: &Manifest, _form: VocoderForm) -> Result<Box<dyn LoadedGraphs>, BackendError> {
        Ok(Box::new(ReplayGraphs(self.0.clone())))
    }
}

#[derive(Debug)]
struct ReplayGraphs(Arc<Tape>);

/// Runs the stage on the calling thread: a backend without compute threads of its own.
struct Inline;

impl StageCompute for Inline {
    fn run(&self, f: &mut dyn FnMut()) {
        f()
    }
}

impl LoadedGraphs for ReplayGraphs {
    fn backend(&self) -> &'static str {
        "replay"
    }
    fn step_session(&self, spec: &StepSpec) -> Result<Box<dyn StepSession>, StepError> {
        Ok(Box::new(ReplayStep { role: spec.role.key(), tape: self.0.clone(), position: 0, last: None }))
    }
    fn vocoder_session(&self, _max_window: usize) -> Result<Box<dyn VocoderSession>, VocoderError> {
        Ok(Box::new(ReplayVoc(self.0.clone())))
    }
    fn stage_compute(&self, _: &str, _: &[usize], _: PinThread) -> Result<Box<dyn StageCompute>, BackendError> {
        Ok(Box::new(Inline))
    }
    fn load_times(&self) -> LoadTimes {
        LoadTimes::default()
    }
}

struct ReplayStep {
    role: &'static str,
    tape: Arc<Tape>,
    position: usize,
    last: Option<Step>,
}

impl StepSession for ReplayStep {
    fn position(&self) -> usize {
        self.position
    }
    fn clear(&mut self) {
        self.position = 0;
    }
    fn step(&mut self, x: &[f32], positions: usize, head: Option<usize>) -> Result<StepOutput<'_>, StepError> {
        let mismatch = |message: String| StepError::Runtime { stack: self.role.to_owned(), backend: "replay", message };
        let rec = self.tape.steps.lock().unwrap().get_mut(self.role).and_then(VecDeque::pop_front);
        let rec = rec.ok_or_else(|| mismatch("the tape has no more steps".into()))?;
        if rec.x != x || rec.positions != positions || rec.head != head {
            return Err(mismatch(format!(
                "step at position {} differs from the recording (positions {positions} vs {}, head {head:?} vs {:?})",
                self.position, rec.positions, rec.head
            )));
        }
        self.position += positions;
        let rec = self.last.insert(rec);
        Ok(StepOutput { logits: &rec.logits, hidden: rec.hidden.as_deref() })
    }
    fn last_stats(&self) -> KvStats {
        KvStats::default()
    }
}

struct ReplayVoc(Arc<Tape>);

impl VocoderSession for ReplayVoc {
    fn decode(&mut self, window: &[Frame], n: usize, out: &mut [f32]) -> Result<(), VocoderError> {
        let rec = self.0.vocoder.lock().unwrap().pop_front().ok_or_else(|| VocoderError("the tape has no more windows".into()))?;
        if rec.window != window || rec.n != n || rec.out.len() != out.len() {
            return Err(VocoderError(format!("window of {} frames, chunk {n} differs from the recording", window.len())));
        }
        out.copy_from_slice(&rec.out);
        Ok(())
    }
    fn reset(&mut self) {}
    fn form(&self) -> VocoderForm {
        self.0.form.lock().unwrap().unwrap_or(VocoderForm::Windowed)
    }
}

fn speak(engine: &Engine, req: &Request) -> Result<Vec<f32>, EngineError> {
    let mut pcm = Vec::new();
    engine.synthesize(req, &AtomicBool::new(false), |c| {
        pcm.extend_from_slice(c.samples);
        Ok(())
    })?;
    Ok(pcm)
}

fn request() -> Request {
    let mut r = Request::new("The seam carries the whole loop.");
    r.seed = Some(11);
    r.max_frames = Some(30);
    r
}

#[test]
fn a_replayed_backend_drives_the_engine_to_the_same_pcm() {
    let dir = common::bundle("tiny-hybrid");
    let tape = Arc::new(Tape::default());
    let recorded = Engine::load(&dir, &Recorder(tape.clone()), &EngineSettings::default()).unwrap();
    let want = speak(&recorded, &request()).unwrap();
    let (steps, windows) = tape.len();
    assert!(want.len() >= 1920 && steps > 15 && windows >= 2, "{} samples, {steps} steps, {windows} windows", want.len());

    // pinned stages too, so the replay's own StageCompute is on the path
    let settings = EngineSettings { talker_cpus: vec![0], vocoder_cpus: vec![0], ..EngineSettings::default() };
    let replayed = Engine::load(&dir, &Replay(tape.clone()), &settings).unwrap();
    assert_eq!(replayed.bundle().graphs.backend(), "replay");
    let got = speak(&replayed, &request()).unwrap();
    assert!(got == want, "replayed PCM differs from the recorded run");
    assert_eq!(tape.len(), (0, 0), "every recorded call was asked for");

    // one more utterance has nothing to replay: the backend's error comes back typed and named
    let err = speak(&replayed, &request()).unwrap_err();
    assert!(matches!(err, EngineError::Step(StepError::Runtime { backend: "replay", .. })), "{err:?}");
    assert!(err.to_string().starts_with("talker: replay: the tape has no more steps"), "{err}");
}
