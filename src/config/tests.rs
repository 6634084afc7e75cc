use super::*;

#[test]
fn defaults_are_valid_and_reaper_defaults_to_quarter_lease() {
    let c = Config::from_toml("").unwrap();
    assert_eq!(c, Config::default());
    assert_eq!(c.reaper_interval(), Duration::from_secs(75));
}

#[test]
fn shape_settings_parse() {
    let c = Config::from_toml(
        "[mongodb]\ntime_encoding = \"date\"\nuuid_representation = \"csharp-legacy\"\n[rabbitmq]\nforward_headers = false",
    )
    .unwrap();
    assert_eq!(c.mongodb.time_encoding, TimeEncoding::Date);
    assert_eq!(
        c.mongodb.uuid_representation,
        UuidRepresentation::CsharpLegacy
    );
    assert!(!c.rabbitmq.forward_headers);
    let d = Config::default();
    assert_eq!(d.mongodb.time_encoding, TimeEncoding::Auto);
    assert_eq!(d.mongodb.database, "RMessageBusPersistantStore");
    assert!(d.rabbitmq.forward_headers);
}

#[test]
fn durations_parse_humanely() {
    let c = Config::from_toml(
        "[dispatch]\npoll_interval = \"250ms\"\nlock_lease = \"5m\"\n[reaper]\ninterval = \"10s\"",
    )
    .unwrap();
    assert_eq!(c.dispatch.poll_interval, Duration::from_millis(250));
    assert_eq!(c.reaper_interval(), Duration::from_secs(10));
}

fn keys_of(text: &str) -> Vec<String> {
    Config::from_toml(text)
        .unwrap_err()
        .problems
        .into_iter()
        .map(|p| p.key)
        .collect()
}

/// Each validation rule names its key, and only its key.
#[test]
fn each_rule_names_its_key() {
    let cases = [
        ("[dispatch]\nbatch_size = 0", "dispatch.batch_size"),
        ("[dispatch]\nbatch_size = -5", "dispatch.batch_size"),
        (
            "[dispatch]\npoll_interval = \"0s\"",
            "dispatch.poll_interval",
        ),
        (
            "[dispatch]\npoll_interval = \"-1s\"",
            "dispatch.poll_interval",
        ),
        (
            "[dispatch]\nlock_lease = \"3s\"\nlease_safety_margin = \"2s\"",
            "dispatch.lock_lease",
        ),
        ("[dispatch]\nbogus = 1", "dispatch.bogus"),
        ("[nosuch]\nx = 1", "nosuch"),
        (
            "[mongodb]\ntime_encoding = \"unix\"",
            "mongodb.time_encoding",
        ),
        (
            "[mongodb]\nuuid_representation = \"java-legacy\"",
            "mongodb.uuid_representation",
        ),
        (
            "[rabbitmq]\nforward_headers = \"no\"",
            "rabbitmq.forward_headers",
        ),
        (
            "[rabbitmq]\nmessage_id = \"sometimes\"",
            "rabbitmq.message_id",
        ),
        ("[log]\nformat = \"xml\"", "log.format"),
        ("[reaper]\ninterval = \"0ms\"", "reaper.interval"),
        // The default reaper interval, a quarter of the lease, is zero: tokio's interval
        // panicked on it in the reaper task.
        (
            "[dispatch]\nlock_lease = \"3ns\"\npoll_interval = \"1ns\"\nlease_safety_margin = \"1ns\"\nlook_ahead = \"0s\"",
            "reaper.interval",
        ),
        ("[rabbitmq]\nuri = \"http://x\"", "rabbitmq.uri"),
        ("[http]\nlisten = \"nope\"", "http.listen"),
        (
            "[mongodb]\nuri = \"mongodb://h/?retryWrites=true&w=0\"",
            "mongodb.uri",
        ),
        (
            "[dispatch]\nshutdown_timeout = \"0s\"",
            "dispatch.shutdown_timeout",
        ),
        (
            "[dispatch]\nlease_safety_margin = \"0s\"",
            "dispatch.lease_safety_margin",
        ),
        (
            "[rabbitmq]\npublish_timeout = \"0s\"",
            "rabbitmq.publish_timeout",
        ),
        ("[mongodb]\nuri = \"\"", "mongodb.uri"),
        ("[mongodb]\nuri = \"postgres://h\"", "mongodb.uri"),
        // The driver refuses it (exit 1 at start-up, before this rule).
        ("[mongodb]\nuri = \"mongodb://h:notaport/\"", "mongodb.uri"),
        (
            "[mongodb]\nuri = \"mongodb://h/?nosuchoption=1&maxPoolSize=x\"",
            "mongodb.uri",
        ),
        ("[mongodb]\ndatabase = \" \"", "mongodb.database"),
        ("[mongodb]\ncollection = \"\"", "mongodb.collection"),
        (
            "[mongodb]\nparked_collection = \"\"",
            "mongodb.parked_collection",
        ),
        (
            "[mongodb]\nattempts_collection = \"\"",
            "mongodb.attempts_collection",
        ),
        (
            "[mongodb]\nparked_collection = \"Timeouts\"",
            "mongodb.parked_collection",
        ),
        (
            "[mongodb]\nuri_file = \"/nonexistent/uri\"",
            "mongodb.uri_file",
        ),
        ("[rabbitmq]\nuri = \"\"", "rabbitmq.uri"),
        (
            "[rabbitmq]\nuri_file = \"/nonexistent/uri\"",
            "rabbitmq.uri_file",
        ),
        (
            "[rabbitmq]\nsource_address = \"\"",
            "rabbitmq.source_address",
        ),
        (
            "[rabbitmq]\nfull_type_name = \"\"",
            "rabbitmq.full_type_name",
        ),
        ("[retry]\nbase = \"0s\"", "retry.base"),
        ("[retry]\nbase = \"1m\"\ncap = \"10s\"", "retry.cap"),
        ("[retry]\nmax_attempts = 0", "retry.max_attempts"),
        ("[retry]\nmax_attempts = -1", "retry.max_attempts"),
        ("[retry]\nbogus = 1", "retry.bogus"),
        ("[history]\nkeep = \"500ms\"", "history.keep"),
        ("[history]\nkeep = \"100years\"", "history.keep"),
        ("[history]\nbogus = 1", "history.bogus"),
        // Durations that parse but that no instant can be that far ahead of: an error, never a
        // panic when a deadline is worked out from one.
        (
            "[mongodb]\noperation_timeout = \"300000000000years\"",
            "mongodb.operation_timeout",
        ),
        (
            "[dispatch]\nshutdown_timeout = \"366days\"",
            "dispatch.shutdown_timeout",
        ),
        (
            "[reaper]\ninterval = \"500000000000years\"",
            "reaper.interval",
        ),
        ("[log]\nlevel = \"timeoutd=loud\"", "log.level"),
        ("[http]\nlisten = \"127.0.0.1:99999\"", "http.listen"),
    ];
    for (text, key) in cases {
        assert_eq!(keys_of(text), [key], "{text:?}");
    }
}

