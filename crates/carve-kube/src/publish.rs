//! [`SlicePublisher`]: makes this node's ResourceSlices of one driver match a
//! desired set, with the fewest writes.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};

use crate::error::{PublishError, Verb, api_code};
use crate::plan::{Listed, Step, plan, validate_desired};
use crate::watch::{OwnWrites, SliceWatch};

/// How often and how patiently [`SlicePublisher::sync`] retries after a 409
/// Conflict (a concurrent writer changed or created a slice between the list
/// and the write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConflictRetry {
    /// Sync passes in all (the first one included); at least 1.
    pub attempts: u32,
    /// Wait before the second pass; doubled for every further pass.
    pub initial_backoff: Duration,
    /// Upper bound of one wait.
    pub max_backoff: Duration,
}

impl Default for ConflictRetry {
    /// 5 passes, waiting 20, 40, 80 and 160 ms in between.
    fn default() -> Self {
        Self {
            attempts: 5,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl ConflictRetry {
    fn backoff(&self, failed_passes: u32) -> Duration {
        let factor = 1u32
            .checked_shl(failed_passes.saturating_sub(1))
            .unwrap_or(u32::MAX);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

/// What one [`SlicePublisher::sync`] did. Counts are successful writes, summed
/// over all passes when a conflict forced a re-read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[must_use]
pub struct SyncReport {
    /// Slices created (POST).
    pub created: usize,
    /// Slices replaced (PUT with the observed resourceVersion).
    pub updated: usize,
    /// Slices deleted (stale names, other pools of this node, renamed pools).
    pub deleted: usize,
    /// Desired slices that already existed with the same content: no write.
    pub unchanged: usize,
    /// The highest pool generation of the desired slices after the sync; `None`
    /// when nothing is desired. With one pool per node this is that pool's.
    pub generation: Option<i64>,
    /// The generation of every desired pool after the sync.
    pub generations: BTreeMap<String, i64>,
    /// How many passes were restarted after a 409 Conflict.
    pub conflicts: u32,
}

impl SyncReport {
    /// Creates + updates + deletes.
    pub fn writes(&self) -> usize {
        self.created + self.updated + self.deleted
    }
}

/// Publishes the ResourceSlices of one driver on one node.
///
/// What it writes depends on nothing remembered between calls: every
/// [`sync`](Self::sync) lists what the API server has, so a freshly
/// constructed publisher (after a restart) makes no write when nothing
/// changed. It remembers only which writes were its own, so that its
/// [`watch`](Self::watch) can tell them from changes made behind its back.
/// Only slices whose `spec.driver` and `spec.nodeName` are this publisher's
/// are ever written or deleted.
pub struct SlicePublisher {
    client: Client,
    node_name: String,
    driver: String,
    retry: ConflictRetry,
    request_timeout: Duration,
    own: OwnWrites,
}

/// How long one API request of the publisher may take by default (see
/// [`SlicePublisher::with_request_timeout`]).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

impl fmt::Debug for SlicePublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlicePublisher")
            .field("node_name", &self.node_name)
            .field("driver", &self.driver)
            .field("retry", &self.retry)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

/// Why one pass of a sync stopped.
enum PassError {
    /// A 409 (or a slice that vanished before its update): list again and retry.
    Conflict {
        verb: Verb,
        slice: String,
        source: kube::Error,
    },
    /// Anything else: give up.
    Fatal(PublishError),
}

impl SlicePublisher {
    /// A publisher of `driver`'s slices on `node_name`, with [`ConflictRetry::default`].
    pub fn new(client: Client, node_name: impl Into<String>, driver: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            driver: driver.into(),
            retry: ConflictRetry::default(),
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            own: OwnWrites::default(),
        }
    }

    /// Bounds each API request (a list page, a create, an update, a delete)
    /// to `timeout` ([`DEFAULT_REQUEST_TIMEOUT`] unless set). The kube client
    /// has no read timeout of its own, so without this an API server that
    /// accepts the connection and never answers would hold a sync, and the
    /// plugin's start before it registers with the kubelet, forever. A request
    /// that runs out fails the sync with [`PublishError::Timeout`]; whether a
    /// write that timed out was applied is unknown, and the next sync starts
    /// from a fresh list, so it does not matter.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// `call`, bounded by the request timeout; `Err(None)` when it ran out.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, Option<kube::Error>> {
        match tokio::time::timeout(self.request_timeout, call).await {
            Ok(r) => r.map_err(Some),
            Err(_) => Err(None),
        }
    }

    fn timed_out(&self, verb: Verb, slice: impl Into<String>) -> PublishError {
        PublishError::Timeout {
            verb,
            slice: slice.into(),
            after: self.request_timeout,
        }
    }

    /// A watch of this driver's slices on this node that reports changes made
    /// by anyone but this publisher (see [`SliceWatch`]).
    pub fn watch(&self) -> SliceWatch {
        SliceWatch::new(
            self.client.clone(),
            &self.node_name,
            &self.driver,
            self.own.clone(),
        )
    }

    /// Replaces the conflict retry policy (`attempts` below 1 counts as 1).
    pub fn with_conflict_retry(mut self, retry: ConflictRetry) -> Self {
        self.retry = retry;
        self
    }

    /// The node whose slices this publisher owns.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The driver whose slices this publisher owns.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    fn api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    /// `spec.nodeName=<node>,spec.driver=<driver>`.
    pub(crate) fn selector(node_name: &str, driver: &str) -> String {
        format!("spec.nodeName={node_name},spec.driver={driver}")
    }

    /// The slices of this driver on this node as the API server has them now.
    ///
    /// Uses the field selector `spec.nodeName=<node>,spec.driver=<driver>` and
    /// filters the answer again, so a server that ignores the selector cannot make
    /// the publisher touch another node's or driver's slices.
    /// Each is reduced to a [`Listed`] as it is read (no copy of the full
    /// objects is kept).
    pub async fn existing(&self) -> Result<Vec<Listed>, PublishError> {
        let selector = Self::selector(&self.node_name, &self.driver);
        let api: Api<Listed> = Api::all(self.client.clone());
        let mut params = ListParams::default().fields(&selector).limit(500);
        let mut out = Vec::new();
        loop {
            let list = self.bounded(api.list(&params)).await.map_err(|e| match e {
                Some(source) => PublishError::List {
                    node: self.node_name.clone(),
                    driver: self.driver.clone(),
                    source,
                },
                None => self.timed_out(
                    Verb::List,
                    format!("(all of driver {} on node {})", self.driver, self.node_name),
                ),
            })?;
            out.extend(list.items.into_iter().filter(|s| {
                s.driver == self.driver && s.node_name.as_deref() == Some(self.node_name.as_str())
            }));
            match list.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => break,
            }
        }
        Ok(out)
    }

    /// Makes the slices of this driver on this node equal to `desired` (as built
    /// by `carve_model::slices::build_slices`).
    ///
    /// `desired` is checked first (names, driver, node, `resourceSliceCount`);
    /// a bad set is rejected before any write. Then the existing slices are
    /// listed and compared with [`crate::plan::content`] (server-set metadata and
    /// `spec.pool.generation` are ignored): an unchanged set costs no write. A
    /// changed pool gets its generation bumped once and all its slices written;
    /// stale slices are deleted last (see [`crate::plan::plan`] for why that
    /// order is safe). The `spec.pool.generation` of `desired` is ignored.
    ///
    /// On 409 Conflict the pass stops, the slices are listed again and the pass
    /// is redone, up to [`ConflictRetry::attempts`] passes with backoff; then
    /// [`PublishError::Conflict`] names the slice. Any other API error stops the
    /// sync at once with [`PublishError::Api`] naming the verb and slice; the
    /// next sync starts from what the server then has.
    ///
    /// When the server's answer to a create or update lacks the
    /// `sharedCounters` or a device's `consumesCounters` that were sent (the
    /// API server drops them silently while the DRAPartitionableDevices feature
    /// gate is off), the sync stops at once, without retrying or writing the
    /// other slices, with an error naming the slice and the gate (see
    /// [`dropped_counter_fields`]). Until the gate is on, each later sync
    /// stops the same way at its first write that carries counters.
    /// `desired` is only read: a caller that keeps its slices passes them by
    /// reference instead of cloning them for every sync.
    pub async fn sync(
        &mut self,
        desired: impl AsRef<[ResourceSlice]>,
    ) -> Result<SyncReport, PublishError> {
        let desired = desired.as_ref();
        validate_desired(desired, &self.node_name, &self.driver)?;
        let attempts = self.retry.attempts.max(1);
        let mut report = SyncReport::default();
        let mut pass = 1;
        loop {
            match self.pass(desired, &mut report).await {
                Ok(()) => return Ok(report),
                Err(PassError::Fatal(e)) => return Err(e),
                Err(PassError::Conflict {
                    verb,
                    slice,
                    source,
                }) => {
                    if pass >= attempts {
                        return Err(PublishError::Conflict {
                            verb,
                            slice,
                            attempts: pass,
                            source,
                        });
                    }
                    let wait = self.retry.backoff(pass);
                    tracing::info!(
                        node = %self.node_name, slice = %slice, %verb, pass,
                        wait_ms = wait.as_millis() as u64,
                        "ResourceSlice write conflicted; listing again"
                    );
                    report.conflicts += 1;
                    pass += 1;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    async fn pass(
        &self,
        desired: &[ResourceSlice],
        report: &mut SyncReport,
    ) -> Result<(), PassError> {
        let existing = self.existing().await.map_err(PassError::Fatal)?;
        let plan = plan(&existing, desired);
        report.unchanged = plan.unchanged;
        report.generation = plan.generations.values().copied().max();
        report.generations = plan.generations;
        let api = self.api();
        for step in plan.steps {
            match step {
                Step::Create(write) => {
                    let slice = write.to_slice();
                    let name = write.name().to_owned();
                    match self
                        .bounded(api.create(&PostParams::default(), &slice))
                        .await
                    {
                        Ok(stored) => {
                            self.own.written(&stored);
                            check_counters_kept(Verb::Create, &slice, &stored)?;
                            report.created += 1;
                        }
                        Err(Some(e)) => return Err(classify(Verb::Create, name, e, false)),
                        Err(None) => {
                            return Err(PassError::Fatal(self.timed_out(Verb::Create, name)));
                        }
                    }
                    tracing::debug!(node = %self.node_name, slice = %name, generation = slice.spec.pool.generation, "created ResourceSlice");
                }
                Step::Update(write) => {
                    let slice = write.to_slice();
                    let name = write.name().to_owned();
                    match self
                        .bounded(api.replace(&name, &PostParams::default(), &slice))
                        .await
                    {
                        Ok(stored) => {
                            self.own.written(&stored);
                            check_counters_kept(Verb::Update, &slice, &stored)?;
                            report.updated += 1;
                        }
                        // Deleted since the list: re-list and create it.
                        Err(Some(e)) => return Err(classify(Verb::Update, name, e, true)),
                        Err(None) => {
                            return Err(PassError::Fatal(self.timed_out(Verb::Update, name)));
                        }
                    }
                    tracing::debug!(node = %self.node_name, slice = %name, generation = slice.spec.pool.generation, "updated ResourceSlice");
                }
                Step::Delete(name) => {
                    match self
                        .bounded(api.delete(&name, &DeleteParams::default()))
                        .await
                    {
                        Ok(_) => {
                            self.own.deleted(&name);
                            report.deleted += 1;
                        }
                        // Already gone: that is what we wanted.
                        Err(Some(e)) if api_code(&e) == Some(404) => {}
                        Err(Some(e)) => return Err(classify(Verb::Delete, name, e, false)),
                        Err(None) => {
                            return Err(PassError::Fatal(self.timed_out(Verb::Delete, name)));
                        }
                    }
                    tracing::debug!(node = %self.node_name, slice = %name, "deleted ResourceSlice");
                }
            }
        }
        Ok(())
    }

    /// Deletes every slice of this driver on this node (uninstall, or shutdown
    /// of a node agent that takes its devices with it). Returns how many were
    /// deleted; slices already gone are not counted and are no error.
    pub async fn delete_all(&self) -> Result<usize, PublishError> {
        let api = self.api();
        let mut deleted = 0;
        for slice in self.existing().await? {
            let name = slice.name().to_owned();
            match self
                .bounded(api.delete(&name, &DeleteParams::default()))
                .await
            {
                Ok(_) => {
                    self.own.deleted(&name);
                    deleted += 1;
                }
                Err(Some(e)) if api_code(&e) == Some(404) => {}
                Err(Some(source)) => {
                    return Err(PublishError::Api {
                        verb: Verb::Delete,
                        slice: name,
                        source,
                    });
                }
                Err(None) => return Err(self.timed_out(Verb::Delete, name)),
            }
        }
        Ok(deleted)
    }
}

/// The counter fields of `sent` that the API server dropped: the object it
/// answered a write with (what it stored) lacks `spec.sharedCounters` or a
/// device's `consumesCounters` that `sent` had. `None` when all are there.
///
/// The API server drops these fields without an error when the
/// DRAPartitionableDevices feature gate is off.
pub fn dropped_counter_fields(sent: &ResourceSlice, stored: &ResourceSlice) -> Option<String> {
    let sets = |s: &ResourceSlice| s.spec.shared_counters.as_ref().map_or(0, Vec::len);
    let mut dropped = Vec::new();
    if sets(sent) > 0 && sets(stored) == 0 {
        dropped.push(format!("spec.sharedCounters ({} counter sets)", sets(sent)));
    }
    let consumes = |d: &Device| d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty());
    let stored_devices: BTreeMap<&str, &Device> = stored
        .spec
        .devices
        .iter()
        .flatten()
        .map(|d| (d.name.as_str(), d))
        .collect();
    let lost: Vec<&str> = sent
        .spec
        .devices
        .iter()
        .flatten()
        .filter(|d| consumes(d))
        .filter(|d| {
            stored_devices
                .get(d.name.as_str())
                .is_some_and(|s| !consumes(s))
        })
        .map(|d| d.name.as_str())
        .collect();
    if let Some(first) = lost.first() {
        dropped.push(format!(
            "consumesCounters of {} devices (first: {first})",
            lost.len()
        ));
    }
    (!dropped.is_empty()).then(|| dropped.join(" and "))
}

/// Fails the sync when the server dropped counter fields on a write: the slice
/// is stored without them, and writing it again would only be dropped again.
fn check_counters_kept(
    verb: Verb,
    sent: &ResourceSlice,
    stored: &ResourceSlice,
) -> Result<(), PassError> {
    match dropped_counter_fields(sent, stored) {
        None => crate::dropped::check(verb, sent, stored).map_err(PassError::Fatal),
        Some(dropped) => {
            let slice = sent.metadata.name.clone().unwrap_or_default();
            tracing::error!(%slice, %verb, %dropped, "the API server dropped the counter fields of a ResourceSlice; enable the DRAPartitionableDevices feature gate");
            Err(PassError::Fatal(counters_dropped(verb, slice, &dropped)))
        }
    }
}

/// The error for a write whose counter fields the server dropped.
fn counters_dropped(verb: Verb, slice: String, dropped: &str) -> PublishError {
    PublishError::CountersDropped {
        verb,
        slice,
        dropped: dropped.to_string(),
    }
}

/// 409 is a conflict to retry after a re-list; with `missing_is_conflict`, 404
/// too. Everything else is fatal.
fn classify(
    verb: Verb,
    slice: String,
    source: kube::Error,
    missing_is_conflict: bool,
) -> PassError {
    match api_code(&source) {
        Some(409) => PassError::Conflict {
            verb,
            slice,
            source,
        },
        Some(404) if missing_is_conflict => PassError::Conflict {
            verb,
            slice,
            source,
        },
        _ => PassError::Fatal(PublishError::Api {
            verb,
            slice,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::slices::{KubeLayout, NodeGpu, SliceOptions, build_slices, simulated_node};

    /// What carve publishes for two H200s, and the same with the counter
    /// fields removed as an API server without DRAPartitionableDevices does.
    fn sent_and_stripped(layout: KubeLayout) -> (Vec<ResourceSlice>, Vec<ResourceSlice>) {
        let gpus: Vec<NodeGpu> = simulated_node("h200-141gb", 2)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        let sent = build_slices(&gpus, &SliceOptions::new("node-a", layout)).unwrap();
        let mut stripped = sent.clone();
        for s in &mut stripped {
            s.spec.shared_counters = None;
            for d in s.spec.devices.iter_mut().flatten() {
                d.consumes_counters = None;
            }
        }
        (sent, stripped)
    }

    #[test]
    fn dropped_counter_fields_are_named() {
        // 1.35+: [counters-0, devices-00].
        let (sent, stripped) = sent_and_stripped(KubeLayout::V135Plus);
        assert_eq!(
            dropped_counter_fields(&sent[0], &stripped[0]).as_deref(),
            Some("spec.sharedCounters (2 counter sets)")
        );
        let devices = sent[1].spec.devices.as_ref().unwrap();
        let d = dropped_counter_fields(&sent[1], &stripped[1]).unwrap();
        assert_eq!(
            d,
            format!(
                "consumesCounters of {} devices (first: {})",
                devices.len(),
                devices[0].name
            )
        );
        // 1.34: counter sets and devices in one slice; both are named.
        let (sent, stripped) = sent_and_stripped(KubeLayout::V134);
        let d = dropped_counter_fields(&sent[0], &stripped[0]).unwrap();
        assert!(
            d.starts_with("spec.sharedCounters (2 counter sets) and consumesCounters of "),
            "{d}"
        );
        // One device losing its counters is enough.
        let mut one = sent[0].clone();
        one.spec.devices.as_mut().unwrap()[3].consumes_counters = None;
        let name = &sent[0].spec.devices.as_ref().unwrap()[3].name;
        assert_eq!(
            dropped_counter_fields(&sent[0], &one),
            Some(format!("consumesCounters of 1 devices (first: {name})"))
        );
    }

    #[test]
    fn kept_or_absent_counter_fields_are_not_reported() {
        let (sent, stripped) = sent_and_stripped(KubeLayout::V135Plus);
        for s in &sent {
            assert_eq!(dropped_counter_fields(s, s), None);
        }
        // Nothing to drop: a slice sent without counters.
        for s in &stripped {
            assert_eq!(dropped_counter_fields(s, s), None);
        }
        // The error names the slice, the verb and the feature gate.
        let e = counters_dropped(Verb::Update, "node-a-gpu.carve.dev-devices-00".into(), "x");
        let msg = e.to_string();
        for part in [
            "node-a-gpu.carve.dev-devices-00",
            "update",
            "DRAPartitionableDevices",
        ] {
            assert!(msg.contains(part), "{msg:?} lacks {part:?}");
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let r = ConflictRetry {
            attempts: 10,
            initial_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_millis(50),
        };
        let waits: Vec<u128> = (1..=5).map(|p| r.backoff(p).as_millis()).collect();
        assert_eq!(waits, [10, 20, 40, 50, 50]);
        assert_eq!(r.backoff(200), Duration::from_millis(50));
    }
}
