//! `bundle.toml`, format v1: the typed manifest of a herald model bundle.
//!
//! The format is specified in `docs/bundle.md` and written by `tools/export` (Python). Every
//! table here rejects unknown keys, so a manifest and this parser cannot drift apart silently.
//! Loading checks the format version, that every file the manifest names exists inside the
//! bundle directory, and the internal consistency of the numbers (ids inside their vocabularies,
//! cache kinds per layer, table shapes against the model sizes). Checking the ONNX graphs
//! themselves against their declared IO is the graph loader's job.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::dtype::{Dtype, WeightFormat};

/// The only manifest format this build reads.
pub const FORMAT_VERSION: u32 = 1;
/// The model family this build runs.
pub const FAMILY: &str = "qwen3-tts-12hz";

/// Why a bundle cannot be used. Every variant names the file or key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The bundle directory or its manifest could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// File or directory that failed.
        path: PathBuf,
        /// The operating system's reason.
        source: std::io::Error,
    },
    /// `bundle.toml` is not valid TOML or does not match format v1 (unknown or missing keys,
    /// wrong types); the message is the parser's, with the key and line.
    #[error("{path}: {message}")]
    Parse {
        /// The manifest file.
        path: PathBuf,
        /// What the TOML parser reported.
        message: String,
    },
    /// The manifest is well-formed but describes something this build cannot run.
    #[error("{path}: {message}")]
    Invalid {
        /// The manifest file (for a file whose checksum does not match: that file).
        path: PathBuf,
        /// What is wrong, naming the key.
        message: String,
    },
}

/// `[model]`: what the bundle was made from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// Model family, always [`FAMILY`].
    pub family: String,
    /// `tts_model_type` of the checkpoint: `base`, `custom_voice` or `voice_design`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `tts_model_size`, e.g. `0b6`.
    pub size: String,
    /// `fp32` or `fp16`: activations, caches and tables (and the weights unless `weights`
    /// says otherwise).
    pub dtype: String,
    /// `fp32`, `fp16`, `q8` or `q4`: how the talker's and code predictor's projections are
    /// stored (absent in bundles written before quantization existed: then `dtype`).
    #[serde(default)]
    pub weights: Option<String>,
    /// Name of the checkpoint directory it was exported from.
    pub source: String,
    /// Exporter name and version.
    pub exporter: String,
}

/// `[audio]`: frame and sample facts (from the speech tokenizer's config).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AudioInfo {
    /// PCM sample rate in Hz (24000 for the 12 Hz codec).
    pub sample_rate: u32,
    /// PCM samples per codec frame (1920: one frame is 80 ms).
    pub samples_per_frame: u32,
    /// Codebooks per frame (16).
    pub num_codebooks: u32,
    /// Codes per codebook (2048).
    pub codebook_size: u32,
}

/// `[text]`: text-side vocabulary size and special ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TextIds {
    /// Rows of the text embedding table.
    pub vocab_size: u32,
    /// `<|im_start|>`.
    pub im_start: u32,
    /// `<|im_end|>`.
    pub im_end: u32,
    /// `<tts_pad>`.
    pub tts_pad: u32,
    /// `<tts_text_bos>`.
    pub tts_bos: u32,
    /// `<tts_text_eod>`.
    pub tts_eos: u32,
    /// The id of `assistant`, when the checkpoint states it.
    pub assistant: Option<u32>,
}

/// `[codec]`: the talker's codec vocabulary and its special ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodecIds {
    /// Talker vocabulary size (3072).
    pub vocab_size: u32,
    /// `codec_pad_id`.
    pub pad: u32,
    /// `codec_bos_id`.
    pub bos: u32,
    /// `codec_eos_token_id`: generation stops when codebook 0 samples it.
    pub eos: u32,
    /// `codec_think_id`.
    pub think: u32,
    /// `codec_nothink_id`.
    pub nothink: u32,
    /// `codec_think_bos_id`.
    pub think_bos: u32,
    /// `codec_think_eos_id`.
    pub think_eos: u32,
}

