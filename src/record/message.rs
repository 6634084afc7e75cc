//! The `TimeoutMessage` on the wire: body, headers and AMQP properties exactly as
//! ServiceConnect v7 sends them (see the interop doc, section 5).

use std::time::SystemTime;

use base64::Engine;
use bson::Bson;
use bson::spec::BinarySubtype;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

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

/// Headers RabbitMQ reads as sender-selected distribution, an array of routing keys: never
/// forwarded from stored headers. As the string a stored value becomes, the broker refuses the
/// message and closes the channel (406), failing every publish pipelined behind it, and the
/// record came back as the oldest due one to every claim of the fleet; as routing keys, they
/// would send copies to other queues (helper-27).
pub const BROKER_ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

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
    let nanos = match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i128::try_from(d.as_nanos()).unwrap_or(i128::MAX),
        Err(e) => -i128::try_from(e.duration().as_nanos()).unwrap_or(i128::MAX),
    };
    // The host clock is always within .NET's years; the epoch is the fallback if it is not.
    format_dotnet_utc(nanos).unwrap_or_else(|| "1970-01-01T00:00:00.0000000Z".into())
}

/// Formats Unix nanoseconds the way .NET's round-trip format (`"o"`) prints a UTC
/// `DateTime`, for every instant .NET can hold (years 1 to 9999, 100 ns resolution).
/// `None` outside those years: no .NET reader could hold the value.
pub fn format_dotnet_utc(unix_nanos: i128) -> Option<String> {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(unix_nanos).ok()?;
    if !(1..=9999).contains(&t.year()) {
        return None;
    }
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:07}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond() / 100
    ))
}

/// A `double` as .NET (Core 3.0 and later) prints it in the invariant culture (`NaN`,
/// `Infinity`, `-Infinity`; for a finite value the shortest digits that read back as the same value, fixed-point while the decimal point
/// falls from 3 places before the first digit to 15 digits after it (or after the last
/// digit, for more), else scientific with a signed exponent of at least two digits
/// (`1E+21`, `1E-05`, `1.5E+300`)).
pub fn format_dotnet_double(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if v.is_sign_negative() { "-" } else { "" };
    // Rust's shortest round-trip digits, as `d.ddde<exp>`.
    let scientific = format!("{:e}", v.abs());
    let (mantissa, exp) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if digits.bytes().all(|d| d == b'0') {
        return format!("{sign}0");
    }
    // Where the decimal point falls, counted from before the first digit.
    let scale = exp.saturating_add(1);
    let width = i32::try_from(digits.len()).unwrap_or(i32::MAX);
    if scale > width.max(15) || scale < -3 {
        let mut chars = digits.chars();
        let first: String = chars.by_ref().take(1).collect();
        let rest: String = chars.collect();
        let point = if rest.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        return format!(
            "{sign}{first}{point}{rest}E{exp_sign}{:02}",
            exp.unsigned_abs()
        );
    }
    let zeros = |n: i32| "0".repeat(usize::try_from(n).unwrap_or(0));
    if scale <= 0 {
        return format!("{sign}0.{}{digits}", zeros(-scale));
    }
    if scale >= width {
        return format!("{sign}{digits}{}", zeros(scale - width));
    }
    let whole: String = digits.chars().take(scale.unsigned_abs() as usize).collect();
    let fraction: String = digits.chars().skip(scale.unsigned_abs() as usize).collect();
    format!("{sign}{whole}.{fraction}")
}

/// A `Decimal128` as .NET prints the `decimal` it reads it as: fixed-point, its scale kept
/// (`1.50`), never an exponent; `None` for what a `decimal` cannot hold (NaN, infinities,
/// more than 96 bits of coefficient, a scale past 28). Before (found in review, helper-34),
/// every `Decimal128` header was dropped.
pub fn format_dotnet_decimal(d: bson::Decimal128) -> Option<String> {
    let text = d.to_string();
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.as_str()),
    };
    let (mantissa, exp) = match unsigned.split_once('E') {
        Some((m, e)) => (m, e.parse::<i32>().ok()?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if !whole
        .bytes()
        .chain(fraction.bytes())
        .all(|b| b.is_ascii_digit())
    {
        return None;
    }
    let mut digits = format!("{whole}{fraction}");
    let mut scale = i32::try_from(fraction.len()).ok()?.checked_sub(exp)?;
    if scale < 0 {
        digits.push_str(&"0".repeat(usize::try_from(-scale).ok()?));
        scale = 0;
    }
    let digits = digits.trim_start_matches('0');
    let coefficient = match digits {
        "" => 0,
        _ => digits.parse::<u128>().ok()?,
    };
    if scale > 28 || digits.len() > 29 || coefficient >= 1 << 96 {
        return None;
    }
    let scale = usize::try_from(scale).ok()?;
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    let sign = if negative && !digits.is_empty() {
        "-"
    } else {
        ""
    };
    let point = if frac.is_empty() { "" } else { "." };
    Some(format!("{sign}{int}{point}{frac}"))
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
        Bson::Double(v) => Some(format_dotnet_double(*v)),
        Bson::Decimal128(d) => format_dotnet_decimal(*d),
        Bson::Binary(b) if b.subtype == BinarySubtype::Generic => Some(format!(
            "base64:{}",
            base64::engine::general_purpose::STANDARD.encode(&b.bytes)
        )),
        // A GUID in either form a C# driver stores (subtype 4, or 3 in .NET's byte order).
        Bson::Binary(_) => {
            crate::record::guid::from_bson(value).map(|u| u.hyphenated().to_string())
        }
        Bson::DateTime(d) => format_dotnet_utc(i128::from(d.timestamp_millis()) * 1_000_000),
        _ => None,
    }
}

