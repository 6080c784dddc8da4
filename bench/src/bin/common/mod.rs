//! Event timing shared by the GPU floor tools (gpu_read_floor, gpu_zero_copy).

use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use cudarc::driver::CudaStream;
use kvtier_bench::median;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Median microseconds of `reps` event pairs around `launch` on `stream` (called `per` times
/// between the events with a running count 0, 1, ...; the result is divided by `per`). Two
/// more rounds run first to warm up.
pub fn time(
    stream: &CudaStream,
    reps: usize,
    per: usize,
    mut launch: impl FnMut(usize) -> Res<()>,
) -> Res<f64> {
    let ev = || stream.context().new_event(Some(CU_EVENT_DEFAULT));
    let (a, b) = (ev()?, ev()?);
    let mut t = Vec::with_capacity(reps + 2);
    let mut k = 0;
    for _ in 0..reps + 2 {
        a.record(stream)?;
        for _ in 0..per {
            launch(k)?;
            k += 1;
        }
        b.record(stream)?;
        b.synchronize()?;
        t.push(a.elapsed_ms(&b)? as f64 * 1e3 / per as f64);
    }
    Ok(median(&mut t[2..]))
}
