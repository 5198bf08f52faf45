//! `--scheduler-version` and `--shared-gpus`: which kube-scheduler the
//! node's slices are for, and so whether sharing devices are published
//! beside exclusive ones or apart on the GPUs named (see
//! [`carve_model::scheduler`]). One set of flags for the plugin, `carve
//! slices`, `carve explain` and `carve simulate`.

use std::collections::BTreeMap;

use carve_model::scheduler::{
    SchedulerVersion, ShareLayout, SharedGpu, parse_shared_gpus, shared_gpus_string,
};
use carve_model::slices::KubeVersion;

/// The GPUs the default simulated node ([`crate::slices::DEFAULT_GPUS`])
/// shares where its scheduler may not count shares: the fourth and fifth
/// (A100s, MIG off) by MPS and by time-slicing, the sixth (an H100) by
/// MPS on its `2g.20gb` instances; the others stay exclusive.
pub const DEFAULT_NODE_SHARED_GPUS: &str = "3=mps,4=timeslice,5=mig-mps:2g.20gb";

/// The flags.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ShareArgs {
    /// The kube-scheduler release the node's slices are for (`1.35`,
    /// `1.36.2`; carve models 1.34 to 1.37). Before 1.36.2 its allocator does
    /// not count the counters of shared devices already allocated, so carve
    /// then publishes shares only on the GPUs of `--shared-gpus`; for 1.34,
    /// whose allocator checks a share on the wrong device, none. Default:
    /// the oldest scheduler the version-skew policy allows beside the API
    /// server (one minor release older).
    #[arg(long, value_parser = parse_scheduler_version)]
    pub scheduler_version: Option<SchedulerVersion>,
    /// Where the scheduler may not count shares: the GPUs that host them,
    /// `INDEX=mps|timeslice|mig-mps:PROFILE` separated by commas (e.g.
    /// `3=mps,5=mig-mps:2g.20gb`). Each hosts only that kind of share, on
    /// units that do not overlap, and no exclusive device; every other GPU
    /// publishes only exclusive devices. Default: none (no share is
    /// published there), but for the default simulated node.
    #[arg(long, value_name = "LIST", value_parser = parse_shared_gpus_flag)]
    pub shared_gpus: Option<BTreeMap<u32, SharedGpu>>,
}

/// How the node publishes its shares for an API server of `api`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareDecision {
    /// The scheduler the slices are for.
    pub scheduler: SchedulerVersion,
    /// Whether the admin stated it (else it is assumed from `api`).
    pub stated: bool,
    /// The layout.
    pub layout: ShareLayout,
}

impl ShareDecision {
    /// One line saying what this means for the node's shares, for logs and
    /// the commands' output; `None` where shares are published everywhere.
    #[must_use]
    pub fn note(&self, sharing_on: bool) -> Option<String> {
        let ShareLayout::Separate(listed) = &self.layout else {
            return None;
        };
        if !sharing_on {
            return None;
        }
        let whose = if self.stated {
            format!("kube-scheduler {} (--scheduler-version)", self.scheduler)
        } else {
            format!(
                "kube-scheduler may be {} (the oldest the version-skew policy allows beside this API server; state yours with --scheduler-version)",
                self.scheduler
            )
        };
        Some(if !self.scheduler.checks_chosen_device_capacity() {
            format!(
                "{whose} checks a share's capacity on another device than the one it chose, and crashes on a request for several devices that reaches past the end of a slice (fixed in 1.35), so no share is published: shares need kube-scheduler 1.35 or later (state it with --scheduler-version), and a 1.34 scheduler is safe only with its DRAConsumableCapacity gate off"
            )
        } else if listed.is_empty() {
            format!(
                "{whose} does not count the counters of shared devices already allocated (fixed in 1.36.2), so no share is published: name the GPUs that host shares with --shared-gpus"
            )
        } else {
            format!(
                "{whose} does not count the counters of shared devices already allocated (fixed in 1.36.2), so shares are published only on GPUs {} (--shared-gpus), apart from exclusive devices",
                shared_gpus_string(listed)
            )
        })
    }
}

/// [`DEFAULT_NODE_SHARED_GPUS`] without the kinds `sharing` leaves off
/// (`--sharing none` shares nothing there).
#[must_use]
pub fn default_node_shared(sharing: &[crate::simulate::SimSharing]) -> BTreeMap<u32, SharedGpu> {
    use crate::simulate::SimSharing;
    let mut m = parse_shared_gpus(DEFAULT_NODE_SHARED_GPUS).unwrap_or_default();
    m.retain(|_, g| {
        sharing.contains(&match g {
            SharedGpu::Mps => SimSharing::Mps,
            SharedGpu::Timeslice => SimSharing::Timeslice,
            SharedGpu::MigMps { .. } => SimSharing::MigMps,
        })
    });
    m
}

