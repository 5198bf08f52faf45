//! Every validation rule has a failing case: mutate a good set of slices, and
//! the error names the rule, the slice and the device or counter set.

use std::collections::BTreeMap;

use carve_model::slices::{
    KubeLayout, NodeGpu, Rule, SliceOptions, build_slices, simulated_node, validate_slices,
};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption,
    DeviceTaint, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

fn good(layout: KubeLayout, gpus: u32) -> Vec<ResourceSlice> {
    let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", gpus)
        .unwrap()
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect();
    let s = build_slices(&gpus, &SliceOptions::new("node-a", layout)).unwrap();
    validate_slices(&s, layout).unwrap();
    s
}

/// 1.35+: [counters-0 (2 sets), devices-00 (52 devices)].
fn v135() -> Vec<ResourceSlice> {
    let s = good(KubeLayout::V135Plus, 2);
    assert_eq!(s.len(), 2);
    s
}

/// 1.34: [devices-00 (gpu 0,1), devices-01 (gpu 2,3)].
fn v134() -> Vec<ResourceSlice> {
    let s = good(KubeLayout::V134, 4);
    assert_eq!(s.len(), 2);
    s
}

fn q(s: &str) -> Quantity {
    Quantity(s.into())
}

fn dev(s: &mut [ResourceSlice], slice: usize, k: usize) -> &mut Device {
    &mut s[slice].spec.devices.as_mut().unwrap()[k]
}

fn set(s: &mut [ResourceSlice], slice: usize, k: usize) -> &mut CounterSet {
    &mut s[slice].spec.shared_counters.as_mut().unwrap()[k]
}

fn consumption(d: &mut Device) -> &mut DeviceCounterConsumption {
    &mut d.consumes_counters.as_mut().unwrap()[0]
}

fn attrs(d: &mut Device) -> &mut BTreeMap<String, DeviceAttribute> {
    d.attributes.as_mut().unwrap()
}

/// Apply `f` to good slices; expect `rule`, reported for slice number
/// `slice`, with `subject` (device / counter set / field) in the message.
fn expect(
    layout: KubeLayout,
    f: impl FnOnce(&mut Vec<ResourceSlice>),
    rule: Rule,
    slice: usize,
    subject: &str,
) {
    let mut s = match layout {
        KubeLayout::V134 => v134(),
        KubeLayout::V135Plus => v135(),
    };
    let name = s[slice].metadata.name.clone().unwrap();
    f(&mut s);
    let e = validate_slices(&s, layout).expect_err(&format!("{rule} not detected"));
    assert_eq!(e.rule(), rule, "{e}");
    let msg = e.to_string();
    if rule != Rule::SliceName {
        assert_eq!(e.slice(), name, "{msg}");
    }
    assert!(msg.contains(subject), "{msg:?} does not name {subject:?}");
    assert!(
        msg.contains(rule.as_str()),
        "{msg:?} does not name the rule"
    );
}

const V135: KubeLayout = KubeLayout::V135Plus;
const V134: KubeLayout = KubeLayout::V134;

