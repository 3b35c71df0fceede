//! The speaker's queue with the real engine on the tiny bundle: a cancel reaches the engine and
//! stops only its own job, a failing job leaves the worker speaking, the stop ends everything.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use board::audio::{AudioSink, NullSink, SampleFormat, ShaperSettings, SinkError, SinkStats};
use engine::{EngineSettings, Request};
use service::{Job, JobError, OutputSettings, Piece, Queue, Reading, Refused, Seeding, Speaker, SpeakerSettings, Stop, Target, Voice};

/// The tiny bundle: from HERALD_TEST_BUNDLES (scripts/test exports it), else exported once
/// into the target's temporary folder.
fn bundle() -> PathBuf {
    if let Some(d) = std::env::var_os("HERALD_TEST_BUNDLES").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("tiny-0.6b");
    }
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("service-bundle");
    if !out.join("bundle.toml").is_file() {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let st = Command::new(repo.join("tools/export/export"))
            .args(["export", "--tiny", "tiny-0.6b", "--seed", "7", "--quiet", "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
    }
    out
}

fn speaker(stop: &Stop) -> Speaker {
    speaker_reading(stop, Reading::default())
}

fn speaker_reading(stop: &Stop, reading: Reading) -> Speaker {
    let voice = Voice {
        language: "auto".into(),
        speaker: None,
        mode: Default::default(),
        seeding: Seeding::fixed(5),
        text: Default::default(),
        speed: 1.0,
    };
    let settings = SpeakerSettings { voice, amplifier: None, output: OutputSettings::default(), reading, start: Default::default() };
    let settings_engine = EngineSettings { kv_capacity: 1024, ..EngineSettings::default() };
    Speaker::prepare(settings, stop.clone()).unwrap().load(&bundle(), &settings_engine).unwrap()
}

fn null() -> Target {
    Target::Sink { sink: Box::new(NullSink::new(ShaperSettings::passthrough())), plays: false }
}

/// A long text: tiny models never emit eos, so this runs until cancelled (or the KV cache fills).
const LONG: &str = "Many words that take a long while to say, again and again and again and again.";

#[test]
fn a_cancel_reaches_the_engine_and_stops_only_its_own_job() {
    let stop = Stop::new();
    let s = speaker(&stop);
    let short = s.request("Short.");
    let long = s.request(LONG);
    let q: Queue = s.start(2).unwrap();
    // the long job cancels itself from its first chunk: the engine must stop within a frame
    let chunks = Arc::new(AtomicUsize::new(0));
    let job = Job::new(long, null());
    let cancel = job.cancel_handle();
    let seen = Arc::clone(&chunks);
    let job = job.on_chunk(move || {
        seen.fetch_add(1, Ordering::SeqCst);
        cancel.cancel();
    });
    let first = q.try_submit(job).unwrap();
    let second = q.try_submit(Job::new(short.clone(), null())).unwrap();
    let first = first.wait().unwrap();
    assert!(first.report.is_none(), "the cancelled job reports itself cut short");
    assert!(chunks.load(Ordering::SeqCst) <= 2, "stopped at once: {} chunks", chunks.load(Ordering::SeqCst));
    let second = second.wait().unwrap();
    let report = second.report.expect("the next job is spoken to its end");
    assert!(report.frames > 0 && second.stats.input_samples == report.samples as u64);
    // and the same text again gives the same audio length (the engine kept no state)
    let again = q.submit(Job::new(short, null())).unwrap().wait().unwrap();
    assert_eq!(again.report.unwrap().samples, report.samples);
}

#[test]
fn a_failing_job_leaves_the_worker_speaking_and_the_stop_ends_everything() {
    let stop = Stop::new();
    let s = speaker(&stop);
    let empty = s.request("");
    let fine = s.request("Fine.");
    let long = s.request(LONG);
    let q = s.start(1).unwrap();
    match q.submit(Job::new(empty, null())).unwrap().wait() {
        Err(JobError::Engine(engine::EngineError::Prompt(_))) => {}
        other => panic!("an empty text fails as a prompt error: {other:?}"),
    }
    assert!(q.submit(Job::new(fine.clone(), null())).unwrap().wait().unwrap().report.is_some());
    // the stop cancels the running job and the waiting one, and refuses the next
    let started = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&started);
    let running = q
        .submit(Job::new(long, null()).on_begin(move |_| {
            seen.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
    let waiting = q.submit(Job::new(fine.clone(), null())).unwrap();
    while started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    stop.stop();
    assert!(running.wait().unwrap().report.is_none());
    assert!(matches!(waiting.wait(), Err(JobError::Cancelled)));
    assert!(matches!(q.try_submit(Job::new(fine, null())), Err(Refused::Stopped(_))));
}

/// Keeps every sample it is given, unshaped, where the test can read it after the job.
struct Capture(Arc<Mutex<Vec<f32>>>);

impl AudioSink for Capture {
    fn begin(&mut self, _: u32) -> Result<(), SinkError> {
        Ok(())
    }
    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.0.lock().unwrap().extend_from_slice(samples);
        Ok(())
    }
    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        let n = self.0.lock().unwrap().len() as u64;
        Ok(SinkStats::passthrough(n, 24_000, SampleFormat::F32))
    }
    fn abort(&mut self) {}
}

/// Speak `request` on `s` into a [`Capture`]; the samples and the report's frames.
fn capture(s: &mut Speaker, request: Request) -> (Vec<f32>, usize) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let target = Target::Sink { sink: Box::new(Capture(Arc::clone(&got))), plays: false };
    let spoken = s.speak(Job::new(request, target)).unwrap();
    let frames = spoken.report.expect("spoken to the end").frames;
    let samples = std::mem::take(&mut *got.lock().unwrap());
    assert_eq!(spoken.stats.input_samples, samples.len() as u64);
    (samples, frames)
}

