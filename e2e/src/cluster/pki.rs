//! The cluster's certificates and keys, made with `openssl` as
//! `hack/local-up-cluster.sh` makes them: one CA signs the API server's
//! serving certificate and every client certificate (the client's user is the
//! subject's CN, its groups the O fields, which is what the Node authorizer
//! and RBAC read), and one key signs service-account tokens. ECDSA P-256
//! throughout (the API server accepts it for both; it is fast to make).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::ClusterError;

/// Where the files are.
#[derive(Debug, Clone)]
pub struct Pki {
    /// The directory.
    pub dir: PathBuf,
}

/// A client certificate and key.
#[derive(Debug, Clone)]
pub struct ClientCert {
    /// PEM certificate.
    pub cert: PathBuf,
    /// PEM key.
    pub key: PathBuf,
}

fn openssl(args: &[&str], dir: &Path) -> Result<(), ClusterError> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| {
            ClusterError::Prerequisite(format!(
                "openssl could not run ({e}): apt-get install openssl"
            ))
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ClusterError::Command {
            what: format!("openssl {}", args.join(" ")),
            output: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

impl Pki {
    /// Makes the CA and the service-account key in `dir`.
    ///
    /// # Errors
    /// openssl is missing or fails.
    pub fn new(dir: &Path) -> Result<Self, ClusterError> {
        std::fs::create_dir_all(dir).map_err(ClusterError::io("creating", dir))?;
        let p = Pki {
            dir: dir.to_path_buf(),
        };
        openssl(
            &[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-days",
                "30",
                "-subj",
                "/CN=carve-e2e-ca",
            ],
            dir,
        )?;
        openssl(
            &[
                "ecparam",
                "-name",
                "prime256v1",
                "-genkey",
                "-noout",
                "-out",
                "sa.key",
            ],
            dir,
        )?;
        openssl(&["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"], dir)?;
        Ok(p)
    }

    /// The CA certificate.
    #[must_use]
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The service-account signing key (private).
    #[must_use]
    pub fn sa_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }

    /// The service-account key (public).
    #[must_use]
    pub fn sa_pub(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }

    /// A certificate named `name` signed by the CA, for `subject`, with the
    /// subject alternative names `sans` (`IP:127.0.0.1,DNS:localhost`) when
    /// it serves, and the usage of a client or a server.
    ///
    /// # Errors
    /// openssl fails.
    pub fn issue(
        &self,
        name: &str,
        subject: &str,
        sans: Option<&str>,
    ) -> Result<ClientCert, ClusterError> {
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let crt = format!("{name}.crt");
        let ext = format!("{name}.ext");
        let usage = if sans.is_some() {
            "serverAuth"
        } else {
            "clientAuth"
        };
        let mut text = format!(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
        );
        if let Some(s) = sans {
            text.push_str(&format!("subjectAltName={s}\n"));
        }
        let ext_path = self.dir.join(&ext);
        std::fs::write(&ext_path, text).map_err(ClusterError::io("writing", &ext_path))?;
        openssl(
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                subject,
            ],
            &self.dir,
        )?;
        openssl(
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &crt,
                "-days",
                "30",
                "-extfile",
                &ext,
            ],
            &self.dir,
        )?;
        Ok(ClientCert {
            cert: self.dir.join(crt),
            key: self.dir.join(key),
        })
    }

    /// A kubeconfig for `server` that authenticates with `cert`.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn kubeconfig(
        &self,
        name: &str,
        server: &str,
        cert: &ClientCert,
    ) -> Result<PathBuf, ClusterError> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: carve-e2e\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: {name}\n  user:\n    client-certificate: {crt}\n    client-key: {key}\ncontexts:\n- name: {name}\n  context:\n    cluster: carve-e2e\n    user: {name}\ncurrent-context: {name}\n",
            ca = self.ca().display(),
            crt = cert.cert.display(),
            key = cert.key.display(),
        );
        let path = self.dir.join(format!("{name}.kubeconfig"));
        std::fs::write(&path, text).map_err(ClusterError::io("writing", &path))?;
        Ok(path)
    }
}