#[test]
fn slice_level_rules() {
    expect(
        V135,
        |s| s[1].metadata.name = Some("Bad_Name".into()),
        Rule::SliceName,
        1,
        "Bad_Name",
    );
    expect(
        V135,
        |s| {
            s[1].metadata
                .labels
                .as_mut()
                .unwrap()
                .insert("gpu.carve.dev/node".into(), "x".repeat(64));
        },
        Rule::Label,
        1,
        "gpu.carve.dev/node",
    );
    expect(
        V135,
        |s| s[0].spec.driver = "x".repeat(64),
        Rule::DriverName,
        0,
        "xxxx",
    );
    expect(
        V135,
        |s| s[0].spec.driver = "gpu_carve".into(),
        Rule::DriverName,
        0,
        "gpu_carve",
    );
    expect(
        V135,
        |s| s[0].spec.pool.name = "a//b".into(),
        Rule::PoolName,
        0,
        "a//b",
    );
    expect(
        V135,
        |s| s[0].spec.pool.name = "p".repeat(254),
        Rule::PoolName,
        0,
        "ppp",
    );
    expect(
        V135,
        |s| s[0].spec.pool.generation = -1,
        Rule::Generation,
        0,
        "-1",
    );
    expect(
        V135,
        |s| s[1].spec.pool.generation = 5,
        Rule::Generation,
        1,
        "differs",
    );
    expect(
        V135,
        |s| s[0].spec.pool.resource_slice_count = 0,
        Rule::SliceCount,
        0,
        "not positive",
    );
    expect(
        V135,
        |s| {
            s.iter_mut()
                .for_each(|x| x.spec.pool.resource_slice_count = 3)
        },
        Rule::SliceCount,
        0,
        "2 slices given",
    );
    expect(
        V135,
        |s| {
            s.pop();
        },
        Rule::SliceCount,
        0,
        "1 slices given",
    );
    expect(
        V135,
        |s| s[0].spec.node_name = None,
        Rule::NodeSelection,
        0,
        "0 of nodeName",
    );
    expect(
        V135,
        |s| s[1].spec.all_nodes = Some(true),
        Rule::NodeSelection,
        1,
        "2 of nodeName",
    );
    expect(
        V135,
        |s| s[0].spec.node_name = Some("Bad Node".into()),
        Rule::NodeSelection,
        0,
        "Bad Node",
    );
    expect(
        V135,
        |s| {
            s[0].spec.node_name = None;
            s[0].spec.all_nodes = Some(false);
        },
        Rule::NodeSelection,
        0,
        "must be true",
    );
}

#[test]
fn device_count_and_layout_rules() {
    expect(
        V135,
        |s| {
            let ds = s[1].spec.devices.as_mut().unwrap();
            for k in 0..13 {
                let mut d = ds[k].clone();
                d.name = format!("extra-{k}");
                ds.push(d);
            }
        },
        Rule::DevicesPerSlice,
        1,
        "65 devices, at most 64",
    );
    expect(
        V135,
        |s| s[0].spec.devices = Some(vec![]),
        Rule::DevicesAndCounters,
        0,
        "both set",
    );
    expect(
        V135,
        |s| {
            let sets = s[0].spec.shared_counters.as_mut().unwrap();
            for k in 0..7 {
                let mut c = sets[0].clone();
                c.name = format!("extra-{k}");
                sets.push(c);
            }
        },
        Rule::CounterSetsPerSlice,
        0,
        "9 counter sets",
    );
}

#[test]
fn counter_set_rules() {
    expect(
        V135,
        |s| set(s, 0, 0).name = "Gpu_0".into(),
        Rule::CounterSetName,
        0,
        "Gpu_0",
    );
    expect(
        V135,
        |s| set(s, 0, 1).name = "gpu-0-counters".into(),
        Rule::CounterSetUnique,
        0,
        "gpu-0-counters",
    );
    expect(
        V135,
        |s| set(s, 0, 0).counters.clear(),
        Rule::CountersEmpty,
        0,
        "gpu-0-counters",
    );
    expect(
        V135,
        |s| {
            set(s, 0, 1)
                .counters
                .insert("Bad_Counter".into(), Counter { value: q("1") });
        },
        Rule::CounterName,
        0,
        "Bad_Counter",
    );
    expect(
        V135,
        |s| {
            let c = &mut set(s, 0, 0).counters;
            for k in 0..18 {
                c.insert(format!("extra-{k}"), Counter { value: q("1") });
            }
        },
        Rule::CountersPerSet,
        0,
        "33 counters",
    );
    expect(
        V135,
        |s| set(s, 0, 0).counters.get_mut("memory").unwrap().value = q("1x"),
        Rule::Quantity,
        0,
        "\"1x\"",
    );
    expect(
        V134,
        |s| {
            let c = &mut set(s, 1, 0).counters;
            for k in 0..3 {
                c.insert(format!("extra-{k}"), Counter { value: q("1") });
            }
        },
        Rule::SharedCountersTotal,
        1,
        "33 counters",
    );
}

