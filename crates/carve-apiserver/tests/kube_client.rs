//! The real kube client against the stand-in server: CRUD, selectors,
//! optimistic concurrency, the status subresource, version and discovery.

use carve_apiserver::{ApiServer, KubeVersion, Options, Resource};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

fn slice(name: &str, node: &str, labels: serde_json::Value) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "driver": "gpu.carve.dev",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}]
        }
    }))
    .unwrap()
}

fn claim(name: &str) -> ResourceClaim {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.carve.dev"}}]}}
    }))
    .unwrap()
}

fn api_code(e: kube::Error) -> (u16, String, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason, s.message),
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn create_get_list_with_field_and_label_selectors() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    let pp = PostParams::default();
    slices
        .create(&pp, &slice("n1-a", "n1", json!({"tier": "gpu"})))
        .await
        .unwrap();
    slices
        .create(&pp, &slice("n1-b", "n1", json!({"tier": "cpu"})))
        .await
        .unwrap();
    let n2 = slices
        .create(&pp, &slice("n2-a", "n2", json!({"tier": "gpu"})))
        .await
        .unwrap();
    assert_eq!(n2.metadata.generation, Some(1));
    assert_eq!(n2.metadata.resource_version.as_deref(), Some("3"));
    assert!(n2.metadata.creation_timestamp.is_some());
    let uid = n2.metadata.uid.clone().unwrap();
    assert_eq!(uid.len(), 36);
    assert_eq!(uid, uid.to_lowercase());

    let got = slices.get("n2-a").await.unwrap();
    assert_eq!(got.spec.node_name.as_deref(), Some("n2"));
    assert_eq!(got.metadata.uid.as_deref(), Some(uid.as_str()));

    let names = |l: kube::api::ObjectList<ResourceSlice>| {
        l.items
            .into_iter()
            .map(|s| s.metadata.name.unwrap())
            .collect::<Vec<_>>()
    };
    let by_node = slices
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .unwrap();
    assert_eq!(by_node.metadata.resource_version.as_deref(), Some("3"));
    assert_eq!(names(by_node), ["n1-a", "n1-b"]);
    let both = ListParams::default()
        .fields("spec.nodeName=n1,spec.driver=gpu.carve.dev")
        .labels("tier=gpu");
    assert_eq!(names(slices.list(&both).await.unwrap()), ["n1-a"]);
    let not_gpu = ListParams::default().labels("tier!=gpu");
    assert_eq!(names(slices.list(&not_gpu).await.unwrap()), ["n1-b"]);
    let set = ListParams::default()
        .labels("tier in (cpu,gpu),tier")
        .fields("metadata.name!=n1-a");
    assert_eq!(names(slices.list(&set).await.unwrap()), ["n1-b", "n2-a"]);

    // Unsupported selectors name the field; duplicates and bad names are refused.
    let (code, reason, msg) = api_code(
        slices
            .list(&ListParams::default().fields("spec.bogus=1"))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (400, "BadRequest"));
    assert!(msg.contains("spec.bogus"), "{msg}");
    let (code, reason, msg) = api_code(
        slices
            .create(&pp, &slice("n1-a", "n1", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));
    assert!(msg.contains("n1-a"), "{msg}");
    let (code, _, msg) = api_code(
        slices
            .create(&pp, &slice("", "n1", json!({})))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 422);
    assert!(msg.contains("metadata.name"), "{msg}");
    let (code, reason, msg) = api_code(slices.get("nope").await.unwrap_err());
    assert_eq!((code, reason.as_str()), (404, "NotFound"));
    assert!(
        msg.contains("resourceslices.resource.k8s.io \"nope\""),
        "{msg}"
    );

    // generateName.
    let mut gen_slice = slice("", "n3", json!({}));
    gen_slice.metadata.generate_name = Some("n3-".into());
    let made = slices.create(&pp, &gen_slice).await.unwrap();
    let made_name = made.metadata.name.unwrap();
    assert!(
        made_name.starts_with("n3-") && made_name.len() == 8,
        "{made_name}"
    );
    assert_eq!(server.store().list(Resource::ResourceSlices).len(), 4);
}

