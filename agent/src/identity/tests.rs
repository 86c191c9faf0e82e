use super::*;

fn dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn identity_is_stable_across_loads() {
    let dir = tempfile::tempdir().unwrap();
    let first = Identity::load_or_create(dir.path()).unwrap();
    let second = Identity::load_or_create(dir.path()).unwrap();
    assert_eq!(first, second);
    assert_eq!(first.node_id.len(), 32);
    assert!(first.node_id.chars().all(|c| c.is_ascii_hexdigit()));
    assert!(!first.hostname.is_empty());
}

#[test]
fn two_state_dirs_get_different_node_ids() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let a = Identity::load_or_create(a.path()).unwrap();
    let b = Identity::load_or_create(b.path()).unwrap();
    assert_ne!(a.node_id, b.node_id);
}

#[test]
fn an_identity_created_concurrently_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(IDENTITY_FILE);
    let first = Identity {
        node_id: "aaaa".into(),
        hostname: "h".into(),
        labels: BTreeMap::new(),
    };
    assert!(persist(dir.path(), &path, &first).unwrap());
    // A second writer that raced the first loses and adopts the stored identity.
    let second = Identity {
        node_id: "bbbb".into(),
        ..first.clone()
    };
    assert!(!persist(dir.path(), &path, &second).unwrap());
    assert_eq!(Identity::load_or_create(dir.path()).unwrap(), first);
    assert_eq!(dir_names(dir.path()), [IDENTITY_FILE]);
}

#[test]
fn creates_missing_state_dir_and_leaves_no_temp_file() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("var/lib/rune");
    Identity::load_or_create(&dir).unwrap();
    assert_eq!(dir_names(&dir), vec![IDENTITY_FILE.to_owned()]);
}

#[test]
fn persisted_file_uses_documented_field_names() {
    let dir = tempfile::tempdir().unwrap();
    let identity = Identity::load_or_create(dir.path()).unwrap();
    let text = fs::read_to_string(dir.path().join(IDENTITY_FILE)).unwrap();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["node_id"], identity.node_id.as_str());
    assert_eq!(value["hostname"], identity.hostname.as_str());
    let mode = fs::metadata(dir.path().join(IDENTITY_FILE))
        .map(|m| m.permissions().mode() & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600);
}

#[test]
fn the_state_dir_is_made_private() {
    let root = tempfile::tempdir().unwrap();
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    // A new one is created 0700.
    let fresh = root.path().join("new/rune");
    Identity::load_or_create(&fresh).unwrap();
    assert_eq!(mode(&fresh), 0o700);
    // An existing one loses group and other permissions, its files too.
    let dir = root.path().join("old");
    fs::create_dir(&dir).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    let store = dir.join("store.redb");
    fs::write(&store, b"").unwrap();
    fs::set_permissions(&store, fs::Permissions::from_mode(0o644)).unwrap();
    let outside = root.path().join("outside");
    fs::write(&outside, b"").unwrap();
    fs::set_permissions(&outside, fs::Permissions::from_mode(0o644)).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
    Identity::load_or_create(&dir).unwrap();
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&store), 0o600);
    assert_eq!(mode(&dir.join(IDENTITY_FILE)), 0o600);
    assert_eq!(mode(&outside), 0o644, "a link's target is not touched");
    // Nothing left to change.
    assert_eq!(secure_state_dir(&dir).unwrap(), vec![]);
    // A dir everybody may write to is refused, and left as it is.
    let shared = root.path().join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
    let err = Identity::load_or_create(&shared).unwrap_err();
    assert!(matches!(err, IdentityError::SharedDir { .. }), "{err}");
    assert_eq!(mode(&shared), 0o1777);
}

#[test]
fn operator_labels_are_loaded() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join(IDENTITY_FILE),
        r#"{"node_id":"abc","hostname":"h","labels":{"zone":"a"}}"#,
    )
    .unwrap();
    let identity = Identity::load_or_create(dir.path()).unwrap();
    assert_eq!(identity.node_id, "abc");
    assert_eq!(identity.labels.get("zone").map(String::as_str), Some("a"));
    assert!(identity.has_label("zone", "a"));
    assert!(!identity.has_label("zone", "b"));
    assert!(!identity.has_label("role", "a"));
}

#[test]
fn malformed_file_is_an_error_naming_the_path_and_is_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(IDENTITY_FILE);
    let garbage = b"{\"node_id\": \"abc\", oops".to_vec();
    fs::write(&path, &garbage).unwrap();

    let error = Identity::load_or_create(dir.path()).unwrap_err();
    assert!(
        matches!(error, IdentityError::Malformed { .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains(&path.display().to_string()),
        "{error}"
    );
    assert_eq!(fs::read(&path).unwrap(), garbage);
    assert_eq!(dir_names(dir.path()), vec![IDENTITY_FILE.to_owned()]);
}

#[test]
fn bad_node_ids_are_rejected_and_not_overwritten() {
    for id in ["", "  ", "node one", "a\u{7}b"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(IDENTITY_FILE);
        let content =
            serde_json::to_vec(&serde_json::json!({"node_id": id, "hostname": "h"})).unwrap();
        fs::write(&path, &content).unwrap();

        let error = Identity::load_or_create(dir.path()).unwrap_err();
        assert!(
            matches!(
                error,
                IdentityError::Invalid {
                    field: "node_id",
                    ..
                }
            ),
            "{id:?}: {error:?}"
        );
        assert!(error.to_string().contains(&path.display().to_string()));
        assert_eq!(fs::read(&path).unwrap(), content);
    }
}
