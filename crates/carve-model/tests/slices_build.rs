//! ResourceSlice building: every model, GPU count and layout; names, counters,
//! order, static and non-MIG GPUs, and errors that leave nothing half-built.

use std::collections::{BTreeMap, BTreeSet};

use carve_model::geometry::{Instance, Occupancy, layouts};
use carve_model::order::{DeviceOrder, node_device_order};
use carve_model::slices::{
    GpuPolicy, KubeLayout, MAX_SIMULATED_GPUS, NodeGpu, Rule, SliceError, SliceOptions,
    build_slices, consumption_fits, counter_set_name, device_order, parse_gpu_spec, simulated_gpus,
    simulated_node, summarize, validate_slices,
};
use carve_model::{DeviceName, GpuSpec, MODELS, PhysicalGpu};
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};

const LAYOUTS: [KubeLayout; 2] = [KubeLayout::V134, KubeLayout::V135Plus];

fn dynamic(gpus: Vec<PhysicalGpu>) -> Vec<NodeGpu> {
    gpus.into_iter().map(NodeGpu::dynamic).collect()
}

fn node(model: &str, n: u32) -> Vec<NodeGpu> {
    dynamic(simulated_node(model, n).unwrap())
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

fn attr_str<'a>(d: &'a Device, k: &str) -> Option<&'a str> {
    d.attributes.as_ref()?.get(k)?.string.as_deref()
}

fn attr_int(d: &Device, k: &str) -> Option<i64> {
    d.attributes.as_ref()?.get(k)?.int
}

/// The device of `spec`'s profile at `start` on GPU `gpu`.
fn mig_device<'a>(all: &[&'a Device], gpu: u32, spec: &GpuSpec, inst: Instance) -> &'a Device {
    let name = DeviceName::mig(gpu, &spec.profiles[inst.profile].name, inst.start)
        .unwrap()
        .to_string();
    all.iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no {name}"))
}

#[test]
fn every_model_count_and_layout_builds_and_validates() {
    for m in MODELS {
        let spec = m.spec();
        let placements: usize = spec.profiles.iter().map(|p| p.placements.len()).sum();
        for n in [1u32, 2, 4, 8] {
            for layout in LAYOUTS {
                let gpus = node(m.key, n);
                let opts = SliceOptions::new("node-a", layout);
                let slices = build_slices(&gpus, &opts)
                    .unwrap_or_else(|e| panic!("{} x{n} {layout:?}: {e:?}", m.key));
                validate_slices(&slices, layout).unwrap();
                let all = devices(&slices);
                assert_eq!(all.len(), n as usize * (placements + 1), "{} x{n}", m.key);
                for i in 0..n {
                    let on_gpu = all
                        .iter()
                        .filter(|d| d.name.parse::<DeviceName>().unwrap().gpu() == i)
                        .count();
                    assert_eq!(on_gpu, placements + 1, "{} gpu {i}", m.key);
                }
                let expected_sets = if spec.mig_capable { n as usize } else { 0 };
                assert_eq!(sets(&slices).len(), expected_sets);
                for s in &slices {
                    assert_eq!(s.spec.pool.resource_slice_count, slices.len() as i64);
                    assert_eq!(s.spec.pool.name, "node-a");
                    assert_eq!(s.spec.node_name.as_deref(), Some("node-a"));
                    assert_eq!(s.spec.driver, "gpu.carve.dev");
                    if layout == KubeLayout::V135Plus {
                        assert!(s.spec.devices.is_none() || s.spec.shared_counters.is_none());
                    }
                    let labels = s.metadata.labels.as_ref().unwrap();
                    assert_eq!(labels["app.kubernetes.io/managed-by"], "carve");
                    assert_eq!(labels["gpu.carve.dev/node"], "node-a");
                }
                // Name order is publish order.
                let names: Vec<_> = slices
                    .iter()
                    .map(|s| s.metadata.name.clone().unwrap())
                    .collect();
                let mut sorted = names.clone();
                sorted.sort();
                assert_eq!(names, sorted);
            }
        }
    }
}

