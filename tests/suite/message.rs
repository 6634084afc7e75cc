//! The wire format and AMQP's limits: the `TimeoutMessage` as ServiceConnect v7 sends it,
//! .NET's date format over the whole range it can hold, and records no message can carry.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use std::time::{Duration, SystemTime};

use bson::spec::BinarySubtype;
use bson::{Bson, DateTime, doc};
use lapin::types::AMQPValue;
use timeoutd::config::{MessageIdMode, RabbitConfig, UuidRepresentation};
use timeoutd::record::TimeoutRecord;
use timeoutd::record::message::*;
use uuid::Uuid;

fn header(m: &OutgoingMessage, k: &str) -> Option<String> {
    m.properties
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get(k)
        .map(|v| match v {
            AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k} is not a long string: {other:?}"),
        })
}

fn saga() -> Uuid {
    Uuid::parse_str("00112233-4455-6677-8899-aabbccddeeff").unwrap()
}

fn record() -> TimeoutRecord {
    TimeoutRecord {
        id: Uuid::parse_str("11111111-2222-4333-8444-555555555555").unwrap(),
        destination: "orders".into(),
        process_manager_id: Uuid::parse_str("3F2504E0-4F89-11D3-9A0C-0305E82C3301").unwrap(),
        due: DateTime::from_millis(0),
        headers: doc! {
            "Tenant": "acme",
            "MessageType": "Publish",
            "Flag": true,
            "Count": 7_i32,
            "Raw": bson::Binary { subtype: BinarySubtype::Generic, bytes: b"hi".to_vec() },
            "Nothing": Bson::Null,
            "Weird": [1, 2],
            // A Guid header as each C# driver stores it: standard, and legacy (.NET byte order).
            "Saga": timeoutd::record::guid::to_bson(saga(), UuidRepresentation::Standard),
            "LegacySaga": timeoutd::record::guid::to_bson(saga(), UuidRepresentation::CsharpLegacy),
        },
    }
}

#[test]
fn time_sent_has_seven_fraction_digits() {
    let t = SystemTime::UNIX_EPOCH + Duration::new(1_777_809_600, 123_456_789);
    assert_eq!(format_time_sent(t), "2026-05-03T12:00:00.1234567Z");
    assert_eq!(
        format_time_sent(SystemTime::UNIX_EPOCH),
        "1970-01-01T00:00:00.0000000Z"
    );
}

