//! Encoded audio formats (issue 39): the HTTP front-end's `response_format` `mp3` and `flac`,
//! and `herald speak --out x.mp3|.flac`.
//!
//! One trait, [`Encoder`]: 16-bit mono samples at the model rate (24 kHz) in, bytes out, chunk
//! by chunk, so that an encoded stream's first bytes leave with the engine's first chunk; then
//! [`Encoder::finish`] flushes what the codec holds back. [`EncodedSink`] puts an encoder behind
//! the [`AudioSink`] trait (shaping like the WAV and raw sinks, then encoding, then a writer).
//!
//! - **mp3**: LAME 3.100 through `mp3lame-encoder` (LAME's C source built by `mp3lame-sys` and
//!   linked statically; LAME is LGPL-2.0-or-later, see docs/licences.md): constant [`MP3_KBPS`] kbit/s, mono, LAME quality
//!   [`MP3_QUALITY`], no Xing/LAME tag (it would have to be written back into the first frame,
//!   which a stream cannot do). At 24 kHz that is MPEG-2 Layer III, 576 samples a frame. The
//!   decoder sees LAME's encoder delay (576 + 529 samples, LAME's `ENCDELAY` + the MDCT delay,
//!   minus what its decoder removes) of leading silence, and the last frame padded.
//! - **flac**: `flacenc` (pure Rust), fixed blocks of [`FLAC_BLOCK`] samples (the last one
//!   shorter), 16 bits. The STREAMINFO header goes out first with the total length, the MD5
//!   and the frame sizes unknown (0: allowed by the FLAC format for a stream), so decoders
//!   read it to its end. Lossless: the decoded samples are the PCM's.
//!
//! Opus and AAC are not made: see [`Codec`].

use std::io::Write;

use board::audio::{AudioSink, ShaperSettings, ShapingStage, SinkError, SinkErrorKind, SinkStats};
use board::pcm::f32_to_s16;
use flacenc::bitsink::ByteSink;
use flacenc::component::{BitRepr, Stream};
use flacenc::error::Verify;
use flacenc::source::{Fill, FrameBuf};

/// The MP3 bit rate, kbit/s (constant): 64 kbit/s mono is what speech needs at 24 kHz
/// (MPEG-2 Layer III allows 8–160), 8 KB a second of audio.
pub const MP3_KBPS: u32 = 64;

/// LAME's algorithm quality (`-q`, 0 best/slowest … 9 worst/fastest): 5, LAME's "good speed,
/// reasonable quality" setting, chosen for the boards' CPUs.
pub const MP3_QUALITY: u8 = 5;

/// The FLAC block size, samples: 4096, the reference encoder's default for its usual levels
/// (170 ms at 24 kHz: a FLAC stream's bytes lag its audio by at most one block).
pub const FLAC_BLOCK: usize = 4096;

/// The encoded formats herald makes. OpenAI's `opus` and `aac` are not among them: no
/// well-kept encoder builds statically here without more tools (libopus's Rust bindings build
/// it with CMake, which the build machine and the Yocto image do not carry; the one AAC
/// encoder of note, Fraunhofer's FDK, is under a licence Debian treats as non-free).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// MPEG-1/2 Layer III ([`MP3_KBPS`] CBR, mono).
    Mp3,
    /// FLAC, 16 bits, mono.
    Flac,
}

impl Codec {
    /// The `Content-Type` of the format: `audio/mpeg`, `audio/flac`.
    pub fn content_type(self) -> &'static str {
        match self {
            Codec::Mp3 => "audio/mpeg",
            Codec::Flac => "audio/flac",
        }
    }

    /// The format's name, as `response_format` and file extensions spell it.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Mp3 => "mp3",
            Codec::Flac => "flac",
        }
    }

    /// A new encoder of this format for mono audio at `sample_rate` Hz.
    ///
    /// # Errors
    /// [`EncodeError::Setup`] when the codec refuses the rate (LAME takes 8–48 kHz; FLAC any
    /// rate up to 655 kHz).
    pub fn encoder(self, sample_rate: u32) -> Result<Box<dyn Encoder>, EncodeError> {
        Ok(match self {
            Codec::Mp3 => Box::new(Mp3::new(sample_rate)?),
            Codec::Flac => Box::new(Flac::new(sample_rate)?),
        })
    }
}