#[test]
fn uri_files_replace_inline_uris() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("mongodb-uri");
    std::fs::write(&file, "mongodb://u:from-file@db:27017\n").unwrap();
    let c = Config::from_toml(&format!(
        "[mongodb]\nuri = \"mongodb://inline\"\nuri_file = \"{}\"",
        file.display()
    ))
    .unwrap();
    assert_eq!(c.mongodb.uri, "mongodb://u:from-file@db:27017");
    assert!(!c.to_redacted_toml().contains("from-file"));
}

#[test]
fn rate_limits_parse_and_are_checked() {
    let c = Config::from_toml(
        "[dispatch]\nmax_rate = 500\n[[dispatch.destination]]\nname = \"billing\"\nmax_rate = 20.5\n",
    )
    .unwrap();
    assert_eq!(c.dispatch.max_rate, Some(500.0));
    assert_eq!(c.dispatch.destination[0].name, "billing");
    assert_eq!(c.dispatch.destination[0].max_rate, 20.5);
    assert_eq!(
        Config::from_toml(&c.to_redacted_toml()).unwrap().dispatch,
        c.dispatch
    );
    assert_eq!(keys_of("[dispatch]\nmax_rate = 0"), ["dispatch.max_rate"]);
    assert_eq!(
        keys_of("[[dispatch.destination]]\nname = \"\"\nmax_rate = 1"),
        ["dispatch.destination[0].name"]
    );
    assert_eq!(
        keys_of(
            "[[dispatch.destination]]\nname = \"a\"\nmax_rate = 1\n[[dispatch.destination]]\nname = \"a\"\nmax_rate = -1"
        ),
        [
            "dispatch.destination[1].name",
            "dispatch.destination[1].max_rate"
        ]
    );
    assert_eq!(
        keys_of("[mongodb]\ncontrol_collection = \"Timeouts\""),
        ["mongodb.control_collection"]
    );
}

