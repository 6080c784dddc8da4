//! Test support for the kvtier workspace, and (in `tests/`) the workspace's end-to-end tests.
//!
//! Crates use it as a dev-dependency instead of their own copies:
//! - [`tierd`]: a real `tierd` process on a private socket ([`Tierd`], built with
//!   [`TierdBuilder`]): waits for the socket, captures stderr, SIGTERM (then SIGKILL) and
//!   reaps on drop, hands back its exit status and its state directory for a restart.
//! - [`bins`]: the workspace's binaries for crates that do not build them (`cargo build`
//!   once per test binary, or `KVTIER_TEST_<NAME>`).
//! - [`uid`]: root, `nobody`, and world-reachable copies of executables for tests that run
//!   a second uid.
//! - [`kv`]: deterministic KV rows, payloads, queries and byte patterns.
//! - [`session`]: sessions on a real daemon with their model-side [`session::Shadow`],
//!   checked against the dense oracle.
//! - the fake cold source is `kvtier_storage::testing::SavedRuns` (unit tests of storage, kernels and
//!   tierd use it too).
//! - [`wire`]: raw frames and error replies, for tests below the client.
//! - [`redis`]: a real Redis Cluster on loopback (`redis-server` processes in cluster mode),
//!   for the remote tier's tests.
//! - [`sys`]: child processes reaped on drop, `/proc` fields, scratch directories, a small
//!   tmpfs.

pub mod bins;
pub mod kv;
pub mod redis;
pub mod session;
pub mod sys;
pub mod tierd;
pub mod uid;
pub mod wire;

pub use tierd::{Tierd, TierdBuilder};
