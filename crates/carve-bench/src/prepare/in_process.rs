//! The in-process part: the driver under test in this process, its calls
//! timed one at a time and then concurrently.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use carve_apiserver::{ApiServer, Options as ApiOptions, Store};
use carve_model::GpuModel;
use carve_plugin::{Checkpoint, ClaimRef, Driver, ReadClaim};
use kube::Api;
use kube::api::{Patch, PatchParams};

use super::backend::{Counts, TimedBackend};
use super::cpu::ThreadCpu;
use super::node::{
    BenchNode, all_placements, concurrent_devices, mig_device, put_claim, put_claims,
};
use super::{API_SAMPLES, Options, STAND_IN_THREAD};
use crate::BenchError;

/// One timed call.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Call {
    /// Wall time.
    pub(super) total: Duration,
    /// Inside `GpuBackend` calls.
    pub(super) nvml: Duration,
    /// CPU time of the threads that made them, inside them.
    pub(super) nvml_cpu: Duration,
    /// Inside checkpoint fsyncs.
    pub(super) sync: Duration,
    /// Checkpoint fsyncs.
    pub(super) syncs: u64,
    /// CPU time of this process's threads but the stand-in's during the
    /// call; `None` where the kernel does not report per-thread CPU time.
    pub(super) cpu: Option<Duration>,
}

impl Call {
    pub(super) fn overhead(&self) -> Duration {
        self.total.saturating_sub(self.nvml)
    }

    /// CPU time minus the CPU time inside NVML.
    pub(super) fn cpu_overhead(&self) -> Option<Duration> {
        self.cpu.map(|c| c.saturating_sub(self.nvml_cpu))
    }
}

/// Figures of the in-process part; [`InProcess::report`] makes them rows.
#[derive(Debug, Default)]
pub struct InProcess {
    /// Per prepare call.
    pub(super) prepare: Vec<Call>,
    /// Per unprepare call.
    pub(super) unprepare: Vec<Call>,
    /// Claim GET and status PATCH round trips to the stand-in, timed alone.
    pub(super) api_get: Vec<Duration>,
    pub(super) api_patch: Vec<Duration>,
    /// Round trips to a blocking thread and back with nothing to do, on the
    /// plugin's runtime: the hand-off each NVML hop of the driver pays.
    pub(super) hop: Vec<Duration>,
    /// Context switches of this whole process (plugin core, stand-in,
    /// runtime) per one-at-a-time prepare+unprepare cycle: thread hand-offs,
    /// counted rather than timed, so it does not move with machine load.
    pub(super) switches_per_cycle: f64,
    /// Claims in the concurrent run.
    pub(super) concurrent_claims: u64,
    /// Wall time of all concurrent prepares.
    pub(super) concurrent_prepare_wall: Duration,
    /// Wall time of all concurrent unprepares.
    pub(super) concurrent_unprepare_wall: Duration,
    /// Backend counters at the end.
    pub(super) counts: Counts,
    /// Prepares and unprepares that succeeded.
    pub(super) prepares_ok: u64,
    pub(super) unprepares_ok: u64,
    /// GPU instances alive at the end (simulator state).
    pub(super) live_at_end: usize,
    /// CDI specs left at the end.
    pub(super) cdi_left: usize,
}

/// The in-process part: the driver, configured as the chart deploys it, on
/// `lib` (the NVML simulator) and an API-server stand-in served from
/// `stand_in` (see [`super::stand_in_runtime`]); its calls timed one at a
/// time over every profile placement, then `concurrency` at once. Run it on
/// a runtime like the plugin's.
pub async fn in_process(
    a: &Options,
    model: &GpuModel,
    lib: &Path,
    stand_in: &tokio::runtime::Handle,
) -> Result<InProcess, BenchError> {
    let node = BenchNode::new(a, model, lib)?;
    // The stand-in serves from a thread of its own, as an API server elsewhere
    // would: every response wakes the driver's thread.
    let api = stand_in
        .spawn(ApiServer::start(ApiOptions::default()))
        .await
        .map_err(|e| BenchError::setup("starting the API-server stand-in", e))?
        .map_err(|e| BenchError::setup("starting the API-server stand-in", e))?;
    let store = api.store();
    let timed = Arc::new(TimedBackend::new(node.backend()?));
    let client = || {
        api.try_client()
            .map_err(|e| BenchError::setup("a client of the stand-in", e))
    };
    let driver = Driver::new(node.config.clone(), timed.clone(), client()?)
        .await
        .map_err(|e| BenchError::driver("starting the driver", e))?;
    driver
        .recover()
        .await
        .map_err(|e| BenchError::driver("recovering", e))?;
    let mut out = InProcess::default();

    let seq = one_at_a_time(a, model, &store, &driver, &timed, &mut out).await?;
    let probe = seq
        .first()
        .ok_or_else(|| BenchError::Options("no claims".into()))?;
    api_round_trips(client()?, probe, &mut out).await?;
    concurrently(a, model, &store, &driver, &mut out).await?;

    out.counts = timed.counts();
    drop(driver);
    out.live_at_end = node.live_instances()?;
    out.cdi_left = node.cdi_files();
    api.shutdown().await;
    Ok(out)
}

