//! The connection limit every network front-end shares (`serve.max_connections`): one table of
//! open connections, what each is doing, and which one to close when a new one arrives at the
//! limit (issue 40).
//!
//! # Counting
//!
//! A connection is counted from its accept until its socket is closed: the front-end holds the
//! [`Member`] for as long as it holds the socket and drops it after the socket (a connection
//! asked to close still counts until then). Of the counted connections at most
//! `max_connections` are not being closed, and at most [`slack`]`(max_connections)` more may be
//! on their way out at once (asked to close to make room, or ending on their own): so a burst of
//! any size leaves at most `max_connections + slack` connections open, and as many threads where
//! a front-end has one per connection. While that many are open ([`Table::full`]) a front-end
//! accepts nothing (new connections wait in the kernel's listen backlog until one has closed),
//! so that a churn of evictions slows down to the pace at which connections really close
//! instead of refusing everyone.
//!
//! # Eviction policy: per-address fairness, then oldest first
//!
//! At the limit a new connection from address A makes room by asking one *evictable*
//! connection to close. Evictable: no request in progress and not asked to close already —
//!
//! - [`Activity::Idle`]: between requests (a keep-alive HTTP connection, a Wyoming connection
//!   waiting for its next event). A connection that has not sent a single byte since it was
//!   accepted gets [`FRESH_GRACE`] first from newcomers of its own address, so that a burst of
//!   clients does not close one another before their first requests arrive (they are refused
//!   busy instead);
//! - [`Activity::Arriving`]: a request head, body or event still arriving (slow or partial:
//!   slowloris), at once;
//! - [`Activity::Stream`]: a Wyoming stream waiting for its next chunk, at once.
//!
//! [`Activity::Busy`] (a request being answered, a job queued or speaking) and
//! [`Activity::Closing`] are never chosen. The choice:
//!
//! 1. among the evictable connections of A itself and of every address that holds at least two
//!    connections more than A (so that the exchange makes the shares more even; their fresh
//!    connections get no grace), the one of the address holding the most connections, oldest
//!    first (the longest in its present activity);
//! 2. else the connection idle (no byte of a request) the longest, of any address, once idle for
//!    at least [`FRESH_GRACE`];
//! 3. else none: the new connection is refused busy.
//!
//! So clients that open many connections (a burst, a slowloris attack from one or a few
//! addresses) only ever close their own connections or those of other heavy addresses, never
//! the one connection of a client elsewhere; and a slow request head from any address is closed
//! before a legitimate request that arrives whole. One address cannot be told apart from
//! itself: clients behind one address share its fate (a flood of connections that send nothing,
//! from the address of a legitimate client, may keep it refused while the flood lasts).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a connection that has sent nothing since its accept is kept from eviction
/// (rule 2 of the module doc, and for its own address in rule 1).
pub const FRESH_GRACE: Duration = Duration::from_secs(1);

/// The most connections that may be on their way out (asked to close, not closed yet) besides
/// `max_connections` ([`slack`]).
pub const MAX_SLACK: usize = 8;

/// Connections that may be on their way out at once besides `max_connections`:
/// `max_connections`, at most [`MAX_SLACK`], at least 1. An evicted connection closes within
/// milliseconds (its thread or task sees the shut-down socket), so this only bounds a burst.
pub fn slack(max_connections: usize) -> usize {
    max_connections.clamp(1, MAX_SLACK)
}

/// What a connection is doing, as its front-end reports it ([`Tracker::set`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    /// Between requests: no byte of the next one yet.
    Idle,
    /// A request (HTTP head or body, a Wyoming event) is arriving.
    Arriving,
    /// A Wyoming stream (`synthesize-start` …) waits for its next chunk: evictable like
    /// [`Arriving`](Self::Arriving), but given the shutdown grace like [`Busy`](Self::Busy).
    Stream,
    /// A request is being answered (a job queued or speaking, a response being sent).
    Busy,
    /// The connection is ending on its own (its socket about to close).
    Closing,
}

/// How the table asks a connection to close from outside its thread or task (shut its socket
/// down, or wake its task); called with the table locked, so it must not call back into it.
pub type Closer = Box<dyn Fn() + Send + Sync>;

struct Entry {
    peer: IpAddr,
    activity: Activity,
    /// When it entered `activity`.
    since: Instant,
    /// No byte has come since the accept.
    fresh: bool,
    /// The table asked it to close.
    evicted: bool,
    close: Closer,
}

