//! Pure types and state machines: no I/O, nothing else of the crate.

pub mod cursor;
pub mod event;
pub mod interaction;
pub mod retry;
pub mod run;
pub mod time;
pub mod tool_call;

/// Declares an enum stored in the database by a stable upper-case name, and
/// exposed to GraphQL under the same names.
macro_rules! stored_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, async_graphql::Enum)]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl std::str::FromStr for $name {
            type Err = crate::domain::UnknownName;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(crate::domain::UnknownName {
                        kind: stringify!($name),
                        name: other.to_owned(),
                    }),
                }
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
pub(crate) use stored_enum;

/// A stored name that this build does not know: a corrupt row or a newer
/// schema. Callers fail closed on it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {name:?}")]
pub struct UnknownName {
    pub kind: &'static str,
    pub name: String,
}

stored_enum!(
    /// Who wrote a message.
    MessageRole { User => "USER", Assistant => "ASSISTANT" }
);

stored_enum!(
    /// What a message part holds.
    PartKind {
        Text => "TEXT",
        Reasoning => "REASONING",
        ToolCall => "TOOL_CALL",
        Question => "QUESTION",
        Approval => "APPROVAL",
        Connection => "CONNECTION",
        Error => "ERROR",
        Notice => "NOTICE",
    }
);

stored_enum!(
    /// Whether a part may still grow.
    PartState { Streaming => "STREAMING", Done => "DONE" }
);

stored_enum!(
    /// How a new message treats a run that has not ended.
    ActiveRunStrategy {
        Queue => "QUEUE",
        Interrupt => "INTERRUPT",
        Reject => "REJECT",
        Steer => "STEER",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_names_round_trip() {
        for role in MessageRole::ALL {
            assert_eq!(role.as_str().parse::<MessageRole>(), Ok(*role));
        }
        for kind in PartKind::ALL {
            assert_eq!(kind.as_str().parse::<PartKind>(), Ok(*kind));
        }
        let err = "SHOUTING".parse::<PartState>().unwrap_err();
        assert_eq!(err.to_string(), "unknown PartState \"SHOUTING\"");
    }
}
