//! Table tests of the allocation semantics, with hand-worked expected results.

mod common;

use carve_alloc::{AllocError, Allocator, Inputs, Reason};
use common::*;
use k8s_openapi::api::resource::v1::ResourceClaim;

/// A claim named `name` in namespace `default` with the given `spec.devices` body.
fn claim_of(name: &str, devices: &str) -> ResourceClaim {
    let indented: String = devices.lines().map(|l| format!("    {l}\n")).collect();
    claim(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: default, uid: uid-{name}}}\nspec:\n  devices:\n{indented}"
    ))
}

fn one(class: &str, extra: &str) -> String {
    format!("requests:\n- name: r\n  exactly:\n    deviceClassName: {class}\n{extra}")
}

fn setup(files: &[&str]) -> Inputs {
    let mut paths: Vec<_> = files.iter().map(|f| fixture(f)).collect();
    paths.push(fixture("classes.yaml"));
    inputs(&paths, "").0
}

fn unsat(
    r: Result<k8s_openapi::api::resource::v1::AllocationResult, AllocError>,
) -> carve_alloc::Explanation {
    match r {
        Err(AllocError::Unsatisfiable(e)) => *e,
        other => panic!("expected Unsatisfiable, got {other:?}"),
    }
}

#[test]
fn overlapping_partitions_exclude_each_other_in_both_layouts() {
    for layout in ["partitions-135.yaml", "partitions-134.yaml"] {
        let inputs = setup(&[layout]);
        let a = Allocator::new(&inputs).unwrap();
        // p01 first; p12 shares s1 with it; p23 fits.
        let r = a
            .allocate(&claim_of("two", &one("part", "    count: 2\n")), "n1")
            .unwrap();
        assert_eq!(picks(&r), pairs(&[("r", "p01"), ("r", "p23")]), "{layout}");
        // Three partitions never fit on four slices.
        let e = unsat(a.allocate(&claim_of("three", &one("part", "    count: 3\n")), "n1"));
        assert_eq!(
            e.requests[0].candidates.len(),
            3,
            "{layout}: each fits alone"
        );
        assert!(!e.combination.is_empty(), "{layout}");
    }
}

#[test]
fn a_whole_gpu_excludes_its_partitions_and_names_the_holder() {
    for layout in ["partitions-135.yaml", "partitions-134.yaml"] {
        let inputs = setup(&[layout]);
        let mut a = Allocator::new(&inputs).unwrap();
        let r = a
            .allocate_and_commit(&claim_of("big", &one("whole", "")), "n1")
            .unwrap();
        assert_eq!(picks(&r), pairs(&[("r", "whole")]));
        let e = unsat(a.allocate(&claim_of("small", &one("part", "")), "n1"));
        let rej = &e.requests[0].rejected;
        assert_eq!(rej.len(), 4, "{layout}: {e}");
        match &rej[0].reason {
            Reason::Counter {
                counter_set,
                counter,
                needs,
                available,
                holders,
            } => {
                assert_eq!((counter_set.as_str(), counter.as_str()), ("g0", "s0"));
                assert_eq!((needs.as_str(), available.as_str()), ("1", "0"));
                assert_eq!(holders, &vec!["default/big".to_string()]);
            }
            other => panic!("{layout}: {other:?}"),
        }
        // The whole GPU is held by "big", but the decisive reason is that
        // class "part" does not select it: releasing it would not help.
        assert!(
            matches!(rej[3].reason, Reason::ClassSelector { ref class, .. } if class == "part"),
            "{layout}: {:?}",
            rej[3].reason
        );
        assert!(
            format!("{e:#}").contains("freeing default/big would release it"),
            "{e}"
        );
    }
    // And the other way round: one partition blocks the whole GPU.
    let inputs = setup(&["partitions-135.yaml"]);
    let mut a = Allocator::new(&inputs).unwrap();
    a.allocate_and_commit(&claim_of("small", &one("part", "")), "n1")
        .unwrap();
    let e = unsat(a.allocate(&claim_of("big", &one("whole", "")), "n1"));
    assert!(
        format!("{e:#}").contains("whole: counter g0/s0 exhausted"),
        "{e}"
    );
}

