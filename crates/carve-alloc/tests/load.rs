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
        common::examples().join("whole-gpu/claim.yaml"),
    ]);
    assert_eq!(objs.len(), 2 + 4 + 1);
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
fn errors_name_file_document_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let unknown = write(
        &dir,
        "u.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {name: a}\n---\napiVersion: v1\nkind: Pod\n",
    );
    let err = load_yaml_documents(&unknown).unwrap_err();
    assert!(
        matches!(err, LoadError::UnknownKind { index: 1, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "{} document 1: unsupported object v1/Pod (expected resource.k8s.io/v1 ResourceSlice, DeviceClass or ResourceClaim)",
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
