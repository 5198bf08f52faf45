//! [`SliceWatch`]: notices within a second when this node's ResourceSlices are
//! deleted or changed behind the publisher's back (an administrator's
//! `kubectl delete resourceslice`, a garbage collector, another writer), so
//! the caller republishes at once instead of at its next periodic resync.
//!
//! It is a kube-runtime [`watcher`] on the publisher's own field selector
//! (`spec.nodeName=<node>,spec.driver=<driver>`): the watcher lists, then
//! watches from the listed resourceVersion, re-lists after a 410 Gone or a
//! broken stream (with kube-runtime's default backoff), and has a client-side
//! idle timeout, so a hung API server does not keep it waiting forever.
//!
//! Events caused by the publisher's own writes are recognised (the
//! resourceVersion its create or update got back; the name it deleted) and
//! ignored: a sync costs no second sync. Everything else is a change.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt as _};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};
use tokio::time::Instant;

use crate::plan::Listed;
use crate::publish::SlicePublisher;

/// Writes a [`SlicePublisher`] made, until its [`SliceWatch`] sees their
/// events. Shared between the two.
#[derive(Debug, Clone, Default)]
pub(crate) struct OwnWrites(Arc<Mutex<Own>>);

#[derive(Debug, Default)]
struct Own {
    /// resourceVersions of slices this publisher created or updated.
    versions: HashSet<String>,
    /// Names of slices this publisher deleted.
    deleted: HashSet<String>,
}

/// More unseen own writes than this are forgotten (an event lost while the
/// watch was down leaves its entry behind; a re-list forgets them all too).
const MAX_REMEMBERED: usize = 4096;

impl OwnWrites {
    fn lock(&self) -> std::sync::MutexGuard<'_, Own> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The server stored `stored` for this publisher's create or update.
    pub(crate) fn written(&self, stored: &ResourceSlice) {
        if let Some(rv) = &stored.metadata.resource_version {
            let mut own = self.lock();
            if own.versions.len() >= MAX_REMEMBERED {
                own.versions.clear();
            }
            own.versions.insert(rv.clone());
        }
    }

    /// This publisher deleted slice `name`.
    pub(crate) fn deleted(&self, name: &str) {
        let mut own = self.lock();
        if own.deleted.len() >= MAX_REMEMBERED {
            own.deleted.clear();
        }
        own.deleted.insert(name.to_string());
    }

    /// Whether an applied `slice` is this publisher's write (forgotten then).
    fn take_applied(&self, slice: &Listed) -> bool {
        slice
            .resource_version()
            .is_some_and(|rv| self.lock().versions.remove(rv))
    }

    /// Whether a deleted `slice` was deleted by this publisher (forgotten then).
    fn take_deleted(&self, slice: &Listed) -> bool {
        self.lock().deleted.remove(slice.name())
    }

    fn forget(&self) {
        let mut own = self.lock();
        own.versions.clear();
        own.deleted.clear();
    }
}

/// What [`SliceWatch::changed`] saw.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[must_use]
pub struct Changes {
    /// Slices created or modified by someone else.
    pub applied: Vec<String>,
    /// Slices deleted by someone else.
    pub deleted: Vec<String>,
    /// The watch (re)started with a fresh list: what happened while it was
    /// not watching is unknown.
    pub relisted: bool,
}

impl Changes {
    /// Whether someone other than the publisher created, changed or deleted
    /// one of the slices. A (re-)list alone is not: on every start the
    /// watch's first list sees the slices the publisher has just written, so
    /// it says nothing about anyone else.
    #[must_use]
    pub fn by_someone_else(&self) -> bool {
        !self.applied.is_empty() || !self.deleted.is_empty()
    }

    /// The report's log line: a warning naming the slices when someone else
    /// changed them, a debug line when the watch only listed them again.
    fn log(&self, node: &str) {
        if self.by_someone_else() {
            tracing::warn!(
                node = %node,
                applied = ?self.applied, deleted = ?self.deleted, relisted = self.relisted,
                "ResourceSlices changed behind the publisher's back"
            );
        } else if self.relisted {
            tracing::debug!(
                node = %node,
                "ResourceSlices listed by the watch; checking them against the published set"
            );
        }
    }
}

/// How [`SliceWatch`] batches and paces what it reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchPacing {
    /// After the first change, further events are collected this long and
    /// reported together (one `kubectl delete` of every slice is one report).
    pub settle: Duration,
    /// When changes keep coming (another writer that keeps undoing this
    /// publisher's slices, such as an older plugin pod during a rolling
    /// update), each report after one that came within `2 * settle` of
    /// the previous one waits twice as long as the one before, from
    /// `settle` up to this.
    pub max_backoff: Duration,
}

