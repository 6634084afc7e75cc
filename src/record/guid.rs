//! GUIDs as BSON binary, in both representations the MongoDB C# driver writes.
//!
//! - Subtype 4 (`Standard`): the 16 bytes in RFC 4122 order.
//! - Subtype 3 (`CSharpLegacy`, the C# driver 2.x default, and what every public ServiceConnect
//!   release stores): the bytes of .NET's `Guid.ToByteArray()`, whose first three groups are
//!   little-endian: bytes 0-3 reversed, 4-5 reversed, 6-7 reversed. .NET prints the GUID from
//!   those swapped bytes, so reading them in standard order would give a different id.
//!
//! A [`Uuid`] here always holds the GUID as .NET's `Guid.ToString()` prints it. Subtype 3 is
//! read as C# legacy: other drivers' legacy orders (Java, Python) are not what ServiceConnect
//! writes.

use bson::spec::BinarySubtype;
use bson::{Binary, Bson};
use uuid::Uuid;

use crate::config::UuidRepresentation;

/// Swaps between RFC 4122 order and .NET's `ToByteArray` order (the swap is its own inverse).
pub fn swap_dotnet_order(bytes: [u8; 16]) -> [u8; 16] {
    let mut b = bytes;
    b[0..4].reverse();
    b[4..6].reverse();
    b[6..8].reverse();
    b
}

/// The GUID as BSON binary in the given representation.
pub fn to_bson(id: Uuid, representation: UuidRepresentation) -> Bson {
    let (subtype, bytes) = match representation {
        UuidRepresentation::Standard => (BinarySubtype::Uuid, *id.as_bytes()),
        UuidRepresentation::CsharpLegacy => {
            (BinarySubtype::UuidOld, swap_dotnet_order(*id.as_bytes()))
        }
    };
    Bson::Binary(Binary {
        subtype,
        bytes: bytes.to_vec(),
    })
}

/// The GUID in both representations: what a filter matches when either may be stored.
pub fn both_forms(id: Uuid) -> [Bson; 2] {
    [
        to_bson(id, UuidRepresentation::Standard),
        to_bson(id, UuidRepresentation::CsharpLegacy),
    ]
}

/// Reads a GUID stored as subtype 4 (standard) or subtype 3 (C# legacy); `None` for anything
/// else, including binary of the wrong length.
pub fn from_bson(value: &Bson) -> Option<Uuid> {
    let Bson::Binary(b) = value else {
        return None;
    };
    let bytes: [u8; 16] = b.bytes.as_slice().try_into().ok()?;
    match b.subtype {
        BinarySubtype::Uuid => Some(Uuid::from_bytes(bytes)),
        BinarySubtype::UuidOld => Some(Uuid::from_bytes(swap_dotnet_order(bytes))),
        _ => None,
    }
}

/// The representation a stored GUID uses, when it is one.
pub fn representation_of(value: &Bson) -> Option<UuidRepresentation> {
    match value {
        Bson::Binary(b) if b.bytes.len() == 16 => match b.subtype {
            BinarySubtype::Uuid => Some(UuidRepresentation::Standard),
            BinarySubtype::UuidOld => Some(UuidRepresentation::CsharpLegacy),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// .NET: `new Guid("00112233-4455-6677-8899-aabbccddeeff").ToByteArray()` is
    /// `33 22 11 00 55 44 77 66 88 99 AA BB CC DD EE FF`, what CSharpLegacy stores.
    const DOTNET_EXAMPLE: [u8; 16] = [
        0x33, 0x22, 0x11, 0x00, 0x55, 0x44, 0x77, 0x66, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee,
        0xff,
    ];

    fn example() -> Uuid {
        Uuid::parse_str("00112233-4455-6677-8899-aabbccddeeff").unwrap()
    }

    #[test]
    fn csharp_legacy_uses_the_dotnet_byte_order() {
        let stored = Bson::Binary(Binary {
            subtype: BinarySubtype::UuidOld,
            bytes: DOTNET_EXAMPLE.to_vec(),
        });
        assert_eq!(
            from_bson(&stored).unwrap().to_string(),
            "00112233-4455-6677-8899-aabbccddeeff"
        );
        assert_eq!(to_bson(example(), UuidRepresentation::CsharpLegacy), stored);
    }

    #[test]
    fn standard_keeps_rfc_order_and_both_round_trip() {
        let standard = to_bson(example(), UuidRepresentation::Standard);
        let Bson::Binary(b) = &standard else {
            panic!("binary")
        };
        assert_eq!(b.subtype, BinarySubtype::Uuid);
        assert_eq!(b.bytes, example().as_bytes().to_vec());
        for id in [example(), crate::host::uuid(), Uuid::nil()] {
            for form in both_forms(id) {
                assert_eq!(from_bson(&form), Some(id));
            }
        }
        assert_eq!(
            representation_of(&both_forms(example())[1]),
            Some(UuidRepresentation::CsharpLegacy)
        );
    }

    #[test]
    fn anything_else_is_not_a_guid() {
        let short = Bson::Binary(Binary {
            subtype: BinarySubtype::UuidOld,
            bytes: vec![1, 2, 3],
        });
        let generic = Bson::Binary(Binary {
            subtype: BinarySubtype::Generic,
            bytes: DOTNET_EXAMPLE.to_vec(),
        });
        for v in [
            short,
            generic,
            Bson::String(example().to_string()),
            Bson::Null,
        ] {
            assert_eq!(from_bson(&v), None, "{v:?}");
            assert_eq!(representation_of(&v), None);
        }
    }
}