impl Entry {
    fn on_the_way_out(&self) -> bool {
        self.evicted || self.activity == Activity::Closing
    }

    /// Whether it may be closed to make room; `grace`: a fresh idle one only after
    /// [`FRESH_GRACE`].
    fn evictable(&self, now: Instant, grace: bool) -> bool {
        if self.on_the_way_out() {
            return false;
        }
        match self.activity {
            Activity::Busy | Activity::Closing => false,
            Activity::Arriving | Activity::Stream => true,
            Activity::Idle => !grace || !self.fresh || now.saturating_duration_since(self.since) >= FRESH_GRACE,
        }
    }
}

struct Inner {
    /// `max_connections` (at least 1); a reload may change it ([`Table::set_max`]).
    max: AtomicUsize,
    next: AtomicU64,
    entries: Mutex<BTreeMap<u64, Entry>>,
}

/// The open connections of one front-end, under one `max_connections` (see the module doc).
#[derive(Clone)]
pub struct Table(Arc<Inner>);

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table").field("max", &self.max()).field("open", &self.open()).finish()
    }
}

/// Why a connection was not admitted (for the log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Connections open (counted) when it came.
    pub open: usize,
    /// Of them, on their way out.
    pub closing: usize,
}

impl Table {
    /// A table for `max_connections` (0 counts as 1) with [`slack`] for those on their way out.
    pub fn new(max_connections: usize) -> Table {
        let max = AtomicUsize::new(max_connections.max(1));
        Table(Arc::new(Inner { max, next: AtomicU64::new(0), entries: Mutex::default() }))
    }

    /// Change `max_connections` (0 counts as 1; a reload of `serve.max_connections`). Raised,
    /// it takes effect with the next connection. Lowered, the connections over the new limit
    /// that may be evicted (idle, or a request still arriving) are asked to close at once,
    /// oldest first; busy ones are not cut short, and until they end new connections make room
    /// by eviction as at the limit.
    pub fn set_max(&self, max_connections: usize) {
        let max = max_connections.max(1);
        let mut entries = self.entries();
        self.0.max.store(max, Ordering::SeqCst);
        let now = Instant::now();
        let mut staying = entries.values().filter(|e| !e.on_the_way_out()).count();
        while staying > max {
            let oldest =
                entries.iter().filter(|(_, e)| e.evictable(now, false)).min_by_key(|(id, e)| (e.since, **id)).map(|(id, _)| *id);
            let Some(victim) = oldest.and_then(|id| entries.get_mut(&id)) else { break };
            victim.evicted = true;
            (victim.close)();
            staying -= 1;
        }
    }

    fn entries(&self) -> MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.0.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `max_connections`.
    pub fn max(&self) -> usize {
        self.0.max.load(Ordering::SeqCst)
    }

    /// The most connections ever counted at once: `max_connections` + [`slack`].
    pub fn ceiling(&self) -> usize {
        let max = self.max();
        max + slack(max)
    }

    /// Connections counted now (those on their way out included).
    pub fn open(&self) -> usize {
        self.entries().len()
    }

    /// Whether as many connections are counted as may ever be ([`ceiling`](Self::ceiling)):
    /// the front-end then accepts no more until one has closed, so that new connections wait
    /// in the kernel's listen backlog instead of being refused while evicted ones close.
    pub fn full(&self) -> bool {
        self.open() >= self.ceiling()
    }

    /// Admit a connection from `peer`, making room by the module doc's policy if the limit is
    /// reached; `close` is how the table may ask it to close later. The connection counts until
    /// the returned [`Member`] is dropped.
    ///
    /// # Errors
    /// [`Refusal`]: no room (the front-end answers busy and closes the connection).
    pub fn admit(&self, peer: IpAddr, close: Closer) -> Result<Member, Refusal> {
        self.admit_at(peer, close, Instant::now())
    }

