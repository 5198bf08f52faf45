//! End to end: the plugin in-process over the real sockets, the real
//! `NvmlBackend` over the NVML simulator library, the real kube client against
//! the API-server stand-in.

mod common;

use std::sync::Arc;

use carve_apiserver::{ApiServer, Resource};
use carve_gpu::GpuBackend;
use carve_model::{DeviceName, GpuModel};
use carve_plugin::testing::FakeKubelet;
use carve_plugin::{CdiSpec, ClaimRef, Driver, PluginConfig, claim_spec_path, serve};
use common::*;
use nvidia_ml_sim::GpuEntry;

struct Running {
    driver: Arc<Driver>,
    backend: Arc<dyn GpuBackend>,
    kubelet: FakeKubelet,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    serving: Option<carve_plugin::Serving>,
}

impl Running {
    async fn start(node: &Node, api: &ApiServer, config: PluginConfig) -> Self {
        Self::start_with(node.backend(), api, config).await
    }

    async fn start_with(
        backend: Arc<dyn GpuBackend>,
        api: &ApiServer,
        config: PluginConfig,
    ) -> Self {
        let driver = Arc::new(
            Driver::new(config.clone(), backend.clone(), api.client())
                .await
                .unwrap(),
        );
        driver.recover().await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let serving = serve(driver.clone(), async move {
            let _ = rx.await;
        })
        .await
        .unwrap();
        let mut reg = serving.registration();
        let kubelet = FakeKubelet::register(&serving.paths.registration, "gpu.carve.dev")
            .await
            .unwrap();
        assert_eq!(reg.wait().await, Ok(()));
        Self {
            driver,
            backend,
            kubelet,
            stop: Some(tx),
            serving: Some(serving),
        }
    }

    async fn stop(mut self) {
        let paths = self.serving.as_ref().unwrap().paths.clone();
        let _ = self.stop.take().unwrap().send(());
        self.serving.take().unwrap().wait().await.unwrap();
        assert!(
            !paths.registration.exists() && !paths.dra.exists(),
            "sockets removed at shutdown"
        );
    }
}

async fn prepare_ok(k: &FakeKubelet, c: &ClaimRef) -> Vec<carve_proto::dra_v1::Device> {
    let r = k.prepare(std::slice::from_ref(c)).await.unwrap();
    let cr = &r.claims[&c.uid];
    assert_eq!(cr.error, "", "prepare {c}");
    cr.devices.clone()
}

async fn unprepare_ok(k: &FakeKubelet, c: &ClaimRef) {
    let r = k.unprepare(std::slice::from_ref(c)).await.unwrap();
    assert_eq!(r.claims[&c.uid].error, "", "unprepare {c}");
}

