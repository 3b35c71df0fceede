//! The settings `herald serve` may change while it runs (SIGHUP, docs/reliability.md
//! "Signals"): the voice of a request that names none, the voice aliases, the shaping and ALSA
//! settings of each new output, the amplifier line's lead, and the longest text a network
//! request may carry ([`Live`]); and, each in its own [`Reloadable`], the network servers' limits and timeouts.
//! Every job reads them when it is made, so a change applies from the next job on; the one in
//! progress keeps what it began with.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use crate::front::Aliases;
use crate::output::OutputSettings;
use crate::speaker::Voice;

/// The settings themselves (see the [module](self) docs).
#[derive(Debug, Clone)]
pub struct LiveSettings {
    /// The voice of a request that does not name one.
    pub voice: Voice,
    /// The voice aliases (`[voices.aliases]` over the built-in ones), checked against the
    /// bundle.
    pub aliases: Aliases,
    /// Gain, silences and fades of each output, and the ALSA device it plays on.
    pub output: OutputSettings,
    /// The longest text a network request may carry, characters (`serve.max_text_chars`).
    pub max_text_chars: usize,
    /// How long before the first sample the amplifier line goes on (`amplifier.lead_ms`);
    /// `None`: as the line was opened.
    pub amp_lead: Option<Duration>,
}

/// A shared handle on settings a reload may change: clones see the same settings. Readers take
/// a copy ([`get`](Self::get)) when they begin a piece of work, so a change applies from the
/// next one on.
#[derive(Debug)]
pub struct Reloadable<T>(Arc<RwLock<T>>);

impl<T> Clone for Reloadable<T> {
    fn clone(&self) -> Self {
        Reloadable(Arc::clone(&self.0))
    }
}

impl<T: Clone> Reloadable<T> {
    /// A handle holding `settings`.
    pub fn new(settings: T) -> Self {
        Reloadable(Arc::new(RwLock::new(settings)))
    }

    /// A copy of the settings now.
    pub fn get(&self) -> T {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// `f` of the settings now, without copying them (for a reader that looks often, such as
    /// a connection's watchdog tick).
    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Replace the settings (for the next job, request or connection on).
    pub fn set(&self, settings: T) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = settings;
    }
}

/// The handle on [`LiveSettings`] the speaker's front-ends share.
pub type Live = Reloadable<LiveSettings>;