    fn admit_at(&self, peer: IpAddr, close: Closer, now: Instant) -> Result<Member, Refusal> {
        let mut entries = self.entries();
        let open = entries.len();
        let closing = entries.values().filter(|e| e.on_the_way_out()).count();
        let max = self.max();
        if open >= max {
            // room only by evicting (or once one on its way out is gone), and only within the slack
            if open >= max + slack(max) {
                return Err(Refusal { open, closing });
            }
            if open - closing >= max {
                let Some(victim) = choose(&entries, peer, now) else { return Err(Refusal { open, closing }) };
                if let Some(v) = entries.get_mut(&victim) {
                    v.evicted = true;
                    (v.close)();
                }
            }
        }
        let id = self.0.next.fetch_add(1, Ordering::Relaxed);
        entries.insert(id, Entry { peer, activity: Activity::Idle, since: now, fresh: true, evicted: false, close });
        Ok(Member { tracker: Tracker { table: self.clone(), id } })
    }

    /// Ask every connection whose activity `which` holds to close (a shutdown).
    pub fn close_all(&self, which: impl Fn(Activity) -> bool) {
        for e in self.entries().values().filter(|e| which(e.activity)) {
            (e.close)();
        }
    }
}

/// The connection to close for a newcomer from `peer` (the module doc's policy), if any.
fn choose(entries: &BTreeMap<u64, Entry>, peer: IpAddr, now: Instant) -> Option<u64> {
    let mut per_address: HashMap<IpAddr, usize> = HashMap::new();
    for e in entries.values().filter(|e| !e.on_the_way_out()) {
        *per_address.entry(e.peer).or_default() += 1;
    }
    let mine = per_address.get(&peer).copied().unwrap_or(0);
    let count = |a: &IpAddr| per_address.get(a).copied().unwrap_or(0);
    // 1: my own address (past the grace), or one at least two connections heavier (at once)
    let fair = entries
        .iter()
        .filter(|(_, e)| if e.peer == peer { e.evictable(now, true) } else { count(&e.peer) >= mine + 2 && e.evictable(now, false) })
        .max_by(|(ia, a), (ib, b)| count(&a.peer).cmp(&count(&b.peer)).then(b.since.cmp(&a.since)).then(ib.cmp(ia)));
    if let Some((id, _)) = fair {
        return Some(*id);
    }
    // 2: idle the longest, of any address, past the grace
    entries
        .iter()
        .filter(|(_, e)| {
            e.evictable(now, true) && e.activity == Activity::Idle && now.saturating_duration_since(e.since) >= FRESH_GRACE
        })
        .min_by_key(|(id, e)| (e.since, **id))
        .map(|(id, _)| *id)
}

/// A handle to report a connection's [`Activity`] to its [`Table`]; it does not count the
/// connection (its [`Member`] does).
#[derive(Clone)]
pub struct Tracker {
    table: Table,
    id: u64,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker").field("id", &self.id).finish()
    }
}

impl Tracker {
    /// Report what the connection does from now on. Returns `false` when the table has asked
    /// it to close already (it is on its way out: a request that completed just then is not to
    /// be answered); the activity is set either way.
    pub fn set(&self, activity: Activity) -> bool {
        let mut entries = self.table.entries();
        let Some(e) = entries.get_mut(&self.id) else { return false };
        if e.activity != activity {
            e.activity = activity;
            e.since = Instant::now();
        }
        if activity != Activity::Idle {
            e.fresh = false;
        }
        !e.evicted
    }

    /// Whether the table has asked the connection to close.
    pub fn evicted(&self) -> bool {
        self.table.entries().get(&self.id).is_none_or(|e| e.evicted)
    }
}

/// A counted connection: it counts against `max_connections` until dropped, which must be
/// after its socket is closed.
#[derive(Debug)]
pub struct Member {
    tracker: Tracker,
}

impl Member {
    /// The handle to report its activity with.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // the closer (it may hold a descriptor of the socket) is dropped outside the lock
        let entry = self.tracker.table.entries().remove(&self.tracker.id);
        drop(entry);
    }
}

/// At most one info line about refused connections per this time; the others go to debug.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The log of refused connections: at info level at most once every [`REFUSAL_LOG_INTERVAL`]
/// (with how many were refused meanwhile), else at debug level, so that a flood of connections
/// does not flood the journal.
#[derive(Debug, Default)]
pub struct RefusalLog(Mutex<(Option<Instant>, u64)>);

