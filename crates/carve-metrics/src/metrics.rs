//! The metric set and its typed recording methods.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use carve_model::names::DeviceName;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// `Content-Type` of [`Metrics::encode`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

macro_rules! label_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident => $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($(#[$vm])* $v),+ }
        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v),+];
            /// The label value.
            #[must_use]
            pub fn as_str(self) -> &'static str {
                match self { $($name::$v => $s),+ }
            }
        }
        impl EncodeLabelValue for $name {
            fn encode(&self, e: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                e.write_str(self.as_str())
            }
        }
    };
}

label_enum!(
    /// Why a prepare or unprepare failed (label `reason`). A fixed set keeps the
    /// number of series bounded; callers map their errors onto it.
    FailureReason {
        /// The claim or its allocation is malformed or names unknown devices.
        InvalidClaim => "invalid_claim",
        /// The ResourceClaim could not be found or read.
        ClaimNotFound => "claim_not_found",
        /// The allocated placement is occupied or the GPU cannot host it.
        PlacementUnavailable => "placement_unavailable",
        /// An NVML call failed.
        Nvml => "nvml",
        /// Starting, configuring or stopping an MPS control daemon failed.
        Mps => "mps",
        /// Writing or removing the CDI spec failed.
        Cdi => "cdi",
        /// Writing the checkpoint failed.
        Checkpoint => "checkpoint",
        /// A Kubernetes API call failed.
        KubeApi => "kube_api",
        /// Anything else.
        Internal => "internal",
    }
);

label_enum!(
    /// Kind of a published device (label `type`).
    DeviceType {
        /// A whole GPU (`gpu-0`).
        Gpu => "gpu",
        /// A MIG placement (`gpu-0-mig-1g10gb-3`).
        Mig => "mig",
        /// An MPS-shared GPU or MIG placement (`gpu-0-mps`, `gpu-0-mig-1g10gb-3-mps`).
        Mps => "mps",
        /// A time-sliced GPU (`gpu-0-ts`).
        TimeSlice => "timeslice",
    }
);

label_enum!(
    /// A writing Kubernetes API verb (label `verb`).
    ApiVerb {
        /// POST.
        Create => "create",
        /// PUT.
        Update => "update",
        /// PATCH.
        Patch => "patch",
        /// DELETE.
        Delete => "delete",
    }
);

label_enum!(
    /// Outcome of an operation (label `result`).
    Outcome {
        /// It succeeded.
        Ok => "ok",
        /// It failed.
        Error => "error",
    }
);