#[test]
fn device_attribute_and_capacity_rules() {
    expect(
        V135,
        |s| dev(s, 1, 0).name = "GPU-0".into(),
        Rule::DeviceName,
        1,
        "GPU-0",
    );
    expect(
        V135,
        |s| dev(s, 1, 5).name = dev(s, 1, 4).name.clone(),
        Rule::DeviceNameUnique,
        1,
        "-mig-1g10gb-",
    );
    expect(
        V135,
        |s| {
            attrs(dev(s, 1, 3)).insert(
                "a/b/c".into(),
                DeviceAttribute {
                    int: Some(1),
                    ..Default::default()
                },
            );
        },
        Rule::AttributeName,
        1,
        "a/b/c",
    );
    expect(
        V135,
        |s| {
            attrs(dev(s, 1, 3)).insert(
                "x".repeat(33),
                DeviceAttribute {
                    int: Some(1),
                    ..Default::default()
                },
            );
        },
        Rule::AttributeName,
        1,
        "not a C identifier",
    );
    expect(
        V135,
        |s| attrs(dev(s, 1, 3)).get_mut("index").unwrap().string = Some("0".into()),
        Rule::AttributeValue,
        1,
        "\"index\" has 2 values",
    );
    expect(
        V135,
        |s| {
            attrs(dev(s, 1, 3)).insert("empty".into(), DeviceAttribute::default());
        },
        Rule::AttributeValue,
        1,
        "has 0 values",
    );
    expect(
        V135,
        |s| attrs(dev(s, 1, 2)).get_mut("productName").unwrap().string = Some("p".repeat(65)),
        Rule::StringLength,
        1,
        "65 bytes",
    );
    expect(
        V135,
        |s| {
            attrs(dev(s, 1, 2))
                .get_mut("driverVersion")
                .unwrap()
                .version = Some("580.65.06".into())
        },
        Rule::VersionFormat,
        1,
        "580.65.06",
    );
    expect(
        V135,
        |s| {
            let a = attrs(dev(s, 1, 2));
            for k in 0..16 {
                a.insert(
                    format!("extra{k}"),
                    DeviceAttribute {
                        bool: Some(true),
                        ..Default::default()
                    },
                );
            }
        },
        Rule::AttributeCount,
        1,
        "33 attributes and capacities",
    );
    expect(
        V135,
        |s| {
            dev(s, 1, 2)
                .capacity
                .as_mut()
                .unwrap()
                .get_mut("memory")
                .unwrap()
                .value = q("lots")
        },
        Rule::Quantity,
        1,
        "capacity \"memory\"",
    );
    expect(
        V135,
        |s| {
            dev(s, 1, 2)
                .capacity
                .as_mut()
                .unwrap()
                .get_mut("memory")
                .unwrap()
                .request_policy = Some(CapacityRequestPolicy {
                default: Some(q("1Gi")),
                ..Default::default()
            });
        },
        Rule::RequestPolicy,
        1,
        "allowMultipleAllocations",
    );
    // With allowMultipleAllocations the same policy is fine.
    let mut s = v135();
    let d = dev(&mut s, 1, 2);
    d.allow_multiple_allocations = Some(true);
    d.capacity
        .as_mut()
        .unwrap()
        .get_mut("memory")
        .unwrap()
        .request_policy = Some(CapacityRequestPolicy {
        default: Some(q("1Gi")),
        ..Default::default()
    });
    validate_slices(&s, V135).unwrap();
    expect(
        V135,
        |s| dev(s, 1, 2).node_name = Some("node-a".into()),
        Rule::DeviceNodeSelection,
        1,
        "perDeviceNodeSelection",
    );
    let taint = DeviceTaint {
        key: "k".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    };
    let t = taint.clone();
    expect(
        V135,
        move |s| dev(s, 1, 2).taints = Some(vec![t; 17]),
        Rule::TaintsPerDevice,
        1,
        "17 taints",
    );
    expect(
        V134,
        move |s| dev(s, 0, 2).taints = Some(vec![taint; 5]),
        Rule::TaintsPerDevice,
        0,
        "5 taints",
    );
}

