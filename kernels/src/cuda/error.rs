//! Typed errors of the CUDA backend.

use cudarc::driver::DriverError;

/// Every failure of the CUDA backend: driver statuses, compile errors and rejected inputs.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// libcuda could not be loaded (no NVIDIA driver on this machine).
    #[error("CUDA driver library (libcuda) not found")]
    NoDriver,
    /// libnvrtc could not be loaded.
    #[error(
        "NVRTC library (libnvrtc) not found; the CUDA backend compiles its kernels at run time"
    )]
    NoNvrtc,
    /// The requested device ordinal does not exist.
    #[error("no CUDA device with ordinal {ordinal} ({count} present)")]
    NoDevice { ordinal: usize, count: usize },
    /// The device is too old for the kernels (warp match/ballot need compute capability 7.0).
    #[error("device compute capability {major}.{minor} is below the required 7.0")]
    ComputeCapability { major: i32, minor: i32 },
    /// A CUDA driver call returned an error status.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    /// NVRTC rejected the kernel sources.
    #[error("NVRTC compile of the kvtier kernels failed: {log}")]
    Compile { log: String },
    /// cuMemHostRegister failed; everything registered before the failure was unregistered.
    #[error(
        "pinning {len} bytes at {base:#x} failed at offset {offset} (chunk of {chunk_len} bytes): \
         {source}; RLIMIT_MEMLOCK = {memlock}"
    )]
    Pin {
        base: usize,
        len: usize,
        offset: usize,
        chunk_len: usize,
        memlock: String,
        #[source]
        source: DriverError,
    },
    /// An anonymous host mapping could not be created.
    #[error("mmap of {len} bytes failed: {source}")]
    Mmap {
        len: usize,
        #[source]
        source: std::io::Error,
    },
    /// A host region to register is empty.
    #[error("cannot register an empty host region")]
    EmptyRegion,
    /// A host region base or chunk size is not page aligned.
    #[error("host region {what} {value:#x} is not a multiple of the page size {page}")]
    Misaligned {
        what: &'static str,
        value: usize,
        page: usize,
    },
    /// A (offset, len) range is outside the pinned region or crosses a registration chunk.
    #[error("host range [{offset}, {offset}+{len}) is outside the pinned region of {region_len} bytes or crosses a registration chunk")]
    HostRange {
        offset: u64,
        len: u64,
        region_len: usize,
    },
    /// No pinned host region is attached to the backend.
    #[error("the host region is registered read-only: the device cannot write into it")]
    ReadOnlyRegion,

    #[error("no pinned host region is attached to the backend")]
    NoHostRegion,
    /// A pinned host region is already attached.
    #[error("a pinned host region is already attached to the backend")]
    HostRegionAttached,
    /// A configuration value is invalid.
    #[error("invalid CUDA backend config: {reason}")]
    InvalidConfig { reason: String },
    /// A slice argument has the wrong length.
    #[error("{what} has length {got}, expected {expected}")]
    BadLength {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    /// A value that must be finite is NaN or infinite.
    #[error("{what} holds a non-finite value at index {index}")]
    NonFinite { what: &'static str, index: usize },
    /// Layer index out of range.
    #[error("layer {layer} out of range (model has {layers} layers)")]
    LayerOutOfRange { layer: u32, layers: u32 },
    /// Session slot out of range.
    #[error("session slot {slot} out of range (max_sessions = {max})")]
    SlotOutOfRange { slot: u32, max: u32 },
    /// The session slot is not open.
    #[error("session slot {slot} is not open")]
    SessionNotOpen { slot: u32 },
    /// The session slot is already open.
    #[error("session slot {slot} is already open")]
    SessionAlreadyOpen { slot: u32 },
    /// Block range out of the configured capacity.
    #[error("blocks [{first}, {first}+{count}) exceed max_blocks {max}")]
    BlockOutOfRange { first: u32, count: u32, max: u32 },
    /// Token counts may only grow (append-only positions) and must fit the capacity.
    #[error("session {slot} layer {layer}: token count {new} invalid (current {current}, capacity {capacity})")]
    BadTokenCount {
        slot: u32,
        layer: u32,
        current: u32,
        new: u32,
        capacity: u64,
    },
    /// A block to attend has no summary or no host extent yet: never attend over unknown bytes.
    #[error("session {slot} layer {layer}: {n_blocks} blocks needed but only {ready} have a summary and a host extent")]
    NotReady {
        slot: u32,
        layer: u32,
        n_blocks: u32,
        ready: u32,
    },
    /// The session layer has no tokens to attend over.
    #[error("session {slot} layer {layer} has no tokens")]
    EmptySession { slot: u32, layer: u32 },
    /// The host region cannot be detached while sessions map into it.
    #[error("{open} sessions are open and map into the host region")]
    SessionsOpen { open: usize },
    /// Batch is empty.
    #[error("layer {layer} appears twice in one call")]
    DuplicateLayer { layer: u32 },

    #[error("empty decode batch")]
    EmptyBatch,
    /// A device call with no bound batch (never bound, or a session changed since).
    #[error("no bound batch: bind_batch after the sessions' last change")]
    NotBound,
    /// A device call given a null q or output address.
    #[error("a device call needs q and output buffers (got a null address)")]
    NullBuffer,
    /// A device call's tail (`DeviceTail`) is half given or misaligned.
    #[error("a device call's tail {0}")]
    BadTail(&'static str),
    /// Batch larger than configured.
    #[error("decode batch of {got} sessions exceeds max_batch {max}")]
    BatchTooLarge { got: usize, max: u32 },
    /// A session appears twice in one batch (its cache bookkeeping would race).
    #[error("session slot {slot} appears twice in one decode batch")]
    DuplicateSession { slot: u32 },
    /// Dense attention from GPU memory over a session whose KV copy does not cover the call
    /// (never copied, or blocks appended since).
    #[error("session {slot} layer {layer}: {n_blocks} blocks needed but the GPU copy of its KV holds {copied}")]
    KvNotOnDevice {
        slot: u32,
        layer: u32,
        n_blocks: u32,
        copied: u32,
    },
}

impl CudaError {
    /// Wraps a driver error with the name of the call that produced it.
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> CudaError {
        move |source| CudaError::Driver { call, source }
    }
}

/// Result alias of the CUDA backend.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;
