//! Prepare's one blocking hop: a MIG claim without MPS on a GPU in MIG
//! mode is read, checked and made in one hop. What that hop must still see:
//! a GPU taken out of MIG mode behind the plugin's back (the hop then stops
//! before changing anything, the intent to turn MIG mode on again is written,
//! and a second hop makes the instance), and a placement taken behind its
//! back (refused, nothing created, nothing recorded). The first prepare on
//! each GPU is a claim like any other.

mod common;

use carve_apiserver::ApiServer;
use carve_model::{GpuModel, Placement};
use carve_plugin::{Checkpoint, Driver};
use common::*;
use nvidia_ml_sim::GpuEntry;

/// One H100 in MIG mode and a started driver that has prepared claim
/// `warm` (1g.10gb at 0) on it: the driver has seen the GPU in MIG mode.
async fn warmed() -> (Node, ApiServer, Driver) {
    let node = Node::new(vec![GpuEntry::new("h100-80gb", 1, true)]);
    let api = api().await;
    let driver = started(&node, node.config.clone(), &api).await;
    let warm = put_device_claim(&api, "warm", "u-warm", "gpu-0-mig-1g10gb-0");
    driver.prepare_one(&warm).await.unwrap();
    (node, api, driver)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_taken_out_of_mig_mode_behind_the_plugins_back_goes_the_general_way() {
    let (node, api, driver) = warmed().await;
    let b = node.backend();
    driver.unprepare_one("u-warm").await.unwrap();
    assert!(b.mig_mode(0).unwrap().current);

    // An administrator turns MIG mode off.
    b.set_mig_mode(0, false).unwrap();
    let c = put_device_claim(&api, "c", "u-c", "gpu-0-mig-1g10gb-4");
    driver.prepare_one(&c).await.unwrap();
    assert!(b.mig_mode(0).unwrap().current, "MIG mode turned on again");
    let gis = live(&*b, 0);
    assert_eq!(gis.len(), 1);
    assert_eq!(gis[0].placement, Placement::new(4, 1));
    let uuid = b.gpus().unwrap()[0].uuid.clone();
    let st = driver.snapshot().await;
    assert!(st.mig_enabled_by_plugin.contains(&uuid));
    assert_eq!(st.claims.keys().collect::<Vec<_>>(), ["u-c"]);
    let file = Checkpoint::load(&node.config.checkpoint_path)
        .unwrap()
        .unwrap();
    assert!(file.body.mig_enabled_by_plugin.contains(&uuid));

    // The plugin turned it on, so it turns it off with the last instance.
    driver.unprepare_one("u-c").await.unwrap();
    assert!(!b.mig_mode(0).unwrap().current);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_taken_behind_the_plugins_back_is_refused_and_nothing_recorded() {
    let (node, api, driver) = warmed().await;
    let b = node.backend();

    let one_g = GpuModel::find("h100-80gb")
        .unwrap()
        .spec()
        .profile("1g.10gb")
        .unwrap()
        .id;
    b.create_gpu_instance(0, one_g, Placement::new(5, 1))
        .unwrap();
    let c = put_device_claim(&api, "c", "u-c", "gpu-0-mig-2g20gb-4");
    let e = driver.prepare_one(&c).await.unwrap_err().to_string();
    assert!(
        e.contains("placement 4:2 on GPU 0 is occupied by GPU instance")
            && e.contains("1g.10gb at 5:1) that carve does not know"),
        "{e}"
    );
    assert_eq!(
        live(&*b, 0).len(),
        2,
        "the warm claim's and the foreign one"
    );
    assert_eq!(
        driver.snapshot().await.claims.keys().collect::<Vec<_>>(),
        ["u-warm"]
    );
    let file = Checkpoint::load(&node.config.checkpoint_path)
        .unwrap()
        .unwrap();
    assert_eq!(file.body.claims.keys().collect::<Vec<_>>(), ["u-warm"]);

    // Another claim on the same GPU still goes through.
    let d = put_device_claim(&api, "d", "u-d", "gpu-0-mig-1g10gb-6");
    driver.prepare_one(&d).await.unwrap();
    assert_eq!(live(&*b, 0).len(), 3);
}
