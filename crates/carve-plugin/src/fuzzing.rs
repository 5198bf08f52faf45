//! Entry points for the fuzz targets (`fuzz/` at the repository root; feature
//! `fuzzing`): the parsers that the kubelet, the API server and the disk feed.
//! Each takes arbitrary bytes and must return without panicking; a panic is a
//! bug (in the parser, or a broken property asserted here).
//!
//! - [`claim_json`]: a ResourceClaim as the API server answers the claim GET
//!   ([`ReadClaim`]), then the validation every allocation goes through
//!   before anything is made (device names, pools, opaque configs).
//! - [`opaque_config`]: the bytes as the `parameters` of a claim's opaque
//!   config for `gpu.carve.dev`, on an allocation of each device kind.
//! - [`checkpoint`]: the checkpoint file as read at start and under the host
//!   lock; a body that parses survives a write and a read unchanged.
//! - [`cdi_spec`]: a CDI spec file as recovery reads it back
//!   ([`CdiSpec::read`]).
//! - [`kubelet_claim`]: a claim of a kubelet request (namespace, name, UID).

use std::path::Path;

use carve_proto::dra_v1;
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::cdi::CdiSpec;
use crate::checkpoint::{Checkpoint, CheckpointBody};
use crate::claim::{ClaimRef, ReadClaim};

/// Parse `data` as the claim GET's answer and plan it.
pub fn claim_json(data: &[u8]) {
    let Ok(ReadClaim(rc)) = serde_json::from_slice::<ReadClaim>(data) else {
        return;
    };
    plan(&rc);
}

/// Plan a claim allocated one device of each kind, with `data` as the
/// parameters of its opaque config.
pub fn opaque_config(data: &[u8]) {
    let Ok(parameters) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let results: Vec<serde_json::Value> = [
        ("mig", "gpu-0-mig-1g10gb-3"),
        ("whole", "gpu-2"),
        ("ts", "gpu-2-ts"),
        ("mps", "gpu-2-mps"),
    ]
    .iter()
    .map(|(r, d)| serde_json::json!({"request": r, "driver": "gpu.carve.dev", "pool": "node-a", "device": d}))
    .collect();
    for requests in [
        serde_json::json!(["mig", "whole", "ts", "mps"]),
        serde_json::json!([]),
    ] {
        let claim = serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {
                "results": results,
                "config": [
                    {"source": "FromClass", "requests": requests, "opaque": {"driver": "gpu.carve.dev", "parameters": parameters}},
                    {"source": "FromClaim", "requests": requests, "opaque": {"driver": "gpu.carve.dev", "parameters": parameters}},
                ],
            }}},
        });
        if let Ok(rc) = serde_json::from_value::<ResourceClaim>(claim) {
            plan(&rc);
        }
    }
}

fn plan(rc: &ResourceClaim) {
    match crate::driver::plan_on_simulated_node(rc) {
        Ok(_) => {}
        // Every refusal has a message (the kubelet shows it).
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// Decode `data` as the checkpoint file; a body that parses is written and
/// read back unchanged.
pub fn checkpoint(data: &[u8]) {
    let path = Path::new("/fuzz/checkpoint.json");
    if let Ok(c) = Checkpoint::decode(path, data) {
        roundtrip(c.body);
    }
    // Checksums are rarely right by chance: the body's own parser is fuzzed
    // directly too.
    if let Ok(body) = serde_json::from_slice::<CheckpointBody>(data) {
        roundtrip(body);
    }
}

fn roundtrip(body: CheckpointBody) {
    let bytes = crate::checkpoint::encode_body(&body, Path::new("/fuzz/checkpoint.json"))
        .expect("a parsed checkpoint body encodes");
    let back = Checkpoint::decode(Path::new("/fuzz/checkpoint.json"), &bytes)
        .expect("an encoded checkpoint decodes");
    assert_eq!(
        back.body, body,
        "checkpoint body changed in a write and a read"
    );
}

/// Parse `data` as a CDI spec file as [`CdiSpec::read`] does; what parses
/// serializes and parses again.
pub fn cdi_spec(data: &[u8]) {
    let Ok(spec) = serde_json::from_slice::<CdiSpec>(data) else {
        return;
    };
    let bytes = serde_json::to_vec(&spec).expect("a parsed CDI spec serializes");
    assert!(
        serde_json::from_slice::<CdiSpec>(&bytes).is_ok(),
        "a serialized CDI spec does not parse"
    );
}

/// Split `data` into namespace, name and UID (at `\n`) as a kubelet claim.
pub fn kubelet_claim(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\n');
    let claim = dra_v1::Claim {
        namespace: parts.next().unwrap_or_default().to_string(),
        name: parts.next().unwrap_or_default().to_string(),
        uid: parts.next().unwrap_or_default().to_string(),
    };
    match ClaimRef::try_from(claim) {
        Ok(c) => assert!(!c.to_string().is_empty()),
        Err(e) => assert!(e.to_string().len() < 1024, "invalid-claim error too long"),
    }
}