/// One claim at a time over every profile placement, GPUs in turn: each
/// prepare and unprepare timed (wall, NVML, fsync, CPU), and the context
/// switches of the whole run counted. Returns the claims.
async fn one_at_a_time(
    a: &Options,
    model: &GpuModel,
    store: &Store,
    driver: &Driver,
    timed: &TimedBackend,
    out: &mut InProcess,
) -> Result<Vec<ClaimRef>, BenchError> {
    let placements = all_placements(model);
    let mut seq = Vec::new();
    for i in 0..a.iterations {
        let (profile, start) = &placements[i as usize % placements.len()];
        let dev = mig_device(i % a.gpus, profile, *start)?;
        seq.push(put_claim(
            store,
            &format!("seq-{i}"),
            &format!("uid-seq-{i}"),
            &dev,
        )?);
    }
    let switches_before = context_switches()?;
    for c in &seq {
        let s = CallStart::now(timed);
        driver
            .prepare_one(c)
            .await
            .map_err(|e| BenchError::driver(format!("prepare {c}"), e))?;
        out.prepare.push(s.end(timed));
        out.prepares_ok += 1;
        // On a node the pod runs between the two, and the prepare's status
        // write (background, not waited for by the kubelet) is long done
        // when the unprepare comes: let it finish outside the timed span.
        driver.settle_status_writes().await;
        let s = CallStart::now(timed);
        driver
            .unprepare_one(&c.uid)
            .await
            .map_err(|e| BenchError::driver(format!("unprepare {c}"), e))?;
        out.unprepare.push(s.end(timed));
        out.unprepares_ok += 1;
    }
    out.switches_per_cycle =
        (context_switches()? - switches_before) as f64 / seq.len().max(1) as f64;
    Ok(seq)
}

/// The counters at the start of a timed call.
struct CallStart {
    cpu: Option<ThreadCpu>,
    counts: Counts,
    syncs: (u64, Duration),
    t: Instant,
}

impl CallStart {
    fn now(timed: &TimedBackend) -> Self {
        Self {
            cpu: ThreadCpu::before(STAND_IN_THREAD),
            counts: timed.counts(),
            syncs: Checkpoint::sync_totals(),
            t: Instant::now(),
        }
    }

    /// The call since `self`.
    fn end(self, timed: &TimedBackend) -> Call {
        let total = self.t.elapsed();
        let cpu = self.cpu.and_then(|c| c.since(STAND_IN_THREAD));
        let (syncs, sync) = Checkpoint::sync_totals();
        let now = timed.counts();
        Call {
            total,
            nvml: Duration::from_nanos(now.nanos - self.counts.nanos),
            nvml_cpu: Duration::from_nanos(now.cpu_nanos - self.counts.cpu_nanos),
            sync: sync.saturating_sub(self.syncs.1),
            syncs: syncs - self.syncs.0,
            cpu,
        }
    }
}

/// Context switches of this process so far, voluntary and not.
fn context_switches() -> Result<i64, BenchError> {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map(|u| u.voluntary_context_switches() + u.involuntary_context_switches())
        .map_err(|e| BenchError::setup("getrusage(RUSAGE_SELF)", e))
}