/// `[sampling.talker]`: defaults from the checkpoint's generation_config.json.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TalkerSampling {
    /// Sample (true) or take the argmax.
    pub do_sample: bool,
    /// Softmax temperature.
    pub temperature: f32,
    /// Keep the k most likely ids.
    pub top_k: u32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Penalty over previously sampled codebook-0 ids (HF sign rule).
    pub repetition_penalty: f32,
    /// EOS is blocked for this many frames.
    pub min_new_tokens: u32,
    /// Hard frame limit.
    pub max_new_tokens: u32,
}

/// `[sampling.code_predictor]`: the "subtalker" defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PredictorSampling {
    /// Sample (true) or take the argmax.
    pub do_sample: bool,
    /// Softmax temperature.
    pub temperature: f32,
    /// Keep the k most likely codes.
    pub top_k: u32,
    /// Nucleus mass.
    pub top_p: f32,
}

/// `[sampling]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    /// Codebook 0.
    pub talker: TalkerSampling,
    /// Codebooks 1..15.
    pub code_predictor: PredictorSampling,
}

/// `[tokenizer]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerInfo {
    /// File name inside the bundle (`tokenizer.json`).
    pub file: String,
    /// Regular BPE tokens.
    pub vocab_size: u32,
    /// BPE merges.
    pub merges: u32,
    /// Special tokens.
    pub added_tokens: u32,
    /// Hex SHA-256 of the file.
    pub sha256: String,
}

/// One named tensor in `tables.safetensors`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableRef {
    /// Tensor name in the file.
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
}

/// `[tables]`: host-side embedding tables.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tables {
    /// File name inside the bundle.
    pub file: String,
    /// `float32` or `float16`.
    pub dtype: String,
    /// Projected text embedding `[text vocab, H]`.
    pub text_embedding: TableRef,
    /// Talker codec embedding `[codec vocab, H]`.
    pub codec_embedding: TableRef,
    /// Code-predictor input embeddings `[15, 2048, H]`.
    pub cp_embedding: TableRef,
}

/// Cache kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum CacheKind {
    /// Slot = position; capacity grows with the sequence.
    Full,
    /// A ring of `window - 1` slots, slot = position mod (window - 1).
    Sliding {
        /// Window W including the query itself (Hugging Face's `sliding_window`).
        window: u32,
    },
}

/// `[talker]` and `[code_predictor]`: one decoder stack.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackInfo {
    /// Key into [`Manifest::graphs`].
    pub graph: String,
    /// Hidden size.
    pub hidden: u32,
    /// Decoder layers.
    pub layers: u32,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads.
    pub kv_heads: u32,
    /// Per-head dimension.
    pub head_dim: u32,
    /// SwiGLU width.
    pub intermediate: u32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// `max_position_embeddings`.
    pub max_positions: u32,
    /// Per layer, in order.
    pub cache: Vec<CacheKind>,
    /// Code predictor only: `small_to_mtp_projection` present.
    pub projection: Option<bool>,
    /// Code predictor only: number of heads selected by the `head` input.
    pub lm_heads: Option<u32>,
}

/// `[vocoder]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VocoderInfo {
    /// Key into [`Manifest::graphs`]: the windowed vocoder (codes of left context + chunk →
    /// PCM of the whole window).
    pub graph: String,
    /// Key into [`Manifest::graphs`] of the stateful streaming vocoder (the chunk's codes plus
    /// the carried `state.*` tensors → the chunk's PCM plus `next.*`), when the bundle carries
    /// one (docs/bundle.md "Stateful vocoder"); bundles without it decode windowed only.
    #[serde(default)]
    pub stream_graph: Option<String>,
    /// Codebooks read per frame.
    pub num_quantizers: u32,
    /// Codes per codebook.
    pub codebook_size: u32,
    /// Causal window of the decoder transformer, in frames (72).
    pub sliding_window: u32,
    /// Default left context of windowed decoding, in frames.
    pub left_context_frames: u32,
    /// Decoder transformer layers.
    pub transformer_layers: u32,
    /// History of the convolution stack, in frames.
    pub conv_receptive_field_frames: u32,
    /// Total history one sample depends on, in frames.
    pub receptive_field_frames: u32,
    /// Default chunk ramp in frames.
    pub ramp: Vec<u32>,
}

/// `[attention]`: host-side constants of the step-graph contract.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionInfo {
    /// Additive mask value for hidden keys.
    pub mask_fill: f32,
    /// RoPE layout (`rotate_half`).
    pub rope: String,
}