fn long_string(s: impl Into<String>) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.into()))
}

/// AMQP's limit for a short string: routing keys, header names, `message_id`.
pub const SHORT_STRING_MAX: usize = 255;

/// RabbitMQ's default `frame_max`, used until a connection negotiated its own.
pub const DEFAULT_FRAME_MAX: u32 = 131_072;

/// Bytes of a content header frame besides its properties: frame type, channel and size (7),
/// class, weight, body size and property flags (14), frame end (1).
const HEADER_FRAME_OVERHEAD: usize = 22;

/// Why a record cannot be sent as it stands. Each names the field and the limit; the record
/// is parked with this as its error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unsendable {
    #[error(
        "Destination is {len} bytes long; an AMQP routing key holds at most {SHORT_STRING_MAX} bytes"
    )]
    RoutingKeyTooLong { len: usize },
    #[error(
        "the message's properties and headers take {size} bytes of a content header frame; the broker's frame_max is {frame_max} bytes (largest header `{largest}`: {largest_len} bytes)"
    )]
    HeaderFrameTooLarge {
        size: usize,
        frame_max: u32,
        largest: String,
        largest_len: usize,
    },
    #[error("building the message failed unexpectedly: {0}")]
    Panicked(String),
}

/// The size of the content header frame that carries `properties` (message id, delivery mode
/// and a table of long strings, as [`build`] sets them), to compare with `frame_max`.
pub fn header_frame_size(properties: &BasicProperties) -> usize {
    let message_id = properties
        .message_id()
        .as_ref()
        .map_or(0, |id| 1 + id.as_str().len());
    let delivery_mode = usize::from(properties.delivery_mode().is_some());
    let table = properties.headers().as_ref().map_or(0, |t| {
        4 + t
            .inner()
            .iter()
            .map(|(k, v)| 1 + k.as_str().len() + field_value_size(v))
            .sum::<usize>()
    });
    HEADER_FRAME_OVERHEAD + message_id + delivery_mode + table
}

/// Encoded size of one field-table value, type octet included. [`build`] only writes long
/// strings; the other arms keep the count honest should that change.
fn field_value_size(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::LongString(s) => 1 + 4 + s.as_bytes().len(),
        AMQPValue::ShortString(s) => 1 + 1 + s.as_str().len(),
        AMQPValue::Boolean(_) => 2,
        _ => 1 + 8,
    }
}

/// Builds the `TimeoutMessage` for a record, checked against AMQP's limits: a routing key of
/// at most 255 bytes and a content header frame within the broker's `frame_max`. `now`
/// stamps `TimeSent`. Header names longer than 255 bytes and values ServiceConnect cannot
/// carry are dropped (logged); the record still fires.
pub fn build(
    record: &TimeoutRecord,
    rabbit: &RabbitConfig,
    now: SystemTime,
    frame_max: u32,
) -> Result<OutgoingMessage, Unsendable> {
    #[cfg(feature = "failpoints")]
    if fail::eval("message-build-panic", |arg| arg)
        .flatten()
        .as_deref()
        == Some(record.destination.as_str())
    {
        panic!("failpoint message-build-panic");
    }
    if record.destination.len() > SHORT_STRING_MAX {
        return Err(Unsendable::RoutingKeyTooLong {
            len: record.destination.len(),
        });
    }
    let correlation_id = record.process_manager_id.hyphenated().to_string();
    let message_id = match rabbit.message_id {
        MessageIdMode::Stable => record.id.hyphenated().to_string(),
        MessageIdMode::Random => crate::host::uuid().hyphenated().to_string(),
    };

    let mut headers = FieldTable::default();
    for (key, value) in &record.headers {
        if RESERVED_HEADERS.contains(&key.as_str()) {
            continue;
        }
        if BROKER_ROUTING_HEADERS.contains(&key.as_str()) {
            tracing::warn!(timeout_id = %record.id, header = %key, "dropping header: RabbitMQ reads it as routing (sender-selected distribution)");
            continue;
        }
        let Ok(name) = ShortString::try_new(key.clone()) else {
            tracing::warn!(timeout_id = %record.id, header_bytes = key.len(), "dropping header: its name is longer than an AMQP field name may be (255 bytes)");
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
                "dropping header of a type or range ServiceConnect cannot carry"
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
    let largest = headers
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), field_value_size(v)))
        .max_by_key(|(_, len)| *len);

    let body = format!("{{\"CorrelationId\":\"{correlation_id}\"}}").into_bytes();
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message_id.into())
        .with_headers(headers);
    let size = header_frame_size(&properties);
    let limit = if frame_max == 0 { u32::MAX } else { frame_max };
    if size > limit as usize {
        let (largest, largest_len) = largest.unwrap_or_default();
        return Err(Unsendable::HeaderFrameTooLarge {
            size,
            frame_max: limit,
            largest,
            largest_len,
        });
    }
    Ok(OutgoingMessage {
        routing_key: record.destination.clone(),
        body,
        properties,
    })
}

/// [`build`], with any panic inside it caught and turned into [`Unsendable::Panicked`]: the
/// last line of defence, so that one record can never stop a wave.
pub fn build_contained(
    record: &TimeoutRecord,
    rabbit: &RabbitConfig,
    now: SystemTime,
    frame_max: u32,
) -> Result<OutgoingMessage, Unsendable> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        build(record, rabbit, now, frame_max)
    }))
    .unwrap_or_else(|panic| {
        Err(Unsendable::Panicked(
            crate::service::supervisor::panic_message(panic.as_ref()),
        ))
    })
}
