//! pread/pwrite driver for machines without io_uring. Each batch runs serially on the calling
//! thread; concurrent callers run in parallel (positional I/O needs no shared file offset).

use std::io;
use std::os::unix::fs::FileExt;

use super::{IoCompletion, IoDriver, IoRequest, OpKind};
use crate::nvme::NvmeError;

/// Synchronous positional I/O through `std::os::unix::fs::FileExt`.
#[derive(Debug, Default)]
pub struct PreadDriver {
    _private: (),
}

impl PreadDriver {
    pub fn new() -> Self {
        Self::default()
    }
}

/// How many times a write may make no progress before we give up (ENOSPC-like devices).
const MAX_STALLS: u32 = 8;

pub(crate) fn run_one(mut req: IoRequest) -> IoCompletion {
    req.mark_started();
    let kind = req.kind();
    let offset = req.offset();
    let len = req.len();
    let file = req.file().clone();
    let mut done = 0usize;
    let mut stalls = 0u32;
    let result = loop {
        if done == len {
            break Ok(());
        }
        let at = offset + done as u64;
        let r = match kind {
            OpKind::Read => file.file().read_at(&mut req.buf_mut()[done..], at),
            OpKind::Write => file.file().write_at(&req.buf()[done..], at),
        };
        match r {
            Ok(0) => match kind {
                OpKind::Read => {
                    break Err(NvmeError::ShortRead {
                        offset,
                        expected: len,
                        got: done,
                    })
                }
                OpKind::Write => {
                    stalls += 1;
                    if stalls > MAX_STALLS {
                        break Err(NvmeError::ShortWrite {
                            offset,
                            expected: len,
                            got: done,
                        });
                    }
                }
            },
            Ok(n) => {
                done += n;
                stalls = 0;
            }
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted
                    || e.raw_os_error() == Some(libc::EAGAIN) => {}
            Err(e) => break Err(errno_error(kind, offset, len, e)),
        }
    };
    req.complete(result)
}

/// Maps an errno to the typed error (ENOSPC gets its own variant).
pub(crate) fn errno_error(kind: OpKind, offset: u64, len: usize, e: io::Error) -> NvmeError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        NvmeError::NoSpace { offset, len }
    } else {
        NvmeError::Io {
            kind,
            offset,
            len,
            source: e,
        }
    }
}

impl IoDriver for PreadDriver {
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError> {
        Ok(reqs.into_iter().map(run_one).collect())
    }

    fn name(&self) -> &'static str {
        "pread"
    }
}
