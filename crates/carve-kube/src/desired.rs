//! The slices to publish on one Kubernetes version: the built slices with the
//! health taints that version accepts, checked for that version before they
//! are sent.

use std::collections::BTreeMap;

use carve_model::health::taints_for_version;
use carve_model::slices::{KubeVersion, ValidationError, validate_slices_for_version};
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};

/// [`with_taints`]'s result.
#[derive(Debug, Clone, PartialEq)]
pub struct Tainted {
    /// The slices to send.
    pub slices: Vec<ResourceSlice>,
    /// Devices that carry at least one taint.
    pub tainted: usize,
    /// Taints left out because the version does not know their effect
    /// (effect `None` on 1.34; see [`taints_for_version`]), by device.
    pub withheld: BTreeMap<String, Vec<DeviceTaint>>,
}

/// `base` with each device's taints from `taints` (device name → taints), less
/// those the API server of `version` cannot store, then validated for
/// `version` ([`validate_slices_for_version`]: taint keys, values, effects
/// and counts, and the 64-device limit of a slice with taints).
///
/// # Errors
/// The first rule the tainted slices break; nothing is returned to send.
pub fn with_taints(
    base: &[ResourceSlice],
    taints: &BTreeMap<String, Vec<DeviceTaint>>,
    version: KubeVersion,
) -> Result<Tainted, ValidationError> {
    let mut slices = base.to_vec();
    let mut withheld = BTreeMap::new();
    let mut tainted = 0;
    for s in &mut slices {
        for d in s.spec.devices.iter_mut().flatten() {
            let Some(t) = taints.get(&d.name).filter(|t| !t.is_empty()) else {
                d.taints = None;
                continue;
            };
            let split = taints_for_version(t.clone(), version);
            if !split.withheld.is_empty() {
                withheld.insert(d.name.clone(), split.withheld);
            }
            d.taints = (!split.published.is_empty()).then_some(split.published);
            tainted += usize::from(d.taints.is_some());
        }
    }
    validate_slices_for_version(&slices, version)?;
    Ok(Tainted {
        slices,
        tainted,
        withheld,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_model::slices::{
        KubeLayout, NodeGpu, Rule, SliceOptions, build_slices, simulated_node,
    };

    fn base(layout: KubeLayout) -> Vec<ResourceSlice> {
        let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 2)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        build_slices(&gpus, &SliceOptions::new("node-a", layout)).unwrap()
    }

    fn t(key: &str, effect: &str) -> DeviceTaint {
        DeviceTaint {
            key: key.into(),
            value: Some("1".into()),
            effect: effect.into(),
            time_added: None,
        }
    }

    #[test]
    fn none_taints_are_withheld_on_1_34_and_the_rest_validated() {
        let mut m = BTreeMap::new();
        m.insert("gpu-0".to_string(), vec![t("gpu.carve.dev/xid", "None")]);
        m.insert(
            "gpu-1".to_string(),
            vec![
                t("gpu.carve.dev/ecc", "None"),
                t("gpu.carve.dev/xid", "NoSchedule"),
            ],
        );
        let r = with_taints(&base(KubeLayout::V134), &m, KubeVersion::V1_34).unwrap();
        assert_eq!(r.tainted, 1);
        assert_eq!(r.withheld.len(), 2);
        let r = with_taints(&base(KubeLayout::V135Plus), &m, KubeVersion::V1_35).unwrap();
        assert_eq!(r.tainted, 2);
        assert!(r.withheld.is_empty());
        // A taint no version accepts is refused before anything is sent.
        m.insert("gpu-0".to_string(), vec![t("Bad Key", "NoSchedule")]);
        let e = with_taints(&base(KubeLayout::V135Plus), &m, KubeVersion::V1_35).unwrap_err();
        assert_eq!(e.rule(), Rule::TaintKey, "{e}");
    }
}
