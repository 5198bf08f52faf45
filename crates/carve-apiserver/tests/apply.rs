//! Server-side apply of a ResourceClaim's `status.devices` through the real
//! kube client: what the stand-in models of the API server's apply (see its
//! `apply` module), and what it refuses.

use carve_apiserver::{ApiServer, Options};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

fn entry(driver: &str, device: &str, message: &str) -> Value {
    json!({"driver": driver, "pool": "node-a", "device": device,
        "conditions": [{"type": "Ready", "status": "True", "reason": "R", "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]})
}

fn config(entries: &[Value]) -> Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "status": {"devices": entries}})
}

fn code(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.message),
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn devices(claims: &Api<ResourceClaim>) -> Vec<(String, String, String)> {
    let c = claims.get("c").await.unwrap();
    c.status
        .and_then(|s| s.devices)
        .unwrap_or_default()
        .into_iter()
        .map(|d| {
            let msg = d.conditions.unwrap_or_default()[0].message.clone();
            (d.driver, d.device, msg)
        })
        .collect()
}

#[tokio::test]
async fn apply_keeps_other_managers_entries_and_drops_only_the_managers_own() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let claims: Api<ResourceClaim> = Api::namespaced(server.client(), "default");
    let c: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c"}, "spec": {"devices": {"requests": []}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &c).await.unwrap();
    let carve = PatchParams::apply("gpu.carve.dev").force();
    let other = PatchParams::apply("net.example.com");

    // A merge patch of another writer, then two managers' applies.
    claims
        .patch_status(
            "c",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"devices": [entry("old.example.com", "x", "")]}})),
        )
        .await
        .unwrap();
    let two = [
        entry("gpu.carve.dev", "gpu-0", "a"),
        entry("gpu.carve.dev", "gpu-1", "a"),
    ];
    claims
        .patch_status("c", &carve, &Patch::Apply(config(&two)))
        .await
        .unwrap();
    claims
        .patch_status(
            "c",
            &other,
            &Patch::Apply(config(&[entry("net.example.com", "nic-0", "")])),
        )
        .await
        .unwrap();
    assert_eq!(devices(&claims).await.len(), 4);

    // carve re-applies one of its two entries, changed: the other of its
    // own goes, nobody else's does.
    claims
        .patch_status(
            "c",
            &carve,
            &Patch::Apply(config(&[entry("gpu.carve.dev", "gpu-0", "b")])),
        )
        .await
        .unwrap();
    let mut got = devices(&claims).await;
    got.sort();
    assert_eq!(
        got,
        [
            ("gpu.carve.dev".into(), "gpu-0".into(), "b".into()),
            ("net.example.com".into(), "nic-0".into(), String::new()),
            ("old.example.com".into(), "x".into(), String::new()),
        ]
    );

    // Changing an entry it does not own: a conflict, unless forced.
    let theirs = config(&[entry("net.example.com", "nic-0", "mine now")]);
    let (status, msg) = code(
        claims
            .patch_status(
                "c",
                &PatchParams::apply("gpu.carve.dev"),
                &Patch::Apply(theirs.clone()),
            )
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 409, "{msg}");
    assert!(msg.contains("Apply failed with 1 conflict"), "{msg}");
    assert!(msg.contains(r#""device":"nic-0""#), "{msg}");
    claims
        .patch_status("c", &carve, &Patch::Apply(theirs))
        .await
        .unwrap();

    // An apply without a field manager, of the main resource, or of another
    // status field is refused.
    let no_manager = PatchParams::default();
    let (status, msg) = code(
        claims
            .patch_status("c", &no_manager, &Patch::Apply(config(&[])))
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 400, "{msg}");
    assert!(msg.contains("fieldManager"), "{msg}");
    let (status, _) = code(
        claims
            .patch("c", &carve, &Patch::Apply(config(&[])))
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 415);
    let mut alloc = config(&[]);
    alloc["status"]["reservedFor"] = json!([]);
    let (status, msg) = code(
        claims
            .patch_status("c", &carve, &Patch::Apply(alloc))
            .await
            .unwrap_err(),
    );
    assert_eq!(status, 415, "{msg}");
    server.shutdown().await;
}