#[test]
fn v135_puts_counters_in_their_own_slices_of_at_most_eight() {
    let slices = build_slices(
        &node("h100-80gb", 9),
        &SliceOptions::new("n1", KubeLayout::V135Plus),
    )
    .unwrap();
    let names: Vec<_> = slices
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    // 9 sets -> 2 counter slices; 9 x 26 = 234 devices -> 4 device slices.
    assert_eq!(
        names,
        [
            "n1-gpu.carve.dev-counters-0",
            "n1-gpu.carve.dev-counters-1",
            "n1-gpu.carve.dev-devices-00",
            "n1-gpu.carve.dev-devices-01",
            "n1-gpu.carve.dev-devices-02",
            "n1-gpu.carve.dev-devices-03",
        ]
    );
    assert_eq!(slices[0].spec.shared_counters.as_ref().unwrap().len(), 8);
    assert!(slices[0].spec.devices.is_none());
    assert_eq!(slices[2].spec.devices.as_ref().unwrap().len(), 64);
    assert!(slices[2].spec.shared_counters.is_none());
    // The JSON has no "devices" key at all on a counter slice.
    let json = serde_json::to_value(&slices[0]).unwrap();
    assert!(json["spec"].get("devices").is_none(), "{json}");
}

#[test]
fn v134_keeps_each_gpu_with_its_counters_within_the_limits() {
    let slices = build_slices(
        &node("h100-80gb", 4),
        &SliceOptions::new("n1", KubeLayout::V134),
    )
    .unwrap();
    // 15 counters per H100 set, 32 per 1.34 slice: two GPUs per slice.
    assert_eq!(slices.len(), 2);
    for s in &slices {
        let sets = s.spec.shared_counters.as_ref().unwrap();
        assert_eq!(sets.len(), 2);
        for d in s.spec.devices.as_ref().unwrap() {
            let used = &d.consumes_counters.as_ref().unwrap()[0].counter_set;
            assert!(sets.iter().any(|set| &set.name == used));
        }
    }
    // A30 sets have 11 counters: also two GPUs per slice (three would be 33).
    let slices = build_slices(&node("a30", 4), &SliceOptions::new("n1", KubeLayout::V134)).unwrap();
    assert_eq!(slices.len(), 2);
    // Mixed node: L4s (no counters) group with the A30s while limits hold.
    let mut gpus = simulated_gpus(&[("a30".into(), 1), ("l4".into(), 3)]).unwrap();
    gpus.reverse();
    let slices = build_slices(&dynamic(gpus), &SliceOptions::new("n1", KubeLayout::V134)).unwrap();
    assert_eq!(slices.len(), 1);
    validate_slices(&slices, KubeLayout::V134).unwrap();
}