/// One symbolic or fixed dimension of a graph IO shape.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    /// A fixed size.
    Fixed(u64),
    /// A symbolic size, by name (`seq`, `past`, `frames`, ...).
    Symbol(String),
}

/// One input or output of a graph.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    /// Name in the ONNX graph.
    pub name: String,
    /// `float32`, `float16`, `int64`.
    pub dtype: String,
    /// Dimensions, outermost first.
    pub shape: Vec<Dim>,
}

/// `[graphs.<name>]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GraphInfo {
    /// ONNX file name inside the bundle.
    pub file: String,
    /// Hex SHA-256 of the file.
    pub sha256: String,
    /// Inputs in graph order.
    pub inputs: Vec<TensorSpec>,
    /// Outputs in graph order.
    pub outputs: Vec<TensorSpec>,
    /// How this graph stores its weights (`fp32`, `fp16`, `q8`, `q4`); absent in older
    /// bundles, where it is the model dtype.
    #[serde(default)]
    pub weights: Option<String>,
    /// Bytes of all initializers in the file (what its weights occupy on disk, and about
    /// what they occupy in memory once loaded); absent in older bundles.
    #[serde(default)]
    pub weight_bytes: Option<u64>,
}

/// `[quantization]`: how a q8/q4 bundle was quantized and what its fidelity gate measured
/// at export (docs/bundle.md "Quantized weights").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quantization {
    /// `q8` or `q4`.
    pub format: String,
    /// One line naming the ONNX ops and the scheme.
    pub scheme: String,
    /// Weights per scale (32 for q4), 0 for one scale per output channel (q8).
    pub block_size: u32,
    /// What stays in float (e.g. the code predictor's stacked heads, norms, the vocoder).
    pub float_weights: Vec<String>,
    /// q4 only: the activations of the quantized products as the fidelity gate measured them.
    /// `"int8"`: quantized per block of 32 at run time (`MatMulNBits` `accuracy_level = 4`,
    /// as GGML's Q4_0 × Q8_0), which lets a backend run them that way (herald's AVX-512 VNNI
    /// kernel); `"float32"`, or absent (bundles written before the field): float32 only.
    #[serde(default)]
    pub activations: Option<String>,
    /// The export's fidelity gate against the float32 graphs.
    pub gate: FidelityGate,
}

/// `[quantization.gate]`: the fidelity of the quantized step graphs against float32, measured
/// by the exporter with onnxruntime on the same checkpoint (docs/bundle.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FidelityGate {
    /// Whether every metric met its threshold (false only with `--allow-lossy`).
    pub passed: bool,
    /// Teacher-forced positions compared per stack.
    pub positions: u64,
    /// Talker logits SNR against float32, dB.
    pub talker_logits_snr_db: f64,
    /// Fraction of teacher-forced talker positions whose top-1 code matches float32.
    pub talker_top1: f64,
    /// Code-predictor logits SNR against float32, dB.
    pub code_predictor_logits_snr_db: f64,
    /// Fraction of teacher-forced code-predictor positions whose top-1 code matches.
    pub code_predictor_top1: f64,
    /// Texts decoded greedily, free-running, with both weight sets.
    pub free_running_texts: u64,
    /// Frames compared per text.
    pub free_running_frames: u64,
    /// Fewest frames until the first differing code over the texts.
    pub free_running_agree_min: u64,
}

/// `[qnn]`: context binaries of the step graphs for the Qualcomm NPU (docs/bundle.md "QNN
/// context binaries"), written by `tools/export/export qnn`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QnnSection {
    /// The QAIRT SDK version that compiled the binaries (e.g. `2.51.0`).
    pub sdk: String,
    /// The compiler and its version (e.g. `onnxruntime-qnn 2.7.0`).
    pub compiler: String,
    /// Every binary, sorted by arch, stack and slots.
    pub binaries: Vec<QnnBinary>,
}

