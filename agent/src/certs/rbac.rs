//! etcd's users, roles and authentication for rune ([`apply`]): the admin may do
//! everything, each node may read the prefix and write only its own registration
//! key. With `--client-cert-auth`, etcd takes a client certificate's CN as the
//! user name, so the certificates of [`super::init`] and [`super::issue_node`]
//! are these users, without a password (`root` has a random one, never stored).
//!
//! | user | roles | may |
//! |---|---|---|
//! | `root` | `root` | everything; etcd requires it before enabling auth; no certificate is issued for it; made with a random password never stored (see below) |
//! | `rune-admin` | `root`, `rune-admin` | everything, users and roles included (`rune-admin`: readwrite on the prefix) |
//! | `<node id>` | `rune-node-<id>` | read the prefix; read and write `<prefix>nodes/<id>` |
//!
//! Running it again converges: missing roles and users are added, the permissions
//! of the `rune-*` roles are set to exactly the above (others are revoked), node
//! users lose roles not their own, and auth stays enabled.
//!
//! Fails closed before changing anything when etcd accepts a client without a
//! certificate (no `--client-cert-auth`). etcd with `--trusted-ca-file` alone asks
//! for certificates but takes no CN as a user, which shows only once auth is on:
//! every client is then refused, so auth is switched off again as `root`, whose
//! random password this run made (when it made the root user).

use super::{ADMIN_CN, CertsError, check_node_id};
use crate::orderedlog::etcd::{ConnectError, EtcdOptions};
use etcd_client::{AuthClient, Client, Permission, PermissionType, UserAddOptions};
use thiserror::Error;

/// The role of the admin certificate: readwrite on the whole prefix.
pub const ADMIN_ROLE: &str = "rune-admin";
/// etcd's built-in role of everything, auth management included.
pub const ROOT: &str = "root";

/// The role of node `node_id`.
pub fn node_role(node_id: &str) -> String {
    format!("rune-node-{node_id}")
}

/// The one key node `node_id` may write under `prefix` (which ends with `/`).
pub fn node_key(prefix: &str, node_id: &str) -> String {
    format!("{prefix}nodes/{node_id}")
}

/// Why the roles could not be set up.
#[derive(Debug, Error)]
pub enum RbacError {
    /// The connection options are wrong.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A node id that cannot be a user.
    #[error(transparent)]
    NodeId(#[from] CertsError),
    /// Not mutual TLS: with authentication on, a client would then have no user
    /// (the users have no password) and nobody could reach etcd any more.
    #[error(
        "etcd-rbac needs https:// endpoints, the CA, and the admin's client certificate \
         and key: etcd takes the certificate's CN as the user, and these users have no \
         password (the CN is the credential)"
    )]
    NotMutualTls,
    /// etcd accepted a client without a certificate: it does not run with
    /// `--client-cert-auth`, so it would not take certificates' CNs as users and
    /// enabling authentication would lock every client out.
    #[error(
        "etcd at {endpoints} accepts clients without a certificate, so it does not run \
         with --client-cert-auth: it would not take a certificate's CN as its user, and \
         enabling authentication would lock every client out. Nothing was changed: \
         restart every member with --client-cert-auth (and --trusted-ca-file) first"
    )]
    NoClientCertAuth {
        /// The endpoints, comma-separated.
        endpoints: String,
    },
    /// etcd asks for client certificates but does not take their CN as the user
    /// (a `--trusted-ca-file` without `--client-cert-auth`): found once
    /// authentication was on, which was then switched off again when possible.
    #[error(
        "etcd at {endpoints} does not take a client certificate's CN as its user: it runs \
         without --client-cert-auth (a --trusted-ca-file alone makes it ask for \
         certificates, not use them). {}",
        if *.switched_off {
            "Authentication was switched off again, so clients work as before (the users \
             and roles made stay): restart every member with --client-cert-auth and run \
             this again"
        } else {
            "Authentication is on and every client is refused until every member runs \
             with --client-cert-auth; the admin certificate then works again (it could \
             not be switched off: the root user existed before, with a password this \
             command does not know)"
        }
    )]
    CnNotUsed {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// Authentication was switched off again.
        switched_off: bool,
    },
    /// etcd refused or failed a step.
    #[error("etcd at {endpoints}: {step}: {message}")]
    Etcd {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What was being done (`adding role rune-admin`).
        step: String,
        /// What etcd said, with a hint when it is a refusal.
        message: String,
    },
}

