//! Encoded audio formats (issue 39): the HTTP front-end's `response_format` `mp3`, `flac` and
//! `opus`, and `herald speak --out x.mp3|.flac|.opus`.
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
//! - **opus**: libopus 1.6 through `opusic-c` (its C source built by `opusic-sys` with CMake
//!   and linked statically; BSD-3-Clause), in Ogg pages written by the `ogg` crate (pure Rust)
//!   as RFC 7845 lays them out: an `OpusHead` page (the input rate, 24 kHz, and the pre-skip,
//!   the encoder's look-ahead), an `OpusTags` page, then the audio, [`OPUS_FRAME_MS`] ms a
//!   packet, a page ended after each chunk so that the bytes stream. [`OPUS_BPS`] bit/s, VBR,
//!   `OPUS_APPLICATION_AUDIO`. The last page's granule position trims the padding, so a decoder
//!   gives exactly the input's samples (at 48 kHz, the Opus output rate).
//!
//! AAC is not made: see [`Codec`].

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

/// The Opus bit rate, bit/s (VBR target): 48 kbit/s, where libopus codes 24 kHz mono speech
/// in its full (super-wideband, 12 kHz) band; 6 KB a second of audio.
pub const OPUS_BPS: u32 = 48_000;

/// The Opus frame (one packet), ms: 20, libopus's default and the frame RFC 7845 encoders use;
/// 480 samples at 24 kHz, 960 at the 48 kHz the granule positions count.
pub const OPUS_FRAME_MS: u32 = 20;

/// The Ogg logical stream's serial number in the Opus files herald writes: fixed, so that the
/// same audio gives the same bytes (RFC 3533 asks serials to differ only between the streams
/// of one physical file, and herald's files carry one).
pub const OGG_SERIAL: u32 = 0x6865_7261; // "hera"

/// The encoded formats herald makes. OpenAI's `aac` is not among them: the one AAC encoder of
/// note, Fraunhofer's FDK, is under a licence Debian treats as non-free, and no other
/// well-kept encoder builds into herald.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// MPEG-1/2 Layer III ([`MP3_KBPS`] CBR, mono).
    Mp3,
    /// FLAC, 16 bits, mono.
    Flac,
    /// Opus in Ogg (RFC 7845), [`OPUS_BPS`] VBR, mono.
    Opus,
}

impl Codec {
    /// The `Content-Type` of the format: `audio/mpeg`, `audio/flac`, `audio/ogg` (RFC 7845's
    /// media type for Opus in Ogg).
    pub fn content_type(self) -> &'static str {
        match self {
            Codec::Mp3 => "audio/mpeg",
            Codec::Flac => "audio/flac",
            Codec::Opus => "audio/ogg",
        }
    }

    /// The format's name, as `response_format` and file extensions spell it.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Mp3 => "mp3",
            Codec::Flac => "flac",
            Codec::Opus => "opus",
        }
    }

    /// A new encoder of this format for mono audio at `sample_rate` Hz.
    ///
    /// # Errors
    /// [`EncodeError::Setup`] when the codec refuses the rate (LAME takes 8–48 kHz; FLAC any
    /// rate up to 655 kHz; Opus 8, 12, 16, 24 or 48 kHz).
    pub fn encoder(self, sample_rate: u32) -> Result<Box<dyn Encoder>, EncodeError> {
        Ok(match self {
            Codec::Mp3 => Box::new(Mp3::new(sample_rate)?),
            Codec::Flac => Box::new(Flac::new(sample_rate)?),
            Codec::Opus => Box::new(Opus::new(sample_rate)?),
        })
    }
}