#[test]
fn retry_delays_double_up_to_the_cap() {
    let r = RetryConfig {
        base: Duration::from_secs(5),
        cap: Duration::from_secs(60),
        max_attempts: 10,
    };
    let delays: Vec<u64> = (1..=6).map(|n| r.delay_after(n).as_secs()).collect();
    assert_eq!(delays, [5, 10, 20, 40, 60, 60]);
    assert_eq!(r.delay_after(u32::MAX), Duration::from_secs(60));
}

#[test]
fn reports_all_validation_problems_at_once() {
    let e = Config::from_toml(
        "[dispatch]\nbatch_size = 0\nshutdown_timeout = \"0s\"\n[rabbitmq]\npublish_timeout = \"0s\"",
    )
    .unwrap_err();
    assert_eq!(e.problems.len(), 3, "{e}");
    assert_eq!(e.to_string().lines().count(), 3);
}

#[test]
fn redacted_toml_hides_passwords_and_round_trips() {
    let mut c = Config::default();
    c.mongodb.uri = "mongodb://admin:hunter2@db:27017".into();
    let text = c.to_redacted_toml();
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("admin:***@db"));
    let back = Config::from_toml(&text).unwrap();
    assert_eq!(back.reaper_interval(), c.reaper_interval());
    assert_eq!(back.dispatch, c.dispatch);
}

/// The review of issue 25: the claim window (a poll interval and the look-ahead) saturates
/// rather than panic on absurd durations.
#[test]
fn the_claim_window_saturates() {
    let d = DispatchConfig {
        poll_interval: std::time::Duration::MAX,
        look_ahead: Some(std::time::Duration::MAX),
        ..DispatchConfig::default()
    };
    assert_eq!(d.claim_window(), std::time::Duration::MAX);
}

/// Found in review (helper-33): values that passed validation and failed at run time. A rate
/// that lets no record out within a lease made claims take and release the same records for
/// ever; names MongoDB refuses made every call fail while the daemon waited for a server
/// that answers; a batch past what one claim's filter can name failed every full claim.
#[test]
fn what_fails_at_run_time_is_refused_naming_its_key() {
    let cases = [
        ("[dispatch]\nmax_rate = 0.002", "dispatch.max_rate"),
        (
            "[[dispatch.destination]]\nname = \"q\"\nmax_rate = 0.002",
            "dispatch.destination[0].max_rate",
        ),
        ("[dispatch]\nbatch_size = 4000000000", "dispatch.batch_size"),
        ("[mongodb]\ndatabase = \"my.db\"", "mongodb.database"),
        ("[mongodb]\ndatabase = \"a b\"", "mongodb.database"),
        ("[mongodb]\ncollection = \"a$b\"", "mongodb.collection"),
        (
            "[mongodb]\ncollection = \"system.timeouts\"",
            "mongodb.collection",
        ),
        (
            "[mongodb]\nparked_collection = \"p$\"",
            "mongodb.parked_collection",
        ),
    ];
    for (toml, key) in cases {
        assert_eq!(keys_of(toml), vec![key.to_string()], "{toml}");
    }
    // TLS files that exist but cannot serve: a directory, a file that is no PEM certificate,
    // a certificate where the key belongs.
    let dir = std::env::temp_dir().join(format!("timeoutd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let (not_pem, cert) = (dir.join("not.pem"), dir.join("cert.pem"));
    std::fs::write(&not_pem, "not a certificate").expect("written");
    let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    std::fs::write(&cert, pem).expect("written");
    let tls = |section: &str, key: &str, path: &std::path::Path| {
        format!("[{section}]\n{key} = {:?}", path.display().to_string())
    };
    for (toml, key) in [
        (tls("mongodb", "tls_ca_file", &dir), "mongodb.tls_ca_file"),
        (
            tls("rabbitmq", "tls_ca_file", &not_pem),
            "rabbitmq.tls_ca_file",
        ),
        (
            tls("mongodb", "tls_certificate_key_file", &cert),
            "mongodb.tls_certificate_key_file",
        ),
    ] {
        assert_eq!(keys_of(&toml), vec![key.to_string()], "{toml}");
    }
    assert!(Config::from_toml(&tls("rabbitmq", "tls_ca_file", &cert)).is_ok());
    std::fs::remove_dir_all(&dir).ok();
    // At the edge: one record a lease is enough, and the default names pass.
    let lease = "[dispatch]\nlock_lease = \"102s\"\nlease_safety_margin = \"2s\"\nmax_rate = 0.01";
    assert!(Config::from_toml(lease).is_ok());
    assert!(Config::from_toml("").is_ok());
}