/// What [`apply`] changed, for the operator; empty lists when it was all in place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RbacReport {
    /// Roles added.
    pub roles_added: Vec<String>,
    /// Users added.
    pub users_added: Vec<String>,
    /// Permissions revoked from `rune-*` roles, as `role: key..range_end`.
    pub revoked: Vec<String>,
    /// Roles taken from node users, as `user: role`.
    pub roles_revoked: Vec<String>,
}

/// A permission wanted on a role: type, key, range end (empty: the key alone).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Want {
    kind: PermissionType,
    key: Vec<u8>,
    range_end: Vec<u8>,
}

impl Want {
    fn permission(&self) -> Permission {
        let p = Permission::new(self.kind, self.key.clone());
        if self.range_end.is_empty() {
            p
        } else {
            p.with_range_end(self.range_end.clone())
        }
    }

    fn matches(&self, p: &Permission) -> bool {
        p.get_type() == self.kind as i32 && p.key() == self.key && p.range_end() == self.range_end
    }
}

/// The range end of every key starting with `prefix` (etcd's `--prefix`).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // A prefix of 0xff bytes only: every key after it ("\0" in etcd).
    vec![0]
}

/// The permissions of [`ADMIN_ROLE`] and of each node's role under `prefix`.
fn plan(prefix: &str, nodes: &[String]) -> Vec<(String, Vec<Want>)> {
    let whole = |kind| Want {
        kind,
        key: prefix.as_bytes().to_vec(),
        range_end: prefix_end(prefix),
    };
    let mut roles = vec![(
        ADMIN_ROLE.to_owned(),
        vec![whole(PermissionType::Readwrite)],
    )];
    for id in nodes {
        roles.push((
            node_role(id),
            vec![
                whole(PermissionType::Read),
                Want {
                    kind: PermissionType::Readwrite,
                    key: node_key(prefix, id).into_bytes(),
                    range_end: Vec::new(),
                },
            ],
        ));
    }
    roles
}

/// Sets up the roles and users of this module on the etcd of `options` (its
/// prefix; the client certificate must be the admin's once auth is on) for
/// `nodes`, and enables authentication. Idempotent.
pub async fn apply(options: &EtcdOptions, nodes: &[String]) -> Result<RbacReport, RbacError> {
    let mut unique: Vec<String> = Vec::with_capacity(nodes.len());
    for id in nodes {
        check_node_id(id)?;
        if !unique.contains(id) {
            unique.push(id.clone());
        }
    }
    let nodes = unique.as_slice();
    let https = options.endpoints.iter().all(|e| e.starts_with("https://"));
    if !https || options.cert_file.is_none() || options.key_file.is_none() {
        return Err(RbacError::NotMutualTls);
    }
    let prefix = options.normalized_prefix()?;
    let connect = options.connect_options()?;
    let endpoints = options.endpoints_text();
    if accepts_without_certificate(options).await? {
        return Err(RbacError::NoClientCertAuth { endpoints });
    }
    let client = Client::connect(&options.endpoints, Some(connect))
        .await
        .map_err(|e| RbacError::Etcd {
            endpoints: endpoints.clone(),
            step: "connecting".to_owned(),
            message: describe(&e),
        })?;
    let mut auth = Auth {
        client: client.auth_client(),
        endpoints,
    };
    let mut report = RbacReport::default();

    let roles = auth
        .call("listing roles", |c| Box::pin(c.role_list()))
        .await?
        .roles()
        .to_vec();
    for (role, wants) in plan(&prefix, nodes) {
        if !roles.contains(&role) {
            let r = role.clone();
            auth.call(&format!("adding role {role}"), |c| Box::pin(c.role_add(r)))
                .await?;
            report.roles_added.push(role.clone());
        }
        auth.set_permissions(&role, &wants, &mut report).await?;
    }

    let users = auth
        .call("listing users", |c| Box::pin(c.user_list()))
        .await?
        .users()
        .to_vec();
    let mut grants: Vec<(String, Vec<String>)> = vec![
        (ROOT.to_owned(), vec![ROOT.to_owned()]),
        (
            ADMIN_CN.to_owned(),
            vec![ROOT.to_owned(), ADMIN_ROLE.to_owned()],
        ),
    ];
    grants.extend(nodes.iter().map(|id| (id.clone(), vec![node_role(id)])));
    // The password of a root user made now: never stored or shown, only used to
    // switch authentication off again should etcd not take certificates' CNs.
    let mut root_password = None;
    for (user, roles) in &grants {
        if !users.contains(user) && user == ROOT {
            let password = random_password();
            let (u, p) = (user.clone(), password.clone());
            auth.call(&format!("adding user {user}"), |c| {
                Box::pin(c.user_add(u, p, None))
            })
            .await?;
            root_password = Some(password);
            report.users_added.push(user.clone());
        } else if !users.contains(user) {
            let u = user.clone();
            // No password: the user is only ever the CN of a certificate.
            auth.call(&format!("adding user {user}"), |c| {
                Box::pin(c.user_add(u, "", Some(UserAddOptions::new().with_no_pwd())))
            })
            .await?;
            report.users_added.push(user.clone());
        }
        for role in roles {
            let (u, r) = (user.clone(), role.clone());
            auth.call(&format!("granting role {role} to user {user}"), |c| {
                Box::pin(c.user_grant_role(u, r))
            })
            .await?;
        }
        if nodes.contains(user) {
            auth.revoke_other_roles(user, roles, &mut report).await?;
        }
    }

    // etcd ignores the request when auth is on already (etcd 3.4 cannot say
    // whether it is: no AuthStatus).
    auth.call("enabling authentication", |c| Box::pin(c.auth_enable()))
        .await?;
    // Only a request that needs a user shows whether etcd takes the CN as one.
    match auth.client.role_list().await {
        Ok(_) => Ok(report),
        Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("user name is empty") => {
            let switched_off = match root_password {
                Some(password) => switch_off(options, &password).await.is_ok(),
                None => false,
            };
            Err(RbacError::CnNotUsed {
                endpoints: auth.endpoints,
                switched_off,
            })
        }
        Err(e) => Err(RbacError::Etcd {
            endpoints: auth.endpoints,
            step: "checking the admin's access with authentication on".to_owned(),
            message: describe(&e),
        }),
    }
}