/// `[[qnn.binaries]]`: one graph compiled for one HTP architecture at static shapes: a step graph
/// (`talker`, `code_predictor`: `slots` and `positions`) or the stateful vocoder (`vocoder`:
/// `frames`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QnnBinary {
    /// `talker`, `code_predictor` or `vocoder`.
    pub stack: String,
    /// The HTP architecture (`v68`, `v73`, `v75`, `v79`).
    pub arch: String,
    /// The SoC model id the compiler was told (Qualcomm's `Qnn_SocModel_t`: 43 SM8550, 69
    /// SM8750, 35 QCS6490, ...).
    pub soc_model: u32,
    /// The binary's file name inside the bundle.
    pub file: String,
    /// Hex SHA-256 of the file.
    pub sha256: String,
    /// The graph's name inside the binary.
    pub graph: String,
    /// The static `past` size: KV-cache slots of every `full` layer (step graphs; 0, absent, for
    /// the vocoder).
    #[serde(default)]
    pub slots: u32,
    /// The static `seq` size: positions per execution (step graphs; 0, absent, for the vocoder).
    #[serde(default)]
    pub positions: u32,
    /// The vocoder's static `frames`: frames decoded per execution (`frames` × samples per frame
    /// out); 0, absent, for the step graphs.
    #[serde(default)]
    pub frames: u32,
    /// `fp16` (float16 compute, v73+) or `w8a16` (8-bit weights, 16-bit activations).
    pub precision: String,
}

/// The whole `bundle.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Must equal [`FORMAT_VERSION`].
    pub format_version: u32,
    /// `[model]`.
    pub model: ModelInfo,
    /// `[audio]`.
    pub audio: AudioInfo,
    /// `[text]`.
    pub text: TextIds,
    /// `[codec]`.
    pub codec: CodecIds,
    /// Language name → codec id.
    pub languages: BTreeMap<String, u32>,
    /// Speaker name → codec id.
    pub speakers: BTreeMap<String, u32>,
    /// Dialect speakers → the dialect language they force.
    #[serde(default)]
    pub speaker_dialects: BTreeMap<String, String>,
    /// `[sampling]`.
    pub sampling: Sampling,
    /// `[tokenizer]`.
    pub tokenizer: TokenizerInfo,
    /// `[tables]`.
    pub tables: Tables,
    /// `[talker]`.
    pub talker: StackInfo,
    /// `[code_predictor]`.
    pub code_predictor: StackInfo,
    /// `[vocoder]`.
    pub vocoder: VocoderInfo,
    /// `[attention]`.
    pub attention: AttentionInfo,
    /// Graph name → graph.
    pub graphs: BTreeMap<String, GraphInfo>,
    /// `[quantization]`, present in q8/q4 bundles.
    #[serde(default)]
    pub quantization: Option<Quantization>,
    /// `[qnn]`, present when the bundle carries context binaries for the NPU.
    #[serde(default)]
    pub qnn: Option<QnnSection>,
}

impl Manifest {
    /// Whether the bundle's fidelity gate measured its q4 products with int8 activations
    /// (`[quantization] activations = "int8"`), so a backend may run them that way.
    pub fn int8_activations(&self) -> bool {
        self.quantization.as_ref().is_some_and(|q| q.activations.as_deref() == Some("int8"))
    }

    /// Parse and validate manifest text; `path` is only used in messages.
    ///
    /// # Errors
    /// [`ManifestError::Parse`] for TOML or schema errors, [`ManifestError::Invalid`] for
    /// inconsistent or unsupported content. Reading the file and checking that the files it
    /// names exist is the engine's (`engine::bundle::read_manifest`).
    pub fn parse(text: &str, path: &Path) -> Result<Self, ManifestError> {
        let m: Manifest = toml::from_str(text).map_err(|e| {
            // one line: "line N: message" (toml's own rendering quotes the source over several lines)
            let line = e.span().map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let message = match line {
                Some(l) => format!("line {l}: {}", e.message()),
                None => e.message().to_owned(),
            };
            ManifestError::Parse { path: path.to_owned(), message }
        })?;
        m.validate().map_err(|message| ManifestError::Invalid { path: path.to_owned(), message })?;
        Ok(m)
    }

    /// Every file the manifest names, relative to the bundle directory.
    pub fn files(&self) -> Vec<&str> {
        let mut v = vec![self.tokenizer.file.as_str(), self.tables.file.as_str()];
        v.extend(self.graphs.values().map(|g| g.file.as_str()));
        if let Some(q) = &self.qnn {
            v.extend(q.binaries.iter().map(|b| b.file.as_str()));
        }
        v
    }

