//! Publishes carve's ResourceSlices to the Kubernetes API server.
//!
//! [`SlicePublisher`] makes the slices of one driver on one node equal to a
//! desired set (built by `carve_model::slices`), bumping pool generations only
//! when something changed and writing nothing otherwise. [`server_version`]
//! reads the server's minor version to pick the slice layout.
//!
//! [`SlicePublisher::watch`] reports, within a second, changes made to those
//! slices behind the publisher's back ([`SliceWatch`]). This crate does not
//! build slices or run a control loop: the caller decides when to call
//! [`SlicePublisher::sync`].

#[cfg(feature = "bench")]
pub mod bench;
pub mod desired;
pub mod dropped;
pub mod error;
pub mod layout_watch;
pub mod plan;
pub mod publish;
pub mod version;
pub mod watch;

pub use dropped::{Dropped, FeatureGate, dropped_fields};
pub use error::{PublishError, Verb};
pub use layout_watch::{VersionChange, VersionWatch, skew_warning};
pub use publish::{ConflictRetry, DEFAULT_REQUEST_TIMEOUT, SlicePublisher, SyncReport};
pub use version::{parse_version, server_version};
pub use watch::{Changes, SliceWatch, WatchPacing};
