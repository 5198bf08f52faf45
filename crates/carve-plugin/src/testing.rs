//! Test support (feature `testing`): a fake kubelet that registers over the
//! real registration socket and calls the real `dra.sock`, as kubelet does.

use std::path::{Path, PathBuf};

use carve_proto::{dra_v1, dra_v1beta1, registration as reg};
use tonic::transport::Channel;

use crate::claim::ClaimRef;

/// A fake-kubelet failure.
#[derive(Debug, thiserror::Error)]
pub enum FakeKubeletError {
    /// Connecting to a socket failed.
    #[error("connecting to {path}: {source}")]
    Connect {
        /// Socket.
        path: PathBuf,
        /// Error.
        #[source]
        source: tonic::transport::Error,
    },
    /// A call returned a gRPC error.
    #[error("{call}: {status}")]
    Call {
        /// The method.
        call: &'static str,
        /// The status.
        status: Box<tonic::Status>,
    },
    /// The plugin's `PluginInfo` is not acceptable to a 1.34+ kubelet.
    #[error("plugin info rejected: {0}")]
    Rejected(String),
}

pub use dra_kubeletplugin::testing::grpc_go_authority;

fn connect_error(e: dra_kubeletplugin::testing::ConnectError) -> FakeKubeletError {
    FakeKubeletError::Connect {
        path: e.path,
        source: e.source,
    }
}

/// Connect a tonic channel to a Unix socket as the kubelet dials `dra.sock`
/// (`unix:<path>`, so `:authority` is `localhost`): the kit's
/// [`dra_kubeletplugin::testing::uds_channel`].
///
/// # Errors
/// The socket does not accept connections.
pub async fn uds_channel(path: &Path) -> Result<Channel, FakeKubeletError> {
    dra_kubeletplugin::testing::uds_channel(path)
        .await
        .map_err(connect_error)
}

/// Connect a tonic channel to a registration socket as the kubelet's plugin
/// watcher dials it: every request carries [`grpc_go_authority`] of the path
/// as `:authority` (the kit's
/// [`dra_kubeletplugin::testing::registration_channel`]). A server that h2
/// alone serves rejects these requests, as it rejects the kubelet's.
///
/// # Errors
/// The socket does not accept connections.
pub async fn registration_channel(path: &Path) -> Result<Channel, FakeKubeletError> {
    dra_kubeletplugin::testing::registration_channel(path)
        .await
        .map_err(connect_error)
}

/// How long [`FakeKubelet::register`] keeps re-dialing a registration socket
/// that refuses connections.
const REGISTRATION_DIAL_RETRY: std::time::Duration = std::time::Duration::from_secs(5);

/// A kubelet stand-in holding clients for both DRA versions.
#[derive(Debug, Clone)]
pub struct FakeKubelet {
    /// What the plugin reported in `GetInfo`.
    pub info: reg::PluginInfo,
    v1: dra_v1::dra_plugin_client::DraPluginClient<Channel>,
    v1beta1: dra_v1beta1::dra_plugin_client::DraPluginClient<Channel>,
}

fn wire(c: &ClaimRef) -> dra_v1::Claim {
    dra_v1::Claim {
        namespace: c.namespace.clone(),
        uid: c.uid.clone(),
        name: c.name.clone(),
    }
}

impl FakeKubelet {
    /// Register like kubelet: `GetInfo` on the registration socket (dialed as
    /// the kubelet dials it: [`registration_channel`]), check the
    /// type, name and versions, connect to the endpoint, then
    /// `NotifyRegistrationStatus(registered)`.
    ///
    /// # Errors
    /// Connection or call failures, or an unacceptable `PluginInfo`.
    pub async fn register(reg_socket: &Path, driver: &str) -> Result<Self, FakeKubeletError> {
        // The kubelet's plugin watcher retries a failed dial (its operation
        // executor backs off and tries again); a socket seen between its
        // plugin's bind and listen refuses the first connection.
        let deadline = std::time::Instant::now() + REGISTRATION_DIAL_RETRY;
        let channel = loop {
            match registration_channel(reg_socket).await {
                Ok(c) => break c,
                Err(_) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e),
            }
        };
        let mut r = reg::registration_client::RegistrationClient::new(channel);
        let info = r
            .get_info(reg::InfoRequest {})
            .await
            .map_err(|s| FakeKubeletError::Call {
                call: "GetInfo",
                status: Box::new(s),
            })?
            .into_inner();
        let problem = if info.r#type != reg::DRA_PLUGIN_TYPE {
            Some(format!("type {:?}", info.r#type))
        } else if info.name != driver {
            Some(format!("name {:?}", info.name))
        } else if info.supported_versions.first().map(String::as_str) != Some(dra_v1::VERSION) {
            Some(format!("versions {:?}", info.supported_versions))
        } else if !Path::new(&info.endpoint).is_absolute() {
            Some(format!("endpoint {:?} is not absolute", info.endpoint))
        } else {
            None
        };
        if let Some(p) = problem {
            let _ = r
                .notify_registration_status(reg::RegistrationStatus {
                    plugin_registered: false,
                    error: p.clone(),
                })
                .await;
            return Err(FakeKubeletError::Rejected(p));
        }
        let ch = uds_channel(Path::new(&info.endpoint)).await?;
        r.notify_registration_status(reg::RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .map_err(|s| FakeKubeletError::Call {
            call: "NotifyRegistrationStatus",
            status: Box::new(s),
        })?;
        Ok(Self {
            info,
            v1: dra_v1::dra_plugin_client::DraPluginClient::new(ch.clone()),
            v1beta1: dra_v1beta1::dra_plugin_client::DraPluginClient::new(ch),
        })
    }

    /// `NodePrepareResources` over v1.
    ///
    /// # Errors
    /// gRPC-level failure.
    pub async fn prepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<dra_v1::NodePrepareResourcesResponse, FakeKubeletError> {
        self.v1
            .clone()
            .node_prepare_resources(dra_v1::NodePrepareResourcesRequest {
                claims: claims.iter().map(wire).collect(),
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| FakeKubeletError::Call {
                call: "NodePrepareResources",
                status: Box::new(s),
            })
    }

    /// `NodeUnprepareResources` over v1.
    ///
    /// # Errors
    /// gRPC-level failure.
    pub async fn unprepare(
        &self,
        claims: &[ClaimRef],
    ) -> Result<dra_v1::NodeUnprepareResourcesResponse, FakeKubeletError> {
        self.v1
            .clone()
            .node_unprepare_resources(dra_v1::NodeUnprepareResourcesRequest {
                claims: claims.iter().map(wire).collect(),
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| FakeKubeletError::Call {
                call: "NodeUnprepareResources",
                status: Box::new(s),
            })
    }

    /// `NodePrepareResources` over v1beta1.
    ///
    /// # Errors
    /// gRPC-level failure.
    pub async fn prepare_v1beta1(
        &self,
        claims: &[ClaimRef],
    ) -> Result<dra_v1beta1::NodePrepareResourcesResponse, FakeKubeletError> {
        self.v1beta1
            .clone()
            .node_prepare_resources(dra_v1beta1::NodePrepareResourcesRequest {
                claims: claims
                    .iter()
                    .map(|c| dra_v1beta1::Claim {
                        namespace: c.namespace.clone(),
                        uid: c.uid.clone(),
                        name: c.name.clone(),
                    })
                    .collect(),
            })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| FakeKubeletError::Call {
                call: "NodePrepareResources(v1beta1)",
                status: Box::new(s),
            })
    }
}
