use super::*;

#[test]
fn challenge_tokens_are_answered_only_while_published() {
    let challenges = Challenges::default();
    let path = format!("{CHALLENGE_PATH}tok");
    {
        let mut published = challenges.publication();
        published.add("tok", "tok.thumbprint");
        assert_eq!(challenges.answer(&path).as_deref(), Some("tok.thumbprint"));
        assert_eq!(challenges.answer("/tok"), None);
        assert_eq!(challenges.answer(&format!("{CHALLENGE_PATH}other")), None);
    }
    assert_eq!(challenges.answer(&path), None);
}

#[tokio::test]
async fn a_failed_order_is_reported_and_retried_later_without_a_certificate() {
    let state = tempfile::tempdir().unwrap();
    // Nothing listens on port 1 of loopback: the account cannot be registered.
    let acme = Arc::new(Acme::new(
        AcmeSettings {
            server: AcmeServer {
                directory: "https://127.0.0.1:1/dir".to_owned(),
                email: None,
                ca_bundle: None,
            },
            renew_before: Duration::from_secs(30 * 86_400),
            first_retry: Duration::from_secs(60),
            dir: state.path().join("acme"),
        },
        Arc::default(),
    ));
    acme.want(["a.example".to_owned()].into());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(acme.clone().run(cancel.clone()));
    let mut error = None;
    for _ in 0..200 {
        error = acme.status().first().and_then(|s| s.last_error.clone());
        if error.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    task.await.unwrap();
    let error = error.expect("the failure in status");
    assert!(error.contains("127.0.0.1:1"), "{error}");
    let status = &acme.status()[0];
    assert_eq!(status.issuer, None);
    assert!(
        status
            .to_string()
            .contains("no certificate yet; last error"),
        "{status}"
    );
    assert!(acme.certs().is_empty());
    // The next attempt waits out the backoff.
    let (host, wait) = acme.next_due(&acme.wanted.borrow()).unwrap();
    assert_eq!(host, "a.example");
    assert!(
        wait > Duration::from_secs(50) && wait <= Duration::from_secs(60),
        "{wait:?}"
    );
    assert!(!state.path().join("acme").join("account.json").exists());
}
