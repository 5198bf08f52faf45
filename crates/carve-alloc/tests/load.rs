//! Reading input files: errors name the file, the document and the field.

mod common;

use carve_alloc::{Inputs, LoadError, load_yaml_documents};

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.path().join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn reads_every_kind_and_sorts_claims() {
    let objs = common::load(&[
        common::fixture("partitions-135.yaml"),
        common::fixture("classes.yaml"),
        common::examples().join("whole-gpu/pod.yaml"),
    ]);
    // The whole-gpu example: its ResourceClaimTemplate and its Pod.
    assert_eq!(objs.len(), 2 + 4 + 2);
    let (inputs, pending) = Inputs::from_objects(objs);
    assert_eq!(
        (
            inputs.slices.len(),
            inputs.classes.len(),
            inputs.claims_allocated.len()
        ),
        (2, 4, 0)
    );
    assert_eq!(pending.len(), 1);
}

#[test]
fn a_pod_is_read_strictly_and_left_out_of_the_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: c\n    image: i\n    resources:\n      claims: [{name: gpu}]\n  resourceClaims:\n  - name: gpu\n    resourceClaimTemplateName: t\n";
    let ok = write(&dir, "pod.yaml", pod);
    let objs = load_yaml_documents(&ok).unwrap();
    assert!(
        matches!(&objs[..], [carve_alloc::Object::Pod(_)]),
        "{objs:?}"
    );
    let (inputs, pending) = Inputs::from_objects(objs);
    assert!(pending.is_empty() && inputs.claims_allocated.is_empty());
    // A typo in the pod is named, as the API server's strict decoding names it.
    let typo = write(
        &dir,
        "typo.yaml",
        &pod.replace("resourceClaimTemplateName", "resourceClaimTemplate"),
    );
    let err = load_yaml_documents(&typo).unwrap_err().to_string();
    assert!(
        err.contains("typo.yaml document 0 (Pod)")
            && err.contains("unknown field \"spec.resourceClaims.0.resourceClaimTemplate\""),
        "{err}"
    );
}

#[test]
fn errors_name_file_document_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let unknown = write(
        &dir,
        "u.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: a}\n---\napiVersion: apps/v1\nkind: Deployment\n",
    );
    let err = load_yaml_documents(&unknown).unwrap_err();
    assert!(
        matches!(err, LoadError::UnknownKind { index: 1, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{} document 1: unsupported object apps/v1/Deployment (expected resource.k8s.io/v1 ResourceSlice, DeviceClass, ResourceClaim or ResourceClaimTemplate, a v1 Pod, or a v1 List of them)",
            unknown.display()
        )
    );

    let bad_field = write(
        &dir,
        "f.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: d\n  pool: {name: p, generation: one, resourceSliceCount: 1}\n",
    );
    let err = load_yaml_documents(&bad_field).unwrap_err();
    match &err {
        LoadError::Decode {
            index, kind, field, ..
        } => {
            assert_eq!(
                (*index, kind.as_str(), field.as_str()),
                (0, "ResourceSlice", "spec.pool.generation")
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        err.to_string()
            .contains("f.yaml document 0 (ResourceSlice): field spec.pool.generation"),
        "{err}"
    );

    let no_kind = write(
        &dir,
        "k.yaml",
        "apiVersion: resource.k8s.io/v1\nmetadata: {name: x}\n",
    );
    let err = load_yaml_documents(&no_kind).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("{} document 0: missing kind", no_kind.display())
    );

    let not_yaml = write(&dir, "y.yaml", "a: [1, 2\n");
    assert!(matches!(
        load_yaml_documents(&not_yaml).unwrap_err(),
        LoadError::Yaml { index: 0, .. }
    ));

    let missing = dir.path().join("missing.yaml");
    let err = load_yaml_documents(&missing).unwrap_err();
    assert!(matches!(err, LoadError::Io { .. }));
    assert!(err.to_string().starts_with(&missing.display().to_string()));
}

#[test]
fn an_unknown_field_is_refused_and_named() {
    // `selector:` for `selectors:`: kubectl apply rejects it ("unknown field"),
    // so the offline tools must not read the claim without its selectors.
    let dir = tempfile::tempdir().unwrap();
    let typo = write(
        &dir,
        "typo.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: mig.gpu.carve.dev\n        selector:\n        - cel: {expression: 'true'}\n",
    );
    let err = load_yaml_documents(&typo).unwrap_err();
    match &err {
        LoadError::UnknownField { index, field, .. } => {
            assert_eq!(*index, 0);
            assert_eq!(field, "spec.devices.requests.0.exactly.selector");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "{} document 0 (ResourceClaim): unknown field \"spec.devices.requests.0.exactly.selector\"",
            typo.display()
        )
    );

    // At the top level and in metadata, too.
    let top = write(
        &dir,
        "top.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: a, labelz: {}}\n",
    );
    let err = load_yaml_documents(&top).unwrap_err();
    assert!(
        matches!(&err, LoadError::UnknownField { field, .. } if field == "metadata.labelz"),
        "{err:?}"
    );
}

#[test]
fn a_list_contributes_its_items_and_a_template_its_claim() {
    let dir = tempfile::tempdir().unwrap();
    // What `kubectl get resourceclaimtemplates,deviceclasses -o yaml` prints.
    let list = write(
        &dir,
        "list.yaml",
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: resource.k8s.io/v1\n  kind: DeviceClass\n  metadata: {name: a}\n- apiVersion: resource.k8s.io/v1\n  kind: ResourceClaimTemplate\n  metadata: {name: t, namespace: ns}\n  spec:\n    spec:\n      devices:\n        requests:\n        - name: gpu\n          exactly: {deviceClassName: a}\nmetadata: {resourceVersion: \"\"}\n",
    );
    let objs = load_yaml_documents(&list).unwrap();
    assert_eq!(objs.len(), 2);
    let (inputs, pending) = Inputs::from_objects(objs);
    assert_eq!(inputs.classes.len(), 1);
    assert_eq!(pending.len(), 1);
    let claim = &pending[0];
    assert_eq!(claim.metadata.name.as_deref(), Some("t"));
    assert_eq!(claim.metadata.namespace.as_deref(), Some("ns"));
    let requests = claim
        .spec
        .devices
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap();
    assert_eq!(requests[0].name, "gpu");

    // An error inside a list names the item.
    let bad = write(
        &dir,
        "bad.yaml",
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: resource.k8s.io/v1\n  kind: DeviceClass\n  metadata: {name: a}\n- apiVersion: apps/v1\n  kind: Deployment\n",
    );
    let err = load_yaml_documents(&bad).unwrap_err();
    assert!(
        matches!(
            err,
            LoadError::UnknownKind {
                index: 0,
                item: Some(1),
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("document 0 item 1:"), "{err}");

    let not_list = write(&dir, "nl.yaml", "apiVersion: v1\nkind: List\nitems: 3\n");
    let err = load_yaml_documents(&not_list).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{} document 0 (List): items: not a list",
            not_list.display()
        )
    );
}
