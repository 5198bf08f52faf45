//! SlicePublisher against the carve-apiserver stand-in, through the real kube
//! client over HTTP. Write counts come from the server's own counters.

use std::collections::BTreeMap;
use std::time::Duration;

use carve_apiserver::{ApiServer, Fault, KubeVersion, Options, Resource};
use carve_kube::{ConflictRetry, PublishError, SlicePublisher, Verb, server_version};
use carve_model::DRIVER_NAME;
use carve_model::slices::{
    KubeLayout, NodeGpu, SliceOptions, build_slices, simulated_node, validate_slices,
};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

const NODE: &str = "node-a";

async fn server() -> ApiServer {
    ApiServer::start(Options::default())
        .await
        .expect("stand-in starts")
}

fn publisher(server: &ApiServer) -> SlicePublisher {
    SlicePublisher::new(server.client(), NODE, DRIVER_NAME)
}

/// What carve publishes for a node of `count` H200s on Kubernetes 1.35.
fn h200_node(count: u32) -> Vec<ResourceSlice> {
    let gpus: Vec<NodeGpu> = simulated_node("h200-141gb", count)
        .unwrap()
        .into_iter()
        .map(NodeGpu::dynamic)
        .collect();
    let slices = build_slices(&gpus, &SliceOptions::new(NODE, KubeLayout::V135Plus)).unwrap();
    validate_slices(&slices, KubeLayout::V135Plus).unwrap();
    slices
}

fn device(name: &str, product: &str, memory: &str) -> Device {
    Device {
        name: name.into(),
        attributes: Some(BTreeMap::from([(
            "productName".to_owned(),
            DeviceAttribute {
                string: Some(product.into()),
                ..Default::default()
            },
        )])),
        capacity: Some(BTreeMap::from([(
            "memory".to_owned(),
            DeviceCapacity {
                value: Quantity(memory.into()),
                request_policy: None,
            },
        )])),
        ..Default::default()
    }
}

