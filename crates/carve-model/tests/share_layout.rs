//! Sharing devices published apart (`ShareLayout::Separate`), for a
//! scheduler that leaves shared devices' counters out (before 1.36.2): no
//! published share overlaps any other published device, whatever is
//! allocated; the GPUs not listed publish only exclusive devices; every
//! wrong list is refused by name.

use std::collections::{BTreeMap, BTreeSet};

use carve_model::DeviceName;
use carve_model::scheduler::{ShareLayout, SharedGpu, parse_shared_gpus};
use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use carve_model::slices::{
    KubeLayout, NodeGpu, SharingOptions, SliceError, SliceOptions, build_slices, consumption_fits,
    parse_gpu_spec, simulated_gpus, validate_slices,
};
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};

const CAPS: MpsCapabilities = MpsCapabilities {
    memory_limit: MemoryLimit::Client,
    compute_limit: ComputeLimit::Percentage,
};

fn all_sharing() -> SharingOptions {
    SharingOptions {
        mps_caps: Some(CAPS),
        mps: true,
        timeslice: true,
        mig_mps: true,
    }
}

fn node(spec: &str) -> Vec<NodeGpu> {
    simulated_gpus(&parse_gpu_spec(spec).unwrap())
        .unwrap()
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect()
}

fn build(
    gpus: &[NodeGpu],
    layout: KubeLayout,
    shared: &str,
) -> Result<Vec<ResourceSlice>, SliceError> {
    let mut o = SliceOptions::new("node-a", layout);
    o.sharing = all_sharing();
    o.shares = ShareLayout::Separate(parse_shared_gpus(shared).unwrap());
    build_slices(gpus, &o)
}

fn devices(slices: &[ResourceSlice]) -> Vec<&Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect()
}

fn sets(slices: &[ResourceSlice]) -> BTreeMap<String, CounterSet> {
    slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|c| (c.name.clone(), c.clone()))
        .collect()
}

fn shared(d: &Device) -> bool {
    d.allow_multiple_allocations == Some(true)
}

fn gpu_of(d: &Device) -> u32 {
    d.name.parse::<DeviceName>().unwrap().gpu()
}

fn names_on(all: &[&Device], gpu: u32) -> BTreeSet<String> {
    all.iter()
        .filter(|d| gpu_of(d) == gpu)
        .map(|d| d.name.clone())
        .collect()
}

#[test]
fn listed_gpus_publish_one_kind_of_share_on_disjoint_units_and_the_rest_only_exclusive_devices() {
    let gpus = node("h100-80gb:2,a100-40gb:3");
    for layout in [KubeLayout::V134, KubeLayout::V135Plus] {
        let slices = build(&gpus, layout, "1=mig-mps:2g.20gb,3=mps,4=timeslice").unwrap();
        validate_slices(&slices, layout).unwrap();
        let all = devices(&slices);
        assert_eq!(
            names_on(&all, 1),
            [
                "gpu-1-mig-2g20gb-0-mps",
                "gpu-1-mig-2g20gb-2-mps",
                "gpu-1-mig-2g20gb-4-mps"
            ]
            .map(String::from)
            .into(),
        );
        assert_eq!(names_on(&all, 3), ["gpu-3-mps".to_string()].into());
        assert_eq!(names_on(&all, 4), ["gpu-4-ts".to_string()].into());
        // Not listed: the whole GPU and every MIG placement, no share.
        for gpu in [0, 2] {
            let on = names_on(&all, gpu);
            assert!(
                on.contains(&format!("gpu-{gpu}")) && on.len() > 20,
                "{on:?}"
            );
            assert!(all.iter().filter(|d| gpu_of(d) == gpu).all(|d| !shared(d)));
        }
        assert!(
            all.iter()
                .filter(|d| [1, 3, 4].contains(&gpu_of(d)))
                .all(|d| shared(d))
        );
    }
}