/// English, German, Chinese and French sentences, a number with a decimal point, an
/// abbreviation and a paragraph break.
const MIXED: &str = "The first sentence is in English, and it carries the number 45.6 inside. Mr. Smith reads the second one! \
    Der dritte Satz ist auf Deutsch, bitte sehr. 这是第四句话。这是第五句，很短。\n\n\
    A new paragraph starts here. Et voilà, la fin du texte en français.";

#[test]
fn a_long_text_is_its_segments_spoken_alone_back_to_back_with_the_pause_between() {
    let stop = Stop::new();
    let pause = Duration::from_millis(100);
    let mut s = speaker_reading(&stop, Reading { segment_tokens: 14, pause, ..Reading::default() });
    // greedy, a few frames per segment (tiny models do not stop by themselves)
    let request = Request { seed: None, max_frames: Some(4), ..s.request(MIXED) };
    let pieces = s.plan(&request).unwrap();
    let gaps = pieces.iter().filter(|p| matches!(p, Piece::Silence(d) if *d == pause)).count();
    let parts: Vec<Request> = pieces.iter().filter_map(|p| p.speech().cloned()).collect();
    assert_eq!(pieces.len(), 2 * parts.len() - 1, "speech, pause, speech, ...");
    assert_eq!(gaps, parts.len() - 1);
    let texts: Vec<&str> = parts.iter().map(|p| p.text.as_str()).collect();
    assert!(parts.len() >= 5, "{texts:?}");
    assert!(texts.iter().any(|t| t.contains("45.6")) && texts.iter().any(|t| t.contains("Mr. Smith")), "{texts:?}");
    assert!(texts.iter().all(|t| t.ends_with(['.', '!', '。'])), "whole sentences: {texts:?}");
    assert!(texts.iter().any(|t| t.starts_with("A new paragraph")), "the paragraph starts a segment: {texts:?}");
    let (long, frames) = capture(&mut s, request);
    let gap = vec![0.0f32; 2400]; // 100 ms at 24 kHz
    let mut want = Vec::new();
    let mut alone_frames = 0;
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            want.extend_from_slice(&gap);
        }
        assert_eq!(s.plan(p).unwrap().len(), 1, "a segment alone is one pass: {:?}", p.text);
        let (pcm, f) = capture(&mut s, p.clone());
        assert_eq!(pcm.len(), f * 1920);
        want.extend(pcm);
        alone_frames += f;
    }
    assert_eq!(frames, alone_frames);
    assert_eq!(long.len(), want.len());
    assert!(long == want, "the long text's PCM is the segments' PCM with the pauses, sample for sample");
}

#[test]
fn a_cancel_stops_a_long_text_between_or_inside_segments() {
    let stop = Stop::new();
    let mut s = speaker_reading(&stop, Reading { segment_tokens: 14, pause: Duration::from_millis(50), ..Reading::default() });
    let request = Request { seed: None, max_frames: Some(4), ..s.request(&MIXED.repeat(5)) };
    assert!(s.plan(&request).unwrap().len() > 20);
    let chunks = Arc::new(AtomicUsize::new(0));
    let job = Job::new(request, null());
    let cancel = job.cancel_handle();
    let seen = Arc::clone(&chunks);
    let job = job.on_chunk(move || {
        if seen.fetch_add(1, Ordering::SeqCst) == 5 {
            cancel.cancel();
        }
    });
    let spoken = s.speak(job).unwrap();
    assert!(spoken.report.is_none(), "cut short");
    assert!(chunks.load(Ordering::SeqCst) <= 8, "stopped at once: {} chunks", chunks.load(Ordering::SeqCst));
    // the speaker goes on
    let fine = Request { max_frames: Some(2), ..s.request("Fine.") };
    assert!(capture(&mut s, fine).1 > 0);
}