/// Every profile and placement of a model: prepare puts the GI exactly there
/// with a full CI, the CDI spec has the right nodes and env, unprepare removes
/// everything (and on Hopper returns MIG mode to off).
async fn every_placement(model: &str, mig_initially: bool) -> usize {
    let node = Node::new(vec![GpuEntry::new(model, 1, mig_initially)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let spec = GpuModel::find(model).unwrap().spec();
    let mut n = 0;
    for prof in &spec.profiles {
        for pl in &prof.placements {
            n += 1;
            let dev = DeviceName::mig(0, &prof.name, pl.start)
                .unwrap()
                .to_string();
            let uid = format!("uid-{n}");
            let c = put_claim(
                &api,
                &format!("c{n}"),
                &uid,
                &[("req/sub", &dev)],
                serde_json::json!([]),
            );
            let devs = prepare_ok(&p.kubelet, &c).await;
            assert_eq!(devs.len(), 1);
            assert_eq!(devs[0].device_name, dev);
            assert_eq!(devs[0].pool_name, NODE);
            assert_eq!(devs[0].request_names, ["req"]);
            let cdi_name = format!("{uid}-{dev}");
            assert_eq!(
                devs[0].cdi_device_ids,
                [format!("k8s.gpu.carve.dev/claim={cdi_name}")]
            );

            let gis = live(&*p.backend, 0);
            assert_eq!(gis.len(), 1, "{dev}: exactly one GI");
            assert_eq!(
                gis[0].placement, *pl,
                "{dev}: GI at the allocated placement"
            );
            assert_eq!(gis[0].profile_id, prof.id);
            assert_eq!(gis[0].compute_instances.len(), 1);
            let mig_uuid = gis[0].compute_instances[0].mig_uuid.clone().unwrap();

            let spec_path = claim_spec_path(&node.config.cdi_dir, &uid);
            let cdi = CdiSpec::read(&spec_path).expect("CDI spec written");
            assert_eq!(cdi.kind, "k8s.gpu.carve.dev/claim");
            assert_eq!(cdi.devices.len(), 1);
            assert_eq!(cdi.devices[0].name, cdi_name);
            let e = &cdi.devices[0].container_edits;
            // Issue 16: no per-device visible-device variables (two devices in
            // one container would overwrite each other); `void` at spec level.
            assert!(
                !e.env.iter().any(|v| v.contains("VISIBLE_DEVICES")),
                "{:?} ({mig_uuid})",
                e.env
            );
            let common = cdi.container_edits.as_ref().expect("spec-level edits");
            assert!(
                common
                    .env
                    .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
            );
            assert!(
                common
                    .mounts
                    .iter()
                    .any(|m| m.container_path.ends_with("/libcuda.so.1"))
            );
            let nodes: Vec<&str> = e.device_nodes.iter().map(|d| d.path.as_str()).collect();
            // The control nodes are spec-level edits now.
            assert_eq!(&nodes[..1], ["/dev/nvidia0"]);
            let gi = gis[0].id;
            let ci = gis[0].compute_instances[0].id;
            let gi_cap = p.backend.capability_minor(0, gi, None).unwrap();
            let ci_cap = p.backend.capability_minor(0, gi, Some(ci)).unwrap();
            assert_eq!(
                &nodes[1..],
                [
                    format!("/dev/nvidia-caps/nvidia-cap{gi_cap}"),
                    format!("/dev/nvidia-caps/nvidia-cap{ci_cap}")
                ]
            );
            for n in &e.device_nodes[1..] {
                assert_eq!(n.dev_type.as_deref(), Some("c"), "{n:?}");
                assert_eq!(
                    n.major,
                    Some(i64::from(nvidia_ml_sim::driver_root::CAPS_MAJOR))
                );
            }

            unprepare_ok(&p.kubelet, &c).await;
            assert!(
                live(&*p.backend, 0).is_empty(),
                "{dev}: unprepare removed the GI"
            );
            assert!(!spec_path.exists(), "{dev}: CDI spec removed");
            let m = p.backend.mig_mode(0).unwrap();
            assert_eq!(
                m.current, mig_initially,
                "{dev}: MIG mode back to its initial state"
            );
        }
    }
    assert!(p.driver.snapshot().await.claims.is_empty());
    p.stop().await;
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_h100_80gb_profile_and_placement() {
    let n = every_placement("h100-80gb", false).await;
    eprintln!("h100-80gb: {n} profile placements prepared and unprepared");
    assert!(n >= 19, "covered {n} placements");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_a100_40gb_profile_and_placement() {
    // Ampere: MIG mode changes need a reset, so the GPU starts with MIG on.
    let n = every_placement("a100-40gb", true).await;
    eprintln!("a100-40gb: {n} profile placements prepared and unprepared");
    assert!(n >= 18, "covered {n} placements");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_versions_status_and_v1beta1() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    assert_eq!(
        p.kubelet.info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    );
    assert_eq!(p.kubelet.info.r#type, "DRAPlugin");
    let paths = p.serving.as_ref().unwrap().paths.clone();
    assert_eq!(p.kubelet.info.endpoint, paths.dra.to_string_lossy());
    use std::os::unix::fs::PermissionsExt;
    for s in [&paths.registration, &paths.dra] {
        assert_eq!(
            std::fs::metadata(s).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-1g10gb-2")],
        serde_json::json!([]),
    );
    let r = p
        .kubelet
        .prepare_v1beta1(std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(r.claims["u-1"].error, "");
    assert_eq!(r.claims["u-1"].devices[0].device_name, "gpu-0-mig-1g10gb-2");
    // Status written back through the status subresource.
    let obj = claim_with_status(&api, "c").await;
    let d = &obj["status"]["devices"][0];
    assert_eq!(d["driver"], "gpu.carve.dev");
    assert_eq!(d["device"], "gpu-0-mig-1g10gb-2");
    assert_eq!(d["conditions"][0]["type"], "Ready");
    assert_eq!(d["data"]["profile"], "1g.10gb");
    assert_eq!(d["data"]["placement"]["start"], 2);
    assert!(d["data"]["uuid"].as_str().unwrap().starts_with("MIG-"));
    unprepare_ok(&p.kubelet, &c).await;
    p.stop().await;
}

/// Another driver's `status.devices` entry, written between the plugin's
/// read of the claim and its status write, survives that write: the plugin
/// applies its own entries under its own field manager (server-side apply)
/// instead of writing back the list it read. The stand-in holds the
/// plugin's write for 3 s after it arrives; the other driver applies its
/// entry meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_write_keeps_another_drivers_entry_written_meanwhile() {
    use kube::api::{Api, Patch, PatchParams};
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_device_claim(&api, "c", "u-1", "gpu-0-mig-1g10gb-2");
    api.inject(carve_apiserver::Fault::DelayNext {
        count: 1,
        delay: std::time::Duration::from_secs(3),
        writes_only: true,
        resource: Some("resourceclaims".into()),
    });
    let r = p
        .kubelet
        .prepare_v1beta1(std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(r.claims["u-1"].error, "");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let other = serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "status": {"devices": [{"driver": "net.example.com", "pool": NODE, "device": "nic-0",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]},
    });
    let claims: Api<k8s_openapi::api::resource::v1::ResourceClaim> =
        Api::namespaced(api.client(), "default");
    claims
        .patch_status(
            "c",
            &PatchParams::apply("net.example.com"),
            &Patch::Apply(&other),
        )
        .await
        .unwrap();
    let drivers = || -> Vec<String> {
        let obj = api
            .store()
            .get(Resource::ResourceClaims, Some("default"), "c")
            .unwrap();
        let mut d: Vec<String> = obj["status"]["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["driver"].as_str().unwrap_or_default().to_string())
            .collect();
        d.sort();
        d
    };
    eventually("carve's device status", || {
        drivers().contains(&"gpu.carve.dev".to_string())
    })
    .await;
    assert_eq!(drivers(), ["gpu.carve.dev", "net.example.com"]);
    // Each entry is its manager's.
    let obj = claim_with_status(&api, "c").await;
    let managers: Vec<&str> = obj["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["manager"].as_str().unwrap())
        .collect();
    assert!(managers.contains(&"gpu.carve.dev"), "{managers:?}");
    assert!(managers.contains(&"net.example.com"), "{managers:?}");
    unprepare_ok(&p.kubelet, &c).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_update_sockets_carry_the_pod_uid() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let mut cfg = node.config.clone();
    cfg.pod_uid = Some("pod-1".into());
    // A stale socket of our own from a crashed run is replaced.
    std::fs::create_dir_all(&cfg.plugins_registry_dir).unwrap();
    std::fs::write(
        cfg.plugins_registry_dir
            .join("gpu.carve.dev-pod-1-reg.sock"),
        b"",
    )
    .unwrap();
    let p = Running::start(&node, &api, cfg).await;
    let paths = p.serving.as_ref().unwrap().paths.clone();
    assert!(paths.registration.ends_with("gpu.carve.dev-pod-1-reg.sock"));
    assert!(paths.dra.ends_with("dra-pod-1.sock"));
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prepare_creates_one_instance() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-3g40gb-4")],
        serde_json::json!([]),
    );
    let first = prepare_ok(&p.kubelet, &c).await;
    for _ in 0..999 {
        assert_eq!(prepare_ok(&p.kubelet, &c).await, first);
    }
    assert_eq!(live(&*p.backend, 0).len(), 1);
    unprepare_ok(&p.kubelet, &c).await;
    unprepare_ok(&p.kubelet, &c).await;
    assert!(live(&*p.backend, 0).is_empty());
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_over_eight_gpus() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 8, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    // 7 x 1g.10gb per GPU is the most an H100 holds: 56 claims, plus 8
    // duplicate calls for claims already in the batch = 64 concurrent prepares.
    let mut claims = Vec::new();
    for g in 0..8 {
        for s in 0..7u8 {
            let dev = format!("gpu-{g}-mig-1g10gb-{s}");
            claims.push(put_claim(
                &api,
                &format!("c-{g}-{s}"),
                &format!("u-{g}-{s}"),
                &[("r", &dev)],
                serde_json::json!([]),
            ));
        }
    }
    let mut calls: Vec<ClaimRef> = claims.clone();
    calls.extend(claims.iter().step_by(7).cloned());
    assert_eq!(calls.len(), 64);
    let futs = calls.iter().map(|c| {
        let k = p.kubelet.clone();
        let c = c.clone();
        async move { k.prepare(std::slice::from_ref(&c)).await.unwrap().claims[&c.uid].clone() }
    });
    for r in futures::future::join_all(futs).await {
        assert_eq!(r.error, "");
    }
    for g in 0..8 {
        let gis = live(&*p.backend, g);
        assert_eq!(gis.len(), 7, "GPU {g}");
        for (i, a) in gis.iter().enumerate() {
            for b in &gis[..i] {
                assert!(!a.placement.overlaps(b.placement));
            }
        }
    }
    let r = p.kubelet.unprepare(&claims).await.unwrap();
    assert!(r.claims.values().all(|c| c.error.is_empty()));
    assert_eq!(r.claims.len(), 56);
    for g in 0..8 {
        assert!(live(&*p.backend, g).is_empty());
    }
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_reported_per_claim_and_creates_nothing() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 2, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    // An instance the plugin does not know, made behind its back.
    let spec = GpuModel::find("h100-80gb").unwrap().spec();
    let one_g = spec.profile("1g.10gb").unwrap();
    p.backend
        .create_gpu_instance(1, one_g.id, carve_model::Placement::new(5, 1))
        .unwrap();

    let good = put_claim(
        &api,
        "good",
        "u-good",
        &[("r", "gpu-0-mig-2g20gb-0")],
        serde_json::json!([]),
    );
    let unalloc = put_unallocated(&api, "unalloc", "u-unalloc");
    let other = put_claim_pool(
        &api,
        "other",
        "u-other",
        &[("r", "gpu-0-mig-1g10gb-6")],
        "node-b",
        serde_json::json!([]),
    );
    let badname = put_claim(
        &api,
        "badname",
        "u-badname",
        &[("r", "gpu-0-mig-zz-1")],
        serde_json::json!([]),
    );
    let nogpu = put_claim(
        &api,
        "nogpu",
        "u-nogpu",
        &[("r", "gpu-9-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let badcfg = put_claim(
        &api,
        "badcfg",
        "u-badcfg",
        &[("r", "gpu-0-mig-1g10gb-5")],
        serde_json::json!([{"source": "FromClaim", "opaque": {"driver": "gpu.carve.dev",
            "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "MigConfig", "timeSlice": 3}}}]),
    );
    let occupied = put_claim(
        &api,
        "occ",
        "u-occ",
        &[("r", "gpu-1-mig-2g20gb-4")],
        serde_json::json!([]),
    );
    let replaced = ClaimRef {
        uid: "u-stale".into(),
        ..good.clone()
    };
    let missing = ClaimRef {
        namespace: "default".into(),
        name: "nope".into(),
        uid: "u-nope".into(),
    };
    let all = [
        good.clone(),
        unalloc,
        other,
        badname,
        nogpu,
        badcfg,
        occupied,
        replaced,
        missing,
    ];
    let r = p.kubelet.prepare(&all).await.unwrap();
    assert_eq!(r.claims.len(), all.len(), "every claim answered");
    assert_eq!(r.claims["u-good"].error, "");
    let want = [
        ("u-unalloc", "ResourceClaim is not allocated"),
        (
            "u-other",
            "allocated from pool \"node-b\", not this node's pool \"node-a\"",
        ),
        ("u-badname", "\"gpu-0-mig-zz-1\" is not a carve device name"),
        ("u-nogpu", "this node has no GPU 9"),
        ("u-badcfg", "unknown field `timeSlice`"),
        (
            "u-occ",
            "placement 4:2 on GPU 1 is occupied by GPU instance",
        ),
        ("u-stale", "claim got replaced"),
        (
            "u-nope",
            "claim default/nope (u-nope): ResourceClaim not found",
        ),
    ];
    for (uid, msg) in want {
        let e = &r.claims[uid].error;
        assert!(e.contains(msg), "{uid}: {e:?} should contain {msg:?}");
        assert!(r.claims[uid].devices.is_empty());
    }
    assert!(
        r.claims["u-occ"]
            .error
            .contains("1g.10gb at 5:1) that carve does not know"),
        "{}",
        r.claims["u-occ"].error
    );
    // Only the good claim created anything; the foreign instance is untouched.
    assert_eq!(live(&*p.backend, 0).len(), 1);
    assert_eq!(live(&*p.backend, 1).len(), 1);
    assert_eq!(node.cdi_files().len(), 1);
    let snap = p.driver.snapshot().await;
    assert_eq!(snap.claims.keys().collect::<Vec<_>>(), ["u-good"]);
    unprepare_ok(&p.kubelet, &good).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_gpu_and_opaque_config() {
    let node = Node::new(vec![
        GpuEntry::new("h100-80gb", 1, false),
        GpuEntry::new("l4-24gb", 1, false),
    ]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let cfg = serde_json::json!([
        {"source": "FromClass", "opaque": {"driver": "gpu.carve.dev", "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "GpuConfig", "driverCapabilities": ["all"]}}},
        {"source": "FromClaim", "opaque": {"driver": "gpu.carve.dev", "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "GpuConfig", "driverCapabilities": ["compute"]}}},
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": true}}}
    ]);
    let c = put_claim(&api, "w", "u-w", &[("r", "gpu-1")], cfg);
    let devs = prepare_ok(&p.kubelet, &c).await;
    assert_eq!(devs[0].device_name, "gpu-1");
    let spec = CdiSpec::read(&claim_spec_path(&node.config.cdi_dir, "u-w")).unwrap();
    let e = &spec.devices[0].container_edits;
    assert_eq!(e.device_nodes[0].path, "/dev/nvidia1");
    assert!(
        e.env
            .contains(&"NVIDIA_DRIVER_CAPABILITIES=compute".to_string()),
        "{:?}",
        e.env
    );
    // Whole H100 held: MIG on it is refused, and vice versa.
    let w0 = put_claim(&api, "w0", "u-w0", &[("r", "gpu-0")], serde_json::json!([]));
    prepare_ok(&p.kubelet, &w0).await;
    let m0 = put_claim(
        &api,
        "m0",
        "u-m0",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let r = p.kubelet.prepare(std::slice::from_ref(&m0)).await.unwrap();
    assert!(
        r.claims["u-m0"]
            .error
            .contains("GPU 0 is held as a whole GPU by claim default/w0"),
        "{}",
        r.claims["u-m0"].error
    );
    assert!(
        !p.backend.mig_mode(0).unwrap().current,
        "MIG mode not enabled under a whole-GPU claim"
    );
    unprepare_ok(&p.kubelet, &w0).await;
    unprepare_ok(&p.kubelet, &c).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_gpu_hands_out_existing_instances_only() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let mut cfg = node.config.clone();
    cfg.default_policy = carve_plugin::GpuPolicy::Static;
    let p = Running::start(&node, &api, cfg).await;
    let spec = GpuModel::find("h100-80gb").unwrap().spec();
    let prof = spec.profile("3g.40gb").unwrap();
    let gi = p
        .backend
        .create_gpu_instance(0, prof.id, carve_model::Placement::new(0, 4))
        .unwrap();
    p.backend.create_compute_instance(0, gi.id).unwrap();
    let c = put_claim(
        &api,
        "s",
        "u-s",
        &[("r", "gpu-0-mig-3g40gb-0")],
        serde_json::json!([]),
    );
    prepare_ok(&p.kubelet, &c).await;
    let missing = put_claim(
        &api,
        "m",
        "u-m",
        &[("r", "gpu-0-mig-3g40gb-4")],
        serde_json::json!([]),
    );
    let r = p
        .kubelet
        .prepare(std::slice::from_ref(&missing))
        .await
        .unwrap();
    assert!(
        r.claims["u-m"]
            .error
            .contains("static GPU 0 has no 3g.40gb instance at placement 4:4"),
        "{}",
        r.claims["u-m"].error
    );
    unprepare_ok(&p.kubelet, &c).await;
    let gis = live(&*p.backend, 0);
    assert_eq!(gis.len(), 1, "static instance survives unprepare");
    // Recovery does not sweep static GPUs.
    p.stop().await;
    let mut cfg = node.config.clone();
    cfg.default_policy = carve_plugin::GpuPolicy::Static;
    let p = Running::start(&node, &api, cfg).await;
    assert_eq!(live(&*p.backend, 0).len(), 1);
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_use_is_retried_then_reported() {
    let mut node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    // NVML_ERROR_IN_USE = 19. The first destroy fails once (retried), then a
    // later unprepare sees it fail every attempt.
    for nth in [1, 2, 3, 4] {
        node.sim.faults.push(nvidia_ml_sim::Fault {
            function: "nvmlComputeInstanceDestroy".into(),
            nth,
            action: nvidia_ml_sim::FaultAction::Fail { code: 19 },
        });
    }
    node.write_sim_config();
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    prepare_ok(&p.kubelet, &c).await;
    // attempts = 3: calls 1..3 fail -> reported.
    let r = p.kubelet.unprepare(std::slice::from_ref(&c)).await.unwrap();
    assert!(
        r.claims["u-1"]
            .error
            .contains("still in use after 3 attempts"),
        "{}",
        r.claims["u-1"].error
    );
    assert_eq!(live(&*p.backend, 0).len(), 1);
    // Call 4 fails, 5 succeeds: retried within one unprepare.
    unprepare_ok(&p.kubelet, &c).await;
    assert!(live(&*p.backend, 0).is_empty());
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_unprepares_claims_that_are_gone() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let a = put_claim(
        &api,
        "a",
        "u-a",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    let b = put_claim(
        &api,
        "b",
        "u-b",
        &[("r", "gpu-0-mig-1g10gb-1")],
        serde_json::json!([]),
    );
    prepare_ok(&p.kubelet, &a).await;
    prepare_ok(&p.kubelet, &b).await;
    api.store()
        .delete(Resource::ResourceClaims, Some("default"), "a");
    // b replaced by a new object with another UID.
    put_claim(
        &api,
        "b",
        "u-b2",
        &[("r", "gpu-0-mig-1g10gb-1")],
        serde_json::json!([]),
    );
    let mut done = p.driver.gc_once().await;
    done.sort();
    assert_eq!(done, ["u-a", "u-b"]);
    assert!(live(&*p.backend, 0).is_empty());
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_checkpoint_is_moved_aside_and_state_rebuilt() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let keep = put_claim(
        &api,
        "keep",
        "u-keep",
        &[("r", "gpu-0-mig-2g20gb-0")],
        serde_json::json!([]),
    );
    let devs = prepare_ok(&p.kubelet, &keep).await;
    let orphan = {
        let spec = GpuModel::find("h100-80gb").unwrap().spec();
        let gi = p
            .backend
            .create_gpu_instance(
                0,
                spec.profile("1g.10gb").unwrap().id,
                carve_model::Placement::new(6, 1),
            )
            .unwrap();
        gi.id
    };
    p.stop().await;
    std::fs::write(
        &node.config.checkpoint_path,
        b"{\"apiVersion\": \"checkpoint.gpu.carve.dev/v1\", garbage",
    )
    .unwrap();
    std::fs::remove_file(claim_spec_path(&node.config.cdi_dir, "u-keep")).unwrap();

    let backend = node.backend();
    let driver = Driver::new(node.config.clone(), backend.clone(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    let aside = report.moved_aside.clone().unwrap();
    assert!(
        aside.to_string_lossy().contains("checkpoint.json.corrupt-"),
        "{report:?}"
    );
    assert!(aside.exists());
    assert_eq!(report.adopted, ["u-keep"]);
    assert_eq!(report.swept, [format!("0/{orphan}")]);
    assert_eq!(report.cdi_rewritten, ["u-keep"]);
    let gis = live(&*backend, 0);
    assert_eq!(gis.len(), 1);
    assert_eq!(gis[0].placement, carve_model::Placement::new(0, 2));
    // The adopted claim answers prepare idempotently and unprepares cleanly.
    let again = driver.prepare(vec![keep.clone()]).await;
    let got: Vec<carve_proto::dra_v1::Device> = again[0]
        .1
        .as_ref()
        .unwrap()
        .iter()
        .cloned()
        .map(Into::into)
        .collect();
    assert_eq!(got, devs);
    driver.unprepare_one("u-keep").await.unwrap();
    assert!(live(&*backend, 0).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_from_another_boot_is_discarded() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    prepare_ok(&p.kubelet, &c).await;
    p.stop().await;
    std::fs::write(node.dir.path().join("boot_id"), "boot-2\n").unwrap();
    let backend = node.backend();
    let driver = Driver::new(node.config.clone(), backend.clone(), api.client())
        .await
        .unwrap();
    let report = driver.recover().await.unwrap();
    assert!(report.discarded_other_boot);
    assert_eq!(report.swept.len(), 1);
    assert!(live(&*backend, 0).is_empty());
    assert!(driver.snapshot().await.claims.is_empty());
    assert!(node.cdi_files().is_empty());
}

/// A slow API server holds the status PATCH for a second: the kubelet's
/// prepare does not wait for it, the claim's unprepare does (the status never
/// names devices that are already gone), and a stopping plugin lands its
/// writes before it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_write_is_off_prepares_path_but_lands_before_unprepare_and_stop() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let slow = || carve_apiserver::Fault::DelayNext {
        count: 1,
        delay: std::time::Duration::from_secs(1),
        writes_only: true,
        resource: Some("resourceclaims".into()),
    };
    let stored = |name: &str| {
        api.store()
            .get(Resource::ResourceClaims, Some("default"), name)
            .unwrap()
    };
    let c = put_device_claim(&api, "c", "u-1", "gpu-0-mig-1g10gb-0");
    api.inject(slow());
    prepare_ok(&p.kubelet, &c).await;
    assert!(
        stored("c")["status"].get("devices").is_none(),
        "prepare returned only after its status write: {}",
        stored("c")
    );
    unprepare_ok(&p.kubelet, &c).await;
    assert_eq!(api.stats().count("patch", "resourceclaims/status"), 1);
    assert_eq!(
        stored("c")["status"]["devices"][0]["device"],
        "gpu-0-mig-1g10gb-0",
        "unprepare returned before the status write landed"
    );

    let d = put_device_claim(&api, "d", "u-2", "gpu-0-mig-1g10gb-1");
    api.inject(slow());
    prepare_ok(&p.kubelet, &d).await;
    assert!(stored("d")["status"].get("devices").is_none());
    p.stop().await;
    assert_eq!(
        stored("d")["status"]["devices"][0]["device"],
        "gpu-0-mig-1g10gb-1",
        "the plugin stopped before its status write landed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_write_failure_does_not_fail_prepare() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-1g10gb-0")],
        serde_json::json!([]),
    );
    api.inject(carve_apiserver::Fault::FailNext {
        count: 1,
        status: 500,
        writes_only: true,
        resource: Some("resourceclaims".into()),
    });
    prepare_ok(&p.kubelet, &c).await;
    eventually("the status write", || {
        api.stats().count("patch", "resourceclaims/status") == 1
    })
    .await;
    let obj = api
        .store()
        .get(Resource::ResourceClaims, Some("default"), "c")
        .unwrap();
    assert!(
        obj["status"].get("devices").is_none(),
        "the failed write changed nothing"
    );
    assert_eq!(live(&*p.backend, 0).len(), 1);
    unprepare_ok(&p.kubelet, &c).await;
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ampere_with_mig_off_is_refused_without_changes() {
    let node = Node::new(vec![GpuEntry::new("a100-40gb", 1, false)]);
    let api = api().await;
    let p = Running::start(&node, &api, node.config.clone()).await;
    let c = put_claim(
        &api,
        "c",
        "u-1",
        &[("r", "gpu-0-mig-1g5gb-0")],
        serde_json::json!([]),
    );
    let r = p.kubelet.prepare(std::slice::from_ref(&c)).await.unwrap();
    assert!(
        r.claims["u-1"]
            .error
            .contains("GPU 0: MIG mode is off and enabling it needs a GPU reset"),
        "{}",
        r.claims["u-1"].error
    );
    let m = p.backend.mig_mode(0).unwrap();
    assert!(!m.current && !m.pending, "MIG mode untouched: {m:?}");
    assert!(p.driver.snapshot().await.claims.is_empty());
    assert!(p.driver.snapshot().await.mig_enabled_by_plugin.is_empty());
    p.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_plugin_pods_during_a_rolling_update_share_state() {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, false)]);
    let api = api().await;
    let backend = node.backend();
    let mut old_cfg = node.config.clone();
    old_cfg.pod_uid = Some("old".into());
    let mut new_cfg = node.config.clone();
    new_cfg.pod_uid = Some("new".into());
    let old = Running::start_with(backend.clone(), &api, old_cfg).await;
    let a = put_claim(
        &api,
        "a",
        "u-a",
        &[("r", "gpu-0-mig-3g40gb-0")],
        serde_json::json!([]),
    );
    prepare_ok(&old.kubelet, &a).await;
    // The new pod starts while the old one still serves; both are registered.
    let new = Running::start_with(backend.clone(), &api, new_cfg).await;
    assert_ne!(old.kubelet.info.endpoint, new.kubelet.info.endpoint);
    // The new pod sees the old pod's claim: same answer, no second instance.
    assert_eq!(
        prepare_ok(&new.kubelet, &a).await,
        prepare_ok(&old.kubelet, &a).await
    );
    assert_eq!(live(&*backend, 0).len(), 1);
    // A claim prepared by the new pod blocks an overlapping one on the old pod.
    let b = put_claim(
        &api,
        "b",
        "u-b",
        &[("r", "gpu-0-mig-3g40gb-4")],
        serde_json::json!([]),
    );
    prepare_ok(&new.kubelet, &b).await;
    let x = put_claim(
        &api,
        "x",
        "u-x",
        &[("r", "gpu-0-mig-1g10gb-5")],
        serde_json::json!([]),
    );
    let r = old.kubelet.prepare(std::slice::from_ref(&x)).await.unwrap();
    assert!(
        r.claims["u-x"]
            .error
            .contains("occupied by claim default/b"),
        "{}",
        r.claims["u-x"].error
    );
    // The old pod goes; the new one unprepares what the old one prepared.
    old.stop().await;
    unprepare_ok(&new.kubelet, &a).await;
    unprepare_ok(&new.kubelet, &b).await;
    assert!(live(&*backend, 0).is_empty());
    assert!(!backend.mig_mode(0).unwrap().current, "MIG mode returned");
    assert!(node.cdi_files().is_empty());
    new.stop().await;
}
