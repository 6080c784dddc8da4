//! `kvtier._native`: the Python binding of `kvtier-engine` (the in-engine data path). Thin on
//! purpose: sessions by id, queries and outputs as little-endian f32 bytes; `kvtier.engine`
//! wraps it with numpy shapes and the package's types.

use kvtier_engine::{DeviceRows, HeadShard, InEngine};
use kvtier_kernels::cuda::{CUstream, CudaConfig, DeviceIo, DeviceTail, SummaryDtype};
use kvtier_protocol::{dtype_from_wire, Geometry, Policy, Selector};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    _native,
    EngineError,
    PyRuntimeError,
    "An in-engine path failure."
);

fn err(e: impl std::fmt::Display) -> PyErr {
    EngineError::new_err(e.to_string())
}

/// One engine: tierd's sessions leased and decoded on CUDA device `device`.
#[pyclass(unsendable)]
struct Engine {
    inner: InEngine,
}

#[pymethods]
impl Engine {
    /// `geometry` = (layers, q_heads, kv_heads, head_dim, dtype code, block_tokens),
    /// `policy` = (sink_blocks, local_blocks, top_k, selector code, candidates), `shard` =
    /// (rank, world): the KV heads
    /// attended (tensor parallelism; (0, 1) for all); `in_place`: map tierd's arena writable
    /// for `append_from_device` (every head only); `cache_slots`: tiles of the GPU block
    /// cache per (session, layer, KV head), at least the keep-set (0: twice the keep-set).
    #[new]
    #[pyo3(signature = (socket, device, geometry, policy, max_sessions = 8, max_blocks = 8192, shard = (0, 1), in_place = false, cache_slots = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        socket: &str,
        device: usize,
        geometry: (u32, u32, u32, u32, u8, u32),
        policy: (u32, u32, u32, u32, u32),
        max_sessions: u32,
        max_blocks: u32,
        shard: (u32, u32),
        in_place: bool,
        cache_slots: u32,
    ) -> PyResult<Self> {
        if !kvtier_kernels::cuda::device_available() {
            return Err(err("no CUDA device (or no CUDA driver) on this machine"));
        }
        let (layers, q_heads, kv_heads, head_dim, dtype, block_tokens) = geometry;
        let dtype = dtype_from_wire(dtype).map_err(err)?;
        let geometry = Geometry::new(layers, q_heads, kv_heads, head_dim, dtype, block_tokens);
        let selector = Selector::from_code(policy.3, policy.4)
            .ok_or_else(|| err(format!("unknown selector {}", policy.3)))?;
        let policy = Policy {
            sink_blocks: policy.0,
            local_blocks: policy.1,
            top_k: policy.2,
            selector,
        };
        // As tierd's own CUDA decoder: f32 bounds (the CPU selector's keep-sets).
        let mut cfg = CudaConfig::new(
            geometry,
            policy,
            max_blocks,
            max_sessions,
            SummaryDtype::F32,
        );
        if cache_slots != 0 {
            cfg.cache_slots = cache_slots; // validated (>= the keep-set) when the engine opens
        }
        let shard = HeadShard {
            rank: shard.0,
            world: shard.1,
        };
        let mut inner =
            InEngine::connect_shard(socket.as_ref(), device, cfg, shard).map_err(err)?;
        if in_place {
            inner.enable_in_place_appends().map_err(err)?;
        }
        Ok(Engine { inner })
    }

    /// Leases the session and syncs it to the device; returns its device slot.
    fn attach(&mut self, session: u64) -> PyResult<u32> {
        self.inner.attach(session).map_err(err)
    }

    /// Brings the device up to date with what tierd holds now (after appends).
    fn sync(&mut self, session: u64) -> PyResult<()> {
        self.inner.sync(session).map_err(err)
    }

    /// Releases the session and frees its device slot.
    fn detach(&mut self, session: u64) -> PyResult<()> {
        self.inner.detach(session).map_err(err)
    }

    /// One layer for `sessions`, with `q` their `[n][q_heads * head_dim]` f32 queries as
    /// little-endian bytes; returns the outputs the same way.
    fn decode_layer<'py>(
        &mut self,
        py: Python<'py>,
        layer: u32,
        sessions: Vec<u64>,
        q: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let g = self.inner.config().geometry;
        let per = (g.q_heads * g.head_dim) as usize;
        if q.len() != sessions.len() * per * 4 {
            return Err(err(format!(
                "q holds {} bytes, expected {} sessions x {per} f32",
                q.len(),
                sessions.len()
            )));
        }
        let qf: Vec<f32> = q
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let items: Vec<(u64, &[f32])> = sessions
            .iter()
            .zip(qf.chunks_exact(per))
            .map(|(&s, q)| (s, q))
            .collect();
        let out = self.inner.decode_layer(layer, &items).map_err(err)?;
        let bytes: Vec<u8> = out.out.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &bytes))
    }

    /// Fixes the batch of later `decode_layer_ptr` calls (attached, synced sessions, in order).
    fn bind(&mut self, sessions: Vec<u64>) -> PyResult<()> {
        self.inner.bind(&sessions).map_err(err)
    }

    /// One layer for the bound batch on device buffers, given as raw addresses: q and out
    /// `[batch][q_heads * head_dim]` f32, lse `[batch][q_heads]` f32 or 0, and a tail the
    /// output also attends (`tail_kv`, `tail_last`: `DeviceTail`'s, or 0 and 0), enqueued
    /// behind the CUDA stream `stream` (a raw `CUstream`, 0 = legacy default) without waiting.
    /// Raw on purpose: only `kvtier.engine`, which checks the tensors' device, dtype, shape
    /// and contiguity and keeps them alive, calls it.
    #[pyo3(signature = (layer, q, out, lse, stream, tail_kv = 0, tail_last = 0))]
    #[allow(clippy::too_many_arguments)]
    fn decode_layer_ptr(
        &mut self,
        layer: u32,
        q: u64,
        out: u64,
        lse: u64,
        stream: u64,
        tail_kv: u64,
        tail_last: u64,
    ) -> PyResult<()> {
        let tail = DeviceTail {
            kv: tail_kv,
            last: tail_last,
        };
        let io = DeviceIo { q, out, lse, tail };
        // SAFETY: kvtier.engine passes the addresses of live CUDA tensors of the engine's
        // device with the bound batch's shapes and kinds, contiguous (a tail: DeviceBatch's own
        // buffers), and holds them until the stream has run this work; `stream` is torch's
        // current stream on that device.
        unsafe {
            self.inner
                .decode_layer_device(layer, io, stream as usize as CUstream)
        }
        .map_err(err)
    }

    /// Appends `tokens` rows of every layer to each of `sessions` from device memory by DMA
    /// (RESERVE, copy, COMMIT): session `i`'s rows at `ptr + i * session_stride`, laid out as
    /// `DeviceRows` says (`layer_stride`, `capacity` slots), in the sessions' dtype. Waits for
    /// `stream` (a raw `CUstream`) to have produced them. Raw on purpose, like
    /// `decode_layer_ptr`: only `kvtier.engine.DeviceBatch` calls it, on its own tail buffer.
    #[allow(clippy::too_many_arguments)]
    fn append_from_device(
        &mut self,
        sessions: Vec<u64>,
        ptr: u64,
        session_stride: u64,
        layer_stride: u64,
        capacity: u32,
        tokens: u32,
        stream: u64,
    ) -> PyResult<()> {
        let items: Vec<(u64, DeviceRows)> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let rows = DeviceRows {
                    ptr: ptr + i as u64 * session_stride,
                    layer_stride,
                    capacity,
                };
                (s, rows)
            })
            .collect();
        // SAFETY: DeviceBatch passes its live tail tensor (on the engine's device, in the
        // sessions' dtype, laid out [layers][sessions][kv_heads][2][capacity][head_dim]) and
        // keeps it unchanged until this returns; `stream` is torch's current stream there.
        unsafe {
            self.inner
                .append_from_device(&items, tokens, stream as usize as CUstream)
        }
        .map_err(err)
    }

    /// Opens an append of `tokens[i]` rows to `sessions[i]` copied and committed layer by
    /// layer (`copy_layer`, `commit_layers`) while the model computes the later layers:
    /// RESERVE for each. Needs tierd's protocol version 5.
    fn begin_append_by_layer(&mut self, sessions: Vec<u64>, tokens: Vec<u32>) -> PyResult<()> {
        if sessions.len() != tokens.len() {
            return Err(PyValueError::new_err("one token count per session"));
        }
        let items: Vec<(u64, u32)> = sessions.into_iter().zip(tokens).collect();
        self.inner.begin_append_by_layer(&items).map_err(err)
    }

    /// Enqueues on `stream` (a raw `CUstream`) the copies of layer `layer`'s rows of the open
    /// append by layer, behind the work that produces them: session `i`'s at `ptrs[i]`,
    /// `[kv_heads][2][capacities[i]][head_dim]` elements of the sessions' dtype. Raw on
    /// purpose: only `kvtier.hf`'s prefill calls it, keeping the tensors alive until the layer
    /// is committed.
    fn copy_layer(
        &mut self,
        layer: usize,
        sessions: Vec<u64>,
        ptrs: Vec<u64>,
        capacities: Vec<u32>,
        stream: u64,
    ) -> PyResult<()> {
        if sessions.len() != ptrs.len() || sessions.len() != capacities.len() {
            return Err(PyValueError::new_err(
                "one pointer and capacity per session",
            ));
        }
        let items: Vec<(u64, DeviceRows)> = sessions
            .into_iter()
            .zip(ptrs.into_iter().zip(capacities))
            .map(|(s, (ptr, capacity))| {
                let rows = DeviceRows {
                    ptr,
                    layer_stride: 0,
                    capacity,
                };
                (s, rows)
            })
            .collect();
        // SAFETY: kvtier.hf passes live contiguous tensors of the engine's device in that
        // layout and keeps them until it commits the layer; `stream` is torch's current
        // stream there.
        unsafe {
            self.inner
                .copy_layer(layer, &items, stream as usize as CUstream)
        }
        .map_err(err)
    }

    /// Waits for the copies of layers `first..first + count`, COMMITs them in tierd and
    /// updates the device state of those layers; the last layers' COMMIT lands the append.
    fn commit_layers(&mut self, first: usize, count: usize) -> PyResult<()> {
        self.inner.commit_layers(first..first + count).map_err(err)
    }

    /// Per-layer (hits, misses, bytes_moved, tiles) of the device calls since `bind`.
    fn bound_stats(&mut self) -> PyResult<Vec<(u64, u64, u64, u64)>> {
        let st = self.inner.bound_stats().map_err(err)?;
        Ok(st
            .iter()
            .map(|s| (s.hits, s.misses, s.bytes_moved, s.tiles))
            .collect())
    }

    /// (bytes, seconds) of mapping and registering tierd's arena; None before the first lease.
    fn registration(&self) -> Option<(usize, f64)> {
        self.inner.registration().map(|(n, t)| (n, t.as_secs_f64()))
    }

    /// Seconds of the last in-place append's phases: (reserve, copy, commit, sync); None
    /// before one reached its copies.
    fn last_append(&self) -> Option<(f64, f64, f64, f64)> {
        self.inner.last_append().map(|t| {
            (
                t.reserve.as_secs_f64(),
                t.copy.as_secs_f64(),
                t.commit.as_secs_f64(),
                t.sync.as_secs_f64(),
            )
        })
    }

    /// Keep-sets of the last call at `layer`: [session][kv_head] ascending block ids.
    fn keep_sets(&self, layer: u32) -> PyResult<Vec<Vec<Vec<u32>>>> {
        self.inner.last_keep_sets(layer).map_err(err)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add("EngineError", m.py().get_type::<EngineError>())?;
    Ok(())
}