/// Errors of the encoders; messages name the codec.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The encoder could not be set up (a rate or setting it refuses).
    #[error("{codec} encoder: cannot set up: {message}")]
    Setup {
        /// `mp3` or `flac`.
        codec: &'static str,
        /// The library's message.
        message: String,
    },
    /// Encoding failed.
    #[error("{codec} encoder: {message}")]
    Encode {
        /// `mp3` or `flac`.
        codec: &'static str,
        /// The library's message.
        message: String,
    },
}

/// An audio encoder: 16-bit mono samples at the rate it was made for in, the format's bytes
/// out, the first call's bytes starting with the stream's header.
pub trait Encoder: Send {
    /// Encode `samples` (any number, possibly none); append what is ready to `out` (possibly
    /// nothing: codecs work in frames and hold back the rest).
    ///
    /// # Errors
    /// [`EncodeError::Encode`] when the library fails.
    fn encode(&mut self, samples: &[i16], out: &mut Vec<u8>) -> Result<(), EncodeError>;

    /// End the stream: append what the encoder still holds (the last, padded frame). Call
    /// once; the encoder takes nothing after it.
    ///
    /// # Errors
    /// [`EncodeError::Encode`] when the library fails.
    fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), EncodeError>;
}

/// MP3 through LAME ([`Codec::Mp3`]).
pub struct Mp3 {
    lame: mp3lame_encoder::Encoder,
}

fn mp3_setup(e: impl std::fmt::Display) -> EncodeError {
    EncodeError::Setup { codec: "mp3", message: e.to_string() }
}

impl Mp3 {
    /// LAME for mono at `sample_rate` Hz, [`MP3_KBPS`] CBR, quality [`MP3_QUALITY`].
    ///
    /// # Errors
    /// [`EncodeError::Setup`] when LAME refuses the settings (a rate outside 8–48 kHz).
    pub fn new(sample_rate: u32) -> Result<Self, EncodeError> {
        use mp3lame_encoder::{Bitrate, Builder, Mode, Quality};
        let mut b = Builder::new().ok_or_else(|| mp3_setup("lame_init failed"))?;
        b.set_num_channels(1).map_err(mp3_setup)?;
        b.set_sample_rate(sample_rate).map_err(mp3_setup)?;
        b.set_mode(Mode::Mono).map_err(mp3_setup)?;
        b.set_brate(Bitrate::Kbps64).map_err(mp3_setup)?;
        b.set_quality(Quality::Good).map_err(mp3_setup)?;
        b.set_to_write_vbr_tag(false).map_err(mp3_setup)?;
        Ok(Mp3 { lame: b.build().map_err(mp3_setup)? })
    }
}

impl Encoder for Mp3 {
    fn encode(&mut self, samples: &[i16], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if samples.is_empty() {
            return Ok(());
        }
        out.reserve(mp3lame_encoder::max_required_buffer_size(samples.len()));
        self.lame
            .encode_to_vec(mp3lame_encoder::MonoPcm(samples), out)
            .map(drop)
            .map_err(|e| EncodeError::Encode { codec: "mp3", message: e.to_string() })
    }

    fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        // LAME's documented need for the last frames: 7200 bytes
        out.reserve(7200);
        self.lame
            .flush_to_vec::<mp3lame_encoder::FlushGap>(out)
            .map(drop)
            .map_err(|e| EncodeError::Encode { codec: "mp3", message: e.to_string() })
    }
}

/// FLAC through flacenc ([`Codec::Flac`]).
pub struct Flac {
    config: flacenc::error::Verified<flacenc::config::Encoder>,
    info: flacenc::component::StreamInfo,
    /// The header, until the first call writes it.
    header: Option<Vec<u8>>,
    /// Samples of the block being filled.
    block: Vec<i32>,
    frames: FrameBuf,
    frame_number: usize,
    sink: ByteSink,
}

fn flac_err(e: impl std::fmt::Display) -> EncodeError {
    EncodeError::Encode { codec: "flac", message: e.to_string() }
}

