//! The configuration as the service sees it: the one function that maps [`Config`] into the
//! service's plain settings (voice, amplifier line, sinks).

use std::time::Duration;

use engine::prompt::PromptMode;
use service::{AmpSettings, OutputSettings, Reading, Seeding, SpeakerSettings, StartSettings, Voice};

use crate::config::{ActiveLevel, Config, SynthesisMode};

/// The speaker's settings from `cfg`. `plays`: the audio goes to the device, so the amplifier
/// line (`[amplifier]`) is used; writing files never touches it.
pub fn settings(cfg: &Config, plays: bool) -> SpeakerSettings {
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
    };
    let a = &cfg.amplifier;
    let amplifier = a.chip.as_ref().filter(|_| plays).map(|chip| AmpSettings {
        chip: chip.clone(),
        line: a.line,
        active_low: a.active == ActiveLevel::Low,
        lead: Duration::from_millis(a.lead_ms.into()),
    });
    let reading = Reading { segment_tokens: s.segment_tokens, pause: Duration::from_millis(s.segment_pause_ms.into()) };
    let start = StartSettings {
        policy: s.start_policy.policy(),
        max_delay: Duration::from_millis(s.max_start_delay_ms.into()),
        calibrated: None,
    };
    SpeakerSettings {
        voice,
        amplifier,
        output: OutputSettings { shaper: cfg.shaper_settings(), alsa: cfg.alsa_settings() },
        reading,
        start,
    }
}
