//! Built without the `cuda` feature: there is no CUDA decode path. [`GpuDecoder`] has no
//! value (the engine's `Option<GpuDecoder>` is always `None`), so every decode runs on the CPU
//! backend; `backend.kind = "cuda"` is refused at startup because no device is available.

use kvtier_kernels::{Appended, Attended, Backend};
use kvtier_storage::{Geometry, HostArena, Policy};

use super::{GpuError, GpuSettings};

/// Never present in a build without CUDA.
pub fn device_available() -> bool {
    false
}

/// The CUDA decoder's interface, uninhabited: no value of it can exist in this build.
#[derive(Debug)]
pub enum GpuDecoder {}

impl GpuDecoder {
    pub fn new(_arena: &HostArena, _cfg: &GpuSettings) -> Result<Self, GpuError> {
        Err(GpuError::Unsupported {
            reason: "tierd was built without the `cuda` feature".into(),
        })
    }

    pub fn device_name(&self) -> &str {
        match *self {}
    }

    pub fn lanes(&self) -> usize {
        match *self {}
    }

    pub fn lane_of(&self, _session: u64) -> Option<usize> {
        match *self {}
    }

    pub fn supports(&self, _geo: &Geometry, _policy: &Policy) -> bool {
        match *self {}
    }

    pub fn open(&self, _session: u64, _geo: &Geometry, _policy: &Policy) -> Result<(), GpuError> {
        match *self {}
    }

    pub fn close(&self, _session: u64) -> Result<(), GpuError> {
        match *self {}
    }

    pub fn is_open(&self, _session: u64) -> bool {
        match *self {}
    }

    pub fn invalidate(&self, _session: u64) -> Result<(), GpuError> {
        match *self {}
    }
}

impl Backend for &GpuDecoder {
    fn selects_itself(&self) -> bool {
        match **self {}
    }

    fn attend(&mut self, _: &Appended<'_, '_>, _: &mut [f32]) -> kvtier_kernels::Result<Attended> {
        match **self {}
    }
}