impl Flac {
    /// A FLAC stream of mono 16-bit samples at `sample_rate` Hz, blocks of [`FLAC_BLOCK`].
    ///
    /// # Errors
    /// [`EncodeError::Setup`] when flacenc refuses the rate.
    pub fn new(sample_rate: u32) -> Result<Self, EncodeError> {
        let setup = |e: &dyn std::fmt::Display| EncodeError::Setup { codec: "flac", message: e.to_string() };
        let config = flacenc::config::Encoder::default().into_verified().map_err(|(_, e)| setup(&e))?;
        let mut stream = Stream::new(sample_rate as usize, 1, 16).map_err(|e| setup(&e))?;
        let info = stream.stream_info_mut();
        info.set_block_sizes(FLAC_BLOCK, FLAC_BLOCK).map_err(|e| setup(&e))?;
        info.set_frame_sizes(0, 0).map_err(|e| setup(&e))?;
        let info = info.clone();
        let mut sink = ByteSink::new();
        stream.write(&mut sink).map_err(|e| setup(&e))?;
        let header = sink.as_slice().to_vec();
        sink.clear();
        let frames = FrameBuf::with_size(1, FLAC_BLOCK).map_err(|e| setup(&e))?;
        Ok(Flac { config, info, header: Some(header), block: Vec::with_capacity(FLAC_BLOCK), frames, frame_number: 0, sink })
    }

    /// Encode the block collected so far as one frame, appended to `out`.
    fn frame(&mut self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.frames.fill_interleaved(&self.block).map_err(flac_err)?;
        let frame = flacenc::encode_fixed_size_frame(&self.config, &self.frames, self.frame_number, &self.info).map_err(flac_err)?;
        self.sink.clear();
        frame.write(&mut self.sink).map_err(flac_err)?;
        out.extend_from_slice(self.sink.as_slice());
        self.frame_number += 1;
        self.block.clear();
        Ok(())
    }
}