#[tokio::test]
async fn wrong_kind_is_rejected_and_nothing_is_stored() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let client = server.client();
    let body = json!({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "x"}});
    let req = http::Request::post("/apis/resource.k8s.io/v1/resourceslices")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .unwrap();
    let (code, _, msg) = api_code(client.request_text(req).await.unwrap_err());
    assert_eq!(code, 400);
    assert!(
        msg.contains("DeviceClass") && msg.contains("ResourceSlice"),
        "{msg}"
    );
    let wrong_version = json!({"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceSlice", "metadata": {"name": "x"}});
    let req = http::Request::post("/apis/resource.k8s.io/v1/resourceslices")
        .body(serde_json::to_vec(&wrong_version).unwrap())
        .unwrap();
    let (code, _, msg) = api_code(client.request_text(req).await.unwrap_err());
    assert_eq!(code, 400);
    assert!(msg.contains("v1beta1"), "{msg}");
    assert!(server.store().list(Resource::ResourceSlices).is_empty());
    assert_eq!(server.store().resource_version(), 0);
}

#[tokio::test]
async fn stale_update_is_a_conflict_and_changes_nothing() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let claims: Api<ResourceClaim> = Api::default_namespaced(server.client());
    let created = claims
        .create(&PostParams::default(), &claim("c1"))
        .await
        .unwrap();
    assert_eq!(created.metadata.namespace.as_deref(), Some("default"));

    let mut first = created.clone();
    first.metadata.labels = Some([("a".to_string(), "1".to_string())].into());
    let updated = claims
        .replace("c1", &PostParams::default(), &first)
        .await
        .unwrap();
    assert_ne!(
        updated.metadata.resource_version,
        created.metadata.resource_version
    );
    // Metadata-only change: generation stays.
    assert_eq!(updated.metadata.generation, Some(1));

    let mut stale = created.clone();
    stale.metadata.labels = Some([("a".to_string(), "2".to_string())].into());
    let (code, reason, msg) = api_code(
        claims
            .replace("c1", &PostParams::default(), &stale)
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert!(msg.contains("the object has been modified"), "{msg}");
    let now = claims.get("c1").await.unwrap();
    assert_eq!(now.metadata.labels.unwrap()["a"], "1");
    assert_eq!(
        now.metadata.resource_version,
        updated.metadata.resource_version
    );

    // A merge patch carrying a stale resourceVersion is refused as well.
    let patch = json!({"metadata": {"resourceVersion": created.metadata.resource_version, "labels": {"b": "1"}}});
    let (code, _, _) = api_code(
        claims
            .patch("c1", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 409);
}

#[tokio::test]
async fn status_subresource_is_separate_from_the_main_endpoint() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(server.client(), "ns1");
    // Status sent on create is dropped, as by the real ResourceClaim strategy.
    let mut with_status = claim("c1");
    with_status.status = serde_json::from_value(
        json!({"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}),
    )
    .unwrap();
    let created = claims
        .create(&PostParams::default(), &with_status)
        .await
        .unwrap();
    assert!(created.status.is_none());

    let status_patch = json!({
        "spec": {"devices": {"requests": []}},
        "metadata": {"labels": {"ignored": "yes"}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.carve.dev", "pool": "n1", "device": "gpu-0-mig-1g10gb-3"}
        ]}}}
    });
    let patched = claims
        .patch_status("c1", &PatchParams::default(), &Patch::Merge(&status_patch))
        .await
        .unwrap();
    let results = patched
        .status
        .as_ref()
        .unwrap()
        .allocation
        .as_ref()
        .unwrap()
        .devices
        .as_ref()
        .unwrap()
        .results
        .clone()
        .unwrap();
    assert_eq!(results[0].device, "gpu-0-mig-1g10gb-3");
    assert_eq!(
        patched.spec, created.spec,
        "status patch must not change spec"
    );
    assert!(
        patched.metadata.labels.is_none(),
        "status patch must not change labels"
    );
    assert_eq!(patched.metadata.generation, Some(1));

    // A normal update keeps status even when the body drops it, and bumps generation on spec change.
    let mut no_status = patched.clone();
    no_status.status = None;
    no_status
        .spec
        .devices
        .as_mut()
        .unwrap()
        .requests
        .as_mut()
        .unwrap()[0]
        .name = "gpu2".into();
    let replaced = claims
        .replace("c1", &PostParams::default(), &no_status)
        .await
        .unwrap();
    assert_eq!(replaced.status, patched.status);
    assert_eq!(replaced.metadata.generation, Some(2));

    // Status replace via PUT /status.
    let mut cleared = replaced.clone();
    cleared.status = None;
    let after = claims
        .replace_status("c1", &PostParams::default(), &cleared)
        .await
        .unwrap();
    assert!(after.status.is_none());
    assert_eq!(after.spec, replaced.spec);
}