#[test]
fn counter_consumption_rules() {
    expect(
        V135,
        |s| {
            let d = dev(s, 1, 1);
            let mut extra = d.consumes_counters.as_ref().unwrap()[0].clone();
            extra.counter_set = "gpu-1-counters".into();
            let mut third = extra.clone();
            third.counter_set = "gpu-2-counters".into();
            d.consumes_counters.as_mut().unwrap().extend([extra, third]);
        },
        Rule::ConsumptionEntries,
        1,
        "3 consumesCounters entries",
    );
    expect(
        V135,
        |s| {
            let d = dev(s, 1, 1);
            let again = d.consumes_counters.as_ref().unwrap()[0].clone();
            d.consumes_counters.as_mut().unwrap().push(again);
        },
        Rule::ConsumptionEntries,
        1,
        "consumed by two entries",
    );
    expect(
        V135,
        |s| {
            let c = &mut consumption(dev(s, 1, 1)).counters;
            for k in 0..30 {
                c.insert(format!("extra-{k}"), Counter { value: q("1") });
            }
        },
        Rule::CountersPerConsumption,
        1,
        "at most 32",
    );
    expect(
        V135,
        |s| consumption(dev(s, 1, 1)).counters.clear(),
        Rule::CountersEmpty,
        1,
        "gpu-0-mig",
    );
    expect(
        V135,
        |s| consumption(dev(s, 1, 1)).counter_set = "Gpu-0".into(),
        Rule::CounterSetName,
        1,
        "Gpu-0",
    );
    expect(
        V135,
        |s| consumption(dev(s, 1, 1)).counter_set = "gpu-9-counters".into(),
        Rule::CounterSetReference,
        1,
        "gpu-9-counters",
    );
    expect(
        V135,
        |s| {
            consumption(dev(s, 1, 1))
                .counters
                .insert("memory-slice-9".into(), Counter { value: q("1") });
        },
        Rule::CounterReference,
        1,
        "memory-slice-9",
    );
    expect(
        V135,
        |s| {
            consumption(dev(s, 1, 1))
                .counters
                .insert("compute-slices".into(), Counter { value: q("8") });
        },
        Rule::CounterOverdraw,
        1,
        "compute-slices",
    );
    expect(
        V135,
        |s| {
            consumption(dev(s, 1, 1))
                .counters
                .insert("memory".into(), Counter { value: q("100Gi") });
        },
        Rule::CounterOverdraw,
        1,
        "100Gi",
    );
    // 1.34: the set must be in the same slice.
    expect(
        V134,
        |s| consumption(dev(s, 0, 1)).counter_set = "gpu-2-counters".into(),
        Rule::CounterSetReference,
        0,
        "not in this slice",
    );
    expect(
        V134,
        |s| {
            let c = &mut consumption(dev(s, 0, 1)).counters;
            for k in 0..30 {
                c.insert(format!("extra-{k}"), Counter { value: q("1") });
            }
        },
        Rule::DeviceCountersTotal,
        0,
        "at most 32",
    );
    expect(
        V134,
        |s| {
            for d in s[0].spec.devices.as_mut().unwrap() {
                let c = &mut consumption(d).counters;
                for k in 0..20 {
                    c.insert(format!("extra-{k}"), Counter { value: q("1") });
                }
                while c.len() > 20 {
                    let first = c.keys().next().unwrap().clone();
                    c.remove(&first);
                }
            }
        },
        Rule::SliceDeviceCounters,
        0,
        "1040 device counter entries",
    );
}