impl RefusalLog {
    /// Log that `peer` was refused by `front` (`wyoming`, `http`) under `max` connections,
    /// `what` saying how it was answered.
    pub fn log(&self, front: &str, peer: std::net::SocketAddr, refusal: Refusal, max: usize, what: &str) {
        let now = Instant::now();
        let mut r = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if r.0.is_some_and(|last| now.saturating_duration_since(last) < REFUSAL_LOG_INTERVAL) {
            r.1 += 1;
            log::debug!("{front}: {peer}: refused, no connection to spare (serve.max_connections); {what}");
            return;
        }
        let more = std::mem::take(&mut r.1);
        *r = (Some(now), 0);
        drop(r);
        let since = if more > 0 { format!(" ({more} more refused since the last such line)") } else { String::new() };
        log::info!(
            "{front}: {peer}: refused: {} connections open ({} closing; serve.max_connections = {max}), none may make room; {what}{since}",
            refusal.open,
            refusal.closing,
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use std::sync::atomic::AtomicUsize;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// A closer that counts its calls in `n`.
    fn counting(n: &Arc<AtomicUsize>) -> Closer {
        let n = Arc::clone(n);
        Box::new(move || {
            n.fetch_add(1, Ordering::SeqCst);
        })
    }

    fn closer() -> Closer {
        Box::new(|| {})
    }

    #[test]
    fn the_slack_is_the_limit_capped_at_eight() {
        assert_eq!((slack(0), slack(1), slack(4), slack(16), slack(1024)), (1, 1, 4, 8, 8));
        assert_eq!(Table::new(16).ceiling(), 24);
    }

    #[test]
    fn an_evicted_connection_counts_until_dropped_and_is_never_chosen_twice() {
        let t = Table::new(2);
        let t0 = Instant::now();
        let calls: Vec<Arc<AtomicUsize>> = (0..2).map(|_| Arc::default()).collect();
        let a = t.admit_at(ip(1), counting(&calls[0]), t0).unwrap();
        let b = t.admit_at(ip(1), counting(&calls[1]), t0).unwrap();
        a.tracker().set(Activity::Arriving);
        b.tracker().set(Activity::Arriving);
        // a burst: the first newcomer evicts one, the second the other, then the slack (2) is
        // used up by the two on their way out plus the newcomers: refused
        let later = t0 + Duration::from_millis(1);
        let c = t.admit_at(ip(1), closer(), later).unwrap();
        let d = t.admit_at(ip(1), closer(), later).unwrap();
        assert_eq!((calls[0].load(Ordering::SeqCst), calls[1].load(Ordering::SeqCst)), (1, 1));
        assert_eq!(t.open(), 4);
        assert!(t.admit_at(ip(1), closer(), later).is_err(), "at max + slack");
        assert!(!a.tracker().set(Activity::Busy), "the evicted one learns it");
        // c and d are fresh and idle: within the grace they are not evictable either
        drop(a);
        assert!(t.admit_at(ip(1), closer(), later).is_err(), "one on its way out left, but no room to evict");
        drop(b);
        assert_eq!(t.open(), 2);
        // past the grace the fresh ones may go, oldest first (c)
        let e = t.admit_at(ip(1), closer(), later + FRESH_GRACE).unwrap();
        assert!(c.tracker().evicted() && !d.tracker().evicted());
        drop((c, d, e));
        assert_eq!(t.open(), 0);
    }

    #[test]
    fn a_lowered_limit_closes_the_oldest_evictable_ones_and_never_a_busy_one() {
        let t = Table::new(4);
        let t0 = Instant::now();
        let busy = t.admit_at(ip(1), closer(), t0).unwrap();
        busy.tracker().set(Activity::Busy);
        std::thread::sleep(Duration::from_millis(2));
        let idle_old = t.admit_at(ip(2), closer(), t0).unwrap();
        idle_old.tracker().set(Activity::Arriving);
        idle_old.tracker().set(Activity::Idle);
        std::thread::sleep(Duration::from_millis(2));
        let arriving = t.admit_at(ip(3), closer(), t0).unwrap();
        arriving.tracker().set(Activity::Arriving);
        std::thread::sleep(Duration::from_millis(2));
        let idle_new = t.admit_at(ip(4), closer(), t0).unwrap();
        idle_new.tracker().set(Activity::Arriving);
        idle_new.tracker().set(Activity::Idle);
        // 4 open, lowered to 2: the two oldest evictable ones go (not the busy one, older still)
        t.set_max(2);
        assert_eq!((t.max(), t.ceiling()), (2, 4));
        assert!(!busy.tracker().evicted());
        assert!(idle_old.tracker().evicted() && arriving.tracker().evicted());
        assert!(!idle_new.tracker().evicted());
        // they count until their sockets close: at the ceiling, a newcomer waits
        assert!(t.full());
        drop((idle_old, arriving));
        // lowered to 1 with only the busy one and an idle one left: the idle one goes
        t.set_max(1);
        assert!(idle_new.tracker().evicted() && !busy.tracker().evicted());
        drop(idle_new);
        // raised: room at once
        t.set_max(3);
        let more: Vec<Member> = (0..2).map(|_| t.admit_at(ip(5), closer(), Instant::now()).unwrap()).collect();
        assert_eq!(t.open(), 3);
        drop((busy, more));
    }

    #[test]
    fn slow_heads_are_evicted_oldest_first_and_busy_ones_never() {
        let t = Table::new(3);
        let t0 = Instant::now();
        let slow1 = t.admit_at(ip(2), closer(), t0).unwrap();
        slow1.tracker().set(Activity::Arriving);
        std::thread::sleep(Duration::from_millis(2));
        let slow2 = t.admit_at(ip(2), closer(), t0).unwrap();
        slow2.tracker().set(Activity::Arriving);
        let busy = t.admit_at(ip(2), closer(), t0).unwrap();
        busy.tracker().set(Activity::Busy);
        let now = Instant::now();
        let n1 = t.admit_at(ip(2), closer(), now).unwrap();
        assert!(slow1.tracker().evicted() && !slow2.tracker().evicted());
        let n2 = t.admit_at(ip(2), closer(), now).unwrap();
        assert!(slow2.tracker().evicted() && !busy.tracker().evicted());
        drop((slow1, slow2));
        // busy and two fresh newcomers within the grace: nothing to evict
        assert!(t.admit_at(ip(2), closer(), now).is_err());
        drop((busy, n1, n2));
    }

    #[test]
    fn a_heavy_address_gives_way_and_never_takes_a_light_ones_connection() {
        let t = Table::new(4);
        let t0 = Instant::now();
        // a client elsewhere, its request arriving; three attackers' slow heads
        let legit = t.admit_at(ip(1), closer(), t0).unwrap();
        legit.tracker().set(Activity::Arriving);
        let attackers: Vec<Member> = (0..3)
            .map(|_| {
                let m = t.admit_at(ip(9), closer(), t0).unwrap();
                m.tracker().set(Activity::Arriving);
                m
            })
            .collect();
        // legit is the oldest, but a newcomer of the attacker's address closes its own
        let later = Instant::now() + Duration::from_secs(5);
        let more = t.admit_at(ip(9), closer(), later).unwrap();
        more.tracker().set(Activity::Arriving);
        assert!(!legit.tracker().evicted());
        assert!(attackers[0].tracker().evicted());
        drop(attackers);
        // a second client elsewhere (0 connections) closes one of the heavy address's (3)
        let more2: Vec<Member> = (0..2).map(|_| t.admit_at(ip(9), closer(), later).unwrap()).collect();
        for m in &more2 {
            m.tracker().set(Activity::Arriving);
        }
        let other = t.admit_at(ip(3), closer(), later).unwrap();
        assert!(!legit.tracker().evicted());
        assert!(more.tracker().evicted(), "the heavy address's oldest");
        drop((legit, more, more2, other));
    }

    #[test]
    fn idle_connections_of_any_address_make_room_after_the_grace() {
        let t = Table::new(2);
        let t0 = Instant::now();
        let a = t.admit_at(ip(1), closer(), t0).unwrap();
        let b = t.admit_at(ip(2), closer(), t0).unwrap();
        for m in [&a, &b] {
            m.tracker().set(Activity::Busy);
            m.tracker().set(Activity::Idle);
        }
        // one connection each: no address is heavier; idle for less than the grace → refused
        assert!(t.admit_at(ip(3), closer(), Instant::now()).is_err());
        let c = t.admit_at(ip(3), closer(), Instant::now() + FRESH_GRACE).unwrap();
        assert!(a.tracker().evicted() ^ b.tracker().evicted());
        // a stream of another address is not taken by rule 2
        drop((a, b));
        c.tracker().set(Activity::Stream);
        let d = t.admit_at(ip(4), closer(), Instant::now()).unwrap();
        d.tracker().set(Activity::Stream);
        assert!(t.admit_at(ip(5), closer(), Instant::now() + FRESH_GRACE * 10).is_err());
        drop((c, d));
    }
}
