//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use carve_alloc::{Inputs, Object, load_yaml_documents, parse_yaml_documents};
use k8s_openapi::api::resource::v1::{AllocationResult, ResourceClaim};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

pub fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

pub fn load(paths: &[PathBuf]) -> Vec<Object> {
    paths
        .iter()
        .flat_map(|p| load_yaml_documents(p).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Inputs from files plus inline YAML; returns inputs and unallocated claims.
pub fn inputs(paths: &[PathBuf], extra: &str) -> (Inputs, Vec<ResourceClaim>) {
    let mut objs = load(paths);
    objs.extend(parse_yaml_documents(Path::new("inline"), extra).unwrap_or_else(|e| panic!("{e}")));
    Inputs::from_objects(objs)
}

pub fn claim(yaml: &str) -> ResourceClaim {
    match parse_yaml_documents(Path::new("inline"), yaml)
        .unwrap()
        .pop()
    {
        Some(Object::Claim(c)) => c,
        other => panic!("not a claim: {other:?}"),
    }
}

/// `(request, device)` pairs of a result.
pub fn picks(r: &AllocationResult) -> Vec<(String, String)> {
    r.devices
        .as_ref()
        .and_then(|d| d.results.as_ref())
        .into_iter()
        .flatten()
        .map(|x| (x.request.clone(), x.device.clone()))
        .collect()
}

pub fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}
