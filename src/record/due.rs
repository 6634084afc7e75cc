//! The `Time` field: the shapes fleets store it in, its true UTC instant, and the due query
//! for each shape.
//!
//! - A BSON date (every public ServiceConnect release: a .NET `DateTime` in UTC).
//! - `[Int64 ticks, Int32 offsetMinutes]` (the C# driver 2.x form of a `DateTimeOffset`,
//!   ServiceConnect v7). The ticks are the *clock time* at that offset, not UTC: the instant
//!   is `ticks - offset x 600,000,000`.
//!
//! A query cannot compute `ticks - offset`, so the due query has one branch per [`Shape`]:
//! dates compare `Time` itself, and each offset present in the collection gets
//! `{"Time.1": offset, "Time.0": {$lte: ticks(horizon) + offset}}`, which an index on
//! `{"Time.1": 1, "Time.0": 1}` serves with tight bounds and in order. The claim reads every
//! branch up to the batch size and merges them by instant ([`crate::store`]).

use bson::{Bson, DateTime, Document, doc};

use crate::config::TimeEncoding;
use crate::record::{DecodeError, TICKS_PER_MS, field, ms_to_ticks, ticks_to_ms};

/// .NET ticks per minute.
pub const TICKS_PER_MINUTE: i64 = 600_000_000;
/// `DateTimeOffset` offsets lie within +-14 h.
pub const MAX_OFFSET_MINUTES: i64 = 14 * 60;
/// The ticks of `DateTime.MaxValue` (9999-12-31T23:59:59.9999999).
pub const MAX_TICKS: i64 = 3_155_378_975_999_999_999;
/// Unix ms of `DateTime.MinValue` (0001-01-01T00:00:00Z).
pub const MIN_DATE_MS: i64 = -62_135_596_800_000;
/// Unix ms of the last millisecond of `DateTime.MaxValue`.
pub const MAX_DATE_MS: i64 = (MAX_TICKS - crate::record::UNIX_EPOCH_TICKS) / TICKS_PER_MS;

/// What a decode error says of a `Time` outside .NET's range.
pub const OUT_OF_RANGE: &str = "within .NET's range (years 1 to 9999)";

/// One stored shape of `Time`, a branch of the due query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Shape {
    /// A BSON date.
    Date,
    /// `[ticks, offset]` with this offset in minutes.
    Ticks(i32),
}

impl Shape {
    /// The shape's bound for the instant `t`: a date, or clock ticks at the offset.
    fn bound(self, t: DateTime) -> Bson {
        match self {
            Shape::Date => Bson::DateTime(t),
            Shape::Ticks(o) => Bson::Int64(
                ms_to_ticks(t.timestamp_millis())
                    .saturating_add(i64::from(o).saturating_mul(TICKS_PER_MINUTE)),
            ),
        }
    }

    /// Records of this shape due from `from` (inclusive, when set) to `to` (inclusive). The
    /// upper bound comes first and the ticks clauses stay in one document: SecantusDB bounds
    /// its index scan by the first operator of the first clause only.
    pub fn due_between(self, from: Option<DateTime>, to: DateTime) -> Document {
        let mut range = doc! { "$lte": self.bound(to) };
        if let Some(from) = from {
            range.insert("$gte", self.bound(from));
        }
        match self {
            Shape::Date => doc! { field::TIME: range },
            Shape::Ticks(o) => doc! { field::TIME_OFFSET: o, field::TIME_TICKS: range },
        }
    }

    /// Records of this shape not due yet at `t`.
    pub fn due_after(self, t: DateTime) -> Document {
        match self {
            Shape::Date => doc! { field::TIME: { "$gt": t } },
            Shape::Ticks(o) => {
                doc! { field::TIME_OFFSET: o, field::TIME_TICKS: { "$gt": self.bound(t) } }
            }
        }
    }

    /// The sort (oldest first within the shape) that timeoutd's own index for it serves.
    pub fn sort(self) -> Document {
        match self {
            Shape::Date => doc! { field::TIME: 1 },
            Shape::Ticks(_) => doc! { field::TIME_OFFSET: 1, field::TIME_TICKS: 1 },
        }
    }
}