#[test]
fn only_the_newest_generation_counts_and_broken_pools_are_skipped() {
    let inputs = setup(&["pools.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    let r = a.allocate(&claim_of("c", &one("whole", "")), "n2").unwrap();
    assert_eq!(picks(&r), pairs(&[("r", "new-0")]));
    assert_eq!(r.devices.unwrap().results.unwrap()[0].pool, "gen");
    // "partial" is incomplete and "dangling" has an unresolved counter set:
    // neither offers its partition.
    let e = unsat(a.allocate(&claim_of("p", &one("part", "")), "n2"));
    let notes: Vec<(String, String)> = e
        .unusable_pools
        .iter()
        .map(|p| (p.pool.clone(), p.reason.clone()))
        .collect();
    assert_eq!(notes.len(), 2, "{e}");
    assert_eq!(notes[0].0, "example.com/dangling");
    assert!(notes[0].1.contains("counter set nowhere"), "{}", notes[0].1);
    assert_eq!(notes[1].0, "example.com/partial");
    assert!(notes[1].1.contains("incomplete: 1 of 2"), "{}", notes[1].1);
    assert!(e.requests[0].candidates.is_empty());
}

#[test]
fn slices_of_other_nodes_are_not_used() {
    let inputs = setup(&["pools.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    let r = a
        .allocate(&claim_of("c", &one("whole", "    count: 1\n")), "n3")
        .unwrap();
    assert_eq!(picks(&r), pairs(&[("r", "other-0")]));
    let e = unsat(a.allocate(&claim_of("c", &one("whole", "    count: 2\n")), "n3"));
    assert_eq!(e.requests[0].candidates, vec!["other/other-0".to_string()]);
    let e = unsat(a.allocate(&claim_of("c", &one("whole", "")), "nowhere"));
    assert!(e.combination[0].contains("no ResourceSlice publishes devices for node nowhere"));
}

#[test]
fn exclusively_allocated_devices_are_unavailable() {
    let inputs = setup(&["pools.yaml"]);
    let mut a = Allocator::new(&inputs).unwrap();
    a.allocate_and_commit(&claim_of("first", &one("whole", "")), "n2")
        .unwrap();
    let e = unsat(a.allocate(&claim_of("second", &one("whole", "")), "n2"));
    assert_eq!(
        e.requests[0].rejected[0].reason,
        Reason::InUse {
            holders: vec!["default/first".into()]
        }
    );
}

#[test]
fn first_available_falls_back_in_order() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let mut a = Allocator::new(&inputs).unwrap();
    // Occupy memory slices 1, 3 and 5 of gpu-0 and gpu-1: no 2g.20gb placement
    // (slices 0-1, 2-3, 4-5) is left, 1g.10gb at slices 6, 4, 2, 0 still is.
    let blockers = "requests:\n".to_string()
        + &["gpu-0", "gpu-1"]
            .iter()
            .flat_map(|g| {
                [1, 3, 5].map(|s| {
                    format!(
                        "- name: b{}{s}\n  exactly:\n    deviceClassName: mig.gpu.carve.dev\n    selectors:\n    - cel: {{expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\" && device.attributes[\"gpu.carve.dev\"].index == {} && device.attributes[\"gpu.carve.dev\"].placementStart == {s}'}}\n",
                        &g[4..],
                        &g[4..]
                    )
                })
            })
            .collect::<String>();
    let r = a
        .allocate_and_commit(&claim_of("blockers", &blockers), "node-a")
        .unwrap();
    assert_eq!(picks(&r).len(), 6);
    let objs = load(&[examples().join("mig-first-available/pod.yaml")]);
    let carve_alloc::Object::Claim(c) = objs.into_iter().next().unwrap() else {
        panic!()
    };
    let r = a.allocate(&c, "node-a").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[
            ("mig/two-one-g", "gpu-0-mig-1g10gb-6"),
            ("mig/two-one-g", "gpu-0-mig-1g10gb-4")
        ])
    );
}

#[test]
fn match_attribute_backtracks_to_a_common_parent() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let mut a = Allocator::new(&inputs).unwrap();
    let hold = "requests:\n- name: a\n  exactly:\n    deviceClassName: mig.gpu.carve.dev\n    selectors:\n    - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"3g.40gb\" && device.attributes[\"gpu.carve.dev\"].placementStart == 0'}\n- name: b\n  exactly:\n    deviceClassName: mig.gpu.carve.dev\n    selectors:\n    - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"1g.10gb\"'}\n";
    let r = a
        .allocate_and_commit(&claim_of("hold", hold), "node-a")
        .unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[("a", "gpu-0-mig-3g40gb-0"), ("b", "gpu-0-mig-1g10gb-6")])
    );
    let objs = load(&[examples().join("mig-same-parent/pod.yaml")]);
    let carve_alloc::Object::Claim(mut c) = objs.into_iter().next().unwrap() else {
        panic!()
    };
    // gpu-0 has slices 4, 5, 7 free: a 1g fits there but no 3g, so both move to gpu-1.
    let r = a.allocate(&c, "node-a").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[
            ("small", "gpu-1-mig-1g10gb-6"),
            ("large", "gpu-1-mig-3g40gb-0")
        ])
    );
    // Without the constraint the first fits are on different GPUs.
    c.spec.devices.as_mut().unwrap().constraints = None;
    let r = a.allocate(&c, "node-a").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[
            ("small", "gpu-0-mig-1g10gb-5"),
            ("large", "gpu-1-mig-3g40gb-4")
        ])
    );
}