/// Errors of the encoders; messages name the codec.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The encoder could not be set up (a rate or setting it refuses).
    #[error("{codec} encoder: cannot set up: {message}")]
    Setup {
        /// `mp3`, `flac` or `opus`.
        codec: &'static str,
        /// The library's message.
        message: String,
    },
    /// Encoding failed.
    #[error("{codec} encoder: {message}")]
    Encode {
        /// `mp3`, `flac` or `opus`.
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

/// Opus in Ogg through libopus ([`Codec::Opus`]).
pub struct Opus {
    enc: opusic_c::Encoder,
    /// Samples per packet at the input rate.
    frame: usize,
    /// 48 kHz samples per input sample (2 at 24 kHz).
    scale: u64,
    /// The encoder's look-ahead, input samples.
    lookahead: usize,
    /// The look-ahead at 48 kHz: the OpusHead pre-skip.
    pre_skip: u64,
    /// The two header pages, until the first call writes them.
    header: Option<Vec<u8>>,
    /// Input samples not yet a whole packet (libopus wants `u16` bit patterns of `i16`).
    pending: Vec<u16>,
    /// Input samples taken so far.
    total: u64,
    /// Packets encoded so far.
    packets: u64,
    ogg: ogg::PacketWriter<'static, Vec<u8>>,
    /// One packet's bytes.
    packet: Vec<u8>,
}

fn opus_err(setup: bool) -> impl Fn(opusic_c::ErrorCode) -> EncodeError {
    move |e| {
        let message = format!("libopus: {} ({e:?})", e.message());
        if setup { EncodeError::Setup { codec: "opus", message } } else { EncodeError::Encode { codec: "opus", message } }
    }
}

fn ogg_err(e: std::io::Error) -> EncodeError {
    EncodeError::Encode { codec: "opus", message: format!("ogg: {e}") }
}

/// Libopus's largest packet for one frame is 1275 bytes (RFC 6716, 3.2.1) per 20 ms; 4000 is
/// the buffer its own examples give one packet.
const OPUS_MAX_PACKET: usize = 4000;

impl Opus {
    /// Libopus for mono at `sample_rate` Hz (8, 12, 16, 24 or 48 kHz), [`OPUS_BPS`] VBR,
    /// [`OPUS_FRAME_MS`] ms packets; the `OpusHead` and `OpusTags` pages made ready.
    ///
    /// # Errors
    /// [`EncodeError::Setup`] for another rate, or when libopus refuses a setting.
    pub fn new(sample_rate: u32) -> Result<Self, EncodeError> {
        use opusic_c::{Application, Bitrate, Channels, SampleRate};
        let rate = match sample_rate {
            8_000 => SampleRate::Hz8000,
            12_000 => SampleRate::Hz12000,
            16_000 => SampleRate::Hz16000,
            24_000 => SampleRate::Hz24000,
            48_000 => SampleRate::Hz48000,
            other => {
                return Err(EncodeError::Setup {
                    codec: "opus",
                    message: format!("{other} Hz is not an Opus input rate (8, 12, 16, 24 or 48 kHz)"),
                });
            }
        };
        let mut enc = opusic_c::Encoder::new(Channels::Mono, rate, Application::Audio).map_err(opus_err(true))?;
        enc.set_bitrate(Bitrate::Value(OPUS_BPS)).map_err(opus_err(true))?;
        enc.set_vbr(true).map_err(opus_err(true))?;
        let lookahead = enc.get_look_ahead().map_err(opus_err(true))? as usize;
        let scale = u64::from(48_000 / sample_rate);
        let pre_skip = lookahead as u64 * scale;
        let frame = (sample_rate * OPUS_FRAME_MS / 1000) as usize;
        let mut ogg = ogg::PacketWriter::new(Vec::new());
        let setup = |e: std::io::Error| EncodeError::Setup { codec: "opus", message: format!("ogg: {e}") };
        ogg.write_packet(opus_head(pre_skip as u16, sample_rate), OGG_SERIAL, ogg::PacketWriteEndInfo::EndPage, 0).map_err(setup)?;
        ogg.write_packet(opus_tags(), OGG_SERIAL, ogg::PacketWriteEndInfo::EndPage, 0).map_err(setup)?;
        let header = std::mem::take(ogg.inner_mut());
        Ok(Opus {
            enc,
            frame,
            scale,
            lookahead,
            pre_skip,
            header: Some(header),
            pending: Vec::with_capacity(frame),
            total: 0,
            packets: 0,
            ogg,
            packet: Vec::with_capacity(OPUS_MAX_PACKET),
        })
    }

    /// Encode every whole packet in `pending` into Ogg pages appended to `out`, the last one
    /// ending its page (the end of the stream when `last`).
    fn packets(&mut self, out: &mut Vec<u8>, last: bool) -> Result<(), EncodeError> {
        let whole = self.pending.len() / self.frame;
        for k in 0..whole {
            self.packet.clear();
            self.enc.encode_to_vec(&self.pending[k * self.frame..(k + 1) * self.frame], &mut self.packet).map_err(opus_err(false))?;
            self.packets += 1;
            let end = k + 1 == whole;
            let (info, granule) = if end && last {
                // the end trim: the decoder stops at pre-skip + the input's length
                (ogg::PacketWriteEndInfo::EndStream, self.pre_skip + self.total * self.scale)
            } else {
                let info = if end { ogg::PacketWriteEndInfo::EndPage } else { ogg::PacketWriteEndInfo::NormalPacket };
                (info, self.packets * self.frame as u64 * self.scale)
            };
            self.ogg.write_packet(self.packet.clone(), OGG_SERIAL, info, granule).map_err(ogg_err)?;
        }
        self.pending.drain(..whole * self.frame);
        out.append(self.ogg.inner_mut());
        Ok(())
    }
}

/// RFC 7845 5.1's identification header for one channel: magic, version 1, the channel count,
/// the pre-skip (48 kHz samples), the input rate, an output gain of 0 and channel mapping
/// family 0 (mono or stereo, no table), integers little-endian.
fn opus_head(pre_skip: u16, input_rate: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(19);
    h.extend_from_slice(b"OpusHead");
    h.push(1);
    h.push(1);
    h.extend_from_slice(&pre_skip.to_le_bytes());
    h.extend_from_slice(&input_rate.to_le_bytes());
    h.extend_from_slice(&0i16.to_le_bytes());
    h.push(0);
    h
}

/// RFC 7845 5.2's comment header: magic, the vendor string (length-prefixed UTF-8) and no
/// user comments.
fn opus_tags() -> Vec<u8> {
    let vendor = concat!("herald ", env!("CARGO_PKG_VERSION"), " (libopus)");
    let mut h = Vec::with_capacity(16 + vendor.len());
    h.extend_from_slice(b"OpusTags");
    h.extend_from_slice(&(vendor.len() as u32).to_le_bytes());
    h.extend_from_slice(vendor.as_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

impl Encoder for Opus {
    fn encode(&mut self, samples: &[i16], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if let Some(h) = self.header.take() {
            out.extend_from_slice(&h);
        }
        self.total += samples.len() as u64;
        self.pending.extend(samples.iter().map(|&s| s as u16));
        self.packets(out, false)
    }

    fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        if let Some(h) = self.header.take() {
            out.extend_from_slice(&h);
        }
        // zeros until the packets cover the input and the look-ahead (whose samples come out
        // last), in whole packets; at least one packet, so the stream has an end page
        let fed = self.packets * self.frame as u64 + self.pending.len() as u64;
        let need = (self.total + self.lookahead as u64).div_ceil(self.frame as u64) * self.frame as u64;
        self.pending.resize(self.pending.len() + (need - fed) as usize, 0);
        self.packets(out, true)
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

    /// The packets of an Ogg stream, each with its page's granule position and whether it ends
    /// the stream, read by the `ogg` crate's reader.
    fn ogg_packets(bytes: &[u8]) -> Vec<(Vec<u8>, u64, bool)> {
        let mut r = ogg::PacketReader::new(std::io::Cursor::new(bytes));
        let mut v = Vec::new();
        while let Some(p) = r.read_packet().unwrap() {
            assert_eq!(p.stream_serial(), OGG_SERIAL);
            v.push((p.data.clone(), p.absgp_page(), p.last_in_stream()));
        }
        v
    }

    #[test]
    fn opus_of_a_sine_is_rfc7845_ogg_that_libopus_decodes_to_its_samples() {
        let (pcm, out, first) = sine_stream(Codec::Opus);
        assert_eq!(&out[..4], b"OggS");
        // the audio streams: pages out after the first three 80 ms chunks, beyond the two
        // header pages
        let packets = ogg_packets(&out);
        let header_bytes = Opus::new(24_000).unwrap().header.unwrap().len();
        assert!(first > header_bytes, "{first} bytes after three chunks, {header_bytes} of headers");
        // OpusHead: version 1, one channel, pre-skip 312 (libopus's 6.5 ms look-ahead at 48 kHz:
        // 2.5 ms of MDCT overlap + 4 ms of delay compensation), input rate 24000, gain 0, family 0
        let (head, gp, _) = &packets[0];
        assert_eq!(&head[..8], b"OpusHead");
        assert_eq!((head[8], head[9]), (1, 1));
        let pre_skip = u16::from_le_bytes([head[10], head[11]]);
        assert_eq!(pre_skip, 312);
        assert_eq!(u32::from_le_bytes([head[12], head[13], head[14], head[15]]), 24_000);
        assert_eq!((&head[16..18], head[18], head.len(), *gp), (&[0u8, 0][..], 0, 19, 0));
        let (tags, _, _) = &packets[1];
        assert_eq!(&tags[..8], b"OpusTags");
        let vendor = u32::from_le_bytes([tags[8], tags[9], tags[10], tags[11]]) as usize;
        assert!(std::str::from_utf8(&tags[12..12 + vendor]).unwrap().starts_with("herald "));
        assert_eq!(&tags[12 + vendor..], &[0, 0, 0, 0]);
        // 20 ms packets covering the second and the look-ahead; the last page ends the stream
        // at pre-skip + 2 × 24,000 (48 kHz samples), trimming the padding
        let audio = &packets[2..];
        assert_eq!(audio.len(), (24_000usize + 156).div_ceil(480));
        assert!(audio[..audio.len() - 1].iter().all(|p| !p.2));
        let last = audio.last().unwrap();
        assert!(last.2);
        assert_eq!(last.1, 312 + 48_000);
        // decoded (libopus's decoder, at 24 kHz) and the pre-skip dropped: the sine, in time
        let mut dec = opusic_c::Decoder::new(opusic_c::Channels::Mono, opusic_c::SampleRate::Hz24000).unwrap();
        let mut decoded: Vec<u16> = Vec::new();
        for (data, _, _) in audio {
            let mut frame = vec![0u16; 480];
            assert_eq!(dec.decode_to_slice(data, &mut frame, false).unwrap(), 480);
            decoded.extend_from_slice(&frame);
        }
        let decoded: Vec<i16> = decoded[156..156 + pcm.len()].iter().map(|&s| s as i16).collect();
        let (mut sig, mut noise) = (0.0f64, 0.0f64);
        // the first 20 ms are the codec's start-up
        for (&p, &d) in pcm.iter().zip(&decoded).skip(480) {
            sig += f64::from(p).powi(2);
            noise += (f64::from(p) - f64::from(d)).powi(2);
        }
        let snr = 10.0 * (sig / noise).log10();
        assert!(snr > 20.0, "a 440 Hz sine through 48 kbit/s Opus: {snr:.1} dB");
        // 48 kbit/s VBR: about 6 KB for the second (and far less than its 48,000 bytes of PCM)
        assert!((3_000..10_000).contains(&out.len()), "{}", out.len());
    }

    #[test]
    fn opus_takes_the_opus_rates_only_and_an_empty_stream_still_ends() {
        let e = Codec::Opus.encoder(22_050).err().unwrap();
        assert_eq!(e.to_string(), "opus encoder: cannot set up: 22050 Hz is not an Opus input rate (8, 12, 16, 24 or 48 kHz)");
        let mut enc = Codec::Opus.encoder(24_000).unwrap();
        let mut out = Vec::new();
        enc.finish(&mut out).unwrap();
        let packets = ogg_packets(&out);
        // the headers, then one packet of the look-ahead's padding, ending at the pre-skip: no audio
        assert_eq!(packets.len(), 3);
        assert_eq!((packets[2].1, packets[2].2), (312, true));
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