#[tokio::test]
async fn delete_single_and_collection_and_finalizers() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let classes: Api<DeviceClass> = Api::all(server.client());
    for (name, lbl) in [("a", "x"), ("b", "x"), ("c", "y")] {
        let dc: DeviceClass = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"l": lbl}}, "spec": {}
        }))
        .unwrap();
        classes.create(&PostParams::default(), &dc).await.unwrap();
    }
    let gone = classes.delete("c", &DeleteParams::default()).await.unwrap();
    assert_eq!(gone.left().unwrap().metadata.name.as_deref(), Some("c"));
    let (code, _, _) = api_code(
        classes
            .delete("c", &DeleteParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 404);
    let removed = classes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("l=x"),
        )
        .await
        .unwrap();
    assert_eq!(removed.left().unwrap().items.len(), 2);
    assert!(
        classes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // A finalizer keeps the object until it is removed.
    let dc: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "f", "finalizers": ["carve.dev/x"]}, "spec": {}
    }))
    .unwrap();
    classes.create(&PostParams::default(), &dc).await.unwrap();
    classes.delete("f", &DeleteParams::default()).await.unwrap();
    let pending = classes.get("f").await.unwrap();
    assert!(pending.metadata.deletion_timestamp.is_some());
    let clear = json!({"metadata": {"finalizers": null}});
    classes
        .patch("f", &PatchParams::default(), &Patch::Merge(&clear))
        .await
        .unwrap();
    assert_eq!(api_code(classes.get("f").await.unwrap_err()).0, 404);
}

#[tokio::test]
async fn json_patch_and_strategic_merge_patch() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    slices
        .create(&PostParams::default(), &slice("s", "n1", json!({"a": "1"})))
        .await
        .unwrap();
    let client = server.client();
    let patch = |ctype: &str, body: serde_json::Value| {
        http::Request::patch("/apis/resource.k8s.io/v1/resourceslices/s")
            .header("content-type", ctype)
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    client
        .request_text(patch(
            "application/json-patch+json",
            json!([{"op": "test", "path": "/metadata/labels/a", "value": "1"},
                   {"op": "replace", "path": "/spec/nodeName", "value": "n9"}]),
        ))
        .await
        .unwrap();
    let s = slices.get("s").await.unwrap();
    assert_eq!(s.spec.node_name.as_deref(), Some("n9"));
    assert_eq!(s.metadata.generation, Some(2));
    // A failing test op changes nothing.
    let rv = s.metadata.resource_version.clone();
    let (code, _, msg) = api_code(
        client
            .request_text(patch(
                "application/json-patch+json",
                json!([{"op": "replace", "path": "/spec/nodeName", "value": "n7"},
                       {"op": "test", "path": "/metadata/labels/a", "value": "2"}]),
            ))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 422);
    assert!(msg.contains("operation 1"), "{msg}");
    assert_eq!(slices.get("s").await.unwrap().metadata.resource_version, rv);
    // Strategic merge patch is applied as a merge patch.
    let smp = json!({"metadata": {"labels": {"b": "2"}}});
    let s = slices
        .patch("s", &PatchParams::default(), &Patch::Strategic(&smp))
        .await
        .unwrap();
    assert_eq!(s.metadata.labels.unwrap().len(), 2);
    // Server-side apply is refused with 415.
    let apply = PatchParams::apply("test");
    let (code, _, _) = api_code(
        slices
            .patch("s", &apply, &Patch::Apply(&slice("s", "n1", json!({}))))
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 415);
}

#[tokio::test]
async fn version_is_reported_and_changeable() {
    let server = ApiServer::start(Options {
        version: KubeVersion {
            major: 1,
            minor: 34,
        },
        ..Options::default()
    })
    .await
    .unwrap();
    let client = server.client();
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(
        (v.major.as_str(), v.minor.as_str(), v.git_version.as_str()),
        ("1", "34", "v1.34.0")
    );
    server.set_version(KubeVersion {
        major: 1,
        minor: 36,
    });
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(
        (v.minor.as_str(), v.git_version.as_str()),
        ("36", "v1.36.0")
    );
}

#[tokio::test]
async fn kube_discovery_finds_the_resources() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let discovery = kube::Discovery::new(server.client()).run().await.unwrap();
    let group = discovery.get("resource.k8s.io").expect("group discovered");
    let kinds: Vec<String> = group
        .recommended_resources()
        .into_iter()
        .map(|(ar, _)| ar.kind)
        .collect();
    for k in ["DeviceClass", "ResourceClaim", "ResourceSlice"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing from {kinds:?}");
    }
}