/// Whether etcd completes a request of a client without a certificate: then it
/// does not run with `--client-cert-auth` (etcd's status needs no user, so it
/// answers whenever the TLS handshake passed). A refusal counts only when it is
/// consistent: the client without a certificate fails three times while the admin's
/// client, asked right after each, answers; when the admin's does not answer,
/// nothing can be told and nothing is changed.
async fn accepts_without_certificate(options: &EtcdOptions) -> Result<bool, RbacError> {
    let failed = |e: etcd_client::Error| RbacError::Etcd {
        endpoints: options.endpoints_text(),
        step: "checking whether etcd requires client certificates (nothing was changed)".to_owned(),
        message: describe(&e),
    };
    let mut admin = Client::connect(&options.endpoints, Some(options.connect_options()?))
        .await
        .map_err(failed)?;
    let mut anonymous = options.clone();
    anonymous.cert_file = None;
    anonymous.key_file = None;
    for _ in 0..3 {
        let client =
            Client::connect(&anonymous.endpoints, Some(anonymous.connect_options()?)).await;
        if let Ok(mut client) = client
            && client.status().await.is_ok()
        {
            return Ok(true);
        }
        admin.status().await.map_err(failed)?;
    }
    Ok(false)
}

/// 32 random bytes, hex.
fn random_password() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Switches authentication off as `root` with `password`.
async fn switch_off(options: &EtcdOptions, password: &str) -> Result<(), RbacError> {
    let connect = options.connect_options()?.with_user(ROOT, password);
    let step = |e: etcd_client::Error| RbacError::Etcd {
        endpoints: options.endpoints_text(),
        step: "switching authentication off again".to_owned(),
        message: describe(&e),
    };
    let client = Client::connect(&options.endpoints, Some(connect))
        .await
        .map_err(step)?;
    client.auth_client().auth_disable().await.map_err(step)?;
    Ok(())
}

/// The auth API of one cluster, every error naming the step.
struct Auth {
    client: AuthClient,
    endpoints: String,
}

type Call<'a, T> =
    std::pin::Pin<Box<dyn Future<Output = Result<T, etcd_client::Error>> + Send + 'a>>;

