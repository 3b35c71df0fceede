//! The configuration as the service sees it: the one function that maps [`Config`] into the
//! service's plain settings (voice and its text front-end, amplifier line, sinks), and the
//! voice aliases checked against a bundle.

use std::time::Duration;

use std::sync::Arc;

use engine::prompt::PromptMode;
use service::text::{self, Replacements, TextError, TextOptions};
use service::{Aliases, AmpSettings, OutputSettings, Reading, Seeding, SpeakerSettings, StartSettings, Voice, VoiceInfo};

use crate::config::{ActiveLevel, Config, SynthesisMode, TextCode, TextEmoji, TextMarkdown, TextPauseTags, TextUrls};

/// The text front-end's settings from `[text]`, the replacement file read and checked.
///
/// # Errors
/// [`TextError`] when `text.replacements` cannot be read or has a bad rule.
pub fn text_options(cfg: &Config) -> Result<TextOptions, TextError> {
    let t = &cfg.text;
    let replacements = t.replacements.as_deref().map(Replacements::load).transpose()?.map(Arc::new);
    Ok(TextOptions {
        markdown: match t.markdown {
            TextMarkdown::Auto => text::Markdown::Auto,
            TextMarkdown::On => text::Markdown::On,
            TextMarkdown::Off => text::Markdown::Off,
        },
        emoji: match t.emoji {
            TextEmoji::Remove => text::Emoji::Remove,
            TextEmoji::Keep => text::Emoji::Keep,
        },
        code: match t.code {
            TextCode::Skip => text::Code::Skip,
            TextCode::Read => text::Code::Read,
        },
        urls: match t.urls {
            TextUrls::Host => text::Urls::Host,
            TextUrls::Skip => text::Urls::Skip,
            TextUrls::Keep => text::Urls::Keep,
        },
        replacements,
    })
}

/// `voices.aliases` over the built-in aliases, checked against `voices` (the bundle's,
/// `service::front::catalog`).
///
/// # Errors
/// An alias the bundle cannot serve (`service::AliasError`), prefixed with where
/// `voices.aliases` was set: `/etc/herald/herald.toml:12: voices.aliases.kitchen = "vivan": …`.
pub fn aliases(cfg: &Config, voices: &[VoiceInfo]) -> anyhow::Result<Aliases> {
    Aliases::new(voices, &cfg.voices.aliases).map_err(|e| anyhow::anyhow!("{}: {e}", cfg.origin("voices.aliases")))
}

/// The speaker's settings from `cfg`. `plays`: the audio goes to the device, so the amplifier
/// line (`[amplifier]`) is used; writing files never touches it.
///
/// # Errors
/// [`TextError`] when `text.replacements` cannot be read or has a bad rule ([`text_options`]).
pub fn settings(cfg: &Config, plays: bool) -> Result<SpeakerSettings, TextError> {
    let s = &cfg.synthesis;
    let voice = Voice {
        language: s.language.clone(),
        speaker: s.speaker.clone(),
        mode: match s.mode {
            SynthesisMode::NonStreaming => PromptMode::NonStreaming,
            SynthesisMode::Streaming => PromptMode::Streaming,
        },
        // greedy, the configured seed, or a fresh one per utterance
        seeding: Seeding::from_fn({
            let s = s.clone();
            move || s.utterance_seed()
        }),
        text: text_options(cfg)?,
        speed: s.speed as f32,
    };
    let a = &cfg.amplifier;
    let amplifier = a.chip.as_ref().filter(|_| plays).map(|chip| AmpSettings {
        chip: chip.clone(),
        line: a.line,
        active_low: a.active == ActiveLevel::Low,
        lead: Duration::from_millis(a.lead_ms.into()),
    });
    let reading = Reading {
        segment_tokens: s.segment_tokens,
        pause: Duration::from_millis(s.segment_pause_ms.into()),
        sentence_pause: Duration::from_millis(s.sentence_pause_ms.into()),
        strict_tags: cfg.text.pause_tags == TextPauseTags::Strict,
    };
    let start = StartSettings {
        policy: s.start_policy.policy(),
        max_delay: Duration::from_millis(s.max_start_delay_ms.into()),
        calibrated: None,
    };
    Ok(SpeakerSettings {
        voice,
        amplifier,
        output: OutputSettings { shaper: cfg.shaper_settings(), alsa: cfg.alsa_settings() },
        reading,
        start,
    })
}