#[test]
fn the_same_slices_differ_by_layout() {
    // A 1.34 slice (counters with devices) is invalid on 1.35+, and a 1.35+
    // device slice (sets elsewhere) is invalid on 1.34.
    let e = validate_slices(&v134(), V135).unwrap_err();
    assert_eq!(e.rule(), Rule::DevicesAndCounters);
    let e = validate_slices(&v135(), V134).unwrap_err();
    assert_eq!(e.rule(), Rule::CounterSetReference);
}

#[test]
fn pools_are_checked_apart_when_their_slices_interleave() {
    let node = |name: &str| {
        let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 2)
            .unwrap()
            .into_iter()
            .map(NodeGpu::dynamic)
            .collect();
        build_slices(&gpus, &SliceOptions::new(name, V135)).unwrap()
    };
    let (a, b) = (node("node-a"), node("node-b"));
    // [a counters, b counters, a devices, b devices]
    let mut s = vec![a[0].clone(), b[0].clone(), a[1].clone(), b[1].clone()];
    validate_slices(&s, V135).unwrap();
    fn whole(s: &mut [ResourceSlice]) -> &mut BTreeMap<String, Counter> {
        let d = s[3].spec.devices.as_mut().unwrap().last_mut().unwrap();
        assert_eq!(d.name, "gpu-1");
        &mut d.consumes_counters.as_mut().unwrap()[0].counters
    }
    // The whole GPU consumes all 7 compute slices; the same amount written
    // another way still fits, one milli-unit more does not.
    whole(&mut s).insert("compute-slices".into(), Counter { value: q("7000m") });
    validate_slices(&s, V135).unwrap();
    whole(&mut s).insert("compute-slices".into(), Counter { value: q("7001m") });
    let e = validate_slices(&s, V135).unwrap_err();
    assert_eq!(e.rule(), Rule::CounterOverdraw, "{e}");
    assert_eq!(e.slice(), b[1].metadata.name.as_deref().unwrap(), "{e}");
    assert!(e.to_string().contains("\"gpu-1\""), "{e}");
}

// === rules that change with the Kubernetes version (issue 21) ===

use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use carve_model::slices::{KubeVersion, limits, validate_slices_for_version};
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

/// Good slices of `layout` with MPS and time-slice devices (every device has
/// capacities with a requestPolicy and `allowMultipleAllocations: true`).
fn shared(layout: KubeLayout) -> Vec<ResourceSlice> {
    let gpus: Vec<NodeGpu> = simulated_node("h100-80gb", 1)
        .unwrap()
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect();
    let mut o = SliceOptions::new("node-a", layout);
    o.sharing.mps_caps = Some(MpsCapabilities {
        memory_limit: MemoryLimit::Hard,
        compute_limit: ComputeLimit::Percentage,
    });
    o.sharing.mps = true;
    o.sharing.timeslice = true;
    let s = build_slices(&gpus, &o).unwrap();
    validate_slices(&s, layout).unwrap();
    s
}

/// (slice, device) of the first device named `name`.
fn find(s: &[ResourceSlice], name: &str) -> (usize, usize) {
    for (i, sl) in s.iter().enumerate() {
        if let Some(k) = sl
            .spec
            .devices
            .iter()
            .flatten()
            .position(|d| d.name == name)
        {
            return (i, k);
        }
    }
    panic!("no device {name}")
}

/// Like [`expect`], for one Kubernetes version and given good slices.
fn expect_version(
    version: KubeVersion,
    mut s: Vec<ResourceSlice>,
    f: impl FnOnce(&mut Vec<ResourceSlice>),
    rule: Rule,
    subject: &str,
) {
    validate_slices_for_version(&s, version).unwrap();
    f(&mut s);
    let e = validate_slices_for_version(&s, version)
        .expect_err(&format!("{rule} not detected on {version}"));
    assert_eq!(e.rule(), rule, "{e}");
    let msg = e.to_string();
    assert!(msg.contains(subject), "{msg:?} does not name {subject:?}");
    assert!(
        msg.contains(rule.as_str()),
        "{msg:?} does not name the rule"
    );
}

