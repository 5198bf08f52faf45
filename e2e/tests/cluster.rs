//! Real-cluster suite: runs only when `KUBECONFIG` is set (otherwise it prints
//! why and returns). It needs carve installed in the cluster (see
//! `e2e/README.md`) and `kubectl` on `PATH` for `exec` (the workspace's kube
//! client has no websocket support).
//!
//! In a fresh namespace it creates every example claim whose device types the
//! cluster publishes, plus one pod per claim, waits for the pods to run, and
//! checks inside each container that `NVIDIA_VISIBLE_DEVICES` names a MIG
//! device (`MIG-…`) for MIG examples or a GPU (`GPU-…`) for whole-GPU ones, and,
//! with `CARVE_E2E_REAL_GPU=1`, that `nvidia-smi -L` lists it. Examples whose
//! device types nothing publishes are reported as SKIPPED with the reason.
//!
//! Environment: `CARVE_E2E_IMAGE` (container image, default `ubuntu:24.04`;
//! use a CUDA image with `CARVE_E2E_REAL_GPU=1`), `CARVE_E2E_TIMEOUT_S`
//! (per-pod wait, default 300).

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use carve_alloc::{Object, load_yaml_documents};
use carve_e2e::{device_types, workspace_root};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};

fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Deletes the namespace when the test ends, also on panic.
struct NamespaceGuard(String);

impl Drop for NamespaceGuard {
    fn drop(&mut self) {
        if std::env::var_os("CARVE_E2E_KEEP").is_none() {
            let _ = Command::new("kubectl")
                .args(["delete", "namespace", &self.0, "--wait=false"])
                .status();
        }
    }
}

fn kubectl_exec(ns: &str, pod: &str, cmd: &[&str]) -> Result<String, String> {
    let out = Command::new("kubectl")
        .args(["exec", "-n", ns, pod, "--"])
        .args(cmd)
        .output()
        .map_err(|e| format!("running kubectl: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "kubectl exec {pod} -- {cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn class_types(class: &str) -> &'static [&'static str] {
    match class {
        "mig.gpu.carve.dev" => &["mig"],
        "mps.gpu.carve.dev" => &["mps", "mig-mps"],
        "timeslice.gpu.carve.dev" => &["timeslice"],
        _ => &["gpu"],
    }
}

fn request_names_and_classes(c: &ResourceClaim) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in c
        .spec
        .devices
        .as_ref()
        .and_then(|d| d.requests.as_ref())
        .into_iter()
        .flatten()
    {
        if let Some(e) = &r.exactly {
            out.insert(e.device_class_name.clone());
        }
        for s in r.first_available.iter().flatten() {
            out.insert(s.device_class_name.clone());
        }
    }
    out
}

fn pod_for(claim: &str, image: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": claim},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{
                "name": "main",
                "image": image,
                "command": ["sleep", "3600"],
                "resources": {"claims": [{"name": "gpu"}]},
            }],
        },
    }))
    .expect("pod literal is a Pod")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn examples_run_in_a_real_cluster() {
    if std::env::var_os("KUBECONFIG").is_none() {
        report("SKIPPED cluster suite: KUBECONFIG is not set (see e2e/README.md)");
        return;
    }
    let image = std::env::var("CARVE_E2E_IMAGE").unwrap_or_else(|_| "ubuntu:24.04".into());
    let real_gpu = std::env::var("CARVE_E2E_REAL_GPU").is_ok_and(|v| v == "1");
    let timeout = Duration::from_secs(
        std::env::var("CARVE_E2E_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300),
    );
    let client = Client::try_default()
        .await
        .expect("a client from KUBECONFIG");

    let classes: Api<DeviceClass> = Api::all(client.clone());
    let have: BTreeSet<String> = classes
        .list(&ListParams::default())
        .await
        .expect("listing DeviceClasses")
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect();
    for c in ["gpu.carve.dev", "mig.gpu.carve.dev"] {
        assert!(
            have.contains(c),
            "DeviceClass {c} missing: is carve installed? (have {have:?})"
        );
    }
    let slices: Vec<ResourceSlice> = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("listing ResourceSlices")
        .items
        .into_iter()
        .filter(|s| s.spec.driver == carve_model::DRIVER_NAME)
        .collect();
    assert!(
        !slices.is_empty(),
        "no ResourceSlices of {} in the cluster",
        carve_model::DRIVER_NAME
    );
    let types: BTreeSet<String> = device_types(&slices).into_values().collect();

    let ns = format!("carve-e2e-{}", std::process::id());
    let nss: Api<Namespace> = Api::all(client.clone());
    let n: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap();
    nss.create(&PostParams::default(), &n)
        .await
        .expect("creating the test namespace");
    let _guard = NamespaceGuard(ns.clone());
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);

    let mut started = Vec::new();
    let dir = workspace_root().join("examples");
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        let file = p.join("claim.yaml");
        if !file.is_file() {
            continue;
        }
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let Some(Object::Claim(mut claim)) = load_yaml_documents(&file).unwrap().into_iter().next()
        else {
            panic!("{} holds no ResourceClaim first", file.display());
        };
        let missing: Vec<String> = request_names_and_classes(&claim)
            .into_iter()
            .filter(|c| !class_types(c).iter().any(|t| types.contains(*t)))
            .collect();
        if !missing.is_empty() {
            report(&format!(
                "SKIPPED example {name}: needs {missing:?}, no such devices published (published types {types:?})"
            ));
            continue;
        }
        claim.metadata.name = Some(name.clone());
        claim.metadata.namespace = None;
        claims
            .create(&PostParams::default(), &claim)
            .await
            .unwrap_or_else(|e| panic!("creating claim {name}: {e}"));
        pods.create(&PostParams::default(), &pod_for(&name, &image))
            .await
            .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
        started.push(name);
    }
    assert!(!started.is_empty(), "no example could be started");

    // Pods share the node's GPUs; some may wait for others, so wait per pod.
    for name in &started {
        let t0 = Instant::now();
        loop {
            let p = pods
                .get(name)
                .await
                .unwrap_or_else(|e| panic!("get pod {name}: {e}"));
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            if phase == "Running" {
                break;
            }
            assert!(
                phase != "Failed" && phase != "Succeeded",
                "pod {name} ended: {:?}",
                p.status
            );
            assert!(
                t0.elapsed() < timeout,
                "pod {name} not running after {timeout:?}: {:?}",
                p.status
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let env = kubectl_exec(&ns, name, &["env"]).unwrap_or_else(|e| panic!("{e}"));
        let visible = env
            .lines()
            .find_map(|l| l.strip_prefix("NVIDIA_VISIBLE_DEVICES="))
            .unwrap_or_else(|| panic!("pod {name}: NVIDIA_VISIBLE_DEVICES not set; env:\n{env}"));
        let want = if name.starts_with("mig-") {
            "MIG-"
        } else {
            "GPU-"
        };
        for id in visible.split(',') {
            assert!(
                id.starts_with(want),
                "pod {name}: NVIDIA_VISIBLE_DEVICES={visible}, want {want}… ids"
            );
        }
        if real_gpu {
            let l =
                kubectl_exec(&ns, name, &["nvidia-smi", "-L"]).unwrap_or_else(|e| panic!("{e}"));
            for id in visible.split(',') {
                assert!(
                    l.contains(id),
                    "pod {name}: nvidia-smi -L does not list {id}:\n{l}"
                );
            }
        }
        report(&format!(
            "example {name}: pod running with NVIDIA_VISIBLE_DEVICES={visible}"
        ));
        // Free the devices for the examples still waiting.
        pods.delete(name, &DeleteParams::default()).await.unwrap();
    }
}