#[tokio::test]
async fn write_counters_count_exactly() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let claims: Api<ResourceClaim> = Api::default_namespaced(server.client());
    claims
        .create(&PostParams::default(), &claim("warmup"))
        .await
        .unwrap();
    server.reset_stats();
    assert_eq!(server.stats().requests, 0);

    let c = claims
        .create(&PostParams::default(), &claim("c"))
        .await
        .unwrap();
    claims.get("c").await.unwrap();
    claims.list(&ListParams::default()).await.unwrap();
    claims
        .replace("c", &PostParams::default(), &c)
        .await
        .unwrap();
    let p = json!({"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}});
    claims
        .patch_status("c", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    claims.delete("c", &DeleteParams::default()).await.unwrap();
    let all: Api<ResourceClaim> = Api::all(server.client());
    all.list(&ListParams::default()).await.unwrap();

    let stats = server.stats();
    assert_eq!(stats.requests, 7);
    assert_eq!(stats.writes, 4);
    assert_eq!(stats.count("create", "resourceclaims"), 1);
    assert_eq!(stats.count("update", "resourceclaims"), 1);
    assert_eq!(stats.count("patch", "resourceclaims/status"), 1);
    assert_eq!(stats.count("delete", "resourceclaims"), 1);
    assert_eq!(stats.count("list", "resourceclaims"), 2);
    assert_eq!(stats.count("get", "resourceclaims"), 1);
    let log = server.request_log();
    assert_eq!(log.len(), 7);
    assert_eq!((log[0].method.as_str(), log[0].status), ("POST", 201));
    assert_eq!(log[6].path, "/apis/resource.k8s.io/v1/resourceclaims");

    // Reads only: zero writes.
    server.reset_stats();
    all.list(&ListParams::default()).await.unwrap();
    assert_eq!((server.stats().requests, server.stats().writes), (1, 0));
}

#[tokio::test]
async fn store_handle_sees_and_feeds_http() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let store = server.store();
    let inserted = store
        .insert(
            Resource::ResourceClaims,
            json!({"metadata": {"name": "pre", "namespace": "default"}, "spec": {},
                   "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}}),
        )
        .unwrap();
    assert_eq!(inserted["kind"], "ResourceClaim");
    let claims: Api<ResourceClaim> = Api::default_namespaced(server.client());
    let got = claims.get("pre").await.unwrap();
    assert!(got.status.is_some(), "insert keeps status");
    assert_eq!(server.stats().writes, 0);
    claims
        .delete("pre", &DeleteParams::default())
        .await
        .unwrap();
    assert!(
        store
            .get(Resource::ResourceClaims, Some("default"), "pre")
            .is_none()
    );
    let err = store
        .insert(
            Resource::DeviceClasses,
            json!({"kind": "ResourceSlice", "metadata": {"name": "x"}}),
        )
        .unwrap_err();
    assert!(err.to_string().contains("ResourceSlice"), "{err}");
}

#[tokio::test]
async fn namespace_dry_run_and_delete_preconditions() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let client = server.client();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "ns1");

    // Body namespace must match the URL.
    let mut elsewhere = claim("c");
    elsewhere.metadata.namespace = Some("ns2".into());
    let (code, _, msg) = api_code(
        claims
            .create(&PostParams::default(), &elsewhere)
            .await
            .unwrap_err(),
    );
    assert_eq!(code, 400);
    assert!(msg.contains("ns2") && msg.contains("ns1"), "{msg}");
    // Creating through the cluster-wide path of a namespaced resource is not allowed.
    let req = http::Request::post("/apis/resource.k8s.io/v1/resourceclaims")
        .body(serde_json::to_vec(&claim("c")).unwrap())
        .unwrap();
    assert_eq!(api_code(client.request_text(req).await.unwrap_err()).0, 405);

    // dryRun validates but stores nothing.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let would = claims.create(&dry, &claim("c")).await.unwrap();
    assert_eq!(would.metadata.name.as_deref(), Some("c"));
    assert!(server.store().list(Resource::ResourceClaims).is_empty());
    assert_eq!(server.store().resource_version(), 0);

    // Delete preconditions: a wrong uid is a conflict and deletes nothing.
    let made = claims
        .create(&PostParams::default(), &claim("c"))
        .await
        .unwrap();
    let wrong = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let (code, _, msg) = api_code(claims.delete("c", &wrong).await.unwrap_err());
    assert_eq!(code, 409);
    assert!(msg.contains("not-the-uid"), "{msg}");
    let right = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: made.metadata.uid.clone(),
            resource_version: made.metadata.resource_version.clone(),
        }),
        ..DeleteParams::default()
    };
    claims.delete("c", &right).await.unwrap();
    assert!(server.store().list(Resource::ResourceClaims).is_empty());
}