/// Either clause of `shapes`; a filter that matches nothing when there is none.
pub fn any_of(shapes: &[Shape], clause: impl Fn(Shape) -> Document) -> Document {
    match shapes {
        [] => doc! { field::ID: { "$in": [] } },
        [one] => clause(*one),
        many => doc! { "$or": many.iter().map(|s| clause(*s)).collect::<Vec<_>>() },
    }
}

/// The records whose `Time` timeoutd can schedule under `encoding`: a date within .NET's
/// range, or `[ticks, offset]` with integer ticks within range and an offset within +-14 h.
/// Its complement (`$nor`) is what `stats` reports as unschedulable.
pub fn schedulable(encoding: TimeEncoding) -> Document {
    let mut shapes = Vec::new();
    if encoding.reads_dates() {
        shapes.push(doc! { field::TIME: {
            "$type": "date",
            "$gte": DateTime::from_millis(MIN_DATE_MS),
            "$lte": DateTime::from_millis(MAX_DATE_MS),
        } });
    }
    if encoding.reads_ticks() {
        shapes.push(doc! { "$and": [
            { field::TIME: { "$size": 2 } },
            { field::TIME_TICKS: { "$type": ["long", "int"], "$gte": 0_i64, "$lte": MAX_TICKS } },
            { field::TIME_OFFSET: {
                "$type": ["int", "long"],
                "$gte": -MAX_OFFSET_MINUTES,
                "$lte": MAX_OFFSET_MINUTES,
            } },
        ] });
    }
    doc! { "$or": shapes }
}

/// Whether a stored offset (minutes) lies within +-14 h. Any `i64` is safe here, Int64::MIN
/// included (its `abs()` overflows).
pub fn offset_in_range(offset: i64) -> bool {
    (-MAX_OFFSET_MINUTES..=MAX_OFFSET_MINUTES).contains(&offset)
}

/// The whole number a `distinct` value stands for, of any numeric type. `distinct` returns
/// one value for each set of numerically equal ones, in the type of whichever document it
/// met first: a hostile record's offset `-0.0` (simulation seed 269) or `Decimal128` zero
/// (seed 708) stands for every ServiceConnect record's `0`, and no record of offset 0 was
/// ever claimed again while only integers counted. A claim's `Time.1: 0` matches them all.
pub fn whole_number(value: &Bson) -> Option<i64> {
    let whole = |o: f64| (o.fract() == 0.0 && o.abs() <= 1e6).then_some(o as i64);
    match value {
        Bson::Int32(o) => Some(i64::from(*o)),
        Bson::Int64(o) => Some(*o),
        Bson::Double(o) => whole(*o),
        // Its text ("0", "-0", "6.0E+1", "NaN"), which every bit pattern has.
        Bson::Decimal128(d) => d.to_string().parse::<f64>().ok().and_then(whole),
        _ => None,
    }
}

/// Offsets (from a `distinct` of `"Time.1"`) that a due query can serve: whole minutes
/// within +-14 h, sorted, without repeats.
pub fn servable_offsets(values: &[Bson]) -> Vec<i32> {
    let mut offsets: Vec<i32> = values
        .iter()
        .filter_map(whole_number)
        .filter(|o| offset_in_range(*o))
        .filter_map(|o| i32::try_from(o).ok())
        .collect();
    offsets.sort_unstable();
    offsets.dedup();
    offsets
}

/// The BSON value of `Time` for a due instant: `[ticks, 0]` for `dotnet-ticks`, a date
/// otherwise (`auto` writes what the public releases write).
pub fn encode(due: DateTime, encoding: TimeEncoding) -> Bson {
    match encoding {
        TimeEncoding::DotnetTicks => Bson::Array(vec![
            Bson::Int64(ms_to_ticks(due.timestamp_millis())),
            Bson::Int32(0),
        ]),
        TimeEncoding::Date | TimeEncoding::Auto => Bson::DateTime(due),
    }
}