fn taint(key: &str, value: Option<&str>, effect: &str) -> DeviceTaint {
    DeviceTaint {
        key: key.into(),
        value: value.map(Into::into),
        effect: effect.into(),
        time_added: None,
    }
}

fn with_taint(s: &mut [ResourceSlice], t: DeviceTaint) {
    dev(s, 0, 0).taints = Some(vec![t]);
}

const VERSIONS: [KubeVersion; 3] = [KubeVersion::V1_34, KubeVersion::V1_35, KubeVersion::V1_36];

fn good_for(v: KubeVersion) -> Vec<ResourceSlice> {
    let layout = v.layout().unwrap();
    // The 1.34 helper builds 4 GPUs; its first slice holds devices.
    let mut s = match layout {
        KubeLayout::V134 => v134(),
        KubeLayout::V135Plus => v135(),
    };
    // The 1.35 layout's first slice holds only counters; move the device
    // under test to slice 0 by reordering.
    if layout == KubeLayout::V135Plus {
        s.swap(0, 1);
    }
    s
}

#[test]
fn taint_effect_none_is_refused_on_1_34_only() {
    // upstream validDeviceTaintEffects: 1.34 {NoSchedule, NoExecute}, 1.35+ adds None.
    for v in VERSIONS {
        let mut s = good_for(v);
        with_taint(&mut s, taint("gpu.carve.dev/xid", Some("94"), "None"));
        let r = validate_slices_for_version(&s, v);
        if v == KubeVersion::V1_34 {
            let e = r.expect_err("None accepted on 1.34");
            assert_eq!(e.rule(), Rule::TaintEffect, "{e}");
            let msg = e.to_string();
            assert!(msg.contains("\"None\"") && msg.contains("1.34"), "{msg}");
        } else {
            r.unwrap_or_else(|e| panic!("{v}: {e}"));
        }
        // validate_slices(layout) checks the oldest version of the layout.
        assert_eq!(
            validate_slices(&s, v.layout().unwrap()).is_err(),
            v == KubeVersion::V1_34,
            "{v}"
        );
        for effect in ["NoSchedule", "NoExecute"] {
            let mut s = good_for(v);
            with_taint(&mut s, taint("gpu.carve.dev/xid", Some("79"), effect));
            validate_slices_for_version(&s, v).unwrap_or_else(|e| panic!("{v} {effect}: {e}"));
        }
        // PreferNoSchedule (node taints only), an unknown effect and no effect
        // are refused on every version.
        for (effect, subject) in [
            ("PreferNoSchedule", "PreferNoSchedule"),
            ("Evict", "Evict"),
            ("", "no effect"),
        ] {
            expect_version(
                v,
                good_for(v),
                |s| with_taint(s, taint("gpu.carve.dev/xid", Some("79"), effect)),
                Rule::TaintEffect,
                subject,
            );
        }
    }
}

#[test]
fn taint_key_and_value_are_label_syntax() {
    for v in VERSIONS {
        for bad in [
            "",
            "Bad Key",
            "gpu.carve.dev/",
            "a/b/c",
            "Upper.Domain/x",
            &format!("gpu.carve.dev/{}", "x".repeat(64)),
            &format!("{}/x", "a".repeat(254)),
        ] {
            expect_version(
                v,
                good_for(v),
                |s| with_taint(s, taint(bad, None, "NoSchedule")),
                Rule::TaintKey,
                "taint key",
            );
        }
        for bad in ["-x", "x y", &"x".repeat(64)] {
            expect_version(
                v,
                good_for(v),
                |s| with_taint(s, taint("gpu.carve.dev/xid", Some(bad), "NoSchedule")),
                Rule::TaintValue,
                "value",
            );
        }
        // An empty value and a missing one are both fine.
        for value in [None, Some("")] {
            let mut s = good_for(v);
            with_taint(&mut s, taint("gpu.carve.dev/gpu-lost", value, "NoExecute"));
            validate_slices_for_version(&s, v).unwrap();
        }
    }
}

