//! Fault injection as the kube client sees it, and restarting on the same port.

use carve_apiserver::{ApiServer, Fault, Options};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

fn class(name: &str) -> DeviceClass {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": {}})).unwrap()
}

fn code(e: kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

#[tokio::test]
async fn fail_next_hits_only_matching_requests_then_clears() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let classes: Api<DeviceClass> = Api::all(server.client());
    let slices: Api<ResourceSlice> = Api::all(server.client());
    server.inject(Fault::FailNext {
        count: 2,
        status: 500,
        writes_only: true,
        resource: Some("deviceclasses".into()),
    });
    // Reads and other resources pass.
    classes.list(&ListParams::default()).await.unwrap();
    slices.list(&ListParams::default()).await.unwrap();
    let err = classes
        .create(&PostParams::default(), &class("a"))
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(s) => {
            assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
            assert!(s.message.contains("injected"), "{}", s.message);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        code(
            classes
                .create(&PostParams::default(), &class("a"))
                .await
                .unwrap_err()
        ),
        500
    );
    assert!(
        server
            .store()
            .list(carve_apiserver::Resource::DeviceClasses)
            .is_empty(),
        "a failed write stores nothing"
    );
    classes
        .create(&PostParams::default(), &class("a"))
        .await
        .unwrap();
    let stats = server.stats();
    assert_eq!(
        (stats.writes, stats.count("create", "deviceclasses")),
        (3, 3)
    );
}

#[tokio::test]
async fn injected_503_and_409_reach_a_non_retrying_client_once() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let classes: Api<DeviceClass> = Api::all(server.client());
    server.inject(Fault::FailNext {
        count: 1,
        status: 503,
        writes_only: false,
        resource: None,
    });
    server.inject(Fault::FailNext {
        count: 1,
        status: 409,
        writes_only: false,
        resource: None,
    });
    assert_eq!(
        code(server.client().apiserver_version().await.unwrap_err()),
        503
    );
    assert_eq!(code(classes.get("x").await.unwrap_err()), 409);
    assert_eq!(code(classes.get("x").await.unwrap_err()), 404);
    assert_eq!(server.stats().requests, 3);
}

#[tokio::test]
async fn kube_default_retry_rides_over_a_single_503() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let client = kube::Client::try_from(server.config()).unwrap();
    server.inject(Fault::FailNext {
        count: 1,
        status: 503,
        writes_only: false,
        resource: None,
    });
    client.apiserver_version().await.unwrap();
    assert_eq!(server.stats().count("get", "/version"), 2);
}

#[tokio::test]
async fn down_gives_transport_errors_and_up_recovers() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let classes: Api<DeviceClass> = Api::all(server.client());
    classes
        .create(&PostParams::default(), &class("a"))
        .await
        .unwrap();
    server.inject(Fault::Down);
    for _ in 0..2 {
        match classes.get("a").await {
            Err(kube::Error::Api(s)) => panic!("expected a transport error, got status {s:?}"),
            Err(_) => {}
            Ok(_) => panic!("request succeeded while down"),
        }
    }
    server.inject(Fault::Up);
    assert_eq!(
        classes.get("a").await.unwrap().metadata.name.as_deref(),
        Some("a")
    );
}

#[tokio::test]
async fn restart_on_the_same_port_keeps_state() {
    let server = ApiServer::start(Options::default()).await.unwrap();
    let addr = server.addr();
    let store = server.store();
    let client = server.client();
    let classes: Api<DeviceClass> = Api::all(client.clone());
    classes
        .create(&PostParams::default(), &class("a"))
        .await
        .unwrap();
    server.shutdown().await;
    assert!(
        classes.get("a").await.is_err(),
        "nothing listens after shutdown"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "port is closed"
    );

    let again = ApiServer::start_with_store(
        Options {
            addr,
            ..Options::default()
        },
        store,
    )
    .await
    .unwrap();
    assert_eq!(again.url(), format!("http://{addr}"));
    // The same client reconnects.
    let got = classes.get("a").await.unwrap();
    assert_eq!(got.metadata.resource_version.as_deref(), Some("1"));
    classes
        .create(&PostParams::default(), &class("b"))
        .await
        .unwrap();
    assert_eq!(again.store().resource_version(), 2);
}

#[tokio::test]
async fn serve_runs_until_shutdown_future_completes() {
    // Find a free port, then serve on it.
    let probe = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(carve_apiserver::serve(
        Options {
            addr,
            ..Options::default()
        },
        async move {
            let _ = stopped.await;
        },
    ));
    let client =
        kube::Client::try_from(kube::Config::new(format!("http://{addr}").parse().unwrap()))
            .unwrap();
    // Readiness: retry connecting until the listener is bound (no sleeps; bounded attempts).
    let mut version = None;
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            version = Some(client.apiserver_version().await.unwrap());
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(version.expect("server came up").minor, "35");
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