#[test]
fn distinct_attribute_spreads_shares_over_devices() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let a = Allocator::new(&inputs).unwrap();
    let two = "requests:\n- name: x\n  exactly: {deviceClassName: mps.gpu.carve.dev}\n- name: y\n  exactly: {deviceClassName: mps.gpu.carve.dev}\n";
    let r = a.allocate(&claim_of("same", two), "node-a").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[("x", "gpu-2-mps"), ("y", "gpu-2-mps")]),
        "two shares of one device"
    );
    let ids: Vec<_> = r
        .devices
        .unwrap()
        .results
        .unwrap()
        .into_iter()
        .map(|d| d.share_id.unwrap())
        .collect();
    assert_ne!(ids[0], ids[1]);
    let distinct = format!("{two}constraints:\n- distinctAttribute: gpu.carve.dev/parentUUID\n");
    let r = a
        .allocate(&claim_of("spread", &distinct), "node-a")
        .unwrap();
    assert_eq!(picks(&r), pairs(&[("x", "gpu-2-mps"), ("y", "gpu-3-mps")]));
    let three = format!(
        "{two}- name: z\n  exactly: {{deviceClassName: mps.gpu.carve.dev}}\nconstraints:\n- distinctAttribute: gpu.carve.dev/parentUUID\n"
    );
    let e = unsat(a.allocate(&claim_of("too-many", &three), "node-a"));
    assert!(
        e.combination
            .iter()
            .any(|c| c.contains("distinctAttribute gpu.carve.dev/parentUUID")),
        "{e}"
    );
}

#[test]
fn allocation_mode_all_takes_every_match_or_nothing() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let mut a = Allocator::new(&inputs).unwrap();
    let all = one(
        "mig.gpu.carve.dev",
        "    allocationMode: All\n    selectors:\n    - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].profile == \"7g.80gb\"'}\n",
    );
    let r = a.allocate(&claim_of("all", &all), "node-a").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[("r", "gpu-0-mig-7g80gb-0"), ("r", "gpu-1-mig-7g80gb-0")])
    );
    a.allocate_and_commit(
        &claim_of("w", &one("gpu.carve.dev", "    selectors:\n    - cel: {expression: 'device.attributes[\"gpu.carve.dev\"].index == 1'}\n")),
        "node-a",
    )
    .unwrap();
    let e = unsat(a.allocate(&claim_of("all", &all), "node-a"));
    let rej = &e.requests[0].rejected;
    assert!(
        rej.iter().any(|r| r.device == "node-a/gpu-1-mig-7g80gb-0"
            && matches!(r.reason, Reason::Counter { .. })),
        "{e}"
    );
    // All with a count is a bad claim.
    let bad = one(
        "mig.gpu.carve.dev",
        "    allocationMode: All\n    count: 2\n",
    );
    let err = a.allocate(&claim_of("bad", &bad), "node-a").unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/bad: spec.devices.requests[0].count: must not be set with allocationMode All (got 2)"
    );
}

