//! Structure-aware fuzzing of the whole record path: the bytes choose a `Timeouts` document
//! of the right shape with hostile values (tests/common/hostile.rs, shared with the tests),
//! which goes through decoding in every `Time` encoding, triage and message building against
//! the broker's frame size. Nothing may panic, and every record must come out either as a
//! message within AMQP's limits or with a reason to park it.
#![no_main]

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use timeoutd::config::TimeEncoding;

#[path = "../../tests/common/hostile.rs"]
mod hostile;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(frame_max) = u.int_in_range(4_096u32..=131_072) else {
        return;
    };
    let Ok(doc) = hostile::timeout_document(&mut u, 1_767_225_600_000, "orders", true) else {
        return;
    };
    for encoding in [TimeEncoding::DotnetTicks, TimeEncoding::Date] {
        if let Err(e) = hostile::record_path(&doc, encoding, frame_max) {
            panic!("{e}\n{doc:?}");
        }
    }
});