#[test]
fn counter_sets_follow_the_hardware() {
    let slices = build_slices(
        &node("h100-80gb", 1),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    let set = &sets(&slices)["gpu-0-counters"];
    let got: BTreeMap<&str, &str> = set
        .counters
        .iter()
        .map(|(k, v)| (k.as_str(), v.value.0.as_str()))
        .collect();
    let mut want: BTreeMap<&str, &str> = (0..8)
        .map(|k| {
            (
                [
                    "memory-slice-0",
                    "memory-slice-1",
                    "memory-slice-2",
                    "memory-slice-3",
                    "memory-slice-4",
                    "memory-slice-5",
                    "memory-slice-6",
                    "memory-slice-7",
                ][k],
                "1",
            )
        })
        .collect();
    want.extend([
        ("compute-slices", "7"),
        ("multiprocessors", "132"),
        ("memory", "81559Mi"),
        ("copy-engines", "8"),
        ("decoders", "7"),
        ("jpeg-engines", "7"),
        ("ofa-engines", "1"),
    ]);
    // No encoders on H100: a zero counter is omitted.
    assert_eq!(got, want);
    let a30 = build_slices(
        &node("a30", 1),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    let set = &sets(&a30)["gpu-0-counters"];
    assert_eq!(
        set.counters
            .keys()
            .filter(|k| k.starts_with("memory-slice-"))
            .count(),
        4
    );
    assert_eq!(set.counters["compute-slices"].value.0, "4");
}

#[test]
fn device_names_parse_back_to_what_they_consume() {
    for m in MODELS.iter().filter(|m| m.spec().mig_capable) {
        let spec = m.spec();
        let slices = build_slices(
            &node(m.key, 2),
            &SliceOptions::new("n", KubeLayout::V135Plus),
        )
        .unwrap();
        for d in devices(&slices) {
            let name: DeviceName = d.name.parse().unwrap();
            let cc = &d.consumes_counters.as_ref().unwrap()[0];
            assert_eq!(cc.counter_set, counter_set_name(name.gpu()));
            assert_eq!(attr_int(d, "index"), Some(i64::from(name.gpu())));
            let slices_used: BTreeSet<u8> = cc
                .counters
                .keys()
                .filter_map(|k| k.strip_prefix("memory-slice-"))
                .map(|k| k.parse().unwrap())
                .collect();
            match name.mig_placement() {
                Some((profile, start)) => {
                    let p = spec.profile(&profile).unwrap();
                    assert_eq!(attr_str(d, "profile"), Some(profile.as_str()));
                    assert_eq!(attr_str(d, "type"), Some("mig"));
                    assert_eq!(attr_int(d, "placementStart"), Some(i64::from(start)));
                    assert_eq!(
                        attr_int(d, "memorySlices"),
                        Some(i64::from(p.memory_slices))
                    );
                    assert_eq!(slices_used, (start..start + p.memory_slices).collect());
                    assert_eq!(
                        cc.counters["compute-slices"].value.0,
                        p.compute_slices.to_string()
                    );
                    assert_eq!(cc.counters["memory"].value.0, format!("{}Mi", p.memory_mib));
                    assert_eq!(
                        d.capacity.as_ref().unwrap()["memory"].value.0,
                        format!("{}Mi", p.memory_mib)
                    );
                    assert!(attr_str(d, "parentUUID").is_some());
                    assert!(attr_str(d, "uuid").is_none());
                }
                None => {
                    assert_eq!(attr_str(d, "type"), Some("gpu"));
                    assert_eq!(slices_used.len(), usize::from(spec.memory_slices));
                    assert!(attr_str(d, "uuid").unwrap().starts_with("GPU-"));
                    // The whole GPU consumes every counter fully.
                    let set = &sets(&slices)[&cc.counter_set];
                    assert_eq!(cc.counters, set.counters);
                }
            }
        }
    }
}

#[test]
fn attributes_are_complete_and_versions_semver() {
    let slices = build_slices(
        &node("h100-80gb", 1),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    let all = devices(&slices);
    let whole = all.iter().find(|d| d.name == "gpu-0").unwrap();
    let a = whole.attributes.as_ref().unwrap();
    assert_eq!(a["driverVersion"].version.as_deref(), Some("580.65.6"));
    assert_eq!(a["cudaComputeCapability"].version.as_deref(), Some("9.0.0"));
    assert_eq!(
        a["productName"].string.as_deref(),
        Some("NVIDIA H100 80GB HBM3")
    );
    assert_eq!(a["architecture"].string.as_deref(), Some("Hopper"));
    assert_eq!(a["migCapable"].bool, Some(true));
    assert_eq!(a["minor"].int, Some(0));
    assert_eq!(a["computeSlices"].int, Some(7));
    assert!(
        a["resource.kubernetes.io/pciBusID"]
            .string
            .as_deref()
            .unwrap()
            .ends_with(":00.0")
    );
    assert!(
        a["resource.kubernetes.io/pcieRoot"]
            .string
            .as_deref()
            .unwrap()
            .starts_with("pci")
    );
    assert_eq!(
        whole.capacity.as_ref().unwrap()["multiprocessors"].value.0,
        "132"
    );
    let mig = all
        .iter()
        .find(|d| d.name == "gpu-0-mig-1g10gbme-3")
        .unwrap();
    assert_eq!(attr_str(mig, "profile"), Some("1g.10gb+me"));
    assert_eq!(attr_str(mig, "parentUUID"), attr_str(whole, "uuid"));
}

#[test]
fn every_hardware_layout_fits_the_counters_and_forbidden_ones_do_not() {
    for m in MODELS.iter().filter(|m| m.spec().mig_capable) {
        let spec = m.spec();
        let slices = build_slices(
            &node(m.key, 1),
            &SliceOptions::new("n", KubeLayout::V135Plus),
        )
        .unwrap();
        let all = devices(&slices);
        let set = &sets(&slices)["gpu-0-counters"];
        for l in layouts(&spec) {
            let ds: Vec<&Device> = l.iter().map(|&i| mig_device(&all, 0, &spec, i)).collect();
            assert!(consumption_fits(set, &ds).unwrap(), "{}: {l:?}", m.key);
        }
        let whole = all.iter().find(|d| d.name == "gpu-0").copied().unwrap();
        assert!(consumption_fits(set, &[whole]).unwrap());
        let idx = |suffix: &str| spec.profiles.iter().position(|p| p.name.ends_with(suffix));
        let small = Instance {
            profile: 0,
            start: 0,
        };
        // Overlap: two instances on memory slice 0.
        let big = Instance {
            profile: spec.profiles.len() - 1,
            start: 0,
        };
        let pair = [
            mig_device(&all, 0, &spec, small),
            mig_device(&all, 0, &spec, big),
        ];
        assert!(Occupancy::with(&spec, &[small, big]).is_err());
        assert!(
            !consumption_fits(set, &pair).unwrap(),
            "{}: overlap fits",
            m.key
        );
        // Whole GPU plus anything.
        assert!(!consumption_fits(set, &[whole, pair[0]]).unwrap());
        // Two media-extension instances on disjoint slices.
        let me = idx("+me").unwrap();
        let last = spec.profiles[me].placements.last().unwrap().start;
        let two_me = [
            mig_device(
                &all,
                0,
                &spec,
                Instance {
                    profile: me,
                    start: 0,
                },
            ),
            mig_device(
                &all,
                0,
                &spec,
                Instance {
                    profile: me,
                    start: last,
                },
            ),
        ];
        assert!(
            !consumption_fits(set, &two_me).unwrap(),
            "{}: two +me fit",
            m.key
        );
    }
}

#[test]
fn device_order_is_profile_major_then_the_policy() {
    let gpus = node("h100-80gb", 2);
    let names = |order| -> Vec<String> {
        device_order(&gpus, order)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    let first_fit = names(DeviceOrder::FirstFit);
    assert_eq!(first_fit.len(), 52);
    assert_eq!(
        &first_fit[..8],
        [
            "gpu-0-mig-1g10gb-0",
            "gpu-0-mig-1g10gb-1",
            "gpu-0-mig-1g10gb-2",
            "gpu-0-mig-1g10gb-3",
            "gpu-0-mig-1g10gb-4",
            "gpu-0-mig-1g10gb-5",
            "gpu-0-mig-1g10gb-6",
            "gpu-1-mig-1g10gb-0",
        ]
    );
    assert_eq!(first_fit[14], "gpu-0-mig-1g10gbme-0");
    assert_eq!(&first_fit[50..], ["gpu-0", "gpu-1"]);
    // 1g.20gb (2 memory slices, 1 compute) before 2g.20gb (2, 2); 7g last MIG.
    let pos = |n: &str| first_fit.iter().position(|x| x == n).unwrap();
    assert!(pos("gpu-1-mig-1g20gb-6") < pos("gpu-0-mig-2g20gb-0"));
    assert_eq!(first_fit[49], "gpu-1-mig-7g80gb-0");

    // Within each profile, every policy publishes exactly the order module's
    // node order.
    let spec = &gpus[0].gpu.spec;
    for order in [DeviceOrder::FirstFit, DeviceOrder::Carve, DeviceOrder::Name] {
        let all = device_order(&gpus, order).unwrap();
        for (pi, p) in spec.profiles.iter().enumerate() {
            let got: Vec<(u32, u8)> = all
                .iter()
                .filter_map(|n| match n.mig_placement() {
                    Some((prof, start)) if prof == p.name => Some((n.gpu(), start)),
                    _ => None,
                })
                .collect();
            assert_eq!(
                got,
                node_device_order(spec, 2, pi, order),
                "{order:?} {}",
                p.name
            );
        }
    }

    // Carve keeps the profile-major grouping and the same devices; the first
    // small partition avoids memory slice 0.
    let carve = names(DeviceOrder::Carve);
    assert!(carve[0].starts_with("gpu-0-mig-1g10gb-"));
    assert_ne!(carve[0], "gpu-0-mig-1g10gb-0");
    assert_eq!(&carve[50..], ["gpu-0", "gpu-1"]);
    assert_eq!(
        carve.iter().collect::<BTreeSet<_>>(),
        first_fit.iter().collect::<BTreeSet<_>>()
    );

    // Name: string order, whole GPU first on each GPU.
    let by_name = names(DeviceOrder::Name);
    assert_eq!(by_name[0], "gpu-0");
    let mut sorted = by_name.clone();
    sorted.sort();
    assert_eq!(by_name, sorted);

    // Slices publish devices in this order.
    let slices = build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)).unwrap();
    let published: Vec<String> = devices(&slices).iter().map(|d| d.name.clone()).collect();
    assert_eq!(published, carve);
}

#[test]
fn static_gpus_publish_only_their_instances() {
    let mut gpus = node("h100-80gb", 3);
    gpus[0].policy = GpuPolicy::Static {
        instances: vec![
            ("3g.40gb".into(), 4),
            ("1g.10gb".into(), 0),
            ("2g.20gb".into(), 2),
        ],
    };
    gpus[1].policy = GpuPolicy::Static { instances: vec![] };
    for layout in LAYOUTS {
        let slices = build_slices(&gpus, &SliceOptions::new("n", layout)).unwrap();
        let names: BTreeSet<String> = devices(&slices).iter().map(|d| d.name.clone()).collect();
        let on = |g: &str| {
            names
                .iter()
                .filter(|n| n.starts_with(g))
                .cloned()
                .collect::<BTreeSet<_>>()
        };
        assert_eq!(
            on("gpu-0"),
            [
                "gpu-0-mig-1g10gb-0",
                "gpu-0-mig-2g20gb-2",
                "gpu-0-mig-3g40gb-4"
            ]
            .map(String::from)
            .into()
        );
        assert_eq!(on("gpu-1"), ["gpu-1".to_string()].into());
        assert_eq!(on("gpu-2").len(), 26);
        // Static instances still consume the GPU's counter set.
        assert_eq!(sets(&slices).len(), 3);
        validate_slices(&slices, layout).unwrap();
    }
}

#[test]
fn non_mig_gpu_publishes_only_the_whole_device_without_counters() {
    let slices = build_slices(
        &node("l4", 2),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    assert_eq!(slices.len(), 1);
    assert!(slices[0].spec.shared_counters.is_none());
    let all = devices(&slices);
    assert_eq!(
        all.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["gpu-0", "gpu-1"]
    );
    for d in all {
        assert!(d.consumes_counters.is_none());
        assert_eq!(
            d.attributes.as_ref().unwrap()["migCapable"].bool,
            Some(false)
        );
        assert!(
            d.attributes
                .as_ref()
                .unwrap()
                .get("computeSlices")
                .is_none()
        );
    }
    let mut gpus = node("l4", 1);
    gpus[0].policy = GpuPolicy::Static {
        instances: vec![("1g.10gb".into(), 0)],
    };
    assert!(matches!(
        build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)),
        Err(SliceError::StaticOnNonMig { gpu: 0, .. })
    ));
}

#[test]
fn bad_input_fails_naming_gpu_profile_or_field() {
    let opts = SliceOptions::new("n", KubeLayout::V135Plus);
    let mut gpus = node("h100-80gb", 2);
    gpus[1].policy = GpuPolicy::Static {
        instances: vec![("5g.50gb".into(), 0)],
    };
    let e = build_slices(&gpus, &opts).unwrap_err();
    assert!(
        matches!(&e, SliceError::UnknownProfile { gpu: 1, profile, .. } if profile == "5g.50gb")
    );
    assert!(
        e.to_string().contains("1g.10gb"),
        "lists known profiles: {e}"
    );

    gpus[1].policy = GpuPolicy::Static {
        instances: vec![("4g.40gb".into(), 0), ("1g.10gb".into(), 2)],
    };
    let e = build_slices(&gpus, &opts).unwrap_err();
    assert!(
        matches!(&e, SliceError::StaticConflict { gpu: 1, start: 2, profile, .. } if profile == "1g.10gb"),
        "{e:?}"
    );

    let mut gpus = node("h100-80gb", 2);
    gpus[1].gpu.index = 0;
    assert!(matches!(
        build_slices(&gpus, &opts),
        Err(SliceError::DuplicateGpu { index: 0 })
    ));

    let mut gpus = node("h100-80gb", 1);
    gpus[0].gpu.spec.profiles[2].placements.clear();
    let e = build_slices(&gpus, &opts).unwrap_err();
    assert!(matches!(e, SliceError::Spec { gpu: 0, .. }));
    assert!(
        std::error::Error::source(&e)
            .unwrap()
            .to_string()
            .contains("1g.20gb")
    );

    let mut gpus = node("h100-80gb", 1);
    gpus[0].gpu.driver_version = "580.beta".into();
    assert!(matches!(
        build_slices(&gpus, &opts),
        Err(SliceError::BadVersion {
            gpu: 0,
            attribute: "driverVersion",
            ..
        })
    ));
    let mut gpus = node("h100-80gb", 1);
    gpus[0].gpu.uuid = format!("GPU-{}", "f".repeat(70));
    assert!(matches!(
        build_slices(&gpus, &opts),
        Err(SliceError::AttributeTooLong {
            gpu: 0,
            attribute: "uuid",
            ..
        })
    ));

    let gpus = node("h100-80gb", 1);
    for (field, mutate) in [
        (
            "node_name",
            Box::new(|o: &mut SliceOptions| o.node_name = "Bad Node".into())
                as Box<dyn Fn(&mut SliceOptions)>,
        ),
        (
            "driver",
            Box::new(|o: &mut SliceOptions| o.driver = "x".repeat(64)),
        ),
        (
            "pool",
            Box::new(|o: &mut SliceOptions| o.pool = "a//b".into()),
        ),
        (
            "generation",
            Box::new(|o: &mut SliceOptions| o.generation = -1),
        ),
    ] {
        let mut o = opts.clone();
        mutate(&mut o);
        match build_slices(&gpus, &o) {
            Err(SliceError::InvalidOption { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
}

#[test]
fn media_counter_is_added_when_engines_cannot_keep_me_exclusive() {
    // A GPU whose `+me` profile reports no OFA engine: the engine counters alone
    // would let two `+me` instances fit, so a media-extensions counter appears.
    let mut gpus = node("h100-80gb", 1);
    let spec = &mut gpus[0].gpu.spec;
    let me = spec
        .profiles
        .iter()
        .position(|p| p.media_extensions)
        .unwrap();
    spec.profiles[me].engines.ofa = 0;
    let slices = build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)).unwrap();
    let set = &sets(&slices)["gpu-0-counters"];
    assert_eq!(set.counters["media-extensions"].value.0, "1");
    let all = devices(&slices);
    let spec = &gpus[0].gpu.spec;
    let two = [
        mig_device(
            &all,
            0,
            spec,
            Instance {
                profile: me,
                start: 0,
            },
        ),
        mig_device(
            &all,
            0,
            spec,
            Instance {
                profile: me,
                start: 6,
            },
        ),
    ];
    assert!(!consumption_fits(set, &two).unwrap());
    let plain = build_slices(
        &node("h100-80gb", 1),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    assert!(
        !sets(&plain)["gpu-0-counters"]
            .counters
            .contains_key("media-extensions")
    );
}

#[test]
fn limits_a_single_gpu_breaks_are_reported_for_that_gpu() {
    // 1.34 keeps a GPU's devices in one slice: a GPU with more than 64 placements
    // cannot be published there, but can on 1.35+.
    let mut gpus = node("h100-80gb", 2);
    let spec = &mut gpus[1].gpu.spec;
    // 40 more whole-GPU-sized profiles: one placement each, so cheap layouts.
    let base = spec.profiles.last().unwrap().clone();
    for k in 0..40u32 {
        let mut p = base.clone();
        p.name = format!("7g.{}gb", 100 + k);
        p.id = 100 + k;
        p.index = 100 + k;
        spec.profiles.push(p);
    }
    match build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V134)) {
        Err(SliceError::Limit {
            gpu: 1,
            rule: Rule::DevicesPerSlice,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let ok = build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)).unwrap();
    assert_eq!(devices(&ok).len(), 26 + 66);
}

#[test]
fn generation_pool_and_long_node_names() {
    let node_name = format!("{}.example.com", "very-long-node-name".repeat(12));
    let mut opts = SliceOptions::new(&node_name, KubeLayout::V135Plus);
    opts.generation = 7;
    opts.pool = "pool-a/sub".into();
    let slices = build_slices(&node("a100-80gb", 2), &opts).unwrap();
    for s in &slices {
        let name = s.metadata.name.as_deref().unwrap();
        assert!(name.len() <= 253, "{name}");
        assert_eq!(s.spec.pool.generation, 7);
        assert_eq!(s.spec.pool.name, "pool-a/sub");
        assert_eq!(s.spec.node_name.as_deref(), Some(node_name.as_str()));
        let label = &s.metadata.labels.as_ref().unwrap()["gpu.carve.dev/node"];
        assert!(label.len() <= 63);
    }
}

#[test]
fn no_gpus_no_slices() {
    assert!(
        build_slices(&[], &SliceOptions::new("n", KubeLayout::V135Plus))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn summary_counts_devices_per_profile_and_counter_set() {
    let gpus = dynamic(simulated_gpus(&parse_gpu_spec("h100:2,l4").unwrap()).unwrap());
    let slices = build_slices(&gpus, &SliceOptions::new("n", KubeLayout::V135Plus)).unwrap();
    let sum = summarize(&slices);
    assert_eq!(sum.len(), 3);
    assert_eq!(sum[0].gpu, Some(0));
    assert_eq!(sum[0].counter_set.as_deref(), Some("gpu-0-counters"));
    assert_eq!(sum[0].counters["memory"], "81559Mi");
    assert_eq!(sum[0].devices["1g.10gb"], 7);
    assert_eq!(sum[0].devices["3g.40gb"], 2);
    assert_eq!(sum[0].devices["gpu"], 1);
    assert_eq!(sum[1].gpu, Some(1));
    assert_eq!(sum[2].gpu, Some(2));
    assert_eq!(sum[2].counter_set, None);
    assert_eq!(sum[2].devices["gpu"], 1);
}

#[test]
fn gpu_lists_parse_and_simulated_gpus_are_stable() {
    assert_eq!(
        parse_gpu_spec("h100-80gb:8").unwrap(),
        [("h100-80gb".to_string(), 8)]
    );
    assert_eq!(
        parse_gpu_spec("a100:2, H200:1,l4").unwrap(),
        [
            ("a100-40gb".to_string(), 2),
            ("h200-141gb".to_string(), 1),
            ("l4-24gb".to_string(), 1)
        ]
    );
    for bad in ["", "h100:0", "h100:x", ":3", "h100:-1"] {
        assert!(
            matches!(parse_gpu_spec(bad), Err(SliceError::GpuListSyntax { .. })),
            "{bad:?}"
        );
    }
    // At most MAX_SIMULATED_GPUS in all, models summed; the error names the
    // list, the total and the limit.
    assert_eq!(MAX_SIMULATED_GPUS, 64);
    assert_eq!(parse_gpu_spec("h100:32,a100:32").unwrap().len(), 2);
    for (bad, total) in [
        ("h100:65", 65),
        ("h100:32,a100:33", 65),
        ("h100:100000", 100_000),
        ("h100:4294967295,l4:4294967295", 2 * u64::from(u32::MAX)),
    ] {
        let e = parse_gpu_spec(bad).unwrap_err();
        assert!(
            matches!(&e, SliceError::TooManyGpus { input, total: t, max: 64 } if input == bad && *t == total),
            "{bad}: {e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains(bad) && text.contains(&total.to_string()) && text.contains("64"),
            "{text}"
        );
    }
    let e = parse_gpu_spec("v100:2").unwrap_err();
    assert!(matches!(&e, SliceError::UnknownModel { model, .. } if model == "v100"));
    assert!(e.to_string().contains("h100-80gb"), "{e}");
    assert!(simulated_node("v100", 1).is_err());

    let a = simulated_node("h100-80gb", 16).unwrap();
    let b = simulated_node("h100-80gb", 16).unwrap();
    assert_eq!(a, b);
    let uuids: BTreeSet<_> = a.iter().map(|g| g.uuid.clone()).collect();
    let buses: BTreeSet<_> = a.iter().map(|g| g.pci_bus_id.clone().unwrap()).collect();
    assert_eq!((uuids.len(), buses.len()), (16, 16));
    assert!(
        a.iter()
            .all(|g| g.uuid.starts_with("GPU-") && g.uuid.len() == 40)
    );
    assert_eq!(a[3].index, 3);
    assert_eq!(a[0].driver_version, "580.65.06");
}

#[test]
fn validation_failure_of_built_slices_is_an_error_not_output() {
    // Mutating a good build shows validate_slices rejects what build would
    // never return: build_slices ends with the same check.
    let mut slices = build_slices(
        &node("a30", 1),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    slices.pop();
    assert_eq!(
        validate_slices(&slices, KubeLayout::V135Plus)
            .unwrap_err()
            .rule(),
        Rule::SliceCount
    );
}

#[test]
fn a_gpu_locked_in_mig_mode_publishes_no_whole_device_in_any_form() {
    use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
    let mut gpus = dynamic(simulated_gpus(&[("a100-40gb".to_string(), 3)]).unwrap());
    gpus[0].mig_locked = true;
    gpus[1].mig_locked = true;
    gpus[1].policy = GpuPolicy::Static {
        instances: vec![("3g.20gb".into(), 4)],
    };
    gpus[2].policy = GpuPolicy::Static { instances: vec![] };
    let reference = build_slices(
        &dynamic(simulated_node("a100-40gb", 1).unwrap()),
        &SliceOptions::new("n", KubeLayout::V135Plus),
    )
    .unwrap();
    let placements = devices(&reference)
        .iter()
        .filter(|d| d.name.starts_with("gpu-0-mig-"))
        .count();
    for layout in LAYOUTS {
        let mut o = SliceOptions::new("n", layout);
        o.sharing.mps_caps = Some(MpsCapabilities {
            memory_limit: MemoryLimit::Hard,
            compute_limit: ComputeLimit::Percentage,
        });
        o.sharing.mps = true;
        o.sharing.timeslice = true;
        let slices = build_slices(&gpus, &o).unwrap();
        validate_slices(&slices, layout).unwrap();
        let names: Vec<&str> = devices(&slices).iter().map(|d| d.name.as_str()).collect();
        let on = |g: &str| {
            names
                .iter()
                .filter(|n| n.starts_with(&format!("{g}-")) || **n == g)
                .copied()
                .collect::<Vec<_>>()
        };
        // Dynamic and locked: every placement, no gpu-0 / gpu-0-mps / gpu-0-ts.
        let g0 = on("gpu-0");
        assert_eq!(g0.len(), placements, "{g0:?}");
        assert!(g0.iter().all(|n| n.starts_with("gpu-0-mig-")), "{g0:?}");
        // Static and locked: only its instance.
        assert_eq!(on("gpu-1"), ["gpu-1-mig-3g20gb-4"]);
        // Not locked, static without instances: the whole GPU and its sharing forms.
        let mut g2 = on("gpu-2");
        g2.sort_unstable();
        assert_eq!(g2, ["gpu-2", "gpu-2-mps", "gpu-2-ts"]);
        // The locked GPUs keep their counter sets (their placements consume them).
        assert_eq!(sets(&slices).len(), 3);
    }
}

#[test]
fn counters_kept_between_builds_follow_the_spec_not_the_product() {
    // A build keeps each spec's counters for later builds of this process: a
    // spec that differs only in its numbers (same product name) must not get
    // the first one's counters.
    let opts = SliceOptions::new("n", KubeLayout::V135Plus);
    let memory = |gpus: &[NodeGpu]| {
        let slices = build_slices(gpus, &opts).unwrap();
        sets(&slices)["gpu-0-counters"].counters["memory"]
            .value
            .0
            .clone()
    };
    let stock = node("h100-80gb", 1);
    let mut smaller = stock.clone();
    // Every profile and the whole GPU 1 GiB smaller: every layout's total
    // memory changes, so the counter must.
    let spec = &mut smaller[0].gpu.spec;
    spec.memory_mib -= 1024;
    for p in &mut spec.profiles {
        p.memory_mib -= 1024;
    }
    let (a, b, again) = (memory(&stock), memory(&smaller), memory(&stock));
    assert_ne!(a, b);
    assert_eq!(a, again);
}
