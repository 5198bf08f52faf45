//! Generated gRPC code (prost + tonic) for the kubelet protocols carve speaks,
//! compiled at build time from `proto/` by protox. One module per protocol
//! version, each with the version string kubelet uses for it.
//!
//! This crate holds wire types only: no conversions and no behaviour. Conversion
//! to domain types happens at the edge, in `carve-plugin`.

/// `k8s.io.kubelet.pkg.apis.dra.v1`: the DRA plugin service, v1 (kubelet 1.34+).
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod dra_v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    /// The `supported_versions` string for this service.
    pub const VERSION: &str = "v1.DRAPlugin";
}

/// `k8s.io.kubelet.pkg.apis.dra.v1beta1`: the DRA plugin service, v1beta1.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod dra_v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    /// The `supported_versions` string for this service.
    pub const VERSION: &str = "v1beta1.DRAPlugin";
}

/// `pluginregistration`: kubelet plugin registration, v1.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod registration {
    tonic::include_proto!("pluginregistration");
    /// The API version of the registration protocol.
    pub const VERSION: &str = "v1";
    /// `PluginInfo.type` for DRA drivers.
    pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
}

/// `v1alpha1`: the DRA resource health service.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod health_v1alpha1 {
    tonic::include_proto!("v1alpha1");
    /// The `supported_versions` string for this service.
    pub const VERSION: &str = "v1alpha1.DRAResourceHealth";
}

#[cfg(test)]
mod tests {
    use prost::Message;

    #[test]
    fn v1_device_share_id_is_field_5_and_optional() {
        let d = super::dra_v1::Device {
            share_id: Some("x".into()),
            ..Default::default()
        };
        // tag 5, wire type 2 => key byte 0x2a
        assert_eq!(d.encode_to_vec(), vec![0x2a, 1, b'x']);
        let none = super::dra_v1::Device::default();
        assert!(none.encode_to_vec().is_empty());
    }

    #[test]
    fn v1beta1_device_decodes_v1_bytes_without_share_id() {
        let d = super::dra_v1::Device {
            request_names: vec!["r".into()],
            pool_name: "p".into(),
            device_name: "d".into(),
            cdi_device_ids: vec!["a/b=c".into()],
            share_id: Some("s".into()),
        };
        let b = super::dra_v1beta1::Device::decode(&*d.encode_to_vec()).unwrap();
        assert_eq!(b.request_names, ["r"]);
        assert_eq!(b.pool_name, "p");
        assert_eq!(b.device_name, "d");
        assert_eq!(b.cdi_device_ids, ["a/b=c"]);
    }

    #[test]
    fn claim_field_numbers() {
        let c = super::dra_v1::Claim {
            namespace: "n".into(),
            uid: "u".into(),
            name: "m".into(),
        };
        assert_eq!(
            c.encode_to_vec(),
            vec![0x0a, 1, b'n', 0x12, 1, b'u', 0x1a, 1, b'm']
        );
    }

    #[test]
    fn registration_plugin_info_field_numbers() {
        let i = super::registration::PluginInfo {
            r#type: "t".into(),
            name: "n".into(),
            endpoint: "e".into(),
            supported_versions: vec!["v".into()],
        };
        assert_eq!(
            i.encode_to_vec(),
            vec![0x0a, 1, b't', 0x12, 1, b'n', 0x1a, 1, b'e', 0x22, 1, b'v']
        );
    }

    #[test]
    fn service_names_are_package_qualified() {
        use super::*;
        assert_eq!(
            <dra_v1::dra_plugin_server::DraPluginServer<()> as tonic::server::NamedService>::NAME,
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
        );
        assert_eq!(
            <registration::registration_server::RegistrationServer<()> as tonic::server::NamedService>::NAME,
            "pluginregistration.Registration"
        );
        assert_eq!(
            <health_v1alpha1::dra_resource_health_server::DraResourceHealthServer<()> as tonic::server::NamedService>::NAME,
            "v1alpha1.DRAResourceHealth"
        );
    }
}