    /// The HTP architectures the bundle has binaries for, sorted, each once.
    pub fn qnn_arches(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.qnn.iter().flat_map(|q| q.binaries.iter().map(|b| b.arch.as_str())).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The dtype of weights and caches (`model.dtype`, validated at parse time).
    pub fn dtype(&self) -> Dtype {
        self.model.dtype.parse().unwrap_or(Dtype::Fp32)
    }

    /// How the talker's and code predictor's projections are stored (`model.weights`,
    /// validated at parse time; the model dtype in bundles that predate it).
    pub fn weights(&self) -> WeightFormat {
        self.model.weights.as_deref().and_then(|w| w.parse().ok()).unwrap_or_else(|| self.dtype().into())
    }

    /// How graph `name` stores its weights (its own `weights` key, else the model's dtype;
    /// the vocoder graphs are never quantized).
    pub fn graph_weights(&self, name: &str) -> WeightFormat {
        self.graphs.get(name).and_then(|g| g.weights.as_deref()).and_then(|w| w.parse().ok()).unwrap_or_else(|| self.dtype().into())
    }

    /// The dtype of the host tables (`tables.dtype`: `float32` or `float16`).
    pub fn tables_dtype(&self) -> Dtype {
        if self.tables.dtype == "float16" { Dtype::Fp16 } else { Dtype::Fp32 }
    }

    /// The graph key of the vocoder in `form`: `[vocoder].graph` (windowed) or
    /// `[vocoder].stream_graph` (stateful; `None` when the bundle has none).
    pub fn vocoder_graph(&self, form: crate::backend::VocoderForm) -> Option<&str> {
        match form {
            crate::backend::VocoderForm::Windowed => Some(&self.vocoder.graph),
            crate::backend::VocoderForm::Stateful => self.vocoder.stream_graph.as_deref(),
        }
    }

    /// The vocoder form a bundle decodes with unless told otherwise: stateful when it carries a
    /// stream graph (exact, one pass per frame), else windowed.
    pub fn default_vocoder_form(&self) -> crate::backend::VocoderForm {
        if self.vocoder.stream_graph.is_some() { crate::backend::VocoderForm::Stateful } else { crate::backend::VocoderForm::Windowed }
    }

    /// Seconds of one codec frame (0.080 for the 12 Hz family).
    pub fn frame_seconds(&self) -> f64 {
        crate::frame::frame_seconds(self.audio.samples_per_frame, self.audio.sample_rate)
    }

    /// Frames per second of the codec (12.5 for the 12 Hz family).
    pub fn frame_rate(&self) -> f64 {
        f64::from(self.audio.sample_rate) / f64::from(self.audio.samples_per_frame)
    }

    fn validate(&self) -> Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format_version {} is not supported by this herald (it reads {FORMAT_VERSION}); re-export the bundle",
                self.format_version
            ));
        }
        if self.model.family != FAMILY {
            return Err(format!("model.family {:?} is not {FAMILY:?}", self.model.family));
        }
        if self.model.dtype.parse::<Dtype>().is_err() {
            return Err(format!("model.dtype {:?} must be \"fp32\" or \"fp16\"", self.model.dtype));
        }
        let weights = match &self.model.weights {
            Some(w) => w.parse::<WeightFormat>().map_err(|e| format!("model.weights {e}"))?,
            None => self.dtype().into(),
        };
        if weights.is_quantized() != self.quantization.is_some() {
            return Err(if weights.is_quantized() {
                format!("model.weights = \"{weights}\" needs a [quantization] table")
            } else {
                format!("a [quantization] table needs model.weights = \"q8\" or \"q4\" (it is \"{weights}\")")
            });
        }
        for (name, g) in &self.graphs {
            if let Some(w) = &g.weights {
                let w = w.parse::<WeightFormat>().map_err(|e| format!("graphs.{name}.weights {e}"))?;
                // the step graphs carry the model's weight format; the vocoder graphs stay float
                let step = name == &self.talker.graph || name == &self.code_predictor.graph;
                let want = if step { weights } else { self.dtype().into() };
                if w != want {
                    return Err(format!(
                        "graphs.{name}.weights = \"{w}\" contradicts model.weights = \"{weights}\" (expected \"{want}\")"
                    ));
                }
            }
        }
        if let Some(q) = &self.quantization {
            if q.format.parse::<WeightFormat>().map(WeightFormat::is_quantized) != Ok(true) {
                return Err(format!("quantization.format {:?} must be \"q8\" or \"q4\"", q.format));
            }
            if q.format != weights.as_str() {
                return Err(format!("quantization.format = {:?} differs from model.weights = \"{weights}\"", q.format));
            }
            // q4 is Q4_0: blocks of 32 (docs/bundle.md); q8 has one scale per output channel
            let block = if weights == WeightFormat::Q4 { 32 } else { 0 };
            if q.block_size != block {
                return Err(format!("quantization.block_size = {} must be {block} for {weights}", q.block_size));
            }
            match (q.activations.as_deref(), weights) {
                (None | Some("float32"), _) | (Some("int8"), WeightFormat::Q4) => {}
                (Some("int8"), _) => {
                    return Err(format!("quantization.activations = \"int8\" is for q4 bundles (this one is {weights})"));
                }
                (Some(other), _) => return Err(format!("quantization.activations {other:?} must be \"float32\" or \"int8\"")),
            }
        }
        let a = &self.audio;
        if a.sample_rate == 0 || a.samples_per_frame == 0 || a.num_codebooks < 2 || a.codebook_size == 0 {
            return Err("audio: sample_rate, samples_per_frame, codebook_size must be positive and num_codebooks >= 2".into());
        }
        let c = &self.codec;
        for (k, v) in [
            ("pad", c.pad),
            ("bos", c.bos),
            ("eos", c.eos),
            ("think", c.think),
            ("nothink", c.nothink),
            ("think_bos", c.think_bos),
            ("think_eos", c.think_eos),
        ] {
            if v >= c.vocab_size {
                return Err(format!("codec.{k} = {v} is outside the codec vocabulary 0..{}", c.vocab_size));
            }
        }
        let t = &self.text;
        for (k, v) in
            [("im_start", t.im_start), ("im_end", t.im_end), ("tts_pad", t.tts_pad), ("tts_bos", t.tts_bos), ("tts_eos", t.tts_eos)]
        {
            if v >= t.vocab_size {
                return Err(format!("text.{k} = {v} is outside the text vocabulary 0..{}", t.vocab_size));
            }
        }
        for (table, map) in [("languages", &self.languages), ("speakers", &self.speakers)] {
            if let Some((name, id)) = map.iter().find(|(_, id)| **id >= c.vocab_size) {
                return Err(format!("{table}.{name} = {id} is outside the codec vocabulary"));
            }
        }
        if let Some((spk, lang)) = self.speaker_dialects.iter().find(|(_, l)| !self.languages.contains_key(*l)) {
            return Err(format!("speaker_dialects.{spk} names {lang:?}, which is not in [languages]"));
        }
        for (name, s) in [("talker", &self.talker), ("code_predictor", &self.code_predictor)] {
            if s.cache.len() != s.layers as usize {
                return Err(format!("{name}.cache lists {} layers, {name}.layers is {}", s.cache.len(), s.layers));
            }
            if s.kv_heads == 0 || s.heads % s.kv_heads != 0 || s.head_dim % 2 != 0 {
                return Err(format!(
                    "{name}: heads {} must be a multiple of kv_heads {} and head_dim {} even",
                    s.heads, s.kv_heads, s.head_dim
                ));
            }
            if let Some(CacheKind::Sliding { window }) =
                s.cache.iter().find(|k| matches!(k, CacheKind::Sliding { window } if *window < 2))
            {
                return Err(format!("{name}.cache: sliding window {window} must be at least 2"));
            }
            if !self.graphs.contains_key(&s.graph) {
                return Err(format!("{name}.graph = {:?} is not in [graphs]", s.graph));
            }
        }
        if !self.graphs.contains_key(&self.vocoder.graph) {
            return Err(format!("vocoder.graph = {:?} is not in [graphs]", self.vocoder.graph));
        }
        if let Some(g) = self.vocoder.stream_graph.as_ref().filter(|g| !self.graphs.contains_key(*g)) {
            return Err(format!("vocoder.stream_graph = {g:?} is not in [graphs]"));
        }
        let st = &self.sampling.talker;
        let sp = &self.sampling.code_predictor;
        for (key, t, p) in [("talker", st.temperature, st.top_p), ("code_predictor", sp.temperature, sp.top_p)] {
            if !(t.is_finite() && t > 0.0) {
                return Err(format!("sampling.{key}.temperature = {t} must be a positive number"));
            }
            if !(p > 0.0 && p <= 1.0) {
                return Err(format!("sampling.{key}.top_p = {p} must be in (0, 1]"));
            }
        }
        if !(st.repetition_penalty.is_finite() && st.repetition_penalty > 0.0) {
            return Err(format!("sampling.talker.repetition_penalty = {} must be a positive number", st.repetition_penalty));
        }
        if st.max_new_tokens == 0 || st.min_new_tokens > st.max_new_tokens {
            return Err(format!(
                "sampling.talker: max_new_tokens = {} must be at least 1 and at least min_new_tokens = {}",
                st.max_new_tokens, st.min_new_tokens
            ));
        }
        if self.vocoder.ramp.is_empty() || self.vocoder.ramp.contains(&0) {
            return Err("vocoder.ramp must list positive chunk sizes".into());
        }
        let h = u64::from(self.talker.hidden);
        let groups = u64::from(a.num_codebooks - 1);
        for (name, tr, want) in [
            ("text_embedding", &self.tables.text_embedding, vec![u64::from(t.vocab_size), h]),
            ("codec_embedding", &self.tables.codec_embedding, vec![u64::from(c.vocab_size), h]),
            ("cp_embedding", &self.tables.cp_embedding, vec![groups, u64::from(a.codebook_size), h]),
        ] {
            if tr.shape != want {
                return Err(format!("tables.{name}.shape is {:?}, the model sizes imply {want:?}", tr.shape));
            }
        }
        for (gname, g) in &self.graphs {
            if !is_plain_file_name(&g.file) {
                return Err(format!("graphs.{gname}.file {:?} must be a file name inside the bundle", g.file));
            }
        }
        for (key, f) in [("tokenizer.file", &self.tokenizer.file), ("tables.file", &self.tables.file)] {
            if !is_plain_file_name(f) {
                return Err(format!("{key} {f:?} must be a file name inside the bundle"));
            }
        }
        if let Some(q) = &self.qnn {
            for (i, b) in q.binaries.iter().enumerate() {
                let at = format!("qnn.binaries[{i}]");
                match b.stack.as_str() {
                    "talker" | "code_predictor" => {
                        if b.slots == 0 || b.positions == 0 || b.frames != 0 {
                            return Err(format!("{at}: a step graph's binary has positive slots and positions and no frames"));
                        }
                    }
                    "vocoder" => {
                        if b.frames == 0 || b.slots != 0 || b.positions != 0 {
                            return Err(format!("{at}: a vocoder binary has positive frames and no slots or positions"));
                        }
                        if self.vocoder.stream_graph.is_none() {
                            return Err(format!("{at}: a vocoder binary needs the stream graph ([vocoder] stream_graph)"));
                        }
                    }
                    _ => return Err(format!("{at}.stack {:?} must be \"talker\", \"code_predictor\" or \"vocoder\"", b.stack)),
                }
                if !(b.arch.len() >= 3 && b.arch.starts_with('v') && b.arch[1..].bytes().all(|c| c.is_ascii_digit())) {
                    return Err(format!("{at}.arch {:?} must name an HTP architecture such as \"v73\"", b.arch));
                }
                if !is_plain_file_name(&b.file) {
                    return Err(format!("{at}.file {:?} must be a file name inside the bundle", b.file));
                }
                if b.precision != "fp16" && b.precision != "w8a16" {
                    return Err(format!("{at}.precision {:?} must be \"fp16\" or \"w8a16\"", b.precision));
                }
                if b.graph.is_empty() {
                    return Err(format!("{at}.graph is empty"));
                }
            }
        }
        Ok(())
    }
}

/// True when `name` is a single normal path component (no `..`, no `/`, not absolute).
fn is_plain_file_name(name: &str) -> bool {
    let mut comps = Path::new(name).components();
    matches!((comps.next(), comps.next()), (Some(Component::Normal(_)), None))
}