#[test]
fn request_policy_contents_are_checked_by_validate_slices_alone() {
    for layout in [V134, V135] {
        let good = shared(layout);
        let (i, k) = find(&good, "gpu-0-mps");
        let (ti, tk) = find(&good, "gpu-0-ts");
        let mutate = |f: fn(&mut CapacityRequestPolicy), ts: bool| {
            let mut s = good.clone();
            let (a, b) = if ts { (ti, tk) } else { (i, k) };
            let d = dev(&mut s, a, b);
            let name = d.name.clone();
            let caps = d.capacity.as_mut().unwrap();
            let (cap, c) = caps.iter_mut().next().unwrap();
            let cap = cap.clone();
            f(c.request_policy.as_mut().unwrap());
            (s, name, cap)
        };
        type Case = (fn(&mut CapacityRequestPolicy), bool, &'static str);
        let cases: [Case; 9] = [
            (|p| p.default = None, false, "default is required"),
            (|p| p.default = None, true, "default is required"),
            (
                |p| p.valid_values = Some(vec![q("0")]),
                false,
                "both validValues and validRange",
            ),
            (
                |p| p.valid_values = Some(vec![q("2"), q("1"), q("0")]),
                true,
                "ascending",
            ),
            (
                |p| p.valid_values = Some(vec![q("1")]),
                true,
                "do not contain default",
            ),
            (
                |p| p.valid_values = Some((0..11).map(|n| q(&n.to_string())).collect()),
                true,
                "11 validValues",
            ),
            (
                |p| p.valid_range.as_mut().unwrap().min = q("1000000Ti"),
                false,
                "min",
            ),
            (
                |p| p.valid_range.as_mut().unwrap().step = Some(q("0")),
                false,
                "step",
            ),
            (
                |p| p.valid_range.as_mut().unwrap().max = Some(q("1000000Ti")),
                false,
                "max",
            ),
        ];
        for (f, ts, subject) in cases {
            let (s, device, cap) = mutate(f, ts);
            let e = validate_slices(&s, layout).expect_err(subject);
            assert_eq!(e.rule(), Rule::RequestPolicy, "{e}");
            let msg = e.to_string();
            for part in [subject, device.as_str(), cap.as_str()] {
                assert!(msg.contains(part), "{msg:?} lacks {part:?}");
            }
        }
    }
}

fn selector(
    reqs: Vec<NodeSelectorRequirement>,
    fields: Vec<NodeSelectorRequirement>,
) -> NodeSelector {
    NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: Some(reqs),
            match_fields: Some(fields),
        }],
    }
}

fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
    NodeSelectorRequirement {
        key: key.into(),
        operator: op.into(),
        values: Some(values.iter().map(|v| (*v).to_string()).collect()),
    }
}

#[test]
fn node_selector_term_contents() {
    let on = |sel: NodeSelector| {
        move |s: &mut Vec<ResourceSlice>| {
            for sl in s.iter_mut() {
                sl.spec.node_name = None;
                sl.spec.node_selector = Some(sel.clone());
            }
        }
    };
    // Good selectors pass.
    for sel in [
        selector(
            vec![req("kubernetes.io/hostname", "In", &["node-a"])],
            vec![],
        ),
        selector(
            vec![req("gpu", "Exists", &[]), req("n", "Gt", &["3"])],
            vec![],
        ),
        selector(vec![], vec![req("metadata.name", "In", &["node-a"])]),
    ] {
        let mut s = v135();
        on(sel)(&mut s);
        validate_slices(&s, V135).unwrap();
    }
    let bad = [
        (
            selector(vec![req("k", "In", &[])], vec![]),
            "operator In with 0 values",
        ),
        (
            selector(vec![req("k", "Exists", &["x"])], vec![]),
            "operator Exists with 1 values",
        ),
        (
            selector(vec![req("k", "Gt", &["1", "2"])], vec![]),
            "operator Gt with 2 values",
        ),
        (
            selector(vec![req("k", "Near", &["x"])], vec![]),
            "\"Near\" is not a valid selector operator",
        ),
        (
            selector(vec![req("Bad Key", "In", &["x"])], vec![]),
            "key \"Bad Key\"",
        ),
        (
            selector(vec![req("k", "In", &["-x"])], vec![]),
            "value \"-x\"",
        ),
        (
            selector(vec![], vec![req("metadata.uid", "In", &["x"])]),
            "not a valid field selector key",
        ),
        (
            selector(vec![], vec![req("metadata.name", "In", &["a", "b"])]),
            "exactly one value",
        ),
        (
            selector(vec![], vec![req("metadata.name", "Exists", &[])]),
            "matchFields operator",
        ),
        (
            selector(vec![], vec![req("metadata.name", "In", &["Node_A"])]),
            "not a node name",
        ),
    ];
    for (sel, subject) in bad {
        expect(V135, on(sel), Rule::NodeSelection, 0, subject);
    }
}