/// A hand-made slice `name` of pool `NODE` holding one device per entry.
fn slice(
    node: &str,
    driver: &str,
    name: &str,
    count: i64,
    devices: &[(&str, &str)],
) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                "carve".to_owned(),
            )])),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 0,
                resource_slice_count: count,
            },
            devices: Some(
                devices
                    .iter()
                    .map(|(d, product)| device(d, product, "40960Mi"))
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

fn three_slices() -> Vec<ResourceSlice> {
    vec![
        slice(NODE, DRIVER_NAME, "s0", 3, &[("gpu-0", "H100")]),
        slice(NODE, DRIVER_NAME, "s1", 3, &[("gpu-1", "H100")]),
        slice(NODE, DRIVER_NAME, "s2", 3, &[("gpu-2", "H100")]),
    ]
}

/// Every stored slice: name → (node, driver, generation, resourceVersion).
fn stored(server: &ApiServer) -> BTreeMap<String, (String, String, i64, String)> {
    server
        .store()
        .list(Resource::ResourceSlices)
        .into_iter()
        .map(|v| {
            let s = |p: &str| {
                v.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned()
            };
            (
                s("/metadata/name"),
                (
                    s("/spec/nodeName"),
                    s("/spec/driver"),
                    v.pointer("/spec/pool/generation")
                        .and_then(Value::as_i64)
                        .unwrap_or(-1),
                    s("/metadata/resourceVersion"),
                ),
            )
        })
        .collect()
}

fn insert(server: &ApiServer, s: &ResourceSlice) {
    let mut v = serde_json::to_value(s).unwrap();
    v["apiVersion"] = "resource.k8s.io/v1".into();
    v["kind"] = "ResourceSlice".into();
    server.store().insert(Resource::ResourceSlices, v).unwrap();
}

#[tokio::test]
async fn first_publish_creates_every_slice_at_generation_zero() {
    let server = server().await;
    let desired = h200_node(2);
    let n = desired.len();
    assert!(
        n >= 2,
        "a 2-GPU node has a counters slice and device slices"
    );
    let report = publisher(&server).sync(desired.clone()).await.unwrap();
    assert_eq!(
        (
            report.created,
            report.updated,
            report.deleted,
            report.unchanged
        ),
        (n, 0, 0, 0)
    );
    assert_eq!(report.generation, Some(0));
    let stats = server.stats();
    assert_eq!(stats.writes, n as u64);
    assert_eq!(stats.count("create", "resourceslices"), n as u64);
    let got = stored(&server);
    assert_eq!(got.len(), n);
    for s in &desired {
        let (node, driver, generation, _) = &got[s.metadata.name.as_deref().unwrap()];
        assert_eq!(
            (node.as_str(), driver.as_str(), *generation),
            (NODE, DRIVER_NAME, 0)
        );
    }
    // What the server holds is what was desired.
    let listed = publisher(&server).existing().await.unwrap();
    for s in &desired {
        let l = listed
            .iter()
            .find(|l| Some(l.name()) == s.metadata.name.as_deref())
            .unwrap();
        assert_eq!(l.digest, carve_kube::plan::digest(s));
    }
}

#[tokio::test]
async fn republishing_the_same_set_writes_nothing() {
    let server = server().await;
    let mut p = publisher(&server);
    let _ = p.sync(h200_node(2)).await.unwrap();
    server.reset_stats();
    let report = p.sync(h200_node(2)).await.unwrap();
    assert_eq!(report.writes(), 0);
    assert_eq!(report.unchanged, h200_node(2).len());
    assert_eq!(report.generation, Some(0));
    let stats = server.stats();
    assert_eq!(stats.writes, 0);
    assert_eq!(
        stats.requests, 1,
        "one list, nothing else: {:?}",
        stats.by_verb_resource
    );
}

#[tokio::test]
async fn restarted_publisher_writes_nothing() {
    let server = server().await;
    let _ = publisher(&server).sync(h200_node(2)).await.unwrap();
    let before = stored(&server);
    server.reset_stats();
    // A new process: new client, new publisher, no memory of the last sync.
    let mut fresh = SlicePublisher::new(server.client(), NODE, DRIVER_NAME);
    let report = fresh.sync(h200_node(2)).await.unwrap();
    assert_eq!(report.writes(), 0);
    assert_eq!(server.stats().writes, 0);
    assert_eq!(stored(&server), before, "resourceVersions untouched");
}

#[tokio::test]
async fn server_canonicalized_quantities_are_not_a_change() {
    let server = server().await;
    // The real API server stores 40960Mi as 40Gi; the desired set still says 40960Mi.
    let desired = vec![slice(NODE, DRIVER_NAME, "s0", 1, &[("gpu-0", "H100")])];
    let mut canonical = desired[0].clone();
    canonical.spec.devices.as_mut().unwrap()[0]
        .capacity
        .as_mut()
        .unwrap()
        .get_mut("memory")
        .unwrap()
        .value = Quantity("40Gi".into());
    canonical.spec.pool.generation = 4;
    insert(&server, &canonical);
    server.reset_stats();
    let report = publisher(&server).sync(desired).await.unwrap();
    assert_eq!((report.writes(), report.generation), (0, Some(4)));
    assert_eq!(server.stats().writes, 0);
}

#[tokio::test]
async fn changed_device_bumps_the_pool_and_deletes_the_stale_slice() {
    let server = server().await;
    let mut p = publisher(&server);
    let _ = p.sync(three_slices()).await.unwrap();
    server.reset_stats();

    // gpu-1 changes, s2 disappears (the pool now has 2 slices).
    let desired = vec![
        slice(NODE, DRIVER_NAME, "s0", 2, &[("gpu-0", "H100")]),
        slice(NODE, DRIVER_NAME, "s1", 2, &[("gpu-1", "H200")]),
    ];
    let report = p.sync(desired).await.unwrap();
    assert_eq!(
        (
            report.created,
            report.updated,
            report.deleted,
            report.unchanged
        ),
        (0, 2, 1, 0)
    );
    assert_eq!(report.generation, Some(1));

    let stats = server.stats();
    assert_eq!(stats.writes, 3);
    assert_eq!(stats.count("update", "resourceslices"), 2);
    assert_eq!(stats.count("delete", "resourceslices"), 1);
    // New generation first, stale slice last.
    let verbs: Vec<String> = server
        .request_log()
        .into_iter()
        .filter(|r| r.verb != "list")
        .map(|r| r.verb)
        .collect();
    assert_eq!(verbs, ["update", "update", "delete"]);

    let got = stored(&server);
    assert_eq!(got.keys().collect::<Vec<_>>(), ["s0", "s1"]);
    assert!(got.values().all(|(_, _, generation, _)| *generation == 1));
}

#[tokio::test]
async fn conflict_on_update_is_reread_and_retried() {
    let server = server().await;
    let mut p = publisher(&server);
    let _ = p.sync(three_slices()).await.unwrap();
    server.reset_stats();
    server.inject(Fault::FailNext {
        count: 1,
        status: 409,
        writes_only: true,
        resource: Some("resourceslices".into()),
    });
    let mut desired = three_slices();
    desired[2] = slice(NODE, DRIVER_NAME, "s2", 3, &[("gpu-2", "H200")]);
    let report = p.sync(desired).await.unwrap();
    assert_eq!(report.conflicts, 1);
    assert_eq!((report.created, report.updated, report.deleted), (0, 3, 0));
    assert_eq!(report.generation, Some(1));
    let stats = server.stats();
    assert_eq!(
        stats.count("list", "resourceslices"),
        2,
        "re-read after the conflict"
    );
    assert_eq!(stats.count("update", "resourceslices"), 4, "1 refused + 3");
    assert!(stored(&server).values().all(|(_, _, g, _)| *g == 1));
}

#[tokio::test]
async fn persistent_conflict_gives_up_naming_the_slice() {
    let server = server().await;
    let mut p = publisher(&server).with_conflict_retry(ConflictRetry {
        attempts: 3,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(2),
    });
    let _ = p.sync(three_slices()).await.unwrap();
    server.inject(Fault::FailNext {
        count: 100,
        status: 409,
        writes_only: true,
        resource: Some("resourceslices".into()),
    });
    let mut desired = three_slices();
    desired[0] = slice(NODE, DRIVER_NAME, "s0", 3, &[("gpu-0", "A100")]);
    let e = p.sync(desired).await.unwrap_err();
    assert!(
        matches!(&e, PublishError::Conflict { verb: Verb::Update, slice, attempts: 3, .. } if slice == "s0"),
        "{e:?}"
    );
    assert!(e.to_string().contains("s0"), "{e}");
    assert_eq!(e.status_code(), Some(409));
}

#[tokio::test]
async fn persistent_server_error_names_slice_and_verb() {
    let server = server().await;
    let mut p = publisher(&server);
    let _ = p.sync(three_slices()).await.unwrap();
    let before = stored(&server);
    server.reset_stats();
    server.inject(Fault::FailNext {
        count: 100,
        status: 500,
        writes_only: true,
        resource: Some("resourceslices".into()),
    });
    let mut desired = three_slices();
    desired[1] = slice(NODE, DRIVER_NAME, "s1", 3, &[("gpu-1", "A100")]);
    let e = p.sync(desired.clone()).await.unwrap_err();
    assert!(
        matches!(&e, PublishError::Api { verb: Verb::Update, slice, .. } if slice == "s0"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), "update ResourceSlice s0");
    assert_eq!(e.status_code(), Some(500));
    assert_eq!(server.stats().writes, 1, "no retry of a 500");
    assert_eq!(stored(&server), before, "nothing changed on the server");

    // Once the server recovers, the next sync finishes the job.
    server.clear_faults();
    let report = p.sync(desired).await.unwrap();
    assert_eq!((report.updated, report.generation), (3, Some(1)));
}

/// An API server that takes a request and does not answer (here: answers
/// only after a minute) fails the sync after the request timeout, naming the
/// verb and slice, instead of holding it; the next sync, once the server
/// answers again, finishes the job.
#[tokio::test]
async fn a_request_without_an_answer_times_out_naming_verb_and_slice() {
    const SHORT: Duration = Duration::from_millis(200);
    let server = server().await;
    let mut p = publisher(&server).with_request_timeout(SHORT);
    let _ = p.sync(three_slices()).await.unwrap();

    // A write that hangs.
    server.inject(Fault::DelayNext {
        count: 1,
        delay: Duration::from_secs(60),
        writes_only: true,
        resource: Some("resourceslices".into()),
    });
    let mut desired = three_slices();
    desired[1] = slice(NODE, DRIVER_NAME, "s1", 3, &[("gpu-1", "A100")]);
    let e = p.sync(desired.clone()).await.unwrap_err();
    assert!(
        matches!(&e, PublishError::Timeout { verb: Verb::Update, slice, after } if slice == "s0" && *after == SHORT),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "update ResourceSlice s0: no answer within 200ms (the API server is hung, overloaded or unreachable)"
    );

    // A list that hangs.
    server.inject(Fault::DelayNext {
        count: 1,
        delay: Duration::from_secs(60),
        writes_only: false,
        resource: Some("resourceslices".into()),
    });
    let e = p.sync(desired.clone()).await.unwrap_err();
    assert!(
        matches!(
            &e,
            PublishError::Timeout {
                verb: Verb::List,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains(&format!("driver {DRIVER_NAME} on node {NODE}")),
        "{e}"
    );

    // Answers again: the next sync finishes.
    server.clear_faults();
    let report = p.sync(desired).await.unwrap();
    assert_eq!(report.updated, 3);
}

#[tokio::test]
async fn other_nodes_and_drivers_are_never_touched() {
    let server = server().await;
    let foreign = [
        slice("node-b", DRIVER_NAME, "b0", 1, &[("gpu-0", "H100")]),
        slice(NODE, "other.example.com", "o0", 1, &[("gpu-0", "H100")]),
    ];
    for s in &foreign {
        insert(&server, s);
    }
    let theirs = |server: &ApiServer| {
        let mut all = stored(server);
        all.retain(|k, _| k == "b0" || k == "o0");
        all
    };
    let before = theirs(&server);
    assert_eq!(before.len(), 2);

    let mut p = publisher(&server);
    let _ = p.sync(three_slices()).await.unwrap();
    let mut changed = three_slices();
    changed.pop();
    for s in &mut changed {
        s.spec.pool.resource_slice_count = 2;
    }
    let report = p.sync(changed).await.unwrap();
    assert_eq!(report.deleted, 1);
    let report = p.sync(Vec::new()).await.unwrap();
    assert_eq!((report.deleted, report.generation), (2, None));
    let _ = p.sync(three_slices()).await.unwrap();
    assert_eq!(p.delete_all().await.unwrap(), 3);

    assert_eq!(theirs(&server), before, "foreign slices unchanged");
    assert_eq!(stored(&server).len(), 2, "only foreign slices are left");
}

#[tokio::test]
async fn stale_pool_of_this_node_is_deleted_after_the_new_one_is_written() {
    let server = server().await;
    let mut old = slice(NODE, DRIVER_NAME, "legacy-0", 1, &[("gpu-0", "H100")]);
    old.spec.pool.name = "legacy-pool".into();
    old.spec.pool.generation = 9;
    insert(&server, &old);
    server.reset_stats();
    let report = publisher(&server).sync(three_slices()).await.unwrap();
    assert_eq!(
        (report.created, report.deleted, report.generation),
        (3, 1, Some(0))
    );
    let verbs: Vec<String> = server
        .request_log()
        .into_iter()
        .filter(|r| r.verb != "list")
        .map(|r| r.verb)
        .collect();
    assert_eq!(verbs, ["create", "create", "create", "delete"]);
}

#[tokio::test]
async fn invalid_desired_set_is_rejected_before_any_request() {
    let server = server().await;
    let mut bad = three_slices();
    bad[1].spec.node_name = Some("node-b".into());
    let e = publisher(&server).sync(bad).await.unwrap_err();
    assert!(
        matches!(&e, PublishError::InvalidDesired { slice, .. } if slice == "s1"),
        "{e:?}"
    );
    assert!(e.to_string().contains("spec.nodeName"), "{e}");
    assert_eq!(server.stats().requests, 0);
    assert!(stored(&server).is_empty());
}

#[tokio::test]
async fn server_version_reads_the_minor() {
    let server = ApiServer::start(Options {
        version: KubeVersion {
            major: 1,
            minor: 34,
        },
        ..Options::default()
    })
    .await
    .unwrap();
    assert_eq!(server_version(&server.client()).await.unwrap(), (1, 34));
    server.set_version(KubeVersion {
        major: 1,
        minor: 36,
    });
    assert_eq!(server_version(&server.client()).await.unwrap(), (1, 36));
    server.inject(Fault::FailNext {
        count: 1,
        status: 500,
        writes_only: false,
        resource: None,
    });
    let e = server_version(&server.client()).await.unwrap_err();
    assert!(matches!(e, PublishError::Version { .. }), "{e:?}");
}

#[tokio::test]
async fn not_found_on_update_is_reread_and_retried() {
    let server = server().await;
    let mut p = publisher(&server);
    let _ = p.sync(three_slices()).await.unwrap();
    // The update of s0 answers 404 (as if s0 vanished after our list); the
    // publisher lists again and writes what the new list calls for.
    server.inject(Fault::FailNext {
        count: 1,
        status: 404,
        writes_only: true,
        resource: Some("resourceslices".into()),
    });
    let mut desired = three_slices();
    desired[1] = slice(NODE, DRIVER_NAME, "s1", 3, &[("gpu-1", "H200")]);
    let report = p.sync(desired).await.unwrap();
    assert_eq!(report.conflicts, 1);
    assert_eq!((report.created, report.updated), (0, 3));
    assert_eq!(
        server.stats().count("list", "resourceslices"),
        3,
        "first sync, pass 1, pass 2"
    );
    let got = stored(&server);
    assert_eq!(got.len(), 3);
    assert!(got.values().all(|(_, _, g, _)| *g == 1));
}

/// Compile-only: a sync can run on a spawned task.
#[allow(dead_code)]
fn sync_is_send(mut p: SlicePublisher) {
    fn send<T: Send>(_: T) {}
    send(async move { p.sync(Vec::new()).await });
}
/// With DRAPartitionableDevices off the API server stores slices without
/// their counter fields and answers with what it stored: the sync stops at the
/// first such write with an error naming the slice and the gate, and a later
/// sync stops again after one write instead of rewriting in a loop.
#[tokio::test]
async fn dropped_counter_fields_stop_the_sync_and_name_the_gate() {
    let server = server().await;
    server.set_partitionable_devices(false);
    let desired = h200_node(8);
    let err = publisher(&server)
        .sync(desired.clone())
        .await
        .expect_err("counters were dropped");
    let msg = err.to_string();
    assert!(msg.contains("DRAPartitionableDevices"), "{msg}");
    let first = desired[0].metadata.name.clone().unwrap();
    assert!(msg.contains(&first), "{msg} does not name {first}");
    assert_eq!(server.stats().writes, 1, "stopped at the first write");
    server.reset_stats();
    assert!(publisher(&server).sync(desired.clone()).await.is_err());
    assert_eq!(server.stats().writes, 1, "one write per sync, no loop");
    // With the gate on the same desired set publishes, counters included.
    server.set_partitionable_devices(true);
    let report = publisher(&server).sync(desired.clone()).await.unwrap();
    assert_eq!(report.writes(), desired.len());
    let stored = server.store().list(Resource::ResourceSlices);
    assert!(
        stored
            .iter()
            .any(|s| s.pointer("/spec/sharedCounters").is_some())
    );
    assert!(
        stored
            .iter()
            .any(|s| s.pointer("/spec/devices/0/consumesCounters").is_some())
    );
}

/// The plugin's publish loop, reduced to the watch: sync whenever the watch
/// reports a change, and at no other time (no periodic resync), so any
/// republish seen below came from the watch. Returns the task and every
/// report of the watch so far.
fn publish_on_changes(
    server: &ApiServer,
    desired: Vec<ResourceSlice>,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::watch::Receiver<Vec<carve_kube::Changes>>,
) {
    let mut p = publisher(server);
    let mut watch = p.watch();
    let (tx, rx) = tokio::sync::watch::channel(Vec::new());
    let task = tokio::spawn(async move {
        loop {
            let changes = watch.changed().await;
            let _ = p.sync(&desired).await.unwrap();
            tx.send_modify(|v| v.push(changes));
        }
    });
    (task, rx)
}

/// Waits until `done` holds for what the stand-in stores (10 s at most,
/// far below the plugin's 60 s periodic resync, which does not run here).
async fn eventually(server: &ApiServer, what: &str, done: impl Fn(&ApiServer) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done(server) {
        assert!(
            std::time::Instant::now() < deadline,
            "after 10 s still waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Someone else's client (an administrator's kubectl).
fn other_client(server: &ApiServer) -> kube::Api<ResourceSlice> {
    kube::Api::all(server.client())
}

#[tokio::test]
async fn a_slice_deleted_behind_the_publishers_back_is_republished_by_the_watch() {
    let server = server().await;
    let desired = h200_node(2);
    let _ = publisher(&server).sync(&desired).await.unwrap();
    let (task, mut reports) = publish_on_changes(&server, desired.clone());
    // The watch's first list is reported (what happened before it is unknown).
    reports.wait_for(|r| !r.is_empty()).await.unwrap();
    assert!(reports.borrow()[0].relisted);
    let before = stored(&server);
    let victim = desired[1].metadata.name.clone().unwrap();

    other_client(&server)
        .delete(&victim, &Default::default())
        .await
        .unwrap();
    eventually(&server, "the deleted slice republished", |s| {
        stored(s).contains_key(&victim)
    })
    .await;
    let after = stored(&server);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    // The pool lost a slice, so it was republished whole at the next generation.
    assert!(after.values().all(|(_, _, g, _)| *g == 1), "{after:?}");
    reports.wait_for(|r| r.len() >= 2).await.unwrap();
    assert_eq!(reports.borrow()[1].deleted, std::slice::from_ref(&victim));
    assert!(
        reports.borrow()[1].applied.is_empty(),
        "{:?}",
        reports.borrow()
    );
    task.abort();
}

#[tokio::test]
async fn a_slice_changed_behind_the_publishers_back_is_restored_by_the_watch() {
    let server = server().await;
    let desired = three_slices();
    let _ = publisher(&server).sync(&desired).await.unwrap();
    let (task, mut reports) = publish_on_changes(&server, desired.clone());
    reports.wait_for(|r| !r.is_empty()).await.unwrap();

    // Another writer renames the device of s1.
    let api = other_client(&server);
    let mut s1 = api.get("s1").await.unwrap();
    s1.spec.devices.as_mut().unwrap()[0].name = "not-carves".into();
    let changed_rv = api
        .replace("s1", &Default::default(), &s1)
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let device_of = |s: &ApiServer| {
        s.store()
            .get(Resource::ResourceSlices, None, "s1")
            .and_then(|v| {
                v.pointer("/spec/devices/0/name")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
    };
    eventually(&server, "s1 restored", |s| {
        device_of(s).as_deref() == Some("gpu-1") && stored(s)["s1"].3 != changed_rv
    })
    .await;
    reports.wait_for(|r| r.len() >= 2).await.unwrap();
    assert_eq!(reports.borrow()[1].applied, ["s1"]);
    task.abort();
}

#[tokio::test]
async fn the_publishers_own_writes_are_not_reported_as_changes() {
    let server = server().await;
    let mut p = publisher(&server);
    let mut watch = p.watch();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("the watch's first list is reported");
    assert!(first.relisted && first.applied.is_empty() && first.deleted.is_empty());

    // Creates, then updates and a delete: all this publisher's own.
    let r = p.sync(three_slices()).await.unwrap();
    assert_eq!(r.created, 3);
    let mut fewer = three_slices();
    fewer.pop();
    for s in &mut fewer {
        s.spec.pool.resource_slice_count = 2;
    }
    let r = p.sync(&fewer).await.unwrap();
    assert_eq!((r.updated, r.deleted), (2, 1));
    // Nothing to report: the watch saw only those writes. (Waiting for a
    // report that must not come; a broken filter reports within the settle
    // time of 200 ms.)
    let seen = tokio::time::timeout(Duration::from_secs(2), watch.changed()).await;
    assert!(seen.is_err(), "own writes reported as {seen:?}");

    // Someone else's write is.
    insert(
        &server,
        &slice(NODE, DRIVER_NAME, "stray", 1, &[("gpu-9", "H100")]),
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("a stray slice is reported");
    assert_eq!(seen.applied, ["stray"]);
}

#[tokio::test]
async fn the_watch_ignores_other_nodes_and_drivers() {
    let server = server().await;
    let p = publisher(&server);
    let mut watch = p.watch();
    let _ = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .unwrap();
    insert(
        &server,
        &slice("node-b", DRIVER_NAME, "b0", 1, &[("gpu-0", "H100")]),
    );
    insert(
        &server,
        &slice(NODE, "other.example.com", "o0", 1, &[("gpu-0", "H100")]),
    );
    insert(
        &server,
        &slice(NODE, DRIVER_NAME, "mine", 1, &[("gpu-0", "H100")]),
    );
    let seen = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .unwrap();
    assert_eq!(seen.applied, ["mine"]);
}

/// The log lines written through `tracing` while the returned guard lives
/// (this thread only: the tests run on a current-thread runtime).
fn capture_logs() -> (
    std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    tracing::subscriber::DefaultGuard,
) {
    #[derive(Clone)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf(std::sync::Arc::default());
    let out = buf.0.clone();
    let sub = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || buf.clone())
        .finish();
    (out, tracing::subscriber::set_default(sub))
}

/// A clean start (publish, then watch) is no change behind the publisher's
/// back: the watch's first list is reported (what happened before it is
/// unknown, so the caller syncs) but not logged as someone else's change;
/// a slice someone else deletes is, as a warning naming it.
#[tokio::test]
async fn a_clean_start_logs_no_change_behind_the_publishers_back() {
    const WARNING: &str = "ResourceSlices changed behind the publisher's back";
    let (logs, _guard) = capture_logs();
    let text = || String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    let server = server().await;
    let desired = three_slices();
    let mut p = publisher(&server);
    assert_eq!(p.sync(&desired).await.unwrap().created, 3);
    let mut watch = p.watch();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("the watch's first list is reported");
    assert!(
        first.relisted && first.applied.is_empty() && first.deleted.is_empty(),
        "{first:?}"
    );
    let _ = p.sync(&desired).await.unwrap();
    assert!(!text().contains(WARNING), "on a clean start:\n{}", text());

    other_client(&server)
        .delete("s2", &Default::default())
        .await
        .unwrap();
    let seen = tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("the deletion is reported");
    assert_eq!(seen.deleted, ["s2"], "{seen:?}");
    let logged = text();
    let line = logged
        .lines()
        .find(|l| l.contains(WARNING))
        .unwrap_or_else(|| panic!("no warning for a deleted slice:\n{logged}"));
    assert!(line.contains("WARN") && line.contains("s2"), "{line}");
}