#[test]
fn texts_over_the_long_text_limit_are_refused_with_the_limit() {
    let stop = Stop::new();
    let s = speaker(&stop);
    let over = "Speak. ".chars().cycle().take(engine::segment::MAX_LONG_TEXT_CHARS + 1).collect::<String>();
    let e = s.plan(&s.request(&over)).unwrap_err().to_string();
    assert!(e.contains("100001 characters") && e.contains("100000"), "{e}");
    let at = "Speak. ".chars().cycle().take(engine::segment::MAX_LONG_TEXT_CHARS).collect::<String>();
    let parts = s.plan(&s.request(&at)).unwrap();
    assert!(parts.len() > 100);
    let max = engine::segment::max_segment_tokens(1024);
    assert!(parts.iter().filter_map(Piece::speech).all(|p| s.engine().bundle().prompter.count_tokens(&p.text) <= max));
    // no letter or digit in any script: nothing to say (the layout alone would take it)
    // and a text with nothing left once read (only emoji, only code) is refused the same way
    for blank in ["?!...,;:", "。！？", " -- ", "🎉🎉 👍🏽", "```\nls -la\n```"] {
        let e = s.plan(&s.request(blank)).unwrap_err();
        assert!(matches!(e, engine::prompt::PromptError::BlankText), "{blank:?}: {e}");
        assert!(e.to_string().contains("nothing to say"), "{e}");
    }
    assert_eq!(s.plan(&s.request("?!a")).unwrap().len(), 1);
}

/// The PCM of each speech of `pieces` spoken alone, with the silences as zeros: what the whole
/// must be, sample for sample.
fn pieces_alone(s: &mut Speaker, pieces: &[Piece]) -> Vec<f32> {
    let mut want = Vec::new();
    for p in pieces {
        match p {
            Piece::Speech(r) => {
                let alone = Speaker::plan(s, r).unwrap();
                assert!(matches!(alone.as_slice(), [Piece::Speech(_)]), "one pass alone: {:?}", r.text);
                want.extend(capture(s, r.clone()).0);
            }
            // at 24 kHz every millisecond is 24 samples
            Piece::Silence(d) => want.extend(std::iter::repeat_n(0.0f32, d.as_millis() as usize * 24)),
        }
    }
    want
}

fn texts(pieces: &[Piece]) -> Vec<String> {
    pieces
        .iter()
        .map(|p| match p {
            Piece::Speech(r) => r.text.clone(),
            Piece::Silence(d) => format!("<{}ms>", d.as_millis()),
        })
        .collect()
}

#[test]
fn pause_tags_are_exact_silences_between_the_words_around_them() {
    let stop = Stop::new();
    let mut s = speaker(&stop);
    let text = "[pause:0.25s]Hello there. [pause:800ms] How are you?[PAUSE] Fine [pause:12s]. Done [pause:2]";
    let request = Request { seed: None, max_frames: Some(3), ..s.request(text) };
    let pieces = s.plan(&request).unwrap();
    // the clamped 12 s tag is the maximum; the malformed [pause:2] is read as text (lenient)
    assert_eq!(
        texts(&pieces),
        ["<250ms>", "Hello there.", "<800ms>", "How are you?", "<500ms>", "Fine", "<10000ms>", "Done [pause:2]"]
    );
    let (whole, frames) = capture(&mut s, request);
    let want = pieces_alone(&mut s, &pieces);
    assert_eq!(frames, 4 * 3, "four speeches of three frames");
    assert_eq!(whole.len(), 4 * 3 * 1920 + (250 + 800 + 500 + 10_000) * 24);
    assert!(whole == want, "the speeches alone and the silences, sample for sample");
    // a text of only tags (or tags and punctuation) has nothing to say
    for blank in ["[pause]", "[pause:1s] . [pause]"] {
        let e = s.plan(&s.request(blank)).unwrap_err();
        assert!(matches!(e, engine::prompt::PromptError::BlankText), "{blank:?}: {e}");
    }
}

