//! Arbitrary bytes, read as a BSON document, through the record decoder in both `Time`
//! encodings and, when a record decodes, through the message builder. Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use timeoutd::config::{RabbitConfig, TimeEncoding};
use timeoutd::message;
use timeoutd::record::TimeoutRecord;

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = bson::Document::from_reader(data) else {
        return;
    };
    for encoding in [TimeEncoding::DotnetTicks, TimeEncoding::Date] {
        if let Ok(record) = TimeoutRecord::decode(&doc, encoding) {
            let _ = message::build(
                &record,
                &RabbitConfig::default(),
                std::time::SystemTime::now(),
            );
            let _ = record.to_document(encoding);
        }
    }
});
