//! Every claim under `examples/` against a hand-written H100 node.

mod common;

use carve_alloc::Allocator;
use common::*;

fn example(dir: &str) -> k8s_openapi::api::resource::v1::ResourceClaim {
    // Each example is a ResourceClaimTemplate and the Pod that names it.
    let objs = load(&[examples().join(dir).join("pod.yaml")]);
    let claim = objs.into_iter().find_map(|o| match o {
        carve_alloc::Object::Claim(c) => Some(c),
        _ => None,
    });
    claim.unwrap_or_else(|| panic!("{dir}/pod.yaml holds no ResourceClaimTemplate"))
}

#[test]
fn every_example_gets_the_expected_device_on_a_fresh_node() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let alloc = Allocator::new(&inputs).unwrap();
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
        ("mps-share", &[("gpu", "gpu-2-mps")]),
        ("mps-hard-limit", &[("gpu", "gpu-3-mps")]),
        ("timeslice", &[("gpu", "gpu-2-ts")]),
    ];
    let mut dirs: Vec<String> = std::fs::read_dir(examples())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("pod.yaml").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        // The hand-written node publishes no MIG-MPS devices; `carve
        // simulate` prepares that example.
        .filter(|d| d != "mig-mps")
        .collect();
    dirs.sort();
    let mut covered: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    covered.sort();
    assert_eq!(dirs, covered, "every example directory has an expectation");
    for (dir, want) in cases {
        let claim = example(dir);
        let result = alloc
            .allocate(&claim, "node-a")
            .unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert_eq!(picks(&result), pairs(want), "{dir}");
        let sel = result.node_selector.as_ref().expect("node-local devices");
        let term = &sel.node_selector_terms[0];
        assert_eq!(
            term.match_fields.as_ref().unwrap()[0]
                .values
                .as_ref()
                .unwrap(),
            &vec!["node-a".to_string()]
        );
    }
}

#[test]
fn shared_examples_carry_share_ids_and_consumed_capacity() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let alloc = Allocator::new(&inputs).unwrap();
    let r = alloc.allocate(&example("mps-share"), "node-a").unwrap();
    let d = &r.devices.unwrap().results.unwrap()[0];
    let share = d.share_id.as_deref().unwrap();
    assert_eq!(share.len(), 36);
    assert_eq!(&share[14..15], "4", "version 4 layout: {share}");
    assert!(
        share
            .chars()
            .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c))
    );
    let cc = d.consumed_capacity.as_ref().unwrap();
    assert_eq!(cc["memory"].0, "10Gi");
    assert_eq!(cc["multiprocessors"].0, "33");

    let r = alloc.allocate(&example("timeslice"), "node-a").unwrap();
    let d = &r.devices.unwrap().results.unwrap()[0];
    assert!(d.share_id.is_some());
    assert_eq!(d.consumed_capacity, None, "no capacities, nothing consumed");

    let r = alloc.allocate(&example("whole-gpu"), "node-a").unwrap();
    let d = &r.devices.unwrap().results.unwrap()[0];
    assert_eq!(d.share_id, None);
}

#[test]
fn examples_allocated_one_after_another_fill_the_node() {
    let (inputs, _) = inputs(
        &[
            fixture("h100-node.yaml"),
            examples().join("deviceclasses.yaml"),
        ],
        "",
    );
    let mut alloc = Allocator::new(&inputs).unwrap();
    let named = |dir: &str, name: &str| {
        let mut c = example(dir);
        c.metadata.name = Some(name.to_string());
        c.metadata.namespace = Some("default".into());
        c
    };
    // whole gpu-0, then the MIG claims move to gpu-1.
    let whole = named("whole-gpu", "w1");
    assert_eq!(
        picks(&alloc.allocate_and_commit(&whole, "node-a").unwrap()),
        pairs(&[("gpu", "gpu-0")])
    );
    let one = named("mig-1g", "m1");
    assert_eq!(
        picks(&alloc.allocate_and_commit(&one, "node-a").unwrap()),
        pairs(&[("gpu", "gpu-1-mig-1g10gb-6")])
    );
    // The time-slice device takes gpu-2's counters; a second share still fits,
    // while the whole gpu-2 does not.
    for n in ["t1", "t2"] {
        let ts = named("timeslice", n);
        assert_eq!(
            picks(&alloc.allocate_and_commit(&ts, "node-a").unwrap()),
            pairs(&[("gpu", "gpu-2-ts")])
        );
    }
    let whole2 = named("whole-gpu", "w2");
    assert_eq!(
        picks(&alloc.allocate_and_commit(&whole2, "node-a").unwrap()),
        pairs(&[("gpu", "gpu-3")])
    );
    // gpu-2-mps shares counters with the time-slice device (charged once) but
    // gpu-2's counters are held by the time-slice shares, so MPS cannot start there;
    // gpu-3 is whole: no MPS device is left.
    let mps = named("mps-share", "p1");
    let err = alloc.allocate(&mps, "node-a").unwrap_err();
    let carve_alloc::AllocError::Unsatisfiable(e) = err else {
        panic!("{err}")
    };
    let text = format!("{e:#}");
    assert!(
        text.contains("gpu-2-mps: counter gpu-2/memory-slice-0 exhausted"),
        "{text}"
    );
    assert!(
        text.contains("default/t1") && text.contains("default/t2"),
        "{text}"
    );
    assert!(
        text.contains("gpu-3-mps: counter gpu-3/memory-slice-0 exhausted"),
        "{text}"
    );
    assert!(text.contains("default/w2"), "{text}");
}