impl Encoder for Flac {
    fn encode(&mut self, samples: &[i16], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if let Some(h) = self.header.take() {
            out.extend_from_slice(&h);
        }
        for &s in samples {
            self.block.push(i32::from(s));
            if self.block.len() == FLAC_BLOCK {
                self.frame(out)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if let Some(h) = self.header.take() {
            out.extend_from_slice(&h);
        }
        if !self.block.is_empty() {
            self.frame(out)?;
        }
        Ok(())
    }
}

/// A sink that shapes the audio like the WAV and raw sinks, encodes it with a [`Codec`] and
/// writes the bytes to a writer as they come (an HTTP response's channel, a file).
pub struct EncodedSink {
    codec: Codec,
    stage: ShapingStage,
    encoder: Option<Box<dyn Encoder>>,
    target: String,
    w: Box<dyn Write + Send>,
    samples: Vec<i16>,
    bytes: Vec<u8>,
}

impl EncodedSink {
    /// `codec` to `w`; `target` names it in error messages.
    pub fn new(codec: Codec, w: impl Write + Send + 'static, target: &str, shaper: ShaperSettings) -> Self {
        EncodedSink {
            codec,
            stage: ShapingStage::new(shaper),
            encoder: None,
            target: target.to_owned(),
            w: Box::new(w),
            samples: Vec::new(),
            bytes: Vec::new(),
        }
    }

    fn failed(&self, e: EncodeError) -> SinkError {
        SinkError::other(SinkErrorKind::Output, format!("audio output {}: {e}", self.target))
    }

    /// Encode what the stage shaped last (and flush the encoder when `last`), write the bytes.
    fn put(&mut self, last: bool) -> Result<(), SinkError> {
        let Some(enc) = self.encoder.as_mut() else {
            return Err(SinkError::Config("write before begin".into()));
        };
        self.samples.clear();
        self.samples.extend(self.stage.shaped().iter().map(|&s| f32_to_s16(s)));
        self.bytes.clear();
        let mut done = enc.encode(&self.samples, &mut self.bytes);
        if last && done.is_ok() {
            done = enc.finish(&mut self.bytes);
            self.encoder = None;
        }
        done.map_err(|e| self.failed(e))?;
        if !self.bytes.is_empty() {
            let target = &self.target;
            self.w.write_all(&self.bytes).map_err(|source| SinkError::Io { target: target.clone(), op: "write", source })?;
        }
        Ok(())
    }
}

impl AudioSink for EncodedSink {
    fn begin(&mut self, sample_rate: u32) -> Result<(), SinkError> {
        self.stage.begin(sample_rate)?;
        self.encoder = Some(self.codec.encoder(sample_rate).map_err(|e| self.failed(e))?);
        Ok(())
    }

    fn write(&mut self, samples: &[f32]) -> Result<(), SinkError> {
        self.stage.process(samples)?;
        self.put(false)
    }

    fn finish(&mut self) -> Result<SinkStats, SinkError> {
        self.stage.finish()?;
        self.put(true)?;
        let target = &self.target;
        self.w.flush().map_err(|source| SinkError::Io { target: target.clone(), op: "flush", source })?;
        Ok(self.stage.stats(board::audio::SampleFormat::S16))
    }

    fn abort(&mut self) {
        self.stage.abort();
        self.encoder = None;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// One second of a 440 Hz sine at half scale, 24 kHz, fed in engine-sized chunks.
    fn sine_stream(codec: Codec) -> (Vec<i16>, Vec<u8>, usize) {
        let pcm: Vec<i16> =
            (0..24_000).map(|i| (16384.0 * (2.0 * std::f64::consts::PI * 440.0 * f64::from(i) / 24_000.0).sin()) as i16).collect();
        let mut enc = codec.encoder(24_000).unwrap();
        let mut out = Vec::new();
        let mut first = 0;
        for (n, chunk) in pcm.chunks(1920).enumerate() {
            enc.encode(chunk, &mut out).unwrap();
            if n == 2 {
                first = out.len();
            }
        }
        enc.finish(&mut out).unwrap();
        (pcm, out, first)
    }

    #[test]
    fn flac_of_a_sine_is_a_stream_with_its_header_and_frames() {
        let (_, out, first) = sine_stream(Codec::Flac);
        assert_eq!(&out[..4], b"fLaC");
        // STREAMINFO, the last metadata block (0x80 | type 0), 34 bytes
        assert_eq!(&out[4..8], &[0x80, 0, 0, 34]);
        // the first frame (4096 samples) is out before the fourth 80 ms chunk
        assert!(first > 42, "{first}");
        // frame sync code 0b1111_1111_1111_10 right after the header
        assert_eq!((out[42], out[43] & 0xFC), (0xFF, 0xF8));
        // a sine compresses: far less than the 48,000 bytes of its PCM
        assert!(out.len() < 30_000, "{}", out.len());
    }

    #[test]
    fn mp3_of_a_sine_is_constant_bit_rate_mpeg2_layer3_frames() {
        let (_, out, first) = sine_stream(Codec::Mp3);
        // the first three 80 ms chunks already gave frames (LAME holds back ~1.1k samples)
        assert!(first > 0);
        // MPEG-2 (ID bit 0), Layer III, no CRC: 0xFFF3; 64 kbit/s at 24 kHz is index 8
        assert_eq!((out[0], out[1]), (0xFF, 0xF3));
        assert_eq!(out[2] >> 4, 8);
        // 576-sample frames of 64000 / 8 * 576 / 24000 = 192 bytes: 1 s + delay ≈ 44 frames
        assert_eq!(out.len() % 192, 0, "{}", out.len());
        let frames = out.len() / 192;
        assert!((42..=46).contains(&frames), "{frames}");
    }

    #[test]
    fn a_sink_writes_the_header_at_begin_and_stops_at_abort() {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        struct W(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut s = EncodedSink::new(Codec::Flac, W(buf.clone()), "test", ShaperSettings::default());
        assert!(s.write(&[0.0; 10]).is_err());
        s.begin(24_000).unwrap();
        s.write(&[0.1; 480]).unwrap();
        assert_eq!(&buf.lock().unwrap()[..4], b"fLaC");
        let stats = s.finish().unwrap();
        assert_eq!(stats.input_samples, 480);
        assert!(buf.lock().unwrap().len() > 42);
    }
}