/// The API-server round trips of a prepare, alone: the claim GET and the
/// status PATCH (the same requests the driver sends, read as it reads
/// them), and the hand-off of an NVML hop with nothing in it.
async fn api_round_trips(
    client: kube::Client,
    probe: &ClaimRef,
    out: &mut InProcess,
) -> Result<(), BenchError> {
    let claims: Api<ReadClaim> = Api::namespaced(client, "default");
    let patch = serde_json::json!({"status": {"devices": []}});
    for _ in 0..API_SAMPLES {
        let t = Instant::now();
        claims
            .get_opt(&probe.name)
            .await
            .map_err(|e| BenchError::setup(format!("GET ResourceClaim {probe}"), e))?
            .ok_or_else(|| BenchError::Options(format!("ResourceClaim {probe} is gone")))?;
        out.api_get.push(t.elapsed());
        let t = Instant::now();
        claims
            .patch_status(&probe.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| BenchError::setup(format!("PATCH ResourceClaim {probe} status"), e))?;
        out.api_patch.push(t.elapsed());
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ())
            .await
            .map_err(|e| BenchError::setup("a blocking thread", e))?;
        out.hop.push(t.elapsed());
    }
    Ok(())
}

/// `concurrency` claims at once, in rounds: the wall time of each round's
/// prepares and of its unprepares.
async fn concurrently(
    a: &Options,
    model: &GpuModel,
    store: &Store,
    driver: &Driver,
    out: &mut InProcess,
) -> Result<(), BenchError> {
    let devices = concurrent_devices(model, a.gpus, a.concurrency)?;
    let rounds = (a.iterations / a.concurrency).max(1);
    let mut all = Vec::new();
    for r in 0..rounds {
        all.push(put_claims(store, &format!("con-{r}"), &devices)?);
    }
    for batch in &all {
        let t = Instant::now();
        let res = futures::future::join_all(batch.iter().map(|c| driver.prepare_one(c))).await;
        out.concurrent_prepare_wall += t.elapsed();
        for (c, r) in batch.iter().zip(res) {
            r.map_err(|e| BenchError::driver(format!("concurrent prepare {c}"), e))?;
            out.prepares_ok += 1;
        }
        let t = Instant::now();
        let res =
            futures::future::join_all(batch.iter().map(|c| driver.unprepare_one(&c.uid))).await;
        out.concurrent_unprepare_wall += t.elapsed();
        for (c, r) in batch.iter().zip(res) {
            r.map_err(|e| BenchError::driver(format!("concurrent unprepare {c}"), e))?;
            out.unprepares_ok += 1;
        }
        out.concurrent_claims += batch.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepare::tests::{options, sim_lib};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_prepare_creates_one_instance_and_every_unprepare_destroys_it() {
        let a = options(12, 2, 14);
        let model = super::super::check(&a).unwrap();
        let lib = sim_lib();
        let r = in_process(&a, model, &lib, &tokio::runtime::Handle::current())
            .await
            .unwrap();
        assert_eq!(r.prepare.len(), 12);
        assert_eq!(r.unprepare.len(), 12);
        // 12 one at a time, then max(1, 12 / 14) = 1 round of 14.
        assert_eq!(r.concurrent_claims, 14);
        assert_eq!(r.prepares_ok, 26);
        assert_eq!(r.unprepares_ok, 26);
        assert_eq!(r.counts.gi_created, 26);
        assert_eq!(r.counts.ci_created, 26);
        assert_eq!(r.counts.gi_destroyed, 26);
        assert_eq!(r.counts.ci_destroyed, 26);
        assert_eq!(r.live_at_end, 0);
        assert_eq!(r.cdi_left, 0);
        // NVML time is part of each call's total. The simulated GPUs start
        // in MIG mode, so no checkpoint write records MIG mode the plugin
        // enabled and none is fsynced (the fsync counter is process-wide, so
        // other tests' writes could add to it: nothing is asserted on it).
        assert!(
            r.prepare
                .iter()
                .chain(&r.unprepare)
                .all(|c| c.nvml <= c.total && !c.nvml.is_zero())
        );
        // Every call used CPU outside NVML (its checkpoint write at least),
        // and the report has the rows.
        assert!(
            r.prepare
                .iter()
                .chain(&r.unprepare)
                .all(|c| c.cpu.is_some_and(|x| x > c.nvml_cpu))
        );
        assert_eq!(r.api_get.len(), API_SAMPLES);
        assert_eq!(r.api_patch.len(), API_SAMPLES);
        assert_eq!(r.hop.len(), API_SAMPLES);
        let report = r.report(&a);
        let out = report.rows;
        assert!(report.met || out.contains("MISSED"));
        assert!(out.contains("26/26, 26/26; 0; 0"), "{out}");
        assert!(
            out.contains("prepare: CPU time - NVML p50 / p99 (ms)"),
            "{out}"
        );
    }
}