impl DeviceType {
    /// The type of a device name.
    #[must_use]
    pub fn of(name: &DeviceName) -> Self {
        match name {
            DeviceName::Gpu { .. } => DeviceType::Gpu,
            DeviceName::Mig { .. } => DeviceType::Mig,
            DeviceName::Mps { .. } | DeviceName::MigMps { .. } => DeviceType::Mps,
            DeviceName::TimeSlice { .. } => DeviceType::TimeSlice,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    result: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ReasonLabels {
    reason: FailureReason,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct FunctionLabels {
    function: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TypeLabels {
    r#type: DeviceType,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VerbLabels {
    verb: ApiVerb,
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn claim_histogram() -> Histogram {
    // 5 ms .. ~41 s: MIG creation takes seconds on real hardware.
    Histogram::new(exponential_buckets(0.005, 2.0, 14))
}

fn nvml_histogram() -> Histogram {
    // 100 µs .. ~26 s.
    Histogram::new(exponential_buckets(0.0001, 4.0, 10))
}

/// Every metric carve exports, registered under the prefix `carve_`.
///
/// | name | type | labels |
/// |---|---|---|
/// | `carve_prepare_duration_seconds` | histogram | `result` = ok/error |
/// | `carve_unprepare_duration_seconds` | histogram | `result` |
/// | `carve_prepare_errors_total` | counter | `reason` ([`FailureReason`]) |
/// | `carve_unprepare_errors_total` | counter | `reason` |
/// | `carve_nvml_call_duration_seconds` | histogram | `function` (NVML symbol) |
/// | `carve_devices_published` | gauge | `type` = gpu/mig/mps/timeslice |
/// | `carve_gpu_instances` | gauge | `gpu` |
/// | `carve_compute_instances` | gauge | `gpu` |
/// | `carve_mps_daemons` | gauge | — |
/// | `carve_stranded_memory_slices` | gauge | `gpu` |
/// | `carve_stranded_compute_slices` | gauge | `gpu` |
/// | `carve_checkpoint_writes_total` | counter | — |
/// | `carve_api_writes_total` | counter | `verb` ([`ApiVerb`]) |
///
/// The `gpu` label is whatever the caller identifies GPUs by (UUID or index);
/// use one convention per process.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    prepare_seconds: HistFamily<ResultLabels>,
    unprepare_seconds: HistFamily<ResultLabels>,
    prepare_errors: Family<ReasonLabels, Counter>,
    unprepare_errors: Family<ReasonLabels, Counter>,
    nvml_seconds: HistFamily<FunctionLabels>,
    devices_published: Family<TypeLabels, Gauge>,
    gpu_instances: Family<GpuLabels, Gauge>,
    compute_instances: Family<GpuLabels, Gauge>,
    mps_daemons: Gauge,
    stranded_memory: Family<GpuLabels, Gauge>,
    stranded_compute: Family<GpuLabels, Gauge>,
    checkpoint_writes: Counter,
    api_writes: Family<VerbLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered and zero.
    #[must_use]
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("carve");
        let m = Metrics {
            prepare_seconds: Family::new_with_constructor(claim_histogram),
            unprepare_seconds: Family::new_with_constructor(claim_histogram),
            prepare_errors: Family::default(),
            unprepare_errors: Family::default(),
            nvml_seconds: Family::new_with_constructor(nvml_histogram),
            devices_published: Family::default(),
            gpu_instances: Family::default(),
            compute_instances: Family::default(),
            mps_daemons: Gauge::default(),
            stranded_memory: Family::default(),
            stranded_compute: Family::default(),
            checkpoint_writes: Counter::default(),
            api_writes: Family::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "prepare_duration_seconds",
            "Time to answer one claim of NodePrepareResources, by result",
            m.prepare_seconds.clone(),
        );
        r.register(
            "unprepare_duration_seconds",
            "Time to answer one claim of NodeUnprepareResources, by result",
            m.unprepare_seconds.clone(),
        );
        r.register(
            "prepare_errors",
            "Claims whose prepare failed, by reason",
            m.prepare_errors.clone(),
        );
        r.register(
            "unprepare_errors",
            "Claims whose unprepare failed, by reason",
            m.unprepare_errors.clone(),
        );
        r.register(
            "nvml_call_duration_seconds",
            "Latency of NVML calls, by NVML function",
            m.nvml_seconds.clone(),
        );
        r.register(
            "devices_published",
            "Devices in this node's ResourceSlices, by type (gpu, mig, mps, timeslice)",
            m.devices_published.clone(),
        );
        r.register(
            "gpu_instances",
            "MIG GPU instances alive, per GPU",
            m.gpu_instances.clone(),
        );
        r.register(
            "compute_instances",
            "MIG compute instances alive, per GPU",
            m.compute_instances.clone(),
        );
        r.register(
            "mps_daemons",
            "MPS control daemons alive",
            m.mps_daemons.clone(),
        );
        r.register(
            "stranded_memory_slices",
            "Free MIG memory slices no profile can use given the current layout, per GPU",
            m.stranded_memory.clone(),
        );
        r.register(
            "stranded_compute_slices",
            "Free MIG compute slices no profile can use given the current layout, per GPU",
            m.stranded_compute.clone(),
        );
        r.register(
            "checkpoint_writes",
            "Checkpoint files written",
            m.checkpoint_writes.clone(),
        );
        r.register(
            "api_writes",
            "Writing Kubernetes API requests sent, by verb",
            m.api_writes.clone(),
        );
        // Series with a fixed label set exist from the start (at zero), so
        // rates and absent-series alerts work before the first event.
        for t in DeviceType::ALL {
            m.devices_published
                .get_or_create(&TypeLabels { r#type: *t })
                .set(0);
        }
        for o in Outcome::ALL {
            drop(
                m.prepare_seconds
                    .get_or_create(&ResultLabels { result: *o }),
            );
            drop(
                m.unprepare_seconds
                    .get_or_create(&ResultLabels { result: *o }),
            );
        }
        for r in FailureReason::ALL {
            drop(m.prepare_errors.get_or_create(&ReasonLabels { reason: *r }));
            drop(
                m.unprepare_errors
                    .get_or_create(&ReasonLabels { reason: *r }),
            );
        }
        for v in ApiVerb::ALL {
            drop(m.api_writes.get_or_create(&VerbLabels { verb: *v }));
        }
        Metrics { registry, ..m }
    }

    /// Records one claim's prepare: its latency under `result`, and on failure
    /// the reason.
    pub fn observe_prepare(&self, elapsed: Duration, result: Result<(), FailureReason>) {
        observe(&self.prepare_seconds, &self.prepare_errors, elapsed, result);
    }

    /// Records one claim's unprepare, like [`Metrics::observe_prepare`].
    pub fn observe_unprepare(&self, elapsed: Duration, result: Result<(), FailureReason>) {
        observe(
            &self.unprepare_seconds,
            &self.unprepare_errors,
            elapsed,
            result,
        );
    }

    /// Records one NVML call's latency. `function` is the NVML symbol name,
    /// e.g. `nvmlDeviceCreateGpuInstanceWithPlacement`.
    pub fn observe_nvml(&self, function: &'static str, elapsed: Duration) {
        self.nvml_seconds
            .get_or_create(&FunctionLabels { function })
            .observe(elapsed.as_secs_f64());
    }

    /// Runs `call`, recording its latency as NVML function `function`.
    pub fn time_nvml<T>(&self, function: &'static str, call: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = call();
        self.observe_nvml(function, t.elapsed());
        out
    }

    /// Sets the published-devices gauge of one type.
    pub fn set_devices_published(&self, kind: DeviceType, count: u64) {
        self.devices_published
            .get_or_create(&TypeLabels { r#type: kind })
            .set(clamp(count));
    }

    /// Sets every published-devices gauge from the names of the devices now
    /// published (types absent from `names` are set to 0).
    pub fn record_published(&self, names: &[DeviceName]) {
        for t in DeviceType::ALL {
            let n = names.iter().filter(|d| DeviceType::of(d) == *t).count();
            self.set_devices_published(*t, n as u64);
        }
    }

    /// Sets the number of GPU and compute instances alive on `gpu`.
    pub fn set_instances(&self, gpu: &str, gpu_instances: u64, compute_instances: u64) {
        let l = GpuLabels { gpu: gpu.into() };
        self.gpu_instances
            .get_or_create(&l)
            .set(clamp(gpu_instances));
        self.compute_instances
            .get_or_create(&l)
            .set(clamp(compute_instances));
    }

    /// Sets the number of MPS control daemons alive.
    pub fn set_mps_daemons(&self, count: u64) {
        self.mps_daemons.set(clamp(count));
    }

    /// Sets the stranded memory and compute slices of `gpu`.
    pub fn set_stranded(&self, gpu: &str, memory_slices: u64, compute_slices: u64) {
        let l = GpuLabels { gpu: gpu.into() };
        self.stranded_memory
            .get_or_create(&l)
            .set(clamp(memory_slices));
        self.stranded_compute
            .get_or_create(&l)
            .set(clamp(compute_slices));
    }

    /// Drops every per-GPU series of `gpu` (the GPU disappeared).
    pub fn forget_gpu(&self, gpu: &str) {
        let l = GpuLabels { gpu: gpu.into() };
        for f in [
            &self.gpu_instances,
            &self.compute_instances,
            &self.stranded_memory,
            &self.stranded_compute,
        ] {
            f.remove(&l);
        }
    }

    /// Counts one checkpoint write.
    pub fn inc_checkpoint_writes(&self) {
        self.checkpoint_writes.inc();
    }

    /// Counts one writing API request.
    pub fn inc_api_write(&self, verb: ApiVerb) {
        self.api_writes.get_or_create(&VerbLabels { verb }).inc();
    }

    /// The OpenMetrics text exposition of every metric, ending in `# EOF`.
    #[must_use]
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; the encoder only returns
        // fmt::Error from its writer.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
            out.push_str("# EOF\n");
        }
        out
    }
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn observe(
    hist: &HistFamily<ResultLabels>,
    errors: &Family<ReasonLabels, Counter>,
    elapsed: Duration,
    result: Result<(), FailureReason>,
) {
    let outcome = match result {
        Ok(()) => Outcome::Ok,
        Err(reason) => {
            errors.get_or_create(&ReasonLabels { reason }).inc();
            Outcome::Error
        }
    };
    hist.get_or_create(&ResultLabels { result: outcome })
        .observe(elapsed.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn every_metric_has_help_and_the_prefix() {
        let m = Metrics::new();
        // Per-GPU and per-function families have no series until first set.
        m.set_instances("0", 0, 0);
        m.set_stranded("0", 0, 0);
        m.observe_nvml("nvmlInit_v2", Duration::ZERO);
        let t = m.encode();
        for name in [
            "carve_prepare_duration_seconds histogram",
            "carve_unprepare_duration_seconds histogram",
            "carve_prepare_errors counter",
            "carve_unprepare_errors counter",
            "carve_nvml_call_duration_seconds histogram",
            "carve_devices_published gauge",
            "carve_gpu_instances gauge",
            "carve_compute_instances gauge",
            "carve_mps_daemons gauge",
            "carve_stranded_memory_slices gauge",
            "carve_stranded_compute_slices gauge",
            "carve_checkpoint_writes counter",
            "carve_api_writes counter",
        ] {
            assert!(
                t.contains(&format!("# TYPE {name}")),
                "{name} missing:\n{t}"
            );
            let short = name.split(' ').next().unwrap();
            assert!(
                t.contains(&format!("# HELP {short} ")),
                "{short} has no HELP"
            );
        }
        assert!(t.ends_with("# EOF\n"));
        assert_eq!(
            line(&t, "carve_devices_published{type=\"timeslice\"}"),
            Some("carve_devices_published{type=\"timeslice\"} 0")
        );
    }

    #[test]
    fn prepare_outcomes_land_under_result_and_reason() {
        let m = Metrics::new();
        m.observe_prepare(Duration::from_millis(3), Ok(()));
        m.observe_prepare(Duration::from_secs(2), Err(FailureReason::Nvml));
        m.observe_prepare(Duration::from_secs(2), Err(FailureReason::Nvml));
        m.observe_unprepare(Duration::from_millis(1), Err(FailureReason::Cdi));
        let t = m.encode();
        assert_eq!(
            line(&t, "carve_prepare_duration_seconds_count{result=\"ok\"}"),
            Some("carve_prepare_duration_seconds_count{result=\"ok\"} 1")
        );
        assert_eq!(
            line(&t, "carve_prepare_duration_seconds_count{result=\"error\"}"),
            Some("carve_prepare_duration_seconds_count{result=\"error\"} 2")
        );
        // 3 ms falls in the first (5 ms) bucket; 2 s does not.
        assert!(
            t.contains("carve_prepare_duration_seconds_bucket{le=\"0.005\",result=\"ok\"} 1"),
            "{t}"
        );
        assert!(
            t.contains("carve_prepare_duration_seconds_bucket{le=\"0.005\",result=\"error\"} 0"),
            "{t}"
        );
        assert!(
            t.contains("carve_prepare_errors_total{reason=\"nvml\"} 2"),
            "{t}"
        );
        assert!(
            t.contains("carve_unprepare_errors_total{reason=\"cdi\"} 1"),
            "{t}"
        );
        assert!(
            t.contains("carve_prepare_errors_total{reason=\"cdi\"} 0"),
            "{t}"
        );
    }

    #[test]
    fn gauges_and_counters_take_typed_values() {
        let m = Metrics::new();
        let names: Vec<DeviceName> = [
            "gpu-0",
            "gpu-0-mig-1g10gb-3",
            "gpu-0-mig-1g10gb-4",
            "gpu-1-mps",
            "gpu-0-mig-1g10gb-3-mps",
            "gpu-1-ts",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        m.record_published(&names);
        m.set_instances("GPU-abc", 2, 3);
        m.set_stranded("GPU-abc", 1, 4);
        m.set_mps_daemons(2);
        m.inc_checkpoint_writes();
        m.inc_api_write(ApiVerb::Create);
        m.inc_api_write(ApiVerb::Create);
        m.inc_api_write(ApiVerb::Delete);
        let v = m.time_nvml("nvmlDeviceGetCount_v2", || 7);
        assert_eq!(v, 7);
        let t = m.encode();
        for want in [
            "carve_devices_published{type=\"gpu\"} 1",
            "carve_devices_published{type=\"mig\"} 2",
            "carve_devices_published{type=\"mps\"} 2",
            "carve_devices_published{type=\"timeslice\"} 1",
            "carve_gpu_instances{gpu=\"GPU-abc\"} 2",
            "carve_compute_instances{gpu=\"GPU-abc\"} 3",
            "carve_stranded_memory_slices{gpu=\"GPU-abc\"} 1",
            "carve_stranded_compute_slices{gpu=\"GPU-abc\"} 4",
            "carve_mps_daemons 2",
            "carve_checkpoint_writes_total 1",
            "carve_api_writes_total{verb=\"create\"} 2",
            "carve_api_writes_total{verb=\"delete\"} 1",
            "carve_nvml_call_duration_seconds_count{function=\"nvmlDeviceGetCount_v2\"} 1",
        ] {
            assert!(t.lines().any(|l| l == want), "missing {want:?} in\n{t}");
        }
        m.forget_gpu("GPU-abc");
        let t = m.encode();
        assert!(!t.contains("GPU-abc"), "{t}");
    }
}
