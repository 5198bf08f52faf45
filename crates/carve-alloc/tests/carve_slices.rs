//! The examples against the ResourceSlices carve-model really builds (both
//! layouts), plus carve-model's MPS and time-slice devices.

mod common;

use carve_alloc::{Allocator, Inputs, Object};
use carve_model::sharing::{
    ComputeLimit, MemoryLimit, MpsCapabilities, MpsDeviceSpec, consume_all, time_slice_device,
};
use carve_model::slices::{
    KubeLayout, NodeGpu, SliceOptions, build_slices, counter_set_name, simulated_node,
};
use common::*;
use k8s_openapi::api::resource::v1::ResourceClaim;

fn example(dir: &str) -> ResourceClaim {
    // The example's ResourceClaimTemplate (the Pod that names it follows).
    let objs = load(&[examples().join(dir).join("pod.yaml")]);
    let claim = objs.into_iter().find_map(|o| match o {
        Object::Claim(c) => Some(c),
        _ => None,
    });
    claim.unwrap_or_else(|| panic!("{dir}: no ResourceClaimTemplate"))
}

/// Two H100s with every MIG placement; GPU 1 also gets an MPS device with the
/// given memory enforcement and a time-slice device (1.35+ only: they go into
/// the device slice that holds GPU 1).
fn node(layout: KubeLayout, mps_limit: Option<MemoryLimit>) -> Inputs {
    let gpus = simulated_node("h100", 2).unwrap();
    let node_gpus: Vec<NodeGpu> = gpus.iter().map(|g| NodeGpu::dynamic(g.clone())).collect();
    let mut slices = build_slices(&node_gpus, &SliceOptions::new("node-a", layout)).unwrap();
    if let Some(limit) = mps_limit {
        let set_name = counter_set_name(1);
        let set = slices
            .iter()
            .flat_map(|s| s.spec.shared_counters.iter().flatten())
            .find(|s| s.name == set_name)
            .unwrap()
            .clone();
        let caps = MpsCapabilities {
            memory_limit: limit,
            compute_limit: ComputeLimit::Percentage,
        };
        let mps = MpsDeviceSpec::whole(&gpus[1], caps)
            .unwrap()
            .device(&gpus[1], consume_all(&set))
            .unwrap();
        let ts = time_slice_device(&gpus[1], consume_all(&set)).unwrap();
        let slice = slices
            .iter_mut()
            .find(|s| s.spec.devices.iter().flatten().any(|d| d.name == "gpu-1"))
            .unwrap();
        slice.spec.devices.as_mut().unwrap().extend([mps, ts]);
    }
    let mut objs: Vec<Object> = slices.into_iter().map(Object::Slice).collect();
    objs.extend(load(&[examples().join("deviceclasses.yaml")]));
    Inputs::from_objects(objs).0
}

#[test]
fn mig_and_whole_examples_fit_carve_slices_in_both_layouts() {
    for layout in [KubeLayout::V134, KubeLayout::V135Plus] {
        let inputs = node(layout, None);
        let a = Allocator::new(&inputs).unwrap();
        let cases: &[(&str, &[(&str, &str)])] = &[
            ("mig-1g", &[("gpu", "gpu-0-mig-1g10gb-6")]),
            ("mig-by-memory", &[("gpu", "gpu-0-mig-3g40gb-4")]),
            (
                "mig-same-parent",
                &[
                    ("small", "gpu-0-mig-1g10gb-6"),
                    ("large", "gpu-0-mig-3g40gb-0"),
                ],
            ),
            ("whole-gpu", &[("gpu", "gpu-0")]),
            (
                "mig-first-available",
                &[("mig/two-g", "gpu-0-mig-2g20gb-4")],
            ),
        ];
        for (dir, want) in cases {
            let r = a
                .allocate(&example(dir), "node-a")
                .unwrap_or_else(|e| panic!("{layout:?} {dir}: {e}"));
            assert_eq!(picks(&r), pairs(want), "{layout:?} {dir}");
        }
    }
}