impl Default for WatchPacing {
    /// Settle 200 ms, back off up to 30 s.
    fn default() -> Self {
        Self {
            settle: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// A watch of one node's slices of one driver, made by
/// [`SlicePublisher::watch`]. [`changed`](Self::changed) resolves when
/// someone other than that publisher changed them.
pub struct SliceWatch {
    events: BoxStream<'static, Result<watcher::Event<Listed>, watcher::Error>>,
    own: OwnWrites,
    node_name: String,
    pacing: WatchPacing,
    /// When the last report was made, and how many reports in a row came
    /// close together.
    last: Option<Instant>,
    streak: u32,
}

impl std::fmt::Debug for SliceWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SliceWatch")
            .field("node_name", &self.node_name)
            .field("pacing", &self.pacing)
            .field("streak", &self.streak)
            .finish_non_exhaustive()
    }
}

impl SliceWatch {
    pub(crate) fn new(client: Client, node_name: &str, driver: &str, own: OwnWrites) -> Self {
        let api: Api<Listed> = Api::all(client);
        let config =
            watcher::Config::default().fields(&SlicePublisher::selector(node_name, driver));
        let node = node_name.to_string();
        let events = watcher(api, config)
            .default_backoff()
            .inspect_err(move |e| {
                tracing::warn!(node = %node, error = %e, "watching ResourceSlices failed; retrying");
            })
            .boxed();
        Self {
            events,
            own,
            node_name: node_name.to_string(),
            pacing: WatchPacing::default(),
            last: None,
            streak: 0,
        }
    }

    /// Replaces the pacing ([`WatchPacing::default`]).
    pub fn with_pacing(mut self, pacing: WatchPacing) -> Self {
        self.pacing = pacing;
        self
    }

    /// Waits until this node's slices were changed by someone other than the
    /// publisher, or the watch re-listed, and returns what it saw (after
    /// [`WatchPacing`]'s settle time or backoff). Errors of the watch are
    /// logged and retried with backoff; they are not changes.
    ///
    /// Cancel safety: dropping the future loses at most changes seen but not
    /// yet reported; a caller that syncs whenever any of its triggers fire
    /// (as the plugin's publish loop does) covers them with that sync.
    pub async fn changed(&mut self) -> Changes {
        let mut changes = Changes::default();
        while !self.note_next(&mut changes).await {}
        let wait = self.pace();
        let until = Instant::now() + wait;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => break,
                _ = self.note_next(&mut changes) => {}
            }
        }
        changes.log(&self.node_name);
        changes
    }

    /// Reads one event into `changes`; true when it was a change.
    async fn note_next(&mut self, changes: &mut Changes) -> bool {
        let Some(event) = self.events.next().await else {
            // The watcher stream does not end; if it did, nothing more comes.
            return std::future::pending().await;
        };
        match event {
            Ok(watcher::Event::Apply(s)) => {
                if self.own.take_applied(&s) {
                    return false;
                }
                changes.applied.push(s.name().to_string());
                true
            }
            Ok(watcher::Event::Delete(s)) => {
                if self.own.take_deleted(&s) {
                    return false;
                }
                changes.deleted.push(s.name().to_string());
                true
            }
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => false,
            Ok(watcher::Event::InitDone) => {
                self.own.forget();
                changes.relisted = true;
                true
            }
            Err(_) => false,
        }
    }

    /// How long to collect before reporting, and the streak bookkeeping.
    fn pace(&mut self) -> Duration {
        let now = Instant::now();
        let settle = self.pacing.settle;
        let close = self.last.is_some_and(|t| {
            now.duration_since(t) < self.current_wait().saturating_mul(2).max(settle * 2)
        });
        self.streak = if close {
            self.streak.saturating_add(1)
        } else {
            0
        };
        self.last = Some(now);
        self.current_wait()
    }

    fn current_wait(&self) -> Duration {
        let factor = 1u32.checked_shl(self.streak).unwrap_or(u32::MAX);
        self.pacing
            .settle
            .saturating_mul(factor)
            .min(self.pacing.max_backoff.max(self.pacing.settle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> SliceWatch {
        SliceWatch {
            events: futures::stream::pending().boxed(),
            own: OwnWrites::default(),
            node_name: "n".into(),
            pacing: WatchPacing {
                settle: Duration::from_millis(100),
                max_backoff: Duration::from_millis(700),
            },
            last: None,
            streak: 0,
        }
    }

    #[test]
    fn reports_close_together_back_off_and_a_quiet_spell_resets() {
        let ms = Duration::from_millis;
        let mut w = watch();
        assert_eq!(w.pace(), ms(100), "the first report waits the settle time");
        // Each next report right after the one before waits twice as long, up
        // to the cap.
        let mut waits = Vec::new();
        for _ in 0..4 {
            w.last = Some(Instant::now() - w.current_wait());
            waits.push(w.pace());
        }
        assert_eq!(waits, [ms(200), ms(400), ms(700), ms(700)]);
        // A report long after the last one is back to the settle time.
        w.last = Some(Instant::now() - Duration::from_secs(5));
        assert_eq!(w.pace(), ms(100));
    }

    #[test]
    fn own_writes_are_recognised_once() {
        let own = OwnWrites::default();
        let mut s = ResourceSlice::default();
        s.metadata.name = Some("a".into());
        s.metadata.resource_version = Some("7".into());
        own.written(&s);
        own.deleted("b");
        let listed = Listed::of(&s);
        assert!(own.take_applied(&listed));
        assert!(!own.take_applied(&listed), "only once");
        let mut b = s.clone();
        b.metadata.name = Some("b".into());
        let b = Listed::of(&b);
        assert!(own.take_deleted(&b));
        assert!(!own.take_deleted(&b));
    }
}