#[test]
fn all_refuses_incomplete_pools() {
    let inputs = setup(&["pools.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    let e = unsat(a.allocate(
        &claim_of("all", &one("whole", "    allocationMode: All\n")),
        "n2",
    ));
    assert!(
        e.unusable_pools
            .iter()
            .any(|p| p.reason.starts_with("incomplete"))
    );
    assert!(
        e.combination
            .iter()
            .any(|c| c.contains("allocationMode All needs every pool")),
        "{e}"
    );
}

fn cap_claim(name: &str, reqs: &str) -> ResourceClaim {
    claim_of(
        name,
        &one(
            "shared",
            &format!("    capacity:\n      requests: {{{reqs}}}\n"),
        ),
    )
}

fn consumed(r: &k8s_openapi::api::resource::v1::AllocationResult) -> Vec<(String, String)> {
    r.devices.as_ref().unwrap().results.as_ref().unwrap()[0]
        .consumed_capacity
        .as_ref()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect()
}

#[test]
fn consumable_capacity_rounds_by_policy() {
    let inputs = setup(&["capacity.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    // validValues round up to the next value, validRange to min + n*step, no
    // policy takes the amount as asked.
    let cases: &[(&str, &[(&str, &str)])] = &[
        (
            "mem: 1500Mi, bw: \"12\", free: \"30\"",
            &[("bw", "15"), ("free", "30"), ("mem", "2Gi")],
        ),
        (
            "mem: 1Mi, bw: \"1\", free: \"7\"",
            &[("bw", "10"), ("free", "7"), ("mem", "1Gi")],
        ),
        (
            "mem: 4Gi, bw: \"50\", free: \"100\"",
            &[("bw", "50"), ("free", "100"), ("mem", "4Gi")],
        ),
        // Unrequested: the defaults, and the full value of a capacity without policy.
        ("", &[("bw", "10"), ("free", "100"), ("mem", "1Gi")]),
    ];
    for (reqs, want) in cases {
        let r = a
            .allocate(&cap_claim("c", reqs), "n4")
            .unwrap_or_else(|e| panic!("{reqs}: {e}"));
        assert_eq!(consumed(&r), pairs(want), "{reqs}");
        let cfg = r.devices.unwrap().config.unwrap();
        assert_eq!(cfg[0].source, "FromClass");
        assert_eq!(cfg[0].requests, None, "applies to every request");
    }
    let rejected: &[(&str, &str)] = &[
        (
            "mem: 5Gi",
            "capacity mem: above every validValue [1Gi, 2Gi, 4Gi]",
        ),
        ("bw: \"51\"", "capacity bw: above validRange.max 50"),
        ("free: \"101\"", "capacity free: exceeds what is left"),
        (
            "nope: \"1\"",
            "capacity nope: the device has no such capacity",
        ),
    ];
    for (reqs, want) in rejected {
        let e = unsat(a.allocate(&cap_claim("c", reqs), "n4"));
        let text = e.requests[0].rejected[0].reason.to_string();
        assert!(text.starts_with(want), "{reqs}: {text}");
    }
}

#[test]
fn a_negative_capacity_request_is_an_invalid_claim_naming_request_and_value() {
    let inputs = setup(&["capacity.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    for (reqs, name, value) in [
        ("mem: -10Gi", "mem", "-10Gi"),
        ("bw: \"-5\"", "bw", "-5"),
        ("free: \"-1m\"", "free", "-1m"),
    ] {
        let e = a.allocate(&cap_claim("c", reqs), "n4").unwrap_err();
        let AllocError::InvalidClaim { field, msg, .. } = &e else {
            panic!("{reqs}: {e:?}");
        };
        assert!(
            field.ends_with(&format!(".capacity.requests.{name}")),
            "{reqs}: {field}"
        );
        assert_eq!(
            msg,
            &format!("negative requested quantity {value:?}: must be 0 or more"),
            "{reqs}"
        );
    }
    // Zero is a request (rounded up by the policy), not an error.
    let r = a.allocate(&cap_claim("c", "mem: \"0\""), "n4").unwrap();
    assert!(consumed(&r).contains(&("mem".to_string(), "1Gi".to_string())));
}

#[test]
fn consumable_capacity_is_used_up_by_shares() {
    let inputs = setup(&["capacity.yaml"]);
    let mut a = Allocator::new(&inputs).unwrap();
    // free has no policy: 30 + 70 fit, then nothing is left.
    a.allocate_and_commit(&cap_claim("a", "mem: 1Gi, free: \"30\""), "n4")
        .unwrap();
    a.allocate_and_commit(&cap_claim("b", "mem: 1Gi, free: \"70\""), "n4")
        .unwrap();
    let e = unsat(a.allocate(&cap_claim("c", "mem: 1Gi, free: \"1\""), "n4"));
    match &e.requests[0].rejected[0].reason {
        Reason::Capacity {
            capacity,
            remaining,
            holders,
            ..
        } => {
            assert_eq!(capacity, "free");
            assert_eq!(remaining, "0");
            assert_eq!(
                holders,
                &vec!["default/a".to_string(), "default/b".to_string()]
            );
        }
        other => panic!("{other:?}"),
    }
    // mem: 1Gi + 1Gi used of 4Gi, so 2Gi fit once more but 4Gi do not.
    let fresh = setup(&["capacity.yaml"]);
    let mut b = Allocator::new(&fresh).unwrap();
    b.allocate_and_commit(&cap_claim("a", "mem: 2Gi, free: \"1\""), "n4")
        .unwrap();
    b.allocate_and_commit(&cap_claim("b", "mem: 2Gi, free: \"1\""), "n4")
        .unwrap();
    let e = unsat(b.allocate(&cap_claim("c", "mem: 1Gi, free: \"1\""), "n4"));
    assert!(
        format!("{e:#}")
            .contains("capacity mem: exceeds what is left (requested 1Gi, consumes 1Gi, 0 left)"),
        "{e}"
    );
}

#[test]
fn cel_errors_abort_with_expression_and_device() {
    let inputs = setup(&["partitions-135.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    let unknown = one(
        "part",
        "    selectors:\n    - cel: {expression: 'device.attributes[\"example.com\"].nosuch == 1'}\n",
    );
    match a.allocate(&claim_of("c", &unknown), "n1").unwrap_err() {
        AllocError::Cel {
            owner,
            expr,
            device,
            msg,
        } => {
            assert_eq!(owner, "claim default/c: request r");
            assert_eq!(expr, "device.attributes[\"example.com\"].nosuch == 1");
            assert_eq!(device, "example.com/n1/p01");
            assert!(msg.contains("nosuch"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    let syntax = one(
        "part",
        "    selectors:\n    - cel: {expression: 'device.driver =='}\n",
    );
    assert!(matches!(
        a.allocate(&claim_of("c", &syntax), "n1").unwrap_err(),
        AllocError::CelCompile { .. }
    ));
    let long = format!("device.driver == \"{}\"", "x".repeat(10240));
    let too_long = one(
        "part",
        &format!("    selectors:\n    - cel: {{expression: '{long}'}}\n"),
    );
    let err = a.allocate(&claim_of("c", &too_long), "n1").unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/c: request r: CEL expression is 10259 bytes long, the limit is 10240"
    );
    let x = "device.attributes[\"example.com\"]";
    let costly = format!("{x}.all(a, {x}.all(b, {x}.all(c, {x}.all(d, true))))");
    let too_costly = one(
        "part",
        &format!("    selectors:\n    - cel: {{expression: '{costly}'}}\n"),
    );
    assert!(
        matches!(a.allocate(&claim_of("c", &too_costly), "n1").unwrap_err(), AllocError::CelTooCostly { cost, .. } if cost > 1_000_000)
    );
    let err = a
        .allocate(&claim_of("c", &one("nosuchclass", "")), "n1")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/c: request r: DeviceClass \"nosuchclass\" not found"
    );
}

#[test]
fn explanation_names_failing_selectors_and_serialises() {
    let inputs = setup(&["partitions-135.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    let c = claim_of(
        "c",
        &one(
            "part",
            "    selectors:\n    - cel: {expression: 'device.attributes[\"example.com\"].gpu == 9'}\n",
        ),
    );
    let e = unsat(a.allocate(&c, "n1"));
    assert_eq!(e, a.explain(&c, "n1").unwrap());
    let reasons: Vec<(String, Reason)> = e.requests[0]
        .rejected
        .iter()
        .map(|r| (r.device.clone(), r.reason.clone()))
        .collect();
    assert_eq!(
        reasons[0].1,
        Reason::RequestSelector {
            index: 0,
            expression: "device.attributes[\"example.com\"].gpu == 9".into()
        }
    );
    assert_eq!(
        reasons[3],
        (
            "n1/whole".to_string(),
            Reason::ClassSelector {
                class: "part".into(),
                index: 0,
                expression: "device.attributes[\"example.com\"].kind == \"part\"".into()
            }
        )
    );
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(
        json["requests"][0]["rejected"][0]["reason"]["kind"],
        "requestSelector"
    );
    assert_eq!(json["claim"], "default/c");
    let text = format!("{e:#}");
    assert!(
        text.starts_with("claim default/c does not fit on node n1\n"),
        "{text}"
    );
    assert!(
        text.contains("n1/whole: class part selector #0 is false"),
        "{text}"
    );
}

#[test]
fn class_and_claim_config_are_copied_like_the_scheduler_does() {
    let inputs = setup(&["capacity.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    // Both share the device; each asks for part of "free" (unrequested it would take all of it).
    let devices = "requests:\n- name: a\n  exactly: {deviceClassName: shared, capacity: {requests: {free: \"1\"}}}\n- name: b\n  exactly: {deviceClassName: shared, capacity: {requests: {free: \"1\"}}}\nconfig:\n- requests: [b]\n  opaque: {driver: example.com, parameters: {x: 1}}\n- opaque: {driver: example.com, parameters: {y: 2}}\n";
    let r = a.allocate(&claim_of("cfg", devices), "n4").unwrap();
    let cfg = r.devices.unwrap().config.unwrap();
    let got: Vec<(String, Option<Vec<String>>)> = cfg
        .iter()
        .map(|c| (c.source.clone(), c.requests.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            ("FromClass".to_string(), None),
            ("FromClaim".to_string(), Some(vec!["b".to_string()])),
            ("FromClaim".to_string(), None),
        ]
    );
    assert_eq!(cfg[0].opaque.as_ref().unwrap().parameters.0["mode"], "fair");
}

#[test]
fn bad_inputs_are_named() {
    let err = Allocator::new(&inputs(
        &[],
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: bad}\nspec:\n  driver: d\n  nodeName: n\n  pool: {name: p, generation: 1, resourceSliceCount: 1}\n  devices:\n  - name: x\n    capacity: {mem: {value: 12XB}}\n",
    ).0)
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "ResourceSlice bad: spec.devices[0].capacity.mem.value: quantity \"12XB\" is malformed: unknown suffix (want n, u, m, k, M, G, T, P, E, Ki..Ei or e<n>)"
    );
    let inputs = setup(&["pools.yaml"]);
    let mut a = Allocator::new(&inputs).unwrap();
    let err = a
        .commit(claim_of("pending", &one("whole", "")))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/pending: status.allocation: missing; only allocated claims can be committed"
    );
    assert_eq!(a.committed().len(), 0, "nothing half-committed");
    let err = a
        .allocate(
            &claim_of("m", &one("whole", "    allocationMode: Some\n")),
            "n2",
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("requests[0].allocationMode: unknown mode \"Some\""),
        "{err}"
    );
    let both = "requests:\n- name: r\n  exactly: {deviceClassName: whole}\nconstraints:\n- {}\n";
    let err = a.allocate(&claim_of("k", both), "n2").unwrap_err();
    assert!(
        err.to_string()
            .contains("constraints[0]: exactly one of matchAttribute and distinctAttribute"),
        "{err}"
    );
}

#[test]
fn taints_need_tolerations() {
    let slice = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: t}\nspec:\n  driver: example.com\n  nodeName: n5\n  pool: {name: n5, generation: 1, resourceSliceCount: 1}\n  devices:\n  - name: sick\n    attributes: {kind: {string: whole}}\n    taints: [{key: health, value: bad, effect: NoSchedule}]\n  - name: fine\n    attributes: {kind: {string: whole}}\n    taints: [{key: note, effect: None}]\n";
    let (inputs, _) = inputs(&[fixture("classes.yaml")], slice);
    let a = Allocator::new(&inputs).unwrap();
    let r = a.allocate(&claim_of("c", &one("whole", "")), "n5").unwrap();
    assert_eq!(
        picks(&r),
        pairs(&[("r", "fine")]),
        "effect None does not block"
    );
    let e = unsat(a.allocate(&claim_of("c", &one("whole", "    count: 2\n")), "n5"));
    assert_eq!(
        e.requests[0].rejected[0].reason,
        Reason::Taint {
            key: "health".into(),
            value: Some("bad".into()),
            effect: "NoSchedule".into()
        }
    );
    let tolerant = one(
        "whole",
        "    count: 2\n    tolerations: [{key: health, operator: Equal, value: bad}]\n",
    );
    let r = a.allocate(&claim_of("c", &tolerant), "n5").unwrap();
    assert_eq!(picks(&r), pairs(&[("r", "sick"), ("r", "fine")]));
    assert!(
        r.devices.unwrap().results.unwrap()[0].tolerations.is_some(),
        "tolerations are copied"
    );
}

#[test]
fn unrequested_capacity_without_policy_takes_everything() {
    let inputs = setup(&["capacity.yaml"]);
    let a = Allocator::new(&inputs).unwrap();
    // Each share defaults to all of "free", so two shares never fit together.
    let two = "requests:\n- name: a\n  exactly: {deviceClassName: shared}\n- name: b\n  exactly: {deviceClassName: shared}\n";
    let e = unsat(a.allocate(&claim_of("two", two), "n4"));
    assert_eq!(e.requests[0].candidates, vec!["n4/shared-0".to_string()]);
    assert_eq!(e.requests[1].candidates, vec!["n4/shared-0".to_string()]);
}

/// Every sequence of up to five single-device claims against a simple model of
/// the fixture's memory slices: picks never overlap, and a claim fails exactly
/// when every device of its class overlaps a committed one.
#[test]
fn counters_match_a_slice_model_for_every_claim_sequence() {
    let slices_of = |d: &str| -> Vec<u8> {
        match d {
            "p01" => vec![0, 1],
            "p12" => vec![1, 2],
            "p23" => vec![2, 3],
            "whole" => vec![0, 1, 2, 3],
            other => panic!("{other}"),
        }
    };
    for layout in ["partitions-135.yaml", "partitions-134.yaml"] {
        for len in 1..=5u32 {
            for bits in 0..(1u32 << len) {
                let inputs = setup(&[layout]);
                let mut a = Allocator::new(&inputs).unwrap();
                let mut used: Vec<u8> = Vec::new();
                for i in 0..len {
                    let class = if bits & (1 << i) == 0 {
                        "part"
                    } else {
                        "whole"
                    };
                    let members: &[&str] = if class == "part" {
                        &["p01", "p12", "p23"]
                    } else {
                        &["whole"]
                    };
                    let free: Vec<&str> = members
                        .iter()
                        .copied()
                        .filter(|d| slices_of(d).iter().all(|s| !used.contains(s)))
                        .collect();
                    let c = claim_of(&format!("c{i}"), &one(class, ""));
                    match a.allocate_and_commit(&c, "n1") {
                        Ok(r) => {
                            let dev = picks(&r)[0].1.clone();
                            assert_eq!(
                                Some(&dev.as_str()),
                                free.first(),
                                "{layout} {bits:b} step {i}: first fit"
                            );
                            used.extend(slices_of(&dev));
                        }
                        Err(AllocError::Unsatisfiable(_)) => {
                            assert!(free.is_empty(), "{layout} {bits:b} step {i}")
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        }
    }
}