#[test]
fn body_and_fixed_headers_match_v7() {
    let m = build(
        &record(),
        &RabbitConfig::default(),
        SystemTime::UNIX_EPOCH,
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    assert_eq!(
        m.body,
        br#"{"CorrelationId":"3f2504e0-4f89-11d3-9a0c-0305e82c3301"}"#
    );
    assert_eq!(m.routing_key, "orders");
    assert_eq!(*m.properties.delivery_mode(), Some(2));
    assert_eq!(
        m.properties.message_id().as_ref().unwrap().as_str(),
        "11111111-2222-4333-8444-555555555555"
    );
    assert_eq!(header(&m, "MessageType").unwrap(), "Send");
    assert_eq!(header(&m, "Tenant").unwrap(), "acme");
    assert_eq!(header(&m, "Flag").unwrap(), "True");
    assert_eq!(header(&m, "Count").unwrap(), "7");
    assert_eq!(header(&m, "Raw").unwrap(), "base64:aGk=");
    assert_eq!(header(&m, "Nothing").unwrap(), "");
    assert_eq!(header(&m, "Weird"), None);
    assert_eq!(header(&m, "Saga").unwrap(), saga().hyphenated().to_string());
    assert_eq!(
        header(&m, "LegacySaga").unwrap(),
        saga().hyphenated().to_string()
    );
    assert_eq!(
        header(&m, "TimeoutId").unwrap(),
        "11111111-2222-4333-8444-555555555555"
    );
    assert!(m.properties.content_type().is_none());
    assert!(m.properties.correlation_id().is_none());
}

#[test]
fn random_mode_has_fresh_ids_and_no_timeout_id() {
    let rabbit = RabbitConfig {
        message_id: MessageIdMode::Random,
        ..RabbitConfig::default()
    };
    let a = build(
        &record(),
        &rabbit,
        SystemTime::UNIX_EPOCH,
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    let b = build(
        &record(),
        &rabbit,
        SystemTime::UNIX_EPOCH,
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    assert_ne!(header(&a, "MessageId"), header(&b, "MessageId"));
    assert_eq!(header(&a, "TimeoutId"), None);
}

#[test]
fn every_date_dotnet_can_hold_is_formatted_and_others_dropped() {
    let ms = |d: i64| Bson::DateTime(DateTime::from_millis(d));
    // DateTime.MinValue, the value of every unset .NET DateTime.
    assert_eq!(
        header_value_string(&ms(-62_135_596_800_000)).unwrap(),
        "0001-01-01T00:00:00.0000000Z"
    );
    // The last millisecond of DateTime.MaxValue's day.
    assert_eq!(
        header_value_string(&ms(253_402_300_799_999)).unwrap(),
        "9999-12-31T23:59:59.9990000Z"
    );
    assert_eq!(
        header_value_string(&ms(-1)).unwrap(),
        "1969-12-31T23:59:59.9990000Z"
    );
    for outside in [-62_135_596_800_001, 253_402_300_800_000, i64::MIN, i64::MAX] {
        assert_eq!(header_value_string(&ms(outside)), None, "{outside}");
    }
}

/// Found in review: a `double` header was printed as Rust prints it (`1e21` as 22 digits,
/// `1e-5` as `0.00001`), not in .NET's invariant form that ServiceConnect sends (interop §5).
#[test]
fn a_double_header_is_printed_as_dotnet_prints_it() {
    for (v, dotnet) in [
        (0.0, "0"),
        (-0.0, "-0"),
        (5.0, "5"),
        (-60.0, "-60"),
        (1.5, "1.5"),
        (0.1 + 0.2, "0.30000000000000004"),
        (0.0001, "0.0001"),
        (0.00001, "1E-05"),
        (123_456_789_012_345.0, "123456789012345"),
        (1e15, "1E+15"),
        (1_234_567_890_123_456.0, "1234567890123456"),
        (1e16, "1E+16"),
        (1e21, "1E+21"),
        (1.5e300, "1.5E+300"),
        (1.25e-7, "1.25E-07"),
        (f64::MAX, "1.7976931348623157E+308"),
        (5e-324, "5E-324"),
    ] {
        assert_eq!(
            header_value_string(&Bson::Double(v)).as_deref(),
            Some(dotnet),
            "{v:e}"
        );
    }
    for (v, dotnet) in [
        (f64::NAN, "NaN"),
        (f64::INFINITY, "Infinity"),
        (f64::NEG_INFINITY, "-Infinity"),
    ] {
        assert_eq!(
            header_value_string(&Bson::Double(v)).as_deref(),
            Some(dotnet)
        );
    }
}

/// Found in review (helper-34): a `Decimal128` header (a C# `decimal` stored with the
/// Decimal128 representation) was dropped. It is printed as .NET prints the `decimal`.
#[test]
fn a_decimal_header_is_printed_as_dotnet_prints_it() {
    let dec = |s: &str| Bson::Decimal128(s.parse().expect("a Decimal128"));
    for (stored, dotnet) in [
        ("0", Some("0")),
        ("-0", Some("0")),
        ("1.50", Some("1.50")),
        ("-12.345", Some("-12.345")),
        ("0.001", Some("0.001")),
        ("1.5E+3", Some("1500")),
        ("1E-28", Some("0.0000000000000000000000000001")),
        (
            "79228162514264337593543950335",
            Some("79228162514264337593543950335"),
        ),
        ("79228162514264337593543950336", None),
        ("1E-29", None),
        ("NaN", None),
        ("Infinity", None),
        ("-Infinity", None),
    ] {
        assert_eq!(
            header_value_string(&dec(stored)).as_deref(),
            dotnet,
            "{stored}"
        );
    }
}

/// Found in review (helper-27): a stored `CC` or `BCC` header was forwarded as a string.
/// RabbitMQ reads both as routing keys and refuses a string there, closing the channel:
/// every publish pipelined behind it failed, and the record came back to every claim.
#[test]
fn headers_the_broker_reads_as_routing_are_not_forwarded() {
    let mut r = record();
    r.headers = doc! { "CC": "audit", "BCC": "x", "Tenant": "acme" };
    let m = build(
        &r,
        &RabbitConfig::default(),
        SystemTime::UNIX_EPOCH,
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    assert_eq!(header(&m, "CC"), None);
    assert_eq!(header(&m, "BCC"), None);
    assert_eq!(header(&m, "Tenant").as_deref(), Some("acme"));
}

#[test]
fn a_routing_key_longer_than_amqp_allows_is_unsendable() {
    let mut r = record();
    r.destination = "q".repeat(256);
    assert_eq!(
        build(
            &r,
            &RabbitConfig::default(),
            SystemTime::now(),
            DEFAULT_FRAME_MAX
        )
        .unwrap_err(),
        Unsendable::RoutingKeyTooLong { len: 256 }
    );
    r.destination = "q".repeat(255);
    assert!(
        build(
            &r,
            &RabbitConfig::default(),
            SystemTime::now(),
            DEFAULT_FRAME_MAX
        )
        .is_ok()
    );
}

#[test]
fn long_header_names_are_dropped_and_the_record_still_builds() {
    let mut r = record();
    r.headers.insert("k".repeat(300), "v");
    let m = build(
        &r,
        &RabbitConfig::default(),
        SystemTime::now(),
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    assert_eq!(header(&m, &"k".repeat(300)), None);
    assert_eq!(header(&m, "Tenant").unwrap(), "acme");
}

#[test]
fn headers_past_frame_max_are_unsendable_up_to_the_byte() {
    let rabbit = RabbitConfig::default();
    let base = build(
        &record(),
        &rabbit,
        SystemTime::UNIX_EPOCH,
        DEFAULT_FRAME_MAX,
    )
    .unwrap();
    let base_size = header_frame_size(&base.properties);
    // A header named "Big" adds 1 + 3 + 1 + 4 + len bytes.
    let fits = DEFAULT_FRAME_MAX as usize - base_size - 9;
    let mut r = record();
    r.headers.insert("Big", "x".repeat(fits));
    let m = build(&r, &rabbit, SystemTime::UNIX_EPOCH, DEFAULT_FRAME_MAX).unwrap();
    assert_eq!(header_frame_size(&m.properties), DEFAULT_FRAME_MAX as usize);
    r.headers.insert("Big", "x".repeat(fits + 1));
    match build(&r, &rabbit, SystemTime::UNIX_EPOCH, DEFAULT_FRAME_MAX) {
        Err(Unsendable::HeaderFrameTooLarge {
            size,
            frame_max,
            largest,
            ..
        }) => {
            assert_eq!(
                (size, frame_max),
                (DEFAULT_FRAME_MAX as usize + 1, DEFAULT_FRAME_MAX)
            );
            assert_eq!(largest, "Big");
        }
        other => panic!("expected HeaderFrameTooLarge, got {other:?}"),
    }
}