fn list_attr() -> DeviceAttribute {
    DeviceAttribute {
        strings: Some(vec!["a".into(), "b".into()]),
        ..Default::default()
    }
}

#[test]
fn list_attributes_exist_from_1_36_with_48_values_per_device() {
    // 1.34 and 1.35 do not know list-type attributes.
    for v in [KubeVersion::V1_34, KubeVersion::V1_35] {
        expect_version(
            v,
            good_for(v),
            |s| {
                attrs(dev(s, 0, 0)).insert("pcieRoots".into(), list_attr());
            },
            Rule::ListAttribute,
            "1.36+",
        );
    }
    let v = KubeVersion::V1_36;
    let mut s = good_for(v);
    attrs(dev(&mut s, 0, 0)).insert("pcieRoots".into(), list_attr());
    validate_slices_for_version(&s, v).unwrap();
    expect_version(
        v,
        good_for(v),
        |s| {
            attrs(dev(s, 0, 0)).insert(
                "pcieRoots".into(),
                DeviceAttribute {
                    ints: Some(vec![]),
                    ..Default::default()
                },
            );
        },
        Rule::ListAttribute,
        "empty list",
    );
    // Upstream ResourceSliceMaxAttributeValuesPerDevice = 48, list items counted.
    let scalars = good_for(v)[0].spec.devices.as_ref().unwrap()[0]
        .attributes
        .as_ref()
        .unwrap()
        .len();
    let room = limits::ATTRIBUTE_VALUES_PER_DEVICE - scalars;
    let fill = |n: usize| DeviceAttribute {
        ints: Some((0..n as i64).collect()),
        ..Default::default()
    };
    let mut s = good_for(v);
    attrs(dev(&mut s, 0, 0)).insert("many".into(), fill(room));
    validate_slices_for_version(&s, v).unwrap();
    expect_version(
        v,
        good_for(v),
        |s| {
            attrs(dev(s, 0, 0)).insert("many".into(), fill(room + 1));
        },
        Rule::AttributeValueCount,
        "49 attribute values",
    );
    // A slice with a list attribute holds at most 64 devices (1.36
    // ResourceSliceMaxDevicesWithAdvancedFeatures), even without counters.
    let mut s = good_for(v);
    for sl in s.iter_mut() {
        for d in sl.spec.devices.iter_mut().flatten() {
            d.consumes_counters = None;
        }
        sl.spec.shared_counters = None;
    }
    s.retain(|sl| sl.spec.devices.is_some());
    for sl in s.iter_mut() {
        sl.spec.pool.resource_slice_count = 1;
    }
    let ds = s[0].spec.devices.as_mut().unwrap();
    let template = ds[0].clone();
    while ds.len() < 65 {
        let mut d = template.clone();
        d.name = format!("extra-{}", ds.len());
        ds.push(d);
    }
    validate_slices_for_version(&s, v).unwrap();
    attrs(dev(&mut s, 0, 0)).insert("pcieRoots".into(), list_attr());
    let e = validate_slices_for_version(&s, v).unwrap_err();
    assert_eq!(e.rule(), Rule::DevicesPerSlice, "{e}");
}