/// The property a scheduler that leaves shares' counters out needs: on a
/// GPU with shares, every published device can be allocated at once (so no
/// allocation, counted or not, can overlap another), checked with the
/// counters the slices publish.
#[test]
fn on_a_gpu_with_shares_all_its_devices_fit_together() {
    for (spec, list) in [
        (
            "h100-80gb:4",
            "0=mig-mps:1g.10gb,1=mig-mps:1g.10gb+me,2=mig-mps:3g.40gb,3=mps",
        ),
        ("h200:2", "0=mig-mps:1g.18gb,1=timeslice"),
        ("a100-40gb:2", "0=mig-mps:2g.10gb,1=mps"),
        ("a30:2", "0=mig-mps:1g.6gb,1=mig-mps:2g.12gb"),
    ] {
        let gpus = node(spec);
        let slices = build(&gpus, KubeLayout::V135Plus, list).unwrap();
        let all = devices(&slices);
        let sets = sets(&slices);
        for gpu in parse_shared_gpus(list).unwrap().keys() {
            let on: Vec<&Device> = all.iter().copied().filter(|d| gpu_of(d) == *gpu).collect();
            assert!(!on.is_empty(), "{spec} gpu {gpu}");
            let set = on[0].consumes_counters.as_ref().unwrap()[0]
                .counter_set
                .clone();
            assert!(
                consumption_fits(&sets[&set], &on).unwrap(),
                "{spec} gpu {gpu}: {:?} overlap",
                on.iter().map(|d| &d.name).collect::<Vec<_>>()
            );
        }
    }
    // And the units are as many as fit: 7 of 1g.10gb, one +me instance.
    let slices = build(
        &node("h100-80gb:2"),
        KubeLayout::V135Plus,
        "0=mig-mps:1g.10gb,1=mig-mps:1g.10gb+me",
    )
    .unwrap();
    let all = devices(&slices);
    assert_eq!(names_on(&all, 0).len(), 7);
    assert_eq!(names_on(&all, 1).len(), 1);
}

#[test]
fn with_no_gpu_listed_no_share_is_published() {
    let gpus = node("h100-80gb:1,l4:1");
    let slices = build(&gpus, KubeLayout::V135Plus, "").unwrap();
    let all = devices(&slices);
    assert!(!all.is_empty() && all.iter().all(|d| !shared(d)));
    // The L4 publishes its whole GPU without a counter set, as with sharing off.
    assert_eq!(sets(&slices).len(), 1);
}

/// 1.34 checks a share's capacity against the first device of its slice:
/// a GPU with shares has a slice of its own, whose devices all have the
/// first one's capacity.
#[test]
fn in_the_1_34_layout_each_gpu_with_shares_has_a_slice_of_its_own() {
    let gpus = node("a100-40gb:4");
    let slices = build(&gpus, KubeLayout::V134, "1=mps,2=timeslice").unwrap();
    for s in &slices {
        let devs: Vec<&Device> = s.spec.devices.iter().flatten().collect();
        let gpus: BTreeSet<u32> = devs.iter().map(|d| gpu_of(d)).collect();
        if devs.iter().any(|d| shared(d)) {
            assert_eq!(
                gpus.len(),
                1,
                "{:?}",
                devs.iter().map(|d| &d.name).collect::<Vec<_>>()
            );
            assert!(devs.iter().all(|d| d.capacity == devs[0].capacity));
        }
    }
    let slices = build(&node("h100-80gb:1"), KubeLayout::V134, "0=mig-mps:2g.20gb").unwrap();
    let devs = devices(&slices);
    assert_eq!(devs.len(), 3);
    assert!(
        devs.iter()
            .all(|d| shared(d) && d.capacity == devs[0].capacity)
    );
}

#[test]
fn a_list_the_node_cannot_host_is_refused_by_name() {
    let refused = |gpus: &[NodeGpu], list: &str| match build(gpus, KubeLayout::V135Plus, list) {
        Ok(_) => panic!("{list} was accepted"),
        Err(e) => e.to_string(),
    };
    let gpus = node("h100-80gb:1,l4:1");
    for (list, says) in [
        ("5=mps", "no GPU 5 (its GPUs: 0, 1)"),
        (
            "0=mig-mps:9g.1gb",
            "no profile \"9g.1gb\"; its profiles: 1g.10gb",
        ),
        (
            "1=mig-mps:1g.5gb",
            "GPU 1 (NVIDIA L4) cannot host mig-mps:1g.5gb shares: it has no MIG profiles",
        ),
    ] {
        let e = refused(&gpus, list);
        assert!(e.contains(says), "{list}: {e}");
    }
    let mut o = SliceOptions::new("node-a", KubeLayout::V135Plus);
    o.sharing = SharingOptions {
        timeslice: false,
        ..all_sharing()
    };
    o.shares = ShareLayout::Separate([(0, SharedGpu::Timeslice)].into());
    let Err(e) = build_slices(&gpus, &o) else {
        panic!("timeslice off, yet GPU 0 was given time-sliced shares");
    };
    let e = e.to_string();
    assert!(e.contains("sharing does not include timeslice"), "{e}");
    let mut locked = node("a100-40gb:1");
    locked[0].mig_locked = true;
    let e = refused(&locked, "0=mps");
    assert!(
        e.contains("MIG mode is on") && e.contains("mig-mps:PROFILE"),
        "{e}"
    );
    assert!(build(&locked, KubeLayout::V135Plus, "0=mig-mps:1g.5gb").is_ok());
}