impl Auth {
    async fn call<T>(
        &mut self,
        step: &str,
        f: impl for<'a> FnOnce(&'a mut AuthClient) -> Call<'a, T>,
    ) -> Result<T, RbacError> {
        f(&mut self.client).await.map_err(|e| RbacError::Etcd {
            endpoints: self.endpoints.clone(),
            step: step.to_owned(),
            message: describe(&e),
        })
    }

    /// Grants `wants` to `role` and revokes every other permission it has.
    async fn set_permissions(
        &mut self,
        role: &str,
        wants: &[Want],
        report: &mut RbacReport,
    ) -> Result<(), RbacError> {
        let r = role.to_owned();
        let have = self
            .call(&format!("reading role {role}"), |c| Box::pin(c.role_get(r)))
            .await?
            .permissions();
        for p in have.iter().filter(|p| !wants.iter().any(|w| w.matches(p))) {
            let shown = format!(
                "{role}: {}..{}",
                String::from_utf8_lossy(p.key()),
                String::from_utf8_lossy(p.range_end())
            );
            let (r, key) = (role.to_owned(), p.key().to_vec());
            let options = (!p.range_end().is_empty()).then(|| {
                etcd_client::RoleRevokePermissionOptions::new()
                    .with_range_end(p.range_end().to_vec())
            });
            self.call(&format!("revoking {shown}"), |c| {
                Box::pin(c.role_revoke_permission(r, key, options))
            })
            .await?;
            report.revoked.push(shown);
        }
        for want in wants.iter().filter(|w| !have.iter().any(|p| w.matches(p))) {
            let (r, p) = (role.to_owned(), want.permission());
            self.call(
                &format!(
                    "granting role {role} {:?} on {}",
                    want.kind,
                    String::from_utf8_lossy(&want.key)
                ),
                |c| Box::pin(c.role_grant_permission(r, p)),
            )
            .await?;
        }
        Ok(())
    }

    /// Takes from node user `user` every role not in `keep`: a node gets no more
    /// than its own role, whoever granted it what before.
    async fn revoke_other_roles(
        &mut self,
        user: &str,
        keep: &[String],
        report: &mut RbacReport,
    ) -> Result<(), RbacError> {
        let u = user.to_owned();
        let roles = self
            .call(&format!("reading user {user}"), |c| Box::pin(c.user_get(u)))
            .await?
            .roles()
            .to_vec();
        for role in roles.iter().filter(|r| !keep.contains(r)) {
            let (u, r) = (user.to_owned(), role.clone());
            self.call(&format!("revoking role {role} from user {user}"), |c| {
                Box::pin(c.user_revoke_role(u, r))
            })
            .await?;
            report.roles_revoked.push(format!("{user}: {role}"));
        }
        Ok(())
    }
}

/// etcd's message and its causes, each once, without the transport's wrappers; with
/// what to do when etcd refused for lack of permission.
fn describe(e: &etcd_client::Error) -> String {
    let (mut message, denied, mut source) = match e {
        etcd_client::Error::GRpcStatus(s) => (
            s.message().to_owned(),
            s.code() == tonic::Code::PermissionDenied,
            std::error::Error::source(s),
        ),
        etcd_client::Error::TransportError(t) => {
            (t.to_string(), false, std::error::Error::source(t))
        }
        other => (other.to_string(), false, std::error::Error::source(other)),
    };
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message = format!("{message}: {text}");
        }
        source = s.source();
    }
    if denied {
        message.push_str(
            " (authentication is on and this client's user, its certificate's CN, may not \
             manage users and roles: connect with the admin certificate, CN rune-admin)",
        );
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_mutual_tls_is_accepted_before_anything_is_sent() {
        let mut options = EtcdOptions::new(["http://127.0.0.1:1"]);
        let err = apply(&options, &[]).await.unwrap_err();
        assert!(matches!(err, RbacError::NotMutualTls), "{err}");
        options.endpoints = vec!["https://127.0.0.1:1".to_owned()];
        options.ca_file = Some("/nonexistent/ca.pem".into());
        let err = apply(&options, &[]).await.unwrap_err();
        assert!(matches!(err, RbacError::NotMutualTls), "{err}");
        options.cert_file = Some("/nonexistent/admin.pem".into());
        options.key_file = Some("/nonexistent/admin-key.pem".into());
        let err = apply(&options, &["n1".to_owned(), "a/b".to_owned()])
            .await
            .unwrap_err();
        assert!(matches!(err, RbacError::NodeId(_)), "{err}");
    }

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_end("/rune/v1/"), b"/rune/v10".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }

    #[test]
    fn nodes_read_the_prefix_and_write_only_their_key() {
        let roles = plan("/rune/v1/", &["n1".to_owned()]);
        assert_eq!(roles.len(), 2);
        assert_eq!(roles[0].0, "rune-admin");
        assert_eq!(roles[0].1[0].kind, PermissionType::Readwrite);
        assert_eq!(roles[1].0, "rune-node-n1");
        let node = &roles[1].1;
        assert_eq!(
            (
                node[0].kind,
                node[0].key.as_slice(),
                node[0].range_end.as_slice()
            ),
            (PermissionType::Read, &b"/rune/v1/"[..], &b"/rune/v10"[..])
        );
        assert_eq!(
            (
                node[1].kind,
                node[1].key.as_slice(),
                node[1].range_end.as_slice()
            ),
            (
                PermissionType::Readwrite,
                &b"/rune/v1/nodes/n1"[..],
                &b""[..]
            )
        );
    }
}
