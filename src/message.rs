//! The `TimeoutMessage` on the wire: body, headers and AMQP properties exactly as
//! ServiceConnect v7 sends them (see the interop doc, section 5).

use std::time::{Duration, SystemTime};

use base64::Engine;
use bson::spec::BinarySubtype;
use bson::{Bson, DateTime};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use uuid::Uuid;

use crate::config::{MessageIdMode, RabbitConfig};
use crate::record::TimeoutRecord;

/// Header keys ServiceConnect sets itself; never forwarded from a record's stored headers.
pub const RESERVED_HEADERS: &[&str] = &[
    "MessageType",
    "TypeName",
    "FullTypeName",
    "MessageId",
    "DestinationAddress",
    "SourceAddress",
    "RequestMessageId",
    "ResponseMessageId",
    "RoutingKey",
    "RoutingSlip",
    "Publish",
    "SequenceId",
    "PacketNumber",
    "LastPacketNumber",
    "ByteStream",
    "TimeSent",
    "TimeReceived",
    "TimeProcessed",
    "SourceMachine",
    "DestinationMachine",
    "Redelivered",
    "ConsumerType",
    "Language",
    "Exception",
    "RetryCount",
    "CorrelationId",
    "Priority",
];

/// `TypeName` of every timeout message.
pub const TYPE_NAME: &str = "ServiceConnect.Interfaces.TimeoutMessage";
/// Header carrying the record id when `message_id = "stable"`.
pub const TIMEOUT_ID_HEADER: &str = "TimeoutId";

/// One message ready to publish: routing key, body and properties.
#[derive(Debug, Clone)]
pub struct OutgoingMessage {
    pub routing_key: String,
    pub body: Vec<u8>,
    pub properties: BasicProperties,
}

/// Formats an instant as .NET's round-trip UTC form with 7 fractional digits:
/// `2026-05-03T12:00:00.1234567Z`.
pub fn format_time_sent(t: SystemTime) -> String {
    let nanos = humantime::format_rfc3339_nanos(t).to_string();
    // `YYYY-MM-DDTHH:MM:SS.nnnnnnnnnZ`: keep 7 of the 9 fractional digits.
    format!("{}Z", &nanos[..nanos.len() - 3])
}

fn bson_date_to_system_time(d: DateTime) -> Option<SystemTime> {
    let ms = d.timestamp_millis();
    if ms >= 0 {
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms as u64))
    } else {
        SystemTime::UNIX_EPOCH.checked_sub(Duration::from_millis(ms.unsigned_abs()))
    }
}

/// A stored header value as the string ServiceConnect would send, or `None` to drop it.
pub fn header_value_string(value: &Bson) -> Option<String> {
    match value {
        Bson::String(s) => Some(s.clone()),
        Bson::Null => Some(String::new()),
        Bson::Boolean(true) => Some("True".into()),
        Bson::Boolean(false) => Some("False".into()),
        Bson::Int32(v) => Some(v.to_string()),
        Bson::Int64(v) => Some(v.to_string()),
        Bson::Double(v) if v.is_finite() => Some(v.to_string()),
        Bson::Binary(b) if b.subtype == BinarySubtype::Generic => Some(format!(
            "base64:{}",
            base64::engine::general_purpose::STANDARD.encode(&b.bytes)
        )),
        Bson::Binary(b) if b.subtype == BinarySubtype::Uuid => Uuid::from_slice(&b.bytes)
            .ok()
            .map(|u| u.hyphenated().to_string()),
        Bson::DateTime(d) => bson_date_to_system_time(*d).map(format_time_sent),
        _ => None,
    }
}

fn long_string(s: impl Into<String>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.into()))
}

/// Builds the `TimeoutMessage` for a record. `now` stamps `TimeSent`.
pub fn build(record: &TimeoutRecord, rabbit: &RabbitConfig, now: SystemTime) -> OutgoingMessage {
    let correlation_id = record.process_manager_id.hyphenated().to_string();
    let message_id = match rabbit.message_id {
        MessageIdMode::Stable => record.id.hyphenated().to_string(),
        MessageIdMode::Random => Uuid::new_v4().hyphenated().to_string(),
    };

    let mut headers = FieldTable::default();
    for (key, value) in &record.headers {
        if RESERVED_HEADERS.contains(&key.as_str()) {
            continue;
        }
        // AMQP field names are short strings (at most 255 bytes).
        let Ok(name) = ShortString::try_new(key.clone()) else {
            tracing::debug!(timeout_id = %record.id, header = %key, "dropping header: name longer than 255 bytes");
            continue;
        };
        match header_value_string(value) {
            Some(s) => {
                headers.insert(name, long_string(s));
            }
            None => tracing::debug!(
                timeout_id = %record.id,
                header = %key,
                bson_type = ?value.element_type(),
                "dropping header of a type ServiceConnect cannot carry"
            ),
        }
    }
    let fixed = [
        ("CorrelationId", correlation_id.clone()),
        ("MessageId", message_id.clone()),
        ("DestinationAddress", record.destination.clone()),
        ("MessageType", "Send".into()),
        ("SourceAddress", rabbit.source_address.clone()),
        ("TimeSent", format_time_sent(now)),
        ("TypeName", TYPE_NAME.into()),
        ("FullTypeName", rabbit.full_type_name.clone()),
        ("ConsumerType", "RabbitMQ".into()),
        ("Language", "C#".into()),
    ];
    for (k, v) in fixed {
        headers.insert(k.into(), long_string(v));
    }
    if rabbit.message_id == MessageIdMode::Stable {
        headers.insert(
            TIMEOUT_ID_HEADER.into(),
            long_string(record.id.hyphenated().to_string()),
        );
    }

    let body = format!("{{\"CorrelationId\":\"{correlation_id}\"}}").into_bytes();
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message_id.into())
        .with_headers(headers);
    OutgoingMessage {
        routing_key: record.destination.clone(),
        body,
        properties,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::doc;

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
        let m = build(&record(), &RabbitConfig::default(), SystemTime::UNIX_EPOCH);
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
        let a = build(&record(), &rabbit, SystemTime::UNIX_EPOCH);
        let b = build(&record(), &rabbit, SystemTime::UNIX_EPOCH);
        assert_ne!(header(&a, "MessageId"), header(&b, "MessageId"));
        assert_eq!(header(&a, "TimeoutId"), None);
    }
}
