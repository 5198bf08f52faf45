//! Watches through `kube::Api::watch`: event order, 410 Gone, selectors,
//! bookmarks, timeouts, initial events, and the server going away.

use carve_apiserver::{ApiServer, Fault, Options};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::json;

fn slice(name: &str, node: &str) -> ResourceSlice {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"carve.dev/managed": "true"}},
        "spec": {"driver": "gpu.carve.dev", "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}
    }))
    .unwrap()
}

/// (type, name, resourceVersion) of an event.
fn describe(e: WatchEvent<ResourceSlice>) -> (String, String, u64) {
    let (t, obj) = match e {
        WatchEvent::Added(o) => ("ADDED", o),
        WatchEvent::Modified(o) => ("MODIFIED", o),
        WatchEvent::Deleted(o) => ("DELETED", o),
        other => panic!("unexpected event {other:?}"),
    };
    (
        t.to_string(),
        obj.metadata.name.unwrap(),
        obj.metadata.resource_version.unwrap().parse().unwrap(),
    )
}

#[tokio::test]
async fn watch_delivers_added_modified_deleted_in_order() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    slices
        .create(&PostParams::default(), &slice("before", "n0"))
        .await
        .unwrap();
    let rv = slices
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();

    let mut stream = slices
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    slices
        .create(&PostParams::default(), &slice("s", "n1"))
        .await
        .unwrap();
    let p = json!({"spec": {"nodeName": "n2"}});
    slices
        .patch("s", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    slices.delete("s", &DeleteParams::default()).await.unwrap();

    let mut seen = Vec::new();
    while seen.len() < 3 {
        match stream
            .try_next()
            .await
            .unwrap()
            .expect("stream ended early")
        {
            WatchEvent::Bookmark(_) => continue,
            e => seen.push(describe(e)),
        }
    }
    let kinds: Vec<_> = seen
        .iter()
        .map(|(t, n, _)| (t.as_str(), n.as_str()))
        .collect();
    assert_eq!(kinds, [("ADDED", "s"), ("MODIFIED", "s"), ("DELETED", "s")]);
    let rvs: Vec<u64> = seen.iter().map(|e| e.2).collect();
    assert_eq!(
        rvs,
        [2, 3, 4],
        "resourceVersions strictly increase from the watch start"
    );
}

#[tokio::test]
async fn watch_from_a_compacted_version_gets_410_gone() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    for n in ["a", "b", "c"] {
        slices
            .create(&PostParams::default(), &slice(n, n))
            .await
            .unwrap();
    }
    server.store().compact();
    let mut stream = slices
        .watch(&WatchParams::default(), "1")
        .await
        .unwrap()
        .boxed();
    match stream.try_next().await.unwrap() {
        Some(WatchEvent::Error(status)) => {
            assert_eq!((status.code, status.reason.as_str()), (410, "Expired"));
            assert!(
                status.message.contains("too old resource version"),
                "{}",
                status.message
            );
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    assert!(
        stream.try_next().await.unwrap().is_none(),
        "stream ends after 410"
    );
    // The current version is still watchable.
    let mut ok = slices
        .watch(&WatchParams::default(), "3")
        .await
        .unwrap()
        .boxed();
    slices
        .create(&PostParams::default(), &slice("d", "d"))
        .await
        .unwrap();
    assert_eq!(describe(ok.try_next().await.unwrap().unwrap()).1, "d");
}

#[tokio::test]
async fn watch_honours_selectors_with_transitions() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    let wp = WatchParams::default()
        .fields("spec.nodeName=n1")
        .disable_bookmarks();
    let mut stream = slices.watch(&wp, "0").await.unwrap().boxed();
    slices
        .create(&PostParams::default(), &slice("other", "n2"))
        .await
        .unwrap();
    slices
        .create(&PostParams::default(), &slice("mine", "n1"))
        .await
        .unwrap();
    // Moves out of the selection: seen as DELETED; back in: ADDED.
    let out = json!({"spec": {"nodeName": "n3"}});
    slices
        .patch("mine", &PatchParams::default(), &Patch::Merge(&out))
        .await
        .unwrap();
    let back = json!({"spec": {"nodeName": "n1"}});
    slices
        .patch("other", &PatchParams::default(), &Patch::Merge(&back))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (t, n, _) = describe(stream.try_next().await.unwrap().unwrap());
        seen.push(format!("{t} {n}"));
    }
    assert_eq!(seen, ["ADDED mine", "DELETED mine", "ADDED other"]);
}

#[tokio::test]
async fn watch_without_version_starts_with_current_state_and_times_out() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    slices
        .create(&PostParams::default(), &slice("a", "n1"))
        .await
        .unwrap();
    slices
        .create(&PostParams::default(), &slice("b", "n2"))
        .await
        .unwrap();
    let wp = WatchParams::default().timeout(1).disable_bookmarks();
    let events: Vec<_> = slices
        .watch(&wp, "0")
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    let names: Vec<_> = events
        .into_iter()
        .map(describe)
        .map(|(t, n, _)| format!("{t} {n}"))
        .collect();
    assert_eq!(
        names,
        ["ADDED a", "ADDED b"],
        "synthetic ADDED, then the stream ends at timeoutSeconds"
    );
}

#[tokio::test]
async fn bookmarks_and_initial_events_end() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    slices
        .create(&PostParams::default(), &slice("a", "n1"))
        .await
        .unwrap();
    let wp = WatchParams::streaming_lists();
    let mut stream = slices.watch(&wp, "").await.unwrap().boxed();
    assert_eq!(describe(stream.try_next().await.unwrap().unwrap()).1, "a");
    match stream.try_next().await.unwrap().unwrap() {
        WatchEvent::Bookmark(b) => {
            assert_eq!(b.metadata.resource_version, "1");
            assert_eq!(
                b.metadata
                    .annotations
                    .get("k8s.io/initial-events-end")
                    .map(String::as_str),
                Some("true")
            );
        }
        other => panic!("expected the initial-events-end bookmark, got {other:?}"),
    }
    slices
        .create(&PostParams::default(), &slice("b", "n2"))
        .await
        .unwrap();
    assert_eq!(describe(stream.try_next().await.unwrap().unwrap()).1, "b");
    server.send_bookmarks();
    match stream.try_next().await.unwrap().unwrap() {
        WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, "2"),
        other => panic!("expected a bookmark, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_ends_when_the_server_goes_down() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let slices: Api<ResourceSlice> = Api::all(server.client());
    let mut stream = slices
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    server.inject(Fault::Down);
    // The stream ends (kube turns the cut connection into end-of-stream or an error).
    while let Ok(Some(_)) = stream.try_next().await {}
    server.inject(Fault::Up);
    let mut again = slices
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    slices
        .create(&PostParams::default(), &slice("x", "n1"))
        .await
        .unwrap();
    assert_eq!(describe(again.try_next().await.unwrap().unwrap()).1, "x");
}