/// The UTC instant of a stored `Time`, in a shape `encoding` serves.
pub fn decode(value: Option<&Bson>, encoding: TimeEncoding) -> Result<DateTime, DecodeError> {
    let expected = match encoding {
        TimeEncoding::Auto => "a BSON Date or an array [Int64 ticks, Int32 offsetMinutes]",
        TimeEncoding::DotnetTicks => "an array [Int64 ticks, Int32 offsetMinutes]",
        TimeEncoding::Date => "a BSON Date",
    };
    match value {
        Some(Bson::DateTime(d)) if encoding.reads_dates() => {
            if (MIN_DATE_MS..=MAX_DATE_MS).contains(&d.timestamp_millis()) {
                Ok(*d)
            } else {
                Err(DecodeError::Time(OUT_OF_RANGE))
            }
        }
        Some(Bson::Array(parts)) if encoding.reads_ticks() => {
            let integer = |b: &Bson| match b {
                Bson::Int64(v) => Some(*v),
                Bson::Int32(v) => Some(i64::from(*v)),
                _ => None,
            };
            let (Some(ticks), Some(offset), 2) = (
                parts.first().and_then(integer),
                parts.get(1).and_then(integer),
                parts.len(),
            ) else {
                return Err(DecodeError::Time(expected));
            };
            // A range, not `offset.abs()`: the stored value may be Int64::MIN, whose absolute
            // value overflows (a panic in debug builds, 0 in release).
            if !offset_in_range(offset) {
                return Err(DecodeError::Time(
                    "an array [ticks, offsetMinutes] with an offset within +-14 h",
                ));
            }
            if !(0..=MAX_TICKS).contains(&ticks) {
                return Err(DecodeError::Time(OUT_OF_RANGE));
            }
            // The clock ticks and the UTC instant must both be valid .NET values.
            match offset
                .checked_mul(TICKS_PER_MINUTE)
                .and_then(|o| ticks.checked_sub(o))
            {
                Some(utc_ticks) if (0..=MAX_TICKS).contains(&utc_ticks) => {
                    Ok(DateTime::from_millis(ticks_to_ms(utc_ticks)))
                }
                _ => Err(DecodeError::Time(OUT_OF_RANGE)),
            }
        }
        _ => Err(DecodeError::Time(expected)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW_YEAR_MS: i64 = 1_767_225_600_000;
    const NEW_YEAR_TICKS: i64 = 639_028_224_000_000_000;

    fn ticks_at(ticks: i64, offset: i32) -> Bson {
        Bson::Array(vec![Bson::Int64(ticks), Bson::Int32(offset)])
    }

    #[test]
    fn every_offset_gives_the_same_instant() {
        // 2026-01-01T00:00Z written at offsets from -12 h to +14 h: clock ticks differ.
        for offset in (-720..=840).step_by(15) {
            let clock = NEW_YEAR_TICKS + i64::from(offset) * TICKS_PER_MINUTE;
            let due = decode(Some(&ticks_at(clock, offset)), TimeEncoding::Auto).unwrap();
            assert_eq!(due.timestamp_millis(), NEW_YEAR_MS, "offset {offset}");
        }
    }

    #[test]
    fn each_setting_reads_its_shapes() {
        let date = Bson::DateTime(DateTime::from_millis(NEW_YEAR_MS));
        let array = ticks_at(NEW_YEAR_TICKS, 0);
        for (encoding, date_ok, array_ok) in [
            (TimeEncoding::Auto, true, true),
            (TimeEncoding::Date, true, false),
            (TimeEncoding::DotnetTicks, false, true),
        ] {
            assert_eq!(decode(Some(&date), encoding).is_ok(), date_ok);
            assert_eq!(decode(Some(&array), encoding).is_ok(), array_ok);
        }
    }

    #[test]
    fn net_range_is_enforced() {
        let out = [
            Bson::DateTime(DateTime::from_millis(MIN_DATE_MS - 1)),
            Bson::DateTime(DateTime::from_millis(MAX_DATE_MS + 1)),
            Bson::DateTime(DateTime::MAX),
            ticks_at(-5, 0),
            ticks_at(MAX_TICKS + 1, 0),
            // Valid clock ticks whose UTC instant falls before year 1.
            ticks_at(0, 60),
        ];
        for v in out {
            assert_eq!(
                decode(Some(&v), TimeEncoding::Auto),
                Err(DecodeError::Time(OUT_OF_RANGE)),
                "{v:?}"
            );
        }
        for v in [
            Bson::DateTime(DateTime::from_millis(MIN_DATE_MS)),
            Bson::DateTime(DateTime::from_millis(MAX_DATE_MS)),
            ticks_at(MAX_TICKS, 0),
        ] {
            assert!(decode(Some(&v), TimeEncoding::Auto).is_ok(), "{v:?}");
        }
        assert!(decode(Some(&ticks_at(NEW_YEAR_TICKS, 841)), TimeEncoding::Auto).is_err());
    }

    #[test]
    fn integers_at_the_ends_of_int64_are_refused_not_overflowed() {
        // `[t, Int64::MIN]` once reached `offset.abs()`: a panic in debug builds, and in
        // release an offset read as 0, so the record fired at the wrong instant.
        let extremes = [i64::MIN, i64::MIN + 1, i64::MAX, -841, 841];
        for offset in extremes {
            for ticks in [NEW_YEAR_TICKS, 0, MAX_TICKS, i64::MIN, i64::MAX] {
                let v = Bson::Array(vec![Bson::Int64(ticks), Bson::Int64(offset)]);
                assert!(decode(Some(&v), TimeEncoding::Auto).is_err(), "{v:?}");
            }
        }
        for ticks in [i64::MIN, i64::MAX, -1] {
            for offset in [-840, 0, 840] {
                let v = Bson::Array(vec![Bson::Int64(ticks), Bson::Int64(offset)]);
                assert_eq!(
                    decode(Some(&v), TimeEncoding::Auto),
                    Err(DecodeError::Time(OUT_OF_RANGE)),
                    "{v:?}"
                );
            }
        }
        let seen: Vec<Bson> = extremes.iter().map(|o| Bson::Int64(*o)).collect();
        assert_eq!(servable_offsets(&seen), Vec::<i32>::new());
        assert!(decode(None, TimeEncoding::Auto).is_err());
    }

    #[test]
    fn branches_bound_clock_ticks_by_their_offset() {
        let t = DateTime::from_millis(NEW_YEAR_MS);
        let f = Shape::Ticks(60).due_between(None, t);
        assert_eq!(f.get_i32("Time.1").unwrap(), 60);
        assert_eq!(
            f.get_document("Time.0").unwrap().get_i64("$lte").unwrap(),
            NEW_YEAR_TICKS + 60 * TICKS_PER_MINUTE
        );
        let keys: Vec<&String> = f.keys().collect();
        assert_eq!(keys, ["Time.1", "Time.0"]);
        let d = Shape::Date.due_between(Some(t), t);
        let range = d.get_document("Time").unwrap();
        assert_eq!(range.keys().next().unwrap(), "$lte", "upper bound first");
        assert_eq!(
            any_of(&[], |s| s.due_after(t)),
            doc! { "_id": { "$in": [] } }
        );
        assert!(any_of(&[Shape::Date, Shape::Ticks(0)], |s| s.due_after(t)).contains_key("$or"));
    }

    #[test]
    fn only_servable_offsets_are_queried() {
        let seen = [
            Bson::Int32(60),
            Bson::Int64(-300),
            Bson::Int32(60),
            Bson::Int32(5000),
            Bson::Double(30.5),
            Bson::String("0".into()),
            Bson::Int32(-840),
        ];
        assert_eq!(servable_offsets(&seen), [-840, -300, 60]);
    }

    #[test]
    fn an_offset_distinct_returns_as_a_double_is_served() {
        // distinct() collapses 0, 0.0 and -0.0 into whichever it met first.
        let seen = [Bson::Int32(-633), Bson::Double(-0.0), Bson::Double(0.1)];
        assert_eq!(servable_offsets(&seen), [-633, 0]);
        let seen = [
            Bson::Double(60.0),
            Bson::Double(f64::NAN),
            Bson::Double(1e300),
        ];
        assert_eq!(servable_offsets(&seen), [60]);
        let decimal = |s: &str| Bson::Decimal128(s.parse().unwrap());
        let seen = [
            decimal("0E-6176"),
            decimal("-6.0E+1"),
            decimal("0.5"),
            decimal("NaN"),
        ];
        assert_eq!(servable_offsets(&seen), [-60, 0]);
    }

    #[test]
    fn any_decimal128_bit_pattern_reads_without_panic() {
        // Stored values are hostile: every bit pattern of a Decimal128 must read.
        let mut x: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C834;
        for _ in 0..50_000 {
            x = x
                .wrapping_mul(0x2360_ED05_1FC6_5DA4_4385_DF64_9FCC_F645)
                .wrapping_add(1);
            let d = bson::Decimal128::from_bytes(x.to_le_bytes());
            let _ = whole_number(&Bson::Decimal128(d));
        }
    }
}
