//! The fuzz targets of `fuzz/` (libFuzzer through `cargo fuzz`) driven
//! deterministically by proptest, so that every `cargo test` run feeds the
//! parsers that the kubelet, the API server and the disk feed
//! (`carve_plugin::fuzzing`) a few thousand inputs: random bytes, and the
//! seeds in `fuzz/seeds/<target>/` with random edits (bytes replaced,
//! inserted from a JSON alphabet, removed or repeated). A panic fails.
//!
//! Coverage-guided runs go much deeper; see `fuzz/Cargo.toml` for the command.

use carve_plugin::fuzzing;
use carve_plugin::{Checkpoint, CheckpointBody, ClaimRecord, ClaimState};
use proptest::prelude::*;

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read(e.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        !out.is_empty() || target == "checkpoint",
        "no seeds in {}",
        dir.display()
    );
    if target == "checkpoint" {
        out.push(checkpoint_seed());
    }
    out
}

/// A checkpoint file as the driver writes it, with one claim.
fn checkpoint_seed() -> Vec<u8> {
    let mut body = CheckpointBody {
        boot_id: "boot-1".into(),
        ..Default::default()
    };
    body.claims.insert(
        "u-1".into(),
        ClaimRecord {
            uid: "u-1".into(),
            namespace: "ns".into(),
            name: "c".into(),
            state: ClaimState::PrepareCompleted,
            cdi_spec: None,
            devices: Vec::new(),
        },
    );
    serde_json::to_vec(&Checkpoint::new(body)).unwrap()
}

/// One edit of a seed.
#[derive(Debug, Clone)]
enum Edit {
    Replace(usize, u8),
    Insert(usize, u8),
    Remove(usize, usize),
    Repeat(usize, usize),
}

const JSON_BYTES: &[u8] = b"{}[]\":,0123456789-.eE+ truefalsnul\\/\n\xc3\xa9";

fn edit() -> impl Strategy<Value = Edit> {
    let byte = prop_oneof![any::<u8>(), prop::sample::select(JSON_BYTES)];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Edit::Replace(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Edit::Insert(i, b)),
        (any::<usize>(), 1..64usize).prop_map(|(i, n)| Edit::Remove(i, n)),
        (any::<usize>(), 1..64usize).prop_map(|(i, n)| Edit::Repeat(i, n)),
    ]
}

fn apply(mut data: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let len = data.len();
        match *e {
            Edit::Replace(i, b) if len > 0 => data[i % len] = b,
            Edit::Insert(i, b) => data.insert(i % (len + 1), b),
            Edit::Remove(i, n) if len > 0 => {
                let at = i % len;
                data.drain(at..(at + n).min(len));
            }
            Edit::Repeat(i, n) if len > 0 => {
                let at = i % len;
                let piece = data[at..(at + n).min(len)].to_vec();
                data.splice(at..at, piece);
            }
            _ => {}
        }
    }
    data
}

/// Random bytes, or a seed of `target` with up to 8 edits.
fn input(target: &'static str) -> impl Strategy<Value = Vec<u8>> {
    let seeds = seeds(target);
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..512),
        4 => (prop::sample::select(seeds), prop::collection::vec(edit(), 0..8))
            .prop_map(|(s, e)| apply(s, &e)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn claim_json(data in input("claim_json")) {
        fuzzing::claim_json(&data);
    }

    #[test]
    fn opaque_config(data in input("opaque_config")) {
        fuzzing::opaque_config(&data);
    }

    #[test]
    fn checkpoint(data in input("checkpoint")) {
        fuzzing::checkpoint(&data);
    }

    #[test]
    fn cdi_spec(data in input("cdi_spec")) {
        fuzzing::cdi_spec(&data);
    }

    #[test]
    fn kubelet_claim(data in prop::collection::vec(any::<u8>(), 0..600)) {
        fuzzing::kubelet_claim(&data);
    }
}

/// The seeds themselves parse (a seed that does not is no seed).
#[test]
fn the_seeds_parse() {
    for s in seeds("claim_json") {
        serde_json::from_slice::<carve_plugin::ReadClaim>(&s).unwrap();
    }
    for s in seeds("cdi_spec") {
        serde_json::from_slice::<carve_plugin::CdiSpec>(&s).unwrap();
    }
    for s in seeds("opaque_config") {
        serde_json::from_slice::<serde_json::Value>(&s).unwrap();
    }
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("checkpoint.json");
    std::fs::write(&p, checkpoint_seed()).unwrap();
    assert!(Checkpoint::load(&p).unwrap().is_some());
}
