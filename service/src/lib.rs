//! herald's service layer: the speaker and the front-ends that feed it.
//!
//! - [`Speaker`] ([`speaker`]): one loaded engine, the amplifier line and the voice; it speaks
//!   [`Job`]s, each with its own [`Target`] (the sink factory: device, WAV file, stdout or a
//!   caller's sink) and its own [`Cancel`] handle. A [`Request`](engine::Request) is built from
//!   the configuration in one place, [`Voice::request`].
//! - [`Queue`] ([`queue`]): the speaker on a worker thread behind a bounded queue, with
//!   admission ([`Queue::try_submit`] refuses when full) and per-job cancel.
//! - [`Stop`] ([`cancel`]): the process-wide stop (SIGINT/SIGTERM) cancels the job in progress
//!   and the queued ones.
//! - Front-ends call only the above: [`fifo`] today (`herald serve`); a Wyoming or HTTP server
//!   goes beside it as another module.
//! - [`conns`]: the connection limit the network front-ends share (counted until the socket
//!   closes; which connection makes room for a new one).
//! - [`notify`]: systemd's sd_notify(3) and the watchdog; [`output`]: the sinks and atomic file
//!   writes; [`lookahead`]: the player thread that lets a long text's next segment be computed
//!   while the last one plays.
//! - [`selftest`]: the one sentence `herald serve` speaks into a null sink before it says it
//!   is ready.
//! - [`text`]: the text front-end every request goes through ([`Voice::request`]): markdown,
//!   emoji, URLs, punctuation and the user's replacement rules.
//!
//! Nothing here knows the application's configuration: the settings are plain structs
//! ([`SpeakerSettings`]) that the binary fills from its configuration in one function.

pub mod cancel;
pub mod conns;
pub mod device;
pub mod encode;
pub mod fifo;
pub mod front;
pub mod http;
pub mod listen;
pub mod live;
pub mod lookahead;
pub mod notify;
pub mod output;
pub mod page;
pub mod queue;
pub mod selftest;
pub mod speaker;
pub mod stretch;
pub mod text;
pub mod wyoming;
pub mod zeroconf;

pub use cancel::{Cancel, Stop};
pub use device::{DeviceHealth, NoDevice};
pub use front::{Alias, AliasError, Aliases, Front, FrontSettings, Listed, RequestError, Slot, VoiceInfo};
pub use live::{Live, LiveSettings, Reloadable};
pub use output::{AtomicFile, OutputSettings, Target, write_atomic};
pub use queue::{JobHandle, Outcome, Perform, Queue, Refused};
pub use speaker::{
    AmpSettings, DEFAULT_MAX_START_DELAY, Job, JobError, Learned, OnLearned, Piece, Preparing, Reading, Seeding, ServiceError,
    Speaker, SpeakerSettings, Spoken, StageRates, StartSettings, Voice, check, check_in, load_engine, plan,
};
pub use text::{TextError, TextOptions};

/// An error and its causes on one line, skipping a cause whose text its parent already shows
/// (typed errors often print their source themselves).
pub fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut cause = Some(err);
    while let Some(e) = cause {
        let text = e.to_string();
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        cause = e.source();
    }
    line
}