#[test]
fn sharing_examples_fit_carve_sharing_devices() {
    let inputs = node(KubeLayout::V135Plus, Some(MemoryLimit::Client));
    let mut a = Allocator::new(&inputs).unwrap();
    let r = a.allocate(&example("mps-share"), "node-a").unwrap();
    assert_eq!(picks(&r), pairs(&[("gpu", "gpu-1-mps")]));
    let ts = a.allocate(&example("timeslice"), "node-a").unwrap();
    assert_eq!(picks(&ts), pairs(&[("gpu", "gpu-1-ts")]));
    // Only client enforcement on this node: the hard-limit example does not fit.
    let e = match a.allocate(&example("mps-hard-limit"), "node-a") {
        Err(carve_alloc::AllocError::Unsatisfiable(e)) => e,
        other => panic!("{other:?}"),
    };
    assert!(
        format!("{e:#}").contains("gpu-1-mps: request selector #0 is false"),
        "{e}"
    );
    // With the MPS share committed, the whole gpu-1 and its partitions are out.
    let mut c = example("mps-share");
    c.metadata.namespace = Some("default".into());
    a.allocate_and_commit(&c, "node-a").unwrap();
    let mut w = example("whole-gpu");
    w.metadata.name = Some("w".into());
    let r = a.allocate_and_commit(&w, "node-a").unwrap();
    assert_eq!(picks(&r), pairs(&[("gpu", "gpu-0")]));
    let e = match a.allocate(&example("whole-gpu"), "node-a") {
        Err(carve_alloc::AllocError::Unsatisfiable(e)) => e,
        other => panic!("{other:?}"),
    };
    assert!(e.to_string().contains("default/mps-share"), "{e}");

    let hard = node(KubeLayout::V135Plus, Some(MemoryLimit::Hard));
    let a = Allocator::new(&hard).unwrap();
    let r = a.allocate(&example("mps-hard-limit"), "node-a").unwrap();
    assert_eq!(picks(&r), pairs(&[("gpu", "gpu-1-mps")]));
}

/// A claim for one MIG instance of `profile`.
fn profile_claim(name: &str, profile: &str) -> ResourceClaim {
    let yaml = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        selectors:\n        - cel: {{expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"{profile}\"'}}\n"
    );
    claim(&yaml)
}

#[test]
fn a_claim_the_unfixed_upstream_allocator_would_refuse_is_told_apart() {
    // kubernetes/kubernetes#140436: before PR #140431 the scheduler's
    // allocator kept the counters of a candidate it rejected on a
    // matchAttribute constraint. gpu-0 has room for a 1g but not for a 3g;
    // mig-same-parent's 1g goes there first, both 3g placements of gpu-1 are
    // then rejected on the constraint (other parent) and, upstream, keep
    // their memory slices: the 1g can no longer move to gpu-1. Without the
    // leak it fits there.
    for layout in [KubeLayout::V134, KubeLayout::V135Plus] {
        let inputs = node(layout, None);
        let mut a = Allocator::new(&inputs).unwrap();
        for (n, p) in [("four", "4g.40gb"), ("two", "2g.20gb")] {
            a.allocate_and_commit(&profile_claim(n, p), "node-a")
                .unwrap();
        }
        let same_parent = example("mig-same-parent");
        let fit = a.allocate(&same_parent, "node-a").unwrap();
        assert_eq!(
            picks(&fit),
            pairs(&[
                ("small", "gpu-1-mig-1g10gb-6"),
                ("large", "gpu-1-mig-3g40gb-0")
            ]),
            "{layout:?}"
        );
        assert!(
            a.refused_by_upstream_counter_leak(&same_parent, "node-a")
                .unwrap(),
            "{layout:?}"
        );
        // On an empty node the first candidates satisfy the constraint:
        // nothing is rejected, nothing leaks.
        let empty = Allocator::new(&inputs).unwrap();
        assert!(
            !empty
                .refused_by_upstream_counter_leak(&same_parent, "node-a")
                .unwrap()
        );
    }
}
