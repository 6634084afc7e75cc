//! Arbitrary bytes, read as a BSON document, through the record decoder in every `Time`
//! encoding (with and without stored headers), the header normaliser, and, when a record
//! decodes, through the message builder and back to a document in both GUID
//! representations. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use timeoutd::config::{RabbitConfig, TimeEncoding, UuidRepresentation};
use timeoutd::record::message;
use timeoutd::record::{Decoding, TimeoutRecord, normalize_headers};

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = bson::Document::from_reader(data) else {
        return;
    };
    let _ = normalize_headers(&doc);
    for time in [
        TimeEncoding::Auto,
        TimeEncoding::DotnetTicks,
        TimeEncoding::Date,
    ] {
        let _ = TimeoutRecord::decode_due(&doc, time);
        for forward_headers in [true, false] {
            let decoding = Decoding {
                time,
                forward_headers,
            };
            if let Ok(record) = TimeoutRecord::decode(&doc, decoding) {
                let _ = message::build(
                    &record,
                    &RabbitConfig::default(),
                    std::time::SystemTime::now(),
                    message::DEFAULT_FRAME_MAX,
                );
                for uuids in [UuidRepresentation::Standard, UuidRepresentation::CsharpLegacy] {
                    let _ = record.to_document_as(time, uuids);
                }
            }
        }
    }
});