#[test]
fn a_malformed_pause_tag_is_an_error_only_in_strict_mode() {
    let stop = Stop::new();
    let strict = speaker_reading(&stop, Reading { strict_tags: true, ..Reading::default() });
    for (text, tag) in
        [("Wait [pause:2] here.", "[pause:2]"), ("Wait [pause:soon] here.", "[pause:soon]"), ("[pause 1s]x", "[pause 1s]")]
    {
        let e = strict.plan(&strict.request(text)).unwrap_err();
        assert!(matches!(&e, engine::prompt::PromptError::PauseTag { tag: t, .. } if t == tag), "{text}: {e:?}");
        let msg = e.to_string();
        assert!(msg.contains(tag) && msg.contains("strict"), "{msg}");
    }
    // well-formed tags and words in brackets are fine in strict mode too
    let ok = strict.plan(&strict.request("Wait [pause:2s] here [paused]. [Pause for thought]")).unwrap();
    assert_eq!(texts(&ok), ["Wait", "<2000ms>", "here [paused]. [Pause for thought]"]);
    // lenient (the default): the same text is read as it is, in one pass
    let lenient = speaker(&stop);
    let pieces = lenient.plan(&lenient.request("Wait [pause:2] here.")).unwrap();
    assert_eq!(texts(&pieces), ["Wait [pause:2] here."]);
}

#[test]
fn a_sentence_pause_puts_exact_silence_after_every_sentence() {
    let stop = Stop::new();
    let reading = Reading { sentence_pause: Duration::from_millis(300), ..Reading::default() };
    let mut s = speaker_reading(&stop, reading);
    let request =
        Request { seed: None, max_frames: Some(3), ..s.request("One is here. Two, Mr. Smith! Three 4.5?\n\nFour [pause:1s] five.") };
    let pieces = s.plan(&request).unwrap();
    assert_eq!(
        texts(&pieces),
        ["One is here.", "<300ms>", "Two, Mr. Smith!", "<300ms>", "Three 4.5?", "<300ms>", "Four", "<1000ms>", "five."]
    );
    let (whole, _) = capture(&mut s, request);
    let want = pieces_alone(&mut s, &pieces);
    assert_eq!(whole.len(), 5 * 3 * 1920 + (3 * 300 + 1000) * 24);
    assert!(whole == want, "the sentences alone and the pauses, sample for sample");
    // one sentence: spoken as it is, as without the key
    let one = s.request("Just this one.");
    let pieces = s.plan(&one).unwrap();
    assert!(matches!(pieces.as_slice(), [Piece::Speech(r)] if r.text == one.text));
}

/// The start-up self-test (`herald serve`, issue 39): "Hello." through the front's queue and
/// the engine into a null sink, cut at 16 frames (the tiny model never says eos), every sample
/// a number; after the stop it reports `Stopped`, not a failure.
#[test]
fn the_self_test_speaks_its_sentence_through_the_queue() {
    use service::selftest::{self, SelfTestError};
    let stop = Stop::new();
    let front = service::Front::start(
        speaker(&stop),
        &service::FrontSettings { queue_length: 1, max_text_chars: 4096, aliases: Default::default() },
    )
    .unwrap();
    let proof = selftest::run(&front).unwrap();
    assert_eq!(proof.frames, selftest::MAX_FRAMES);
    assert_eq!((proof.samples, proof.sample_rate), (16 * 1920, 24_000), "16 frames of 1920 samples at 24 kHz");
    assert!((proof.audio_seconds() - 1.28).abs() < 1e-9);
    assert!(proof.peak > 0.0 && proof.peak.is_finite(), "sound, not silence: {proof:?}");
    assert!(proof.ttfa > 0.0 && proof.ttfa <= proof.seconds && proof.rtf().is_finite(), "{proof:?}");
    stop.stop();
    assert!(matches!(selftest::run(&front), Err(SelfTestError::Stopped)));
}

/// A job marked unmeasured (the self-test: cold, and cut short) leaves what the speaker learns
/// for its start policy and automatic calibration as it was; the same job measured adds one
/// utterance.
#[test]
fn an_unmeasured_job_teaches_the_speaker_nothing() {
    let stop = Stop::new();
    let mut s = speaker(&stop);
    let mut request = s.request("Hello.");
    request.max_frames = Some(16);
    s.speak(Job::new(request.clone(), null()).unmeasured()).unwrap();
    assert_eq!(s.learned().utterances, 0);
    assert!(s.learned().frames_per_token.is_empty());
    s.speak(Job::new(request, null())).unwrap();
    assert_eq!(s.learned().utterances, 1);
    assert_eq!(s.learned().frames_per_token.len(), 1);
}
