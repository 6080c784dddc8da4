//! kvtier wire protocol: the frame codec spoken between `tierd` and its clients, and a
//! blocking client over a Unix stream socket.
//!
//! The byte-level specification is `docs/protocol.md`; this crate is its reference
//! implementation. It is runtime-neutral (std, libc and memmap2; no async runtime): the daemon reads a 24-byte
//! header, calls [`Header::decode`] and [`Header::check_len`] before reading the body, then
//! [`Request::decode`], which borrows query and KV payloads from the body buffer.
//!
//! # Layout
//! - [`header`]: the 24-byte frame header, opcodes, flags, version constants.
//! - [`request`] / [`response`]: typed bodies with `encode` / `decode`.
//! - [`types`]: geometry, policy, session info, decode stats, STATS key names.
//! - [`error`]: [`ProtoError`] (codec failures) and [`ErrorCode`] (wire error codes).
//! - [`fdpass`]: `sendmsg`/`recvmsg` with SCM_RIGHTS, the one unsafe FFI corner.
//! - [`lease`]: [`lease::ArenaView`], the engine side of LEASE: the daemon's host arena mapped
//!   read-only and a leased session's block runs read in place.
//! - [`client`]: blocking [`client::Client`] used by tierctl, tests and the load generator.

/// Named string keys (STATS keys): `NAME = "text";` makes a `pub const NAME: &str` for each,
/// and `ALL`, every one of them in declaration order.
#[macro_export]
macro_rules! key_list {
    ($( $(#[$meta:meta])* $name:ident = $text:literal; )*) => {
        $( $(#[$meta])* pub const $name: &str = $text; )*

        /// Every key, in declaration (documentation) order.
        pub const ALL: &[&str] = &[$($name),*];
    };
}

/// A `#[repr(u16)]` wire enum: each variant with its wire value and its upper-snake name as in
/// the documentation. Generates `ALL` (declaration order), `as_u16`, `name`, and `from_wire`
/// (the variant of a wire value).
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $value, )*
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$($value),*].len()] = [$($name::$variant),*];

            /// The wire value.
            pub fn as_u16(self) -> u16 {
                self as u16
            }

            /// Upper-snake name as in the documentation.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )*
                }
            }

            fn from_wire(value: u16) -> Option<Self> {
                Self::ALL.into_iter().find(|v| v.as_u16() == value)
            }
        }
    };
}

pub mod client;
pub mod error;
pub mod fdpass;
pub mod header;
pub mod lease;
pub mod request;
pub mod response;
pub mod types;
mod wire;

pub use error::{ErrorCode, ProtoError};
pub use header::{
    Header, Opcode, ERROR_OPCODE, FLAG_APPEND_SHM, FLAG_COMMIT_LAYERS, HEADER_LEN,
    LAYER_COMMIT_VERSION, MAGIC, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, REPLY_BIT,
    RESERVED_TIER_OPCODES,
};
pub use request::{
    AppendData, AppendKvRequest, CreateSessionRequest, DecodeEntryRef, DecodeRequest, HelloRequest,
    Request, DECODE_WANT_STATS,
};
pub use response::{DecodeOutput, DecodeReply, ErrorReply, HelloReply, Response, StatsReply};
pub use types::{
    dtype_from_wire, stats_keys, DType, DecodeStats, Geometry, LeaseLayer, LeaseReply, Policy,
    ReserveReply, Selector, SessionInfo,
};
pub use wire::{f32_le_bytes, f32s_le, read_f32s_into};