impl ShareArgs {
    /// The decision for an API server of `api`, with `default_shared` where
    /// `--shared-gpus` is not given.
    #[must_use]
    pub fn decide(
        &self,
        api: KubeVersion,
        default_shared: &BTreeMap<u32, SharedGpu>,
    ) -> ShareDecision {
        let (scheduler, stated) = match self.scheduler_version {
            Some(v) if v.allowed_with(api.minor) || api.major != 1 => (v, true),
            Some(v) => {
                tracing::warn!(scheduler = %v, apiserver = %api, "the stated kube-scheduler version is not one the version-skew policy allows beside this API server (at most one minor older, never newer): assuming the oldest it allows");
                (SchedulerVersion::oldest_for(api.minor), false)
            }
            None => (SchedulerVersion::oldest_for(api.minor), false),
        };
        let shared = self.shared_gpus.as_ref().unwrap_or(default_shared);
        ShareDecision {
            scheduler,
            stated,
            layout: ShareLayout::for_scheduler(scheduler, shared),
        }
    }

    /// The flags again, for a child `carve` process.
    #[must_use]
    pub fn to_flags(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(v) = self.scheduler_version {
            out.push(format!("--scheduler-version={v}"));
        }
        if let Some(m) = &self.shared_gpus {
            out.push(format!("--shared-gpus={}", shared_gpus_string(m)));
        }
        out
    }
}

/// `1.35`, `v1.36.1`: a release carve models (1.34 to 1.37).
pub fn parse_scheduler_version(s: &str) -> Result<SchedulerVersion, String> {
    let v = SchedulerVersion::parse(s).map_err(|e| {
        format!(
            "{e} (carve models {})",
            carve_model::slices::KubeVersion::modelled_list()
        )
    })?;
    if !KubeVersion::new(1, v.minor).is_modelled() {
        return Err(format!(
            "carve models kube-scheduler {} only",
            KubeVersion::modelled_list()
        ));
    }
    Ok(v)
}

fn parse_shared_gpus_flag(s: &str) -> Result<BTreeMap<u32, SharedGpu>, String> {
    parse_shared_gpus(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_stated_version_the_oldest_allowed_scheduler_decides() {
        let none = ShareArgs::default();
        let empty = BTreeMap::new();
        let d = none.decide(KubeVersion::new(1, 37), &empty);
        assert_eq!(d.scheduler, SchedulerVersion::new(36, Some(0)));
        assert_eq!(d.layout, ShareLayout::Separate(BTreeMap::new()));
        assert!(d.note(true).unwrap().contains("no share is published"));
        assert_eq!(d.note(false), None);
        let stated = ShareArgs {
            scheduler_version: Some(SchedulerVersion::new(36, Some(2))),
            ..ShareArgs::default()
        };
        assert_eq!(
            stated.decide(KubeVersion::new(1, 37), &empty).layout,
            ShareLayout::Mixed
        );
        // Newer than the API server: not allowed, so not believed.
        let d = stated.decide(KubeVersion::new(1, 35), &empty);
        assert!(!d.stated && matches!(d.layout, ShareLayout::Separate(_)));
        // A 1.34 scheduler (stated, or assumed beside a 1.35 API server)
        // gets no share, whatever the list.
        let listed = parse_shared_gpus("3=mps").unwrap();
        let d = ShareArgs::default().decide(KubeVersion::new(1, 35), &listed);
        assert_eq!(d.layout, ShareLayout::Separate(BTreeMap::new()));
        assert!(
            d.note(true)
                .unwrap()
                .contains("kube-scheduler 1.35 or later")
        );
        let v135 = ShareArgs {
            scheduler_version: Some(SchedulerVersion::new(35, None)),
            ..ShareArgs::default()
        };
        assert_eq!(
            v135.decide(KubeVersion::new(1, 35), &listed).layout,
            ShareLayout::Separate(listed.clone())
        );
        use crate::simulate::SimSharing;
        let all =
            default_node_shared(&[SimSharing::Mps, SimSharing::MigMps, SimSharing::Timeslice]);
        let d = ShareArgs::default().decide(KubeVersion::new(1, 36), &all);
        assert!(
            d.note(true)
                .unwrap()
                .contains("3=mps,4=timeslice,5=mig-mps:2g.20gb")
        );
        assert_eq!(
            shared_gpus_string(&default_node_shared(&[SimSharing::Timeslice])),
            "4=timeslice"
        );
        assert!(default_node_shared(&[SimSharing::None]).is_empty());
    }
}
