//! A minimal fan-out over scoped threads for the bulk paths (page store batches, block
//! restores). No pool: a bulk batch is milliseconds of work, so a thread spawn (tens of
//! microseconds) is noise, and callers keep small batches inline.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The default worker count of the bulk paths: one per core, at most 8.
pub fn default_workers() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(8)
}

/// Runs `f(i)` for every `i in 0..n` on up to `threads` threads (the calling thread is one of
/// them; items are handed out one at a time, so uneven items balance) and returns the results
/// in index order. With `threads <= 1` or `n <= 1` everything runs inline, with no spawn. If
/// the OS refuses a thread, the ones that did start (and the caller) do its share. A panic in
/// `f` is re-raised on the calling thread.
pub(crate) fn map_indexed<T: Send>(
    n: usize,
    threads: usize,
    name: &str,
    f: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let threads = threads.min(n);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let next = AtomicUsize::new(0);
    let work = || {
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                return out;
            }
            out.push((i, f(i)));
        }
    };
    let mut all: Vec<(usize, T)> = std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name(name.to_string())
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mut all = work();
        for h in helpers {
            match h.join() {
                Ok(part) => all.extend(part),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    });
    debug_assert_eq!(all.len(), n);
    all.sort_unstable_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, t)| t).collect()
}

/// Runs `f(&mut dst[i], &src[i])` for every `i` on up to `threads` threads (the calling thread
/// is one of them), the pairs cut into `threads` contiguous shares handed out one at a time.
/// With `threads <= 1` everything runs inline. If the OS refuses a thread, the others (and the
/// caller) take its share. A panic in `f` is re-raised on the calling thread. Panics if the
/// slices differ in length.
pub fn zip_mut<T: Send, U: Sync>(
    dst: &mut [T],
    src: &[U],
    threads: usize,
    name: &str,
    f: impl Fn(&mut T, &U) + Sync,
) {
    assert_eq!(dst.len(), src.len(), "zip_mut: slices of different lengths");
    let threads = threads.min(dst.len()).max(1);
    if threads <= 1 {
        return dst.iter_mut().zip(src).for_each(|(d, s)| f(d, s));
    }
    let share = dst.len().div_ceil(threads);
    let parts = parking_lot::Mutex::new(
        dst.chunks_mut(share)
            .zip(src.chunks(share))
            .collect::<Vec<_>>(),
    );
    // One job per thread, each draining shares until none is left.
    map_indexed(threads, threads, name, |_| loop {
        // Its own statement, so the lock is released before the share is worked on.
        let Some((d, s)) = parts.lock().pop() else {
            return;
        };
        d.iter_mut().zip(s).for_each(|(d, s)| f(d, s));
    });
}

/// Runs `f(&mut items[i])` for every item on up to `threads` threads, as [`zip_mut`] does.
pub(crate) fn each_mut<T: Send>(
    items: &mut [T],
    threads: usize,
    name: &str,
    f: impl Fn(&mut T) + Sync,
) {
    let units = vec![(); items.len()];
    zip_mut(items, &units, threads, name, |item, _| f(item));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zip_mut_visits_every_pair_once_for_any_thread_count() {
        for threads in [0, 1, 2, 3, 8, 100] {
            for n in [0, 1, 2, 7, 64] {
                let src: Vec<usize> = (0..n).collect();
                let mut dst = vec![0usize; n];
                zip_mut(&mut dst, &src, threads, "t", |d, s| *d += s * s + 1);
                assert_eq!(
                    dst,
                    (0..n).map(|i| i * i + 1).collect::<Vec<_>>(),
                    "{threads} {n}"
                );
            }
        }
    }

    #[test]
    fn results_come_back_in_order_for_any_thread_count() {
        for threads in [0, 1, 2, 3, 8, 100] {
            for n in [0, 1, 2, 7, 64] {
                let got = map_indexed(n, threads, "t", |i| i * i);
                assert_eq!(
                    got,
                    (0..n).map(|i| i * i).collect::<Vec<_>>(),
                    "{threads} {n}"
                );
            }
        }
    }

    #[test]
    fn one_thread_runs_on_the_caller() {
        let me = std::thread::current().id();
        let ids = map_indexed(5, 1, "t", |_| std::thread::current().id());
        assert!(ids.iter().all(|&id| id == me));
    }

    #[test]
    #[should_panic(expected = "boom")]
    fn a_worker_panic_reaches_the_caller() {
        map_indexed(16, 4, "t", |i| {
            if i == 11 {
                panic!("boom");
            }
            i
        });
    }
}
