//! Event cursors: a conversation's event sequence number, rendered at a fixed
//! width so that the strings sort as the numbers do.

use std::fmt;

const WIDTH: usize = 16;

/// The position of a persisted event in its conversation's log. `Cursor(0)`
/// is the position before the first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Cursor(pub i64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed cursor")]
pub struct MalformedCursor;

impl Cursor {
    pub const START: Cursor = Cursor(0);

    pub fn parse(text: &str) -> Result<Cursor, MalformedCursor> {
        if text.len() != WIDTH || !text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(MalformedCursor);
        }
        text.parse().map(Cursor).map_err(|_| MalformedCursor)
    }

    pub fn next(self) -> Cursor {
        Cursor(self.0 + 1)
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:0width$}", self.0, width = WIDTH)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_anything_but_fixed_width_digits() {
        for bad in [
            "",
            "12",
            "-000000000000001",
            "00000000000000a1",
            "00000000000000001",
        ] {
            assert_eq!(Cursor::parse(bad), Err(MalformedCursor), "{bad:?}");
        }
        assert_eq!(Cursor::START.to_string(), "0000000000000000");
    }

    proptest! {
        #[test]
        fn string_order_is_number_order(a in 0i64..10_000_000_000_000, b in 0i64..10_000_000_000_000) {
            let (ca, cb) = (Cursor(a), Cursor(b));
            prop_assert_eq!(ca.to_string().cmp(&cb.to_string()), a.cmp(&b));
            prop_assert_eq!(Cursor::parse(&ca.to_string()), Ok(ca));
        }
    }
}
